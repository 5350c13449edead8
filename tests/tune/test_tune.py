"""The knob study: search space and skip rules, analysis, and the study end to end on CPU.

The end-to-end tests run the real study code (`trainplan tune`) on the tiny
gloo proxy: a 2-layer model, synthetic tokens, 1 or 2 CPU ranks under real
torchrun, a few trials, a tiny budget. They check that the budget stops the
study and that it says so, and that a study killed with SIGKILL resumes from
its storage (trial numbers go on, the killed trial's spend stays counted).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from trainplan.calibrate.store import load_gpu
from trainplan.tune import knobs
from trainplan.tune import loop as tune_loop
from trainplan.tune import recipe as tune_recipe
from trainplan.tune import report as tune_report
from trainplan.tune import study as tune
from trainplan.tune import trial as tune_launch
from trainplan.tune.trial import HEARTBEAT_S

ROOT = Path(__file__).resolve().parents[2]
TINY = {"n_layers": 2, "hidden": 32, "n_heads": 2, "n_kv_heads": 2, "ffn": 64, "vocab": 256}
SPACE = {"micro_batch": [1, 2], "grad_accum": [1, 2], "recompute": ["none", "full"],
         "compile": [False]}


def _suite(tmp_path, gpus: int, synthetic: bool = True) -> Path:
    """A tiny study suite; `synthetic=False` for stand-in launches that vary loader knobs
    (the tiny vocabulary needs synthetic tokens where the harness really runs)."""
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    suite = {"model": str(tmp_path / "tiny.yaml"), "gpus": gpus, "seq_len": 32, "warmup": 1,
             "windows": 3, "target_sequences": 1, "max_launches": 1, "n_startup": 2,
             "launch_timeout_s": 120, "extra_args": ["--synthetic"] if synthetic else [],
             "space": SPACE}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def _tune(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "trainplan.cli", "tune", *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def _cfg(**kw) -> dict:
    base = {k: v.default for k, v in knobs.SPACE.items()}
    base["prefetch_factor"] = None
    return {**base, **kw}


# ---------------------------------------------------------------- space and skip rules

PROXY = tune.make_suite(suite_path=str(ROOT / "data" / "suites" / "tune-2gpu.yaml"))
H100 = load_gpu("h100-sxm")


def test_space_overrides_and_their_refusals():
    sp = knobs.space({"micro_batch": [2, 4], "num_workers": {"low": 1, "high": 3}})
    assert sp["micro_batch"].values == (2, 4) and sp["num_workers"].values == (1, 2, 3)
    for bad in ({"nope": [1]}, {"micro_batch": [32]}, {"zero": {"low": 2, "high": 3}}):
        with pytest.raises(knobs.SpecError):
            knobs.space(bad)


def test_prefetch_without_workers_is_skipped():
    reason = knobs.skip_reason(_cfg(num_workers=0, prefetch_factor=4), PROXY, H100)
    assert reason and "prefetch_factor 4" in reason


def test_micro_batch_that_does_not_fit_is_skipped_by_the_planners_memory_model():
    # DDP keeps every fp32 gradient twice (its buckets) and all optimizer state: at mb 16 that
    # is over the 80 GB card (DDP mb 8 measured 62.4 GiB reserved on H200)
    reason = knobs.skip_reason(_cfg(micro_batch=16, zero=0, recompute="none"), PROXY, H100)
    assert "GiB" in reason and "79.6" in reason
    # FSDP2 ZeRO-2 mb 16 fits an H200 by its calibrated model (measured 66.7 GiB reserved
    # there); on the H100 datasheet figures, without a calibration, it is marginal and skipped
    h200 = tune_launch.gpu_for("NVIDIA H200", PROXY)
    assert h200.calibration != "datasheet"
    assert knobs.skip_reason(_cfg(micro_batch=16, zero=2, recompute="none"), PROXY, h200) is None
    assert knobs.skip_reason(_cfg(micro_batch=16, recompute="full"), PROXY, H100) is None


def test_a_config_too_slow_to_measure_is_skipped():
    reason = knobs.skip_reason(_cfg(micro_batch=16, grad_accum=8, recompute="full"), PROXY, H100)
    assert "max_measure_s" in reason


def test_knobs_reach_the_harness_and_the_environment(monkeypatch):
    from trainplan.tune import trial as tune_launch

    cfg = _cfg(nccl_algo="Tree", nccl_proto="default", num_workers=3, prefetch_factor=5,
               compile=True)
    args = knobs.harness_args(cfg)
    assert args[args.index("--prefetch-factor") + 1] == "5" and "--compile" in args
    monkeypatch.setenv("NCCL_PROTO", "LL")  # an inherited setting must not leak into "default"
    env = tune_launch.launch_env(cfg)
    assert env["NCCL_ALGO"] == "allreduce:tree" and "NCCL_PROTO" not in env
    assert env["NCCL_NVLS_ENABLE"] == "0"


def test_skip_table_counts_what_the_planner_rules_out():
    # at seq 2048 the whole space fits an H100; at 4096 the large micro-batches do not
    table = knobs.skip_table({**PROXY, "seq_len": 4096}, H100, grad_accum=2)
    assert set(table["verdict"]) == {"run", "skip: memory", "skip: time"}


# ---------------------------------------------------------------- analysis


def fake_study(path: Path, n: int = 40, seed: int = 0):
    """A stored study with a known truth: NCCL_PROTO=LL costs 30%, the other knobs nothing."""
    import optuna
    from optuna.distributions import CategoricalDistribution, IntDistribution

    store, _ = tune.open_storage(str(path), must_exist=False)
    study = optuna.create_study(storage=store, study_name="fake", direction="maximize")
    study.set_user_attr("suite", {"model": "tiny", "gpus": 2})
    study.set_user_attr("card", "simulated")
    rng = np.random.default_rng(seed)
    dists = {"nccl_proto": CategoricalDistribution(["default", "LL", "LL128", "Simple"]),
             "micro_batch": IntDistribution(1, 16), "num_workers": IntDistribution(0, 8)}
    for _ in range(n):
        p = {"nccl_proto": str(rng.choice(["default", "LL", "LL128", "Simple"])),
             "micro_batch": int(rng.integers(1, 17)), "num_workers": int(rng.integers(0, 9))}
        v = 50000 * (0.7 if p["nccl_proto"] == "LL" else 1.0) * rng.normal(1, 0.02)
        study.add_trial(optuna.trial.create_trial(
            params=p, distributions=dists, value=v, user_attrs={
                "config": _cfg(**p), "measured": True, "ci": [v * 0.99, v * 1.01],
                "gpu_seconds": 45.0}))
    return study


def test_report_finds_the_known_effect_and_no_effect_elsewhere(tmp_path):
    fake_study(tmp_path / "fake.journal")
    out = tune_report.report(str(tmp_path / "fake.journal"))
    assert out["trials"] == 40 and out["gpu_hours"] == pytest.approx(0.5)
    top = out["top_knobs"][0]
    assert top["knob"] == "nccl_proto" and top["verdict"] == "measurable effect"
    ll = next(e for e in top["effects"] if e["level"] == "LL")
    assert ll["ci_pct"][0] < -30 < ll["ci_pct"][1] < 0  # the truth is inside its interval
    assert {"num_workers", "micro_batch"} <= set(out["no_measurable_effect"])
    assert out["importance_method"] == "PED-ANOVA" and len(out["top_knobs"]) == 3


def test_report_cli_prints_the_contract_keys_and_figures_draw(tmp_path, capsys):
    from trainplan import cli
    from trainplan.runbook import figures

    fake_study(tmp_path / "fake.journal")
    assert cli.main(["tune", "--report", "--storage", str(tmp_path / "fake.journal"),
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"trials", "gpu_hours", "top_knobs", "best"} <= set(out)
    study = tune_report.load(str(tmp_path / "fake.journal"))
    for fig in (figures.tune_effects(out), figures.tune_importance(out),
                figures.tune_history(tune_report.frame(tune.measured(study)))):
        assert fig.axes


def test_report_of_a_missing_storage_is_one_line_exit_2(tmp_path, capsys):
    from trainplan import cli

    assert cli.main(["tune", "--report", "--storage", str(tmp_path / "none.journal")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.journal" in err[0]


def test_a_second_process_on_the_same_study_is_refused(tmp_path):
    path = tmp_path / "s.journal"
    with tune.exclusive(path), pytest.raises(tune.StudyError, match="another"):
        with tune.exclusive(path):
            pass


# ---------------------------------------------------------------- end to end on CPU


def test_budget_stops_the_study_and_says_so(tmp_path):
    suite = _suite(tmp_path, gpus=1)
    budget_h = 0.003  # 10.8 rank-seconds: a launch or two of 5-15 s (machine load varies)
    proc = _tune("--suite", suite, "--cpu", "--storage", tmp_path / "s.journal",
                 "--gpu-hours", budget_h, "--trials", 10, "--no-progress", "--json")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    out = json.loads(stdout)
    assert out["stopped"] == "budget" and "budget spent" in out["message"]
    assert out["trials"] < 10 and out["gpu_hours"] > 0  # a launch ran, then the budget ended it
    slack = HEARTBEAT_S + 15  # a launch killed at the limit: a heartbeat late, then stopped
    assert out["gpu_hours"] * 3600 <= budget_h * 3600 + slack


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (no psutil here)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_a_killed_study_resumes_from_storage(tmp_path):
    suite, storage = _suite(tmp_path, gpus=2), tmp_path / "s.journal"
    args = ("--suite", suite, "--cpu", "--storage", storage, "--gpu-hours", 1, "--trials", 2,
            "--no-progress", "--json")
    first = _tune(*args, start_new_session=True)
    log = storage.with_name("s.log")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (log.is_file() and '"launch"' in log.read_text()):
        time.sleep(0.5)
    time.sleep(2.0)  # the next trial's launch is under way
    tree = _descendants(first.pid)  # torchrun starts its ranks in sessions of their own
    os.killpg(first.pid, signal.SIGKILL)  # the study, torchrun and its ranks: a preemption
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    done_before = len(tune.measured(tune_report.load(str(storage))))
    assert done_before >= 1

    second = _tune(*args)
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr
    out = json.loads(stdout)
    assert out["stopped"] == "trials" and out["trials"] == 2
    assert out["new_trials"] == 2 - done_before
    study = tune_report.load(str(storage))
    numbers = [t.number for t in tune.measured(study)]
    assert numbers == sorted(numbers) and numbers[0] == 0  # the first run's trials are kept
    assert out["recovered"] == sum("interrupted" in t.user_attrs for t in study.trials)
    assert tune.gpu_seconds(study) > 0


@pytest.mark.parametrize("args,needle", [
    (["--suite", "nope.yaml", "--gpu-hours", "1"], "nope.yaml"),
    (["--gpu-hours", "1"], "exactly one of --suite"),
    (["--model", "llama-1.3b"], "--gpu-hours is required"),
    (["--model", "nope", "--gpu-hours", "1"], "unknown model 'nope'"),
    (["--model", "llama-1.3b", "--gpu-hours", "-1"], "'-1'"),
    (["--model", "llama-1.3b", "--gpu-hours", "1", "--trials", "0"], "'0'"),
])
def test_bad_tune_requests_are_one_line_exit_2_and_write_nothing(args, needle, tmp_path, capsys):
    from trainplan import cli

    rc = cli.main(["tune", "--storage", str(tmp_path / "s.journal"), *args, "--cpu"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.err
    assert list(tmp_path.iterdir()) == []


def test_a_suite_with_a_bad_space_is_refused(tmp_path):
    path = _suite(tmp_path, gpus=1)
    suite = yaml.safe_load(path.read_text())
    suite["space"] = {"micro_batch": [99]}
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(knobs.SpecError, match="micro_batch"):
        tune.make_suite(suite_path=str(path))


def _fake_launch(seconds: float):
    """A stand-in for `tune_launch.run_launch`: instant, `seconds` of wall time, a figure that
    grows with the micro-batch (so successive halving has something to rank)."""
    def run(cmd, env, *, tick, deadline_s):
        mb = int(cmd[cmd.index("--micro-batch") + 1])
        stop = tick(seconds)
        if stop:
            return None, f"stopped: {stop}", seconds
        times = [0.1 / mb] * 10
        return {"tokens_per_step": 32, "ranks": 1, "step_times_s": times,
                "tokens_per_s_per_gpu": 320 * mb, "mfu": None,
                "peak_mem_reserved_gib": None}, "", seconds
    return run


def test_study_loop_promotes_few_configs_to_a_second_launch(tmp_path, monkeypatch):
    from trainplan.tune import trial as tune_launch

    monkeypatch.setattr(tune_launch, "run_launch", _fake_launch(10.0))
    suite = tune.make_suite(suite_path=str(_suite(tmp_path, gpus=1)))
    suite.update(max_launches=2, reduction_factor=3,
                 space={**SPACE, "micro_batch": {"low": 1, "high": 16}})
    out = tune_loop.run_study(suite, storage=str(tmp_path / "s.journal"), name="loop",
                         gpu_hours=1.0, trials=12, cpu=True, progress=False)
    assert out["stopped"] == "trials" and out["trials"] == 12
    study = tune_report.load(str(tmp_path / "s.journal"))
    launches = [t.user_attrs["launches"] for t in tune.measured(study)]
    assert 1 <= launches.count(2) <= 6 and launches.count(1) >= 6
    assert tune.gpu_seconds(study) == pytest.approx(10.0 * sum(launches))


def test_study_loop_stops_at_the_budget_before_overrunning_it(tmp_path, monkeypatch):
    from trainplan.tune import trial as tune_launch

    monkeypatch.setattr(tune_launch, "run_launch", _fake_launch(10.0))
    suite = tune.make_suite(suite_path=str(_suite(tmp_path, gpus=1)))
    out = tune_loop.run_study(suite, storage=str(tmp_path / "s.journal"), name="loop",
                         gpu_hours=35 / 3600, trials=12, cpu=True, progress=False)
    assert out["stopped"] == "budget" and out["trials"] == 3  # a 4th would end at 40 s > 35 s
    assert out["gpu_hours"] * 3600 == pytest.approx(30.0)


def test_recipe_sentences_say_only_what_was_measured(tmp_path):
    assert "No GPU study is committed yet" in tune_recipe.recipe_sentences(None)["status"]
    fake_study(tmp_path / "fake.journal")
    words = tune_recipe.recipe_sentences(tune_report.report(str(tmp_path / "fake.journal")))
    assert "keep the defaults" in words["decision"]  # no level beats its default
    assert "Avoid: `nccl_proto` LL (-30" in words["decision"]
    assert "Leave alone" in words["decision"] and "`num_workers`" in words["decision"]
    assert "still to be measured again on a larger host" in words["missing"]
    recheck = {"gpus": 4, "card": "NVIDIA H200", "base": "a", "rows": [
        {"tag": "a", "change": "none", "launches": 2},
        {"tag": "b", "change": "prefetch_factor 2 -> 8", "launches": 0}]}
    words = tune_recipe.recipe_sentences(tune_report.report(str(tmp_path / "fake.journal")),
                                         recheck)
    assert "re-checked on 4 x NVIDIA H200" in words["missing"]
    assert "Re-checked on" not in words["decision"]  # nothing measurable in this re-check
    recheck["rows"].append({"tag": "c", "change": "micro_batch 16 -> 4", "launches": 2,
                            "effect_pct": -13.9, "measurable": True})
    words = tune_recipe.recipe_sentences(tune_report.report(str(tmp_path / "fake.journal")),
                                         recheck)
    assert "Re-checked on 4 x NVIDIA H200: `micro_batch 16 -> 4` changed tokens/s/GPU by " \
           "-13.9% (intervals apart)." in words["decision"]
    assert "Not run there: `prefetch_factor 2 -> 8`" in words["missing"]


# ---------------------------------------------------------------- concurrent workers


def test_device_groups_split_the_visible_gpus_and_refuse_too_few(monkeypatch):
    from trainplan.errors import TrainplanError
    from trainplan.tune import trial as tune_launch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert tune_launch.device_groups(2, 2, cpu=False) == ["0,1", "2,3"]
    assert tune_launch.device_groups(4, 1, cpu=False) == ["0", "1", "2", "3"]
    assert tune_launch.device_groups(2, 2, cpu=True) == [None, None]
    with pytest.raises(TrainplanError, match="--workers 3: 3 x 2 GPUs needed.*shows 4"):
        tune_launch.device_groups(3, 2, cpu=False)


def _slow_fake_launch(seconds: float, spans: list):
    """`_fake_launch` that takes real time, and notes when each launch ran."""
    fast = _fake_launch(seconds)

    def run(cmd, env, *, tick, deadline_s):
        t0 = time.monotonic()
        time.sleep(0.3)
        out = fast(cmd, env, tick=tick, deadline_s=deadline_s)
        spans.append((t0, time.monotonic()))
        return out
    return run


def test_two_workers_launch_at_once_and_share_one_budget(tmp_path, monkeypatch):
    from trainplan.tune import trial as tune_launch

    spans = []
    monkeypatch.setattr(tune_launch, "run_launch", _slow_fake_launch(10.0, spans))
    suite = tune.make_suite(suite_path=str(_suite(tmp_path, gpus=1)))
    suite.update(space={**SPACE, "micro_batch": {"low": 1, "high": 16}})
    out = tune_loop.run_study(suite, storage=str(tmp_path / "s.journal"), name="two",
                              gpu_hours=65 / 3600, trials=12, cpu=True, progress=False,
                              workers=2)
    # 10 s a launch: six fit in 65 s; a seventh would overrun, counting the one under way
    assert out["stopped"] == "budget" and out["trials"] == 6 and out["workers"] == 2
    assert out["gpu_hours"] * 3600 == pytest.approx(60.0)
    overlapping = sum(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans)
                      for b0, b1 in spans[i + 1:])
    assert overlapping >= 2  # launches ran at the same time, not one after another
    study = tune_report.load(str(tmp_path / "s.journal"))
    assert study.user_attrs["workers"] == 2


def test_two_workers_stop_at_the_trial_count(tmp_path, monkeypatch):
    from trainplan.tune import trial as tune_launch

    monkeypatch.setattr(tune_launch, "run_launch", _slow_fake_launch(10.0, []))
    suite = tune.make_suite(suite_path=str(_suite(tmp_path, gpus=1)))
    suite.update(space={**SPACE, "micro_batch": {"low": 1, "high": 16}})
    out = tune_loop.run_study(suite, storage=str(tmp_path / "s.journal"), name="two",
                              gpu_hours=1.0, trials=5, cpu=True, progress=False, workers=2)
    assert out["stopped"] == "trials" and out["trials"] == 5  # not 6: the count is shared


def test_two_real_torchrun_workers_on_cpu(tmp_path):
    """Two concurrent launches under torchrun --standalone (each its own rendezvous port)."""
    suite, storage = _suite(tmp_path, gpus=1), tmp_path / "s.journal"
    proc = _tune("--suite", suite, "--cpu", "--storage", storage, "--gpu-hours", 1,
                 "--trials", 2, "--workers", 2, "--no-progress", "--json")
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout)
    assert out["trials"] == 2 and out["workers"] == 2
    launches = [json.loads(ln) for ln in storage.with_name("s.log").read_text().splitlines()
                if '"launch"' in ln]
    assert len(launches) >= 2 and all(r["error"] is None for r in launches)


def test_the_report_reads_a_committed_study_without_writing_to_it():
    path = ROOT / "data" / "measurements" / "tune-2gpu" / "study.journal"
    before = path.read_bytes()
    out = tune_report.report(str(path))
    assert out["trials"] >= 15 and out["card"] == "NVIDIA H200"
    assert path.read_bytes() == before


def test_recipe_sentences_of_a_study_too_small_for_intervals_claim_no_effect(tmp_path):
    """A study of a few configurations estimates no effect: the page says so and names its
    fastest measurement as a measurement."""
    fake_study(tmp_path / "small.journal", n=8)
    rep = tune_report.report(str(tmp_path / "small.journal"))
    assert not any(k["effects"] for k in rep["knobs"])
    words = tune_recipe.recipe_sentences(rep)
    assert "too small yet" in words["decision"] and "not a knob effect" in words["decision"]
    assert f"{rep['best']['tokens_per_s_per_gpu']:,.0f}" in words["decision"]
    assert "Set " not in words["decision"] and "Leave alone" not in words["decision"]


def test_the_committed_gpu_study_names_three_top_knobs_with_intervals():
    """Issue 6's bar: at least 30 measured configurations, their GPU-hours, the top three
    knobs, each level's effect with a 95% interval."""
    rep = tune_report.report(str(ROOT / "data" / "measurements" / "tune-2gpu" / "study.journal"))
    assert rep["trials"] >= 30 and rep["gpu_hours"] > 0
    assert len(rep["top_knobs"]) == 3
    for knob in rep["top_knobs"]:
        assert knob["effects"] and all(e["ci_pct"][0] <= e["effect_pct"] <= e["ci_pct"][1]
                                       for e in knob["effects"])


