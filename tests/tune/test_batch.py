"""The search with several trials a launch (`tune --search-batch K`): rounds, successive
halving across rounds, one NCCL setting a launch, the budget, failures, and a real round on
CPU ranks.

The fake sweep (`test_effects.fake_sweep`) stands in for `trial.run_sweep`: a launch takes
START seconds plus EACH a run, and a run's figure grows with its micro-batch, so successive
halving has something to rank.
"""

from __future__ import annotations

import json

import pytest

from trainplan import cli
from trainplan.tune import loop as tune_loop
from trainplan.tune import report as tune_report
from trainplan.tune import study as tune
from trainplan.tune import trial as tune_launch

from .test_effects import fake_sweep
from .test_tune import SPACE, _suite, _tune

START, EACH = 5.0, 2.0


def _by_micro_batch(args) -> float:
    return 320.0 * int(args[args.index("--micro-batch") + 1])


def _at_least(mb: int):
    return lambda args: int(args[args.index("--micro-batch") + 1]) >= mb


def _study(tmp_path, monkeypatch, rounds, gpus=1, batch=4, **kw):
    fail_mb, crash_at = kw.pop("fail_mb", None), kw.pop("crash_at", None)
    monkeypatch.setattr(tune_launch, "run_sweep", fake_sweep(
        _by_micro_batch, START, EACH, rounds, fail_mb and _at_least(fail_mb), crash_at))
    monkeypatch.setattr(tune_launch, "run_launch", None)  # no one-trial launch in this mode
    suite = tune.make_suite(suite_path=str(_suite(tmp_path, gpus=gpus)))
    suite.update(max_launches=2, reduction_factor=3,
                 space={**SPACE, "micro_batch": {"low": 1, "high": 16}, **kw.pop("space", {})})
    args = {"gpu_hours": 1.0, "trials": 12, **kw}
    out = tune_loop.run_study(suite, storage=str(tmp_path / "s.journal"), name="b", cpu=True,
                              progress=False, batch=batch, **args)
    return out, tune_report.load(str(tmp_path / "s.journal"))


def _round_of(rounds) -> dict:
    return {e["tag"]: i for i, (_, entries) in enumerate(rounds) for e in entries}


def test_rounds_run_several_trials_a_launch_and_replicates_in_a_later_one(tmp_path,
                                                                         monkeypatch):
    rounds = []
    out, study = _study(tmp_path, monkeypatch, rounds)
    assert out["stopped"] == "trials" and out["trials"] == 12
    done = tune.measured(study)
    launches = [t.user_attrs["launches"] for t in done]
    runs = sum(len(entries) for _, entries in rounds)
    assert runs == sum(launches) and len(rounds) < runs and max(
        len(entries) for _, entries in rounds) == 4
    assert 1 <= launches.count(2) <= 6
    where = _round_of(rounds)
    for t in done:
        if t.user_attrs["launches"] == 2:  # promoted after its first run, run again later
            assert where[f"trial-{t.number}/launch-1"] > where[f"trial-{t.number}/launch-0"]
    assert tune.gpu_seconds(study) == pytest.approx(sum(START + EACH * len(e)
                                                        for _, e in rounds))
    for t in done:  # each run its own time and a share of the start
        assert all(c == pytest.approx(EACH) for c in t.user_attrs["run_gpu_seconds"])
    best = max(done, key=lambda t: t.value)
    assert out["best"]["trial"] == best.number and best.user_attrs["config"]["micro_batch"] >= 8


def test_a_launch_holds_configs_of_one_nccl_setting(tmp_path, monkeypatch):
    rounds = []
    out, study = _study(tmp_path, monkeypatch, rounds, gpus=2, trials=10,
                        space={"nccl_algo": ["default", "Ring"]})
    configs = {t.number: t.user_attrs["config"] for t in study.get_trials()
               if "config" in t.user_attrs}
    algos = set()
    for env, entries in rounds:
        ran = {configs[int(e["tag"].split("/")[0][6:])]["nccl_algo"] for e in entries}
        assert ran == {"default" if env is None else env}, (env, entries)
        algos |= ran
    assert algos == {"default", "Ring"} and out["trials"] == 10


def test_rounds_stop_before_the_budget_is_overrun(tmp_path, monkeypatch):
    rounds = []
    out, study = _study(tmp_path, monkeypatch, rounds, gpu_hours=60 / 3600, trials=40)
    assert out["stopped"] == "budget"
    assert tune.gpu_seconds(study) <= 60.0 and len(rounds) >= 2
    assert out["gpu_hours"] * 3600 == pytest.approx(sum(START + EACH * len(e)
                                                        for _, e in rounds))


def test_a_failing_run_fails_its_trial_and_a_dead_launch_reruns_the_rest(tmp_path,
                                                                        monkeypatch):
    rounds = []
    out, study = _study(tmp_path, monkeypatch, rounds, fail_mb=9, trials=8)
    failed = [t for t in study.get_trials() if "failed" in t.user_attrs]
    assert failed and all(t.user_attrs["config"]["micro_batch"] >= 9 for t in failed)
    assert all(t.user_attrs["config"]["micro_batch"] < 9 for t in tune.measured(study))
    assert all(t.user_attrs["failed"].startswith("out of memory") for t in failed)

    rounds = []
    (tmp_path / "crash").mkdir()
    out, study = _study(tmp_path / "crash", monkeypatch, rounds, crash_at=2, trials=6)
    died = [t for t in study.get_trials() if t.user_attrs.get("failed") == "rc=1: a rank died"]
    assert died, "the run under way when the launch died fails its trial"
    where = [e["tag"] for _, entries in rounds for e in entries]
    rerun = [tag for tag in set(where) if where.count(tag) > 1]
    assert rerun, "runs the launch did not reach go to the next round"
    assert out["trials"] == 6


def test_search_batch_with_workers_is_one_line_exit_2(tmp_path, capsys):
    rc = cli.main(["tune", "--model", "llama-1.3b", "--gpu-hours", "1", "--cpu", "--storage",
                   str(tmp_path / "s.journal"), "--search-batch", "4", "--workers", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--search-batch 4" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_one_real_round_on_cpu_ranks(tmp_path):
    suite, storage = _suite(tmp_path, gpus=1), tmp_path / "s.journal"
    proc = _tune("--suite", suite, "--cpu", "--storage", storage, "--gpu-hours", 1,
                 "--trials", 3, "--search-batch", 3, "--no-progress", "--json")
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout)
    assert out["trials"] >= 3, out
    log = [json.loads(ln) for ln in storage.with_name("s.log").read_text().splitlines()]
    runs = [r for r in log if "sweep" in r]
    assert runs and all(r["error"] is None and r["rate"] > 0 for r in runs)
    study = tune_report.load(str(storage))
    starts = {s for t in tune.measured(study) for s in t.user_attrs["start_gpu_seconds"]}
    assert len(starts) < len(runs)  # runs shared a launch's start
