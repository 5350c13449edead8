"""Records: builders, provenance, append-only files, and refusal of malformed files."""

from __future__ import annotations

import copy
import hashlib
import json
import socket

import pytest

from trainplan.errors import RecordError
from trainplan.records import schema as records

LAYOUT = dict(dp=2, tp=1, pp=1, cp=1, ep=1, zero=3, micro_batch=8, grad_accum=1,
              recompute="none", compile=True)
TIMES = [0.50, 0.52, 0.49, 0.51, 0.50, 0.53, 0.48, 0.50, 0.51, 0.50]


def measurement(**kw):
    args = dict(model="llama-1.3b", impl="trainplan", layout=LAYOUT, gpus=2, card="NVIDIA H200",
                run_id="r1", step_times_s=TIMES, tokens_per_step=2 * 8 * 2048,
                flops_per_token=8.0e9, peak_tflops=989.0, peak_mem_reserved_gib=40.0,
                peak_mem_allocated_gib=31.5, warmup_steps_dropped=3)
    return records.measurement_record(**{**args, **kw})


def prediction():
    return records.prediction_record(model="llama-1.3b", layout=LAYOUT, gpus=2, card="h200-sxm",
                                     predicted={"step_time_s": 0.5, "mfu": 0.5})


def micro():
    return records.microbenchmark_record(
        bench="all_reduce", config={"op": "all_reduce", "size_bytes": 1024, "world": 2},
        results={"time_s": 1e-5, "algbw_gbps": 0.1024, "busbw_gbps": 0.1024}, gpus=2, card="cpu")


def test_measurement_figures():
    r = measurement()
    assert r["step_time_s"] == 0.50  # median of TIMES
    per_gpu = 2 * 8 * 2048 * len(TIMES) / sum(TIMES) / 2  # total tokens / total time / GPUs
    assert r["tokens_per_s_per_gpu"] == pytest.approx(per_gpu)
    low, high = r["tokens_per_s_per_gpu_ci"]
    assert low < per_gpu < high and high / low < 1.05
    assert r["mfu"] == pytest.approx(per_gpu * 8.0e9 / 989e12)
    assert r["step_time_s_ci"] == [0.49, 0.52]  # ranks 2 and 9 of 10
    assert r["warmup_steps_dropped"] == 3 and r["step_times_s"] == TIMES
    for field in ("kind", "model", "impl", "layout", "gpus", "card", "run_id", "step_time_s",
                  "tokens_per_s_per_gpu", "tokens_per_s_per_gpu_ci", "mfu",
                  "peak_mem_reserved_gib", "peak_mem_allocated_gib", "provenance"):
        assert field in r