def test_report_defaults_to_the_committed_study_and_running_needs_a_storage(capsys, tmp_path):
    from trainplan import cli

    assert cli.main(["tune", "--report", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # issue 25's bar: the recipe's search study has at least 40 configurations on 4 GPUs
    assert out["study"] == "tune-proxy-4gpu" and out["trials"] >= 40 and out["gpus"] == 4
    assert {"FSDP", "TP"} <= set(out["effects"]["families"])  # the effects-only studies too
    for fam in out["effects"]["families"].values():
        assert fam["top_knobs"] and all(k["ci_pct"][0] <= k["effect_pct"] <= k["ci_pct"][1]
                                        for k in fam["top_knobs"])
    rc = cli.main(["tune", "--model", "llama-1.3b", "--gpu-hours", "1", "--cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--storage is required" in err[0]


def test_a_failed_launch_names_the_exception_a_rank_raised(tmp_path):
    """A trial's failure is the rank's own exception, not torchrun's ChildFailedError."""
    script = ("import sys; sys.stderr.write('[rank0]: Traceback (most recent call last):\\n"
              "[rank0]: ValueError: micro-batch 7 does not divide\\nTraceback:\\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \\n'); "
              "sys.exit(1)")
    summary, why, seconds = tune_launch.run_launch([sys.executable, "-c", script],
                                                   dict(os.environ), tick=lambda _: None,
                                                   deadline_s=60)
    assert summary is None and why == "rc=1: ValueError: micro-batch 7 does not divide"
    assert seconds > 0
