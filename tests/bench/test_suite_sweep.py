"""Sweep mode of a suite (`suite --sweep`): one torchrun launch per GPU count and repetition.

End to end on CPU (2 gloo ranks, a tiny model): two good configs and one the
harness refuses (--steps 0), two repetitions. Each good config must give
one measurement record per repetition, marked with its position in the
sweep (the order rotated in the second), with the fields a separate launch
writes; the broken one a line in failed.jsonl and no second try; every
prediction before every measurement. The launch's failure paths (a crash, a
stop at the time limit) run against a stand-in for `run_group`.
"""

from __future__ import annotations

import json
import socket
from datetime import datetime

import pytest
import yaml

from trainplan.bench.series import run as series_run
from trainplan.bench.series import suite as suite_mod
from trainplan.bench.series import suite_sweep
from trainplan.records import schema as records

TINY_MODEL = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"


def _suite(d, configs):
    model = d / "tiny.yaml"
    model.write_text(TINY_MODEL + f"name: {model}\n")
    suite = {"model": str(model), "gpu": "h100-sxm", "cluster": "dgx-h100", "seq_len": 32,
             "steps": 4, "warmup": 1,
             "extra_args": ["--synthetic", "--cpu", "--peak-tflops", "0.5"], "configs": configs}
    path = d / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


CONFIGS = [{"tag": "fsdp-z2", "gpus": 2, "layout": {"dp": 2, "zero": 2, "micro_batch": 2}},
           {"tag": "broken", "gpus": 2, "steps": 0, "layout": {"dp": 2, "micro_batch": 2}},
           {"tag": "ddp", "gpus": 2, "layout": {"dp": 2, "micro_batch": 1}}]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    path = _suite(d, CONFIGS)
    out = d / "out"
    code = series_run.main([str(path), "--out", str(out), "--launches", "2", "--budget-s", "300",
                           "--sweep"])
    assert code == 0
    return d, path, out


def _stamps(path):
    return [datetime.fromisoformat(r["recorded_at"]) for r in records.load(path)]


def test_each_config_gets_its_own_record_per_repetition(swept):
    _, _, out = swept
    meas = records.load(out / "measurements.jsonl")
    preds = records.load(out / "predictions.jsonl")
    assert [p["config"]["tag"] for p in preds] == ["fsdp-z2", "broken", "ddp"]
    assert len(meas) == 4
    by_layout = {}
    for m in meas:
        by_layout.setdefault((m["layout"]["zero"], m["layout"]["micro_batch"]), []).append(m)
    assert sorted(by_layout) == [(0, 1), (2, 2)]  # ddp mb 1, fsdp zero 2 mb 2: 2 records each
    assert {m["tag"] for m in by_layout[(0, 1)]} == {"ddp"}  # each record names its config
    assert {m["tag"] for m in by_layout[(2, 2)]} == {"fsdp-z2"}
    assert all(m["loader"]["synthetic"] for m in meas)
    assert all(len(v) == 2 for v in by_layout.values())
    assert {m["run_id"] for m in meas} == {preds[0]["run_id"]}
    assert max(_stamps(out / "predictions.jsonl")) < min(_stamps(out / "measurements.jsonl"))
    # repetition 1: fsdp-z2, broken, ddp; repetition 2 (broken gone), rotated: ddp, fsdp-z2
    marks = {key: [n for m in v for n in m["notes"] if n.startswith("sweep launch")]
             for key, v in by_layout.items()}
    assert marks[(2, 2)] == ["sweep launch: position 1 of 3", "sweep launch: position 2 of 2"]
    assert marks[(0, 1)] == ["sweep launch: position 3 of 3", "sweep launch: position 1 of 2"]
    assert all(m["warmup_steps_dropped"] == 1 and len(m["step_times_s"]) == 3 for m in meas)
    # what a launch spends before its kept steps: set-up, and the warm-up step that compiles
    assert all(m["setup_s"] > 0 and len(m["warmup_step_times_s"]) == 1
               and m["warmup_step_times_s"][0] > 0 for m in meas)


def test_the_broken_config_is_recorded_failed_and_not_run_again(swept):
    _, _, out = swept
    failed = [json.loads(ln) for ln in (out / "failed.jsonl").read_text().splitlines()]
    assert [(f["tag"], f["launch"]) for f in failed] == [("broken", 1)]
    assert "--steps" in failed[0]["reason"] and "sweep position 2 of 3" in failed[0]["reason"]


def test_sweep_records_have_the_fields_of_a_separate_launch(swept, tmp_path):
    _, path, out = swept
    code = series_run.main([str(path), "--out", str(tmp_path), "--launches", "1",
                           "--only", "ddp", "--budget-s", "120"])
    assert code == 0
    alone = records.load(tmp_path / "measurements.jsonl")[0]
    swept_ddp = [m for m in records.load(out / "measurements.jsonl")
                 if m["layout"]["zero"] == 0][0]
    assert set(alone) == set(swept_ddp)
    assert set(alone["provenance"]) == set(swept_ddp["provenance"])
    assert alone["layout"] == swept_ddp["layout"] and alone["losses"] == swept_ddp["losses"]
    assert not any(n.startswith("sweep launch") for n in alone["notes"])


# ---------------------------------------------------------------- failure paths, no torchrun


def _fake_jobs(tmp_path, n):
    suite = {"model": "llama-1.3b", "seq_len": 32}
    return [(suite, {"tag": f"c{i}", "gpus": 2, "layout": {"dp": 2}}) for i in range(n)]