def test_provenance_hashes_the_host_and_redacts_secrets(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TORCH_HUB_TOKEN", "hunter2")
    monkeypatch.setenv("CUDA_API_KEY", "hunter3")
    monkeypatch.setenv("UNRELATED_THING", "x")
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # changes kernels: recorded
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    p = records.provenance()
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", "redis://:hunter4@cache:6379")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_HOST", "https://me:hunter5@cache.example")
    p = records.provenance()
    assert p["env"]["TORCHINDUCTOR_REDIS_URL"] == p["env"]["TORCHINDUCTOR_CACHE_HOST"] == \
        "<redacted>"
    assert p["env"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"
    assert p["env"]["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "1"
    assert p["host_sha256"] == hashlib.sha256(socket.gethostname().encode()).hexdigest()
    assert socket.gethostname() not in json.dumps(p)
    assert p["env"]["NCCL_DEBUG"] == "INFO" and "UNRELATED_THING" not in p["env"]
    assert p["env"]["TORCH_HUB_TOKEN"] == p["env"]["CUDA_API_KEY"] == "<redacted>"
    assert "hunter" not in json.dumps(p)
    for key in ("git_commit", "date", "gpu_name", "gpu_count", "driver", "torch", "cuda",
                "nccl"):
        assert key in p
    assert p["torch"].startswith("2.")


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "runs" / "records.jsonl"
    written = [prediction(), measurement(), micro()]
    for r in written:
        records.append(path, r)
    assert records.load(path) == written
    assert path.read_text().count("\n") == 3
    assert written[0]["recorded_at"] < written[1]["recorded_at"]  # prediction stamped first


def test_to_frame_flattens_one_level(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    records.append(a, measurement())
    records.append(b, measurement(impl="hf-baseline", layout={**LAYOUT, "zero": 2}))
    records.append(b, micro())
    frame = records.to_frame([a, b])
    assert len(frame) == 3 and list(frame["kind"]) == ["measurement"] * 2 + ["microbenchmark"]
    assert list(frame["layout.zero"][:2]) == [3, 2] and frame["results.busbw_gbps"].iloc[2] > 0
    assert list(frame["line"]) == [1, 1, 2] and frame["source"].iloc[0] == str(a)


def test_combine_launches_uses_total_tokens_over_total_time():
    launches = [measurement(step_times_s=[0.5] * 8), measurement(step_times_s=[1.0] * 8)]
    combined = records.combine_launches(launches)
    assert combined["tokens_per_s_per_gpu"] == pytest.approx(2 * 8 * 2048 * 16 / 12.0 / 2)
    assert combined["launch_range"] == pytest.approx([2 * 8 * 2048 / 2, 2 * 8 * 2048 / 2 / 0.5])
    with pytest.raises(RecordError, match="differ in 'impl'"):
        records.combine_launches([launches[0], measurement(impl="hf-baseline")])


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("mfu"), "missing field 'mfu'"),
    (lambda r: r.update(gpus="2"), "field 'gpus' = '2' is str; expected int"),
    (lambda r: r.update(kind="guess"), "unknown kind 'guess'"),
    (lambda r: r.update(impl="megatron"), "field 'impl' = 'megatron'"),
    (lambda r: r["layout"].pop("compile"), "'layout' is missing 'compile'"),
    (lambda r: r["layout"].update(recompute="some"), "layout.recompute"),
    (lambda r: r.update(tokens_per_s_per_gpu_ci=[1.0]), "has 1 items; expected 2"),
    (lambda r: r.update(tokens_per_s_per_gpu_ci=[1.0, 2.0]), "does not contain"),
    (lambda r: r.update(mfu=float("nan")), "not a finite number"),
])
def test_append_refuses_a_bad_record_and_writes_nothing(tmp_path, change, message):
    path = tmp_path / "r.jsonl"
    records.append(path, measurement())
    before = path.read_bytes()
    bad = copy.deepcopy(measurement())
    change(bad)
    with pytest.raises(RecordError, match=message) as err:
        records.append(path, bad)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert path.read_bytes() == before


def _line(r) -> str:
    return json.dumps(r)


@pytest.mark.parametrize("lines, number, message", [
    (["GOOD", '{"kind": "measurement", '], 2, "not valid JSON"),
    (["GOOD", "", "GOOD"], 2, "empty line"),
    (["GOOD", "   ", "GOOD"], 2, "empty line"),
    (["GOOD", "[1, 2]"], 2, "must be a JSON object"),
    (["GOOD", "GOOD", "NO_MFU"], 3, "missing field 'mfu'"),
    (["WRONG_KIND"], 1, "unknown kind 'benchmark'"),
    (["WRONG_TYPE", "GOOD"], 1, "field 'step_time_s' = 'fast' is str"),
    (["GOOD", "NAN"], 2, "not a finite number"),
    (["MICRO_NO_BUSBW"], 1, "missing 'busbw_gbps'"),
])
def test_malformed_files_are_refused_with_one_line(tmp_path, lines, number, message):
    good = measurement()
    variants = {
        "GOOD": _line(good),
        "NO_MFU": _line({k: v for k, v in good.items() if k != "mfu"}),
        "WRONG_KIND": _line({**good, "kind": "benchmark"}),
        "WRONG_TYPE": _line({**good, "step_time_s": "fast"}),
        "NAN": _line({**good, "mfu": float("nan")}),
        "MICRO_NO_BUSBW": _line({**micro(), "results": {"time_s": 1.0, "algbw_gbps": 1.0}}),
    }
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(variants.get(x, x) for x in lines) + "\n")
    with pytest.raises(RecordError) as err:
        records.load(path)
    text = str(err.value)
    assert text.startswith(f"{path}:{number}: ") and message in text and "\n" not in text
    with pytest.raises(RecordError):
        records.to_frame([path])


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(RecordError, match="cannot read"):
        records.load(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    assert records.load(tmp_path / "empty.jsonl") == []
    assert records.to_frame([tmp_path / "empty.jsonl"]).empty


def test_prediction_may_leave_out_compile_but_not_the_rest():
    layout = {k: v for k, v in LAYOUT.items() if k != "compile"}
    r = records.prediction_record(model="m", layout=layout, gpus=2, card="h100-sxm",
                                  predicted={"mfu": 0.5})
    assert "compile" not in r["layout"]
    with pytest.raises(RecordError, match="missing 'zero'"):
        records.prediction_record(model="m", gpus=2, card="c", predicted={},
                                  layout={k: v for k, v in layout.items() if k != "zero"})


def test_builders_validate():
    with pytest.raises(RecordError, match="step_times_s"):
        measurement(step_times_s=[])
    with pytest.raises(RecordError, match="bench"):
        records.microbenchmark_record(bench="gemm", config={}, results={}, gpus=1, card="cpu")


def test_a_commit_the_run_is_told_wins_over_a_stale_git(monkeypatch):
    """The GPU machines' copy of the tree carries a .git stuck at an older commit."""
    monkeypatch.delenv("TRAINPLAN_GIT_COMMIT", raising=False)
    here = records.provenance()
    assert here["git_commit"] and here["git_dirty"] is not None  # this checkout's own git
    monkeypatch.setenv("TRAINPLAN_GIT_COMMIT", "0123abc")
    told = records.provenance()
    assert told["git_commit"] == "0123abc" and told["git_dirty"] is None
