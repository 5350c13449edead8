"""`trainplan validate` end to end on CPU: microbenchmarks -> calibration -> predictions ->
measurements -> comparison, all under --out, with 2 gloo ranks and a tiny model.

The tiny suite has one good config (2 launches) and one that the harness
refuses (--steps 0), which must be recorded as failed while the series goes
on. A second run continues from the first: it takes the first run's
calibration and runs nothing again. The GPU is a YAML file with a CPU-sized
peak, so that the calibrated fractions are in (0, 1].
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, trainplan_cli
from trainplan import cli
from trainplan.calibrate import store as calibration
from trainplan.compare import matching
from trainplan.cost import memory_runtime as rt
from trainplan.records import schema as records

TINY_MODEL = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
CPU_GPU = ("name: cpu-test\nbf16_tflops: 0.5\nmemory_gib: 64\nhbm_tbps: 0.05\n"
           "matmul_efficiency: 0.5\nattention_efficiency: 0.1\nmemory_efficiency: 0.5\n")


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    d = tmp_path_factory.mktemp("validate")
    model, gpu = d / "tiny.yaml", d / "cpu-test.yaml"
    # micro records the model by its name and calibrate loads it by that name: the path
    model.write_text(TINY_MODEL + f"name: {model}\n")
    gpu.write_text(CPU_GPU)
    suite = {"model": str(model), "gpu": str(gpu), "cluster": "dgx-h100", "seq_len": 32,
             "steps": 4, "warmup": 1,
             "extra_args": ["--synthetic", "--cpu", "--peak-tflops", "0.5"],
             "configs": [{"tag": "fsdp-z2", "gpus": 2, "layout": {"dp": 2, "zero": 2,
                                                                  "micro_batch": 2}},
                         {"tag": "broken", "gpus": 2, "steps": 0,
                          "layout": {"dp": 2, "micro_batch": 2}}]}
    path = d / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return d, path


@pytest.fixture(scope="module")
def first_run(tiny_suite):
    d, suite = tiny_suite
    out = d / "run1"
    proc = trainplan_cli(["validate", "--gpus", "2", "--suite", suite, "--out", out,
                          "--launches", "2", "--budget-s", "240", "--json"], cwd=d, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout), proc.stderr


def _stamps(path):
    return [datetime.fromisoformat(r["recorded_at"]) for r in records.load(path)]


def test_every_stage_wrote_its_files_in_order(first_run):
    out, report, stderr = first_run
    micro = records.load(out / "micro.jsonl")
    assert {r["bench"] for r in micro} >= {"matmul", "attention", "all_reduce"}
    cal = calibration.load("cpu-test", out / "calibration" / "cpu-test.yaml")
    assert cal["sources"][0]["path"] == str(out / "micro.jsonl")
    assert report["calibration"]["source"] == "measured"
    assert report["calibration"]["label"] == cal["label"]
    assert 0 < cal["matmul_efficiency"] <= 1 and cal["collectives"]
    preds = records.load(out / "predictions.jsonl")
    meas = records.load(out / "measurements.jsonl")
    assert [p["config"]["tag"] for p in preds] == ["fsdp-z2", "broken"]
    assert len(meas) == 2 and {m["card"] for m in meas} == {"cpu"} and meas[0]["gpus"] == 2
    assert max(_stamps(out / "predictions.jsonl")) < min(_stamps(out / "measurements.jsonl"))
    assert max(_stamps(out / "micro.jsonl")) < min(_stamps(out / "predictions.jsonl"))
    assert "calibrated cpu-test" in stderr and "fsdp-z2 launch 2/2" in stderr  # progress
    # predicted for the allocator the launches ran (expandable unless this shell set one)
    mode = rt.allocator_of(dict(os.environ), unset=rt.EXPANDABLE)
    assert report["allocator"] == mode and {p["config"]["allocator"] for p in preds} == {mode}
    assert {matching.allocator(m) for m in meas} == {mode}
    from trainplan.commands.validation import format_validate
    assert f"{mode} allocator" in format_validate(report).splitlines()[0]


def test_the_failed_config_is_recorded_and_the_series_goes_on(first_run):
    out, report, _ = first_run
    status = {o["tag"]: (o["status"], o["launches"]) for o in report["configs"]}
    assert status == {"fsdp-z2": ("measured", 2), "broken": ("failed", 0)}
    failed = [json.loads(ln) for ln in (out / "failed.jsonl").read_text().splitlines()]
    assert [f["tag"] for f in failed] == ["broken"] and "--steps" in failed[0]["reason"]
    assert failed[0]["log"] == "logs/broken-launch1.log"  # the end of the launch's output
    assert "--steps" in (out / failed[0]["log"]).read_text()


def test_compare_json_matches_the_records(first_run):
    out, report, _ = first_run
    result = json.loads((out / "compare.json").read_text())
    assert result == report["compare"]
    assert result["configs"] == 1 and not result["refused"]
    row = result["rows"][0]
    pred = records.load(out / "predictions.jsonl")[0]
    combined = records.combine_launches(records.load(out / "measurements.jsonl"))
    assert row["config"] == "fsdp-z2" and row["launches"] == 2 and row["flagged"]
    assert row["prediction"] == f"{out / 'predictions.jsonl'}:1"
    assert row["predicted_step_time_s"] == pred["predicted"]["step_time_s"]
    assert row["measured_step_time_s"] == pytest.approx(combined["step_time_s"])
    assert row["step_time_error"] == pytest.approx(
        pred["predicted"]["step_time_s"] / combined["step_time_s"] - 1)
    assert result["predicted_not_measured"] == []  # it failed: listed under "failed"
    assert [f["tag"] for f in result["failed_launches"]] == ["broken"]
    (broken,) = result["failed"]
    assert broken["config"] == "broken" and broken["predicted_at"] is not None
    assert not broken["out_of_memory"] and broken["memory_error_at_most"] is None
    assert "scaling" in result


def test_predictions_used_the_run_s_calibration(first_run, tiny_suite):
    """The same config priced on the datasheet GPU gives another step time."""
    from trainplan.calibrate.store import load_gpu
    from trainplan.plan.planner import plan
    from trainplan.specs import load_cluster, load_model

    out, _, _ = first_run
    d, _ = tiny_suite
    pred = records.load(out / "predictions.jsonl")[0]
    lay = pred["config"]["full_layout"]
    datasheet = plan(load_model(str(d / "tiny.yaml")),
                     load_gpu(str(d / "cpu-test.yaml"), calibrated=False),
                     load_cluster("dgx-h100"), gpus=2, seq_len=32,
                     global_batch_tokens=2 * 2 * 32, pins=lay)["plans"][0]["step_time_s"]
    assert pred["predicted"]["step_time_s"] != pytest.approx(datasheet, rel=1e-3)


def test_continue_from_reuses_the_calibration_and_skips_what_was_done(first_run, tiny_suite):
    out, _, _ = first_run
    d, suite = tiny_suite
    proc = trainplan_cli(["validate", "--gpus", "2", "--suite", suite, "--out", d / "run2",
                          "--launches", "2", "--continue-from", out, "--json"], cwd=d,
                         timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["calibration"]["source"].startswith("file ")
    assert sorted(report["skipped"]) == ["broken", "fsdp-z2"] and report["configs"] == []
    assert not (d / "run2" / "micro.jsonl").exists()
    assert (d / "run2" / "calibration" / "cpu-test.yaml").read_text() == (
        out / "calibration" / "cpu-test.yaml").read_text()
    # a third run continued from the second skips what the first did: the chain carries
    proc = trainplan_cli(["validate", "--gpus", "2", "--suite", suite, "--out", d / "run3",
                          "--launches", "2", "--continue-from", d / "run2", "--json"], cwd=d,
                         timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    third = json.loads(proc.stdout)
    assert sorted(third["skipped"]) == ["broken", "fsdp-z2"] and third["configs"] == []


@pytest.mark.parametrize("extra, message", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "1"], "need more than --gpus 1"),
    (["--gpus", "2", "--only", "nope"], "'nope' is not a config"),
    (["--gpus", "2", "--launches", "x"], "--launches"),
    (["--gpus", "2", "--continue-from", "/nonexistent"], "validate.json"),
    (["--gpus", "2", "--calibration", "/nonexistent.yaml"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_suite, tmp_path, capsys, extra, message):
    _, suite = tiny_suite
    code = cli.main(["validate", "--suite", str(suite), "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_sweep_of_trainer_configs_is_refused_before_any_work(tmp_path, capsys):
    """Trainer runs its own loop, one launch a config: --sweep says so before microbenchmarks."""
    suite = str(ROOT / "data/suites/baseline-1gpu.yaml")
    code = cli.main(["validate", "--suite", suite, "--out", str(tmp_path / "o"), "--gpus", "1",
                     "--sweep"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "leave out --sweep" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_failure_reasons_and_the_deadline_kill():
    import sys
    import time

    from trainplan.bench.series import suite
    from trainplan.proctree import failure_reason

    oom = ("Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of "
           "memory. Tried to allocate 2.00 GiB\nChildFailedError: ...")
    assert failure_reason(1, oom).startswith("out of memory (rc=1): torch.OutOfMemoryError")
    assert failure_reason(1, "W warn\nerror: tp = 3 does not divide\nChildFailedError: x") \
        == "rc=1: error: tp = 3 does not divide"
    rank_died = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\"\n"
                 "[rank0]: torch._inductor.exc.InductorError: LoweringException: RuntimeError: "
                 "matmul precision\nE1129 api.py:986] failed (exitcode: 1)\nTraceback (most "
                 "recent call last):\ntorch.distributed.elastic.multiprocessing.errors."
                 "ChildFailedError: \n")
    assert failure_reason(1, rank_died) == ("rc=1: torch._inductor.exc.InductorError: "
                                                  "LoweringException: RuntimeError: matmul "
                                                  "precision")
    assert failure_reason(1, "Traceback\nChildFailedError: x") == "rc=1: ChildFailedError: x"
    teed = ("[default0]:[rank0]: ValueError: micro-batch 7\n[default1]:[rank1]: RuntimeError: "
            "gloo: Connection closed by peer\n[default1]:Exception ignored in: <x>\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert failure_reason(1, teed) == "rc=1: ValueError: micro-batch 7"  # the first rank's
    killed = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "  traceback : Signal 9 (SIGKILL) received by PID 4242\n")
    assert failure_reason(-9, killed) == "rc=-9: Signal 9 (SIGKILL) received by PID 4242"
    t0 = time.monotonic()
    summary, why = suite.launch_once(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"],
        {}, timeout_s=1.0)
    assert summary is None and why.startswith("stopped at the time budget")
    assert time.monotonic() - t0 < 10  # the child's child went with it


def test_a_layer_slice_config_predicts_and_launches_the_slice(tmp_path):
    """`layers: N` reaches the prediction (the planner prices N blocks) and the launch."""
    from trainplan.bench.series import suite as suite_mod

    path = tmp_path / "s.yaml"
    path.write_text("model: llama-13b\nseq_len: 4096\nconfigs:\n"
                    "  - {tag: s, gpus: 4, layers: 4, layout: {dp: 4, zero: 3, micro_batch: 1}}\n")
    s = suite_mod.load_suite(str(path))
    cfg = s["configs"][0]
    pred = suite_mod.predict(s, cfg, "NVIDIA H100 80GB HBM3", "r1")
    full = dict(cfg, layers=None)
    whole = suite_mod.predict(s, full, "NVIDIA H100 80GB HBM3", "r1")
    assert pred["model"] == "llama-13b:4-layers" and whole["model"] == "llama-13b"
    assert pred["predicted"]["step_time_s"] < whole["predicted"]["step_time_s"] / 5
    cmd = suite_mod.train_command(s, cfg, tmp_path, "r1")
    assert cmd[cmd.index("--layers") + 1] == "4" and cmd[cmd.index("--model") + 1] == "llama-13b"
    path.write_text(path.read_text().replace("layers: 4", "layers: 0"))
    with pytest.raises(suite_mod.SpecError, match="layers = 0"):
        suite_mod.load_suite(str(path))


def test_a_config_may_name_its_own_model_and_sequence_length(tmp_path):
    """A config's `model` and `seq_len` override the suite's in the prediction, the launch and
    a failure record; the others keep the suite's; a config with no model anywhere, or a
    sequence length that is not a whole number, is refused in one line."""
    from trainplan.bench.series import suite as suite_mod

    path = tmp_path / "s.yaml"
    path.write_text("model: llama-1.3b\nseq_len: 2048\nconfigs:\n"
                    "  - {tag: own, gpus: 4, model: llama-13b, layers: 2, seq_len: 8192,"
                    " layout: {dp: 4, zero: 3, micro_batch: 1}}\n"
                    "  - {tag: suite, gpus: 4, layout: {dp: 4, zero: 3, micro_batch: 1}}\n")
    s = suite_mod.load_suite(str(path))
    own, plain = s["configs"]
    pred = suite_mod.predict(s, own, "NVIDIA H100 80GB HBM3", "r1")
    assert pred["model"] == "llama-13b:2-layers" and pred["config"]["seq_len"] == 8192
    base = suite_mod.predict(s, plain, "NVIDIA H100 80GB HBM3", "r1")
    assert base["model"] == "llama-1.3b" and base["config"]["seq_len"] == 2048
    cmd = suite_mod.train_command(s, own, tmp_path, "r1")
    assert cmd[cmd.index("--model") + 1] == "llama-13b"
    assert cmd[cmd.index("--seq-len") + 1] == "8192"
    suite_mod.record_failure(tmp_path, s, own, 1, "out of memory", "r1")
    failed = json.loads((tmp_path / "failed.jsonl").read_text())
    assert (failed["model"], failed["seq_len"]) == ("llama-13b", 8192)
    path.write_text("configs:\n  - {tag: x, gpus: 1, layout: {}}\n")
    with pytest.raises(suite_mod.SpecError, match="names no model"):
        suite_mod.load_suite(str(path))
    path.write_text("model: llama-1.3b\nconfigs:\n  - {tag: x, gpus: 1, seq_len: 1.5}\n")
    with pytest.raises(suite_mod.SpecError, match="seq_len = 1.5"):
        suite_mod.load_suite(str(path))


def test_other_models_gemms_shape_the_curve_not_the_matmul_fraction(first_run, tiny_suite,
                                                                    tmp_path, monkeypatch):
    """Stage 1d on CPU: the GEMMs of two more models (one GPU each, in two waves of one)
    land in micro.jsonl as curve-only records; the calibration's single matmul fraction
    is still the base model's, and the size curve holds the new widths."""
    import shutil

    from trainplan import validate as v
    from trainplan.bench.micro import stage
    from trainplan.calibrate import fit
    from trainplan.calibrate.store import load_gpu

    d, _ = tiny_suite
    micro = tmp_path / "micro.jsonl"
    shutil.copyfile(first_run[0] / "micro.jsonl", micro)
    models = []
    for name, hidden in (("wide", 128), ("wider", 192)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(TINY_MODEL.replace("hidden: 64", f"hidden: {hidden}") + f"name: {path}\n")
        models.append(str(path))
    monkeypatch.setenv("PYTHONPATH", str(Path(v.__file__).parents[1]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stage.run_gemm_micro(micro, models, 1, v.Clock(200), tokens="16,32")
    assert not list(tmp_path.glob("gemm-*.jsonl"))  # each part appended, then removed
    added = [r for r in records.load(micro) if r["config"].get("base") is False]
    assert {r["model"] for r in added} == set(models)
    assert stage.shard_degrees(models[0]) == [1, 2]  # 2 kv heads: no tp 4 shards
    assert {(r["config"]["m"], r["config"]["tp"]) for r in added} == {
        (m, t) for m in (16, 32) for t in (1, 2)}
    gpu = load_gpu(str(d / "cpu-test.yaml"), calibrated=False)
    before, after = fit.build([first_run[0] / "micro.jsonl"], gpu), fit.build([micro], gpu)
    assert after["matmul_efficiency"] == before["matmul_efficiency"]
    widths = {w for _, w, _ in after["pieces"]["matmul_curve"]}
    assert 192 * 192 in widths and 128 * 128 in widths  # q of each new model
    assert {w for _, w, _ in after["pieces"]["head_matmul_curve"]} == {
        256 * 64, 256 * 128, 256 * 192}  # each output layer, the base model's too


def test_a_micro_run_cut_short_calibrates_from_what_it_recorded(tmp_path, monkeypatch):
    """The overlap benchmark runs last; if the run is stopped there, the GEMM and attention
    records already appended still calibrate the card. Without them it is an error."""
    from trainplan import validate as v
    from trainplan.bench.micro import stage
    from trainplan.bench.series import suite as suite_mod
    from trainplan.errors import TrainplanError

    path = tmp_path / "micro.jsonl"
    lines = [json.dumps({"kind": "microbenchmark", "bench": b}) for b in ("matmul", "attention")]

    def cut(cmd, env, limit, capture):
        path.write_text("\n".join(lines) + '\n{"kind": "microbench')  # killed mid-line
        return None, "", ""

    monkeypatch.setattr(suite_mod, "run_group", cut)
    clock = v.Clock(100)
    assert stage.run_micro(tmp_path, 2, "llama-1.3b", False, clock) == path
    assert path.read_text().endswith("}\n")  # the part line is gone: records.load reads it
    assert stage.micro_kinds(path) == {"matmul", "attention"}
    lines.pop()
    with pytest.raises(TrainplanError, match="ran past its time limit"):
        stage.run_micro(tmp_path, 2, "llama-1.3b", False, clock)


def test_sweep_mode_end_to_end(tiny_suite):
    """`--sweep`: both repetitions of the tiny suite in one launch each, the same outcomes as
    separate launches, each record marked with its place in its sweep."""
    d, suite = tiny_suite
    out = d / "sweep"
    proc = trainplan_cli(["validate", "--gpus", "2", "--suite", suite, "--out", out,
                          "--launches", "2", "--skip-micro", "--sweep", "--budget-s", "240",
                          "--json"], cwd=d, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["sweep"] is True
    status = {o["tag"]: (o["status"], o["launches"]) for o in report["configs"]}
    assert status == {"fsdp-z2": ("measured", 2), "broken": ("failed", 0)}
    meas = records.load(out / "measurements.jsonl")
    marks = [[n for n in m["notes"] if n.startswith("sweep launch")] for m in meas]
    # repetition 1: fsdp-z2, broken; repetition 2: fsdp-z2 alone (broken is not run again)
    assert marks == [["sweep launch: position 1 of 2"], ["sweep launch: position 1 of 1"]]
    assert max(_stamps(out / "predictions.jsonl")) < min(_stamps(out / "measurements.jsonl"))
    failed = [json.loads(ln) for ln in (out / "failed.jsonl").read_text().splitlines()]
    assert [f["tag"] for f in failed] == ["broken"] and "--steps" in failed[0]["reason"]
    assert report["compare"]["configs"] == 1 and "fsdp-z2 launch 2/2" in proc.stderr