def _summary(tag):
    return {"tokens_per_s_per_gpu": 1.0, "tag": tag}


def test_a_crash_fails_the_running_config_and_relaunches_the_rest(tmp_path, monkeypatch):
    launched = []

    def crash_on_c1(cmd, env, limit):
        runs = json.loads(open(cmd[-1]).read())
        launched.append([r["tag"] for r in runs])
        lines = []
        for pos, r in enumerate(runs, 1):
            if r["tag"] == "c1":
                return 1, "\n".join(lines), ("torch.OutOfMemoryError: CUDA out of memory.\n"
                                              f"  host : {socket.gethostname()}")
            lines.append(json.dumps({"tag": r["tag"], "position": pos, "elapsed_s": 1.0,
                                     "summary": _summary(r["tag"])}))
        return 0, "\n".join(lines), ""

    monkeypatch.setattr(suite_mod, "run_group", crash_on_c1)
    jobs = _fake_jobs(tmp_path, 3)
    preds = {c["tag"]: {"predicted": {}} for _, c in jobs}
    import time
    rows, outcomes = suite_sweep.measure_sweep(jobs, preds, tmp_path, "r", 2,
                                               time.monotonic() + 600)
    # rep 1: c0 ok, c1 crashes, c2 relaunched alone; rep 2 (c1 gone): [c0, c2] rotated by 1
    assert launched == [["c0", "c1", "c2"], ["c2"], ["c2", "c0"]]
    status = {o["tag"]: (o["status"], o["launches"]) for o in outcomes}
    assert status == {"c0": ("measured", 2), "c1": ("failed", 0), "c2": ("measured", 2)}
    failed = [json.loads(ln) for ln in (tmp_path / "failed.jsonl").read_text().splitlines()]
    assert [f["tag"] for f in failed] == ["c1"] and "out of memory" in failed[0]["reason"]
    assert failed[0]["log"] == "logs/c1-launch1.log"  # the launch's output, kept beside it
    kept = (tmp_path / failed[0]["log"]).read_text()
    assert "torch.OutOfMemoryError" in kept and socket.gethostname() not in kept  # hashed only


def test_a_stopped_launch_without_time_left_fails_what_it_did_not_reach(tmp_path, monkeypatch):
    import time

    limits = []

    def hang(cmd, env, limit):  # stuck until stopped at its limit: all the time there was
        limits.append(limit)
        time.sleep(limit)
        return None, "", ""

    monkeypatch.setattr(suite_mod, "run_group", hang)
    monkeypatch.setattr(suite_sweep, "CONFIG_GUESS_S", 0.5)
    monkeypatch.setattr(suite_sweep, "START_GUESS_S", 0.5)
    jobs = _fake_jobs(tmp_path, 2)
    preds = {c["tag"]: {"predicted": {}} for _, c in jobs}
    _, outcomes = suite_sweep.measure_sweep(jobs, preds, tmp_path, "r", 1, time.monotonic() + 3)
    failed = [json.loads(ln) for ln in (tmp_path / "failed.jsonl").read_text().splitlines()]
    assert [f["tag"] for f in failed] == ["c0", "c1"]
    assert "time limit" in failed[0]["reason"] and failed[1]["reason"].startswith("not reached")
    assert not any("log" in f for f in failed)  # stopped: no traceback to keep
    assert [o["status"] for o in outcomes] == ["failed", "not run"] and len(limits) == 1


def test_the_budget_takes_only_configs_whose_repetitions_fit():
    b = suite_sweep.Budget()
    jobs = [({}, {"tag": t, "gpus": g}) for t, g in (("a", 2), ("b", 2), ("c", 1))]
    # guesses: start 25 s per GPU count, 20 s a config; 3 repetitions
    assert suite_sweep.choose(jobs, 3, b, 3 * 45 + 3 * 20) == ["a", "b"]
    assert suite_sweep.choose(jobs, 3, b, 3 * 45 + 3 * 20 + 3 * 45) == ["a", "b", "c"]
    b.saw(30.0, [{"tag": "a", "elapsed_s": 8.0}, {"tag": "b", "elapsed_s": 12.0}])
    assert b.start == 10.0 and b.launch(["a", "b"]) == 30.0 and b.of("c") == 12.0
    assert b.limit(["a", "b"], 1000.0) == 120.0 and b.limit(["a"], 50.0) == 50.0


def test_configs_the_guesses_left_out_run_in_a_later_round(tmp_path, monkeypatch):
    """The first round takes what the guesses (start 25 s, a config 20 s) fit; once a round's
    launches show configs take 1 s, the configs left run in a second round."""
    import time

    launched = []

    def quick(cmd, env, limit):
        runs = json.loads(open(cmd[-1]).read())
        launched.append([r["tag"] for r in runs])
        time.sleep(0.2)
        return 0, "\n".join(json.dumps({"tag": r["tag"], "position": pos, "elapsed_s": 0.05,
                                        "summary": _summary(r["tag"])})
                            for pos, r in enumerate(runs, 1)), ""

    monkeypatch.setattr(suite_mod, "run_group", quick)
    jobs = _fake_jobs(tmp_path, 4)
    preds = {c["tag"]: {"predicted": {}} for _, c in jobs}
    _, outcomes = suite_sweep.measure_sweep(jobs, preds, tmp_path, "r", 1,
                                            time.monotonic() + 70)  # 25 + 2 x 20 fit, not 3
    assert launched == [["c0", "c1"], ["c2", "c3"]]
    assert [o["status"] for o in outcomes] == ["measured"] * 4
