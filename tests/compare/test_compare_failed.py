"""Failed launches in `trainplan compare`: paired with their prediction, never dropped."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainplan.compare import accuracy as compare
from trainplan.compare import failed as compare_failed
from trainplan.errors import RecordError
from trainplan.records import schema as records

ROOT = Path(__file__).resolve().parents[2]
FAILED = ROOT / "data/measurements/proxy-h100x2-20261126-failed.jsonl"
PRED = ROOT / "data/measurements/proxy-h100x2-20261126-predictions.jsonl"
OOM = ("out of memory (rc=1): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
       "512.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 0.2 GiB is free. "
       "Including non-PyTorch memory, this process has 78.50 GiB memo")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def committed_pair() -> tuple[dict, dict]:
    """The committed out-of-memory launch (1gpu-mb16-c, 2 x H100) and its prediction."""
    (fail,) = _lines(FAILED)
    pred = next(p for p in _lines(PRED) if p["config"]["tag"] == fail["tag"])
    return fail, pred


def test_needed_memory_is_what_the_process_held_plus_what_it_asked_for():
    assert compare_failed.needed_gib(OOM) == pytest.approx(78.5 + 0.5)
    (fail,) = _lines(FAILED)
    assert compare_failed.needed_gib(fail["reason"]) == pytest.approx(77.85 + 1.95)
    assert compare_failed.needed_gib("rc=1: error: --steps must be > --warmup") is None


def test_committed_out_of_memory_launch_is_listed_with_its_bound():
    out = compare.compare(repredictions=False)
    (row,) = [f for f in out["failed"] if f["config"] == "1gpu-mb16-c"]
    fail, pred = committed_pair()
    assert row["host"] == "2 x NVIDIA H100 80GB HBM3" and row["out_of_memory"]
    assert row["predicted_at"] == pred["recorded_at"] < row["failed_at"]
    assert row["predicted_fits"] is True
    assert row["memory_error_at_most"] == pytest.approx(
        pred["predicted"]["memory_gib"]["total"] / (77.85 + 1.95) - 1)
    assert row["memory_error_at_most"] < 0
    assert not any(t.startswith("1gpu-mb16-c on NVIDIA H100") for t in
                   out["predicted_not_measured"])  # failed, not left for budget


def test_a_prediction_recorded_after_the_failure_is_not_its_prediction(tmp_path):
    fail, pred = committed_pair()
    late = {**copy.deepcopy(pred), "recorded_at": "2026-11-26T23:00:00+00:00"}
    out = compare.compare([_write(tmp_path / "r.jsonl", [fail, late])], repredictions=False)
    (row,) = out["failed"]
    assert row["predicted_at"] is None and row["memory_error_at_most"] is None


def test_out_of_memory_where_fits_was_predicted_on_the_headline_host_misses_the_targets(
        tmp_path):
    """A compared config predicted exactly meets the targets; an out-of-memory launch on the
    same host of a config predicted to fit turns that, one predicted not to fit does not."""
    fail, pred = committed_pair()
    from .test_compare import tp2_records
    tp2, meas = tp2_records()  # a config compared on 2 x H200
    tp2["predicted"]["step_time_s"] = records.combine_launches(meas)["step_time_s"]
    tp2["predicted"]["memory_gib"]["total"] = max(m["peak_mem_reserved_gib"] for m in meas)
    on_h200 = {**copy.deepcopy(fail), "card": tp2["card"],
               "provenance": {**fail["provenance"], "gpu_count": 2}}
    p_h200 = {**copy.deepcopy(pred), "card": tp2["card"]}

    def run(name, recs):
        return compare.compare([_write(tmp_path / name, recs)], repredictions=False)

    assert run("a.jsonl", [tp2, *meas])["meets_targets"]
    both = run("b.jsonl", [tp2, *meas, p_h200, on_h200])
    assert both["failed"][0]["host"] == both["headline_host"] and both["configs"] == 1
    assert not both["meets_targets"]
    p_h200["predicted"]["fits"] = False  # the planner said it would not fit: no miss
    assert run("c.jsonl", [tp2, *meas, p_h200, on_h200])["meets_targets"]


@pytest.mark.parametrize("field", ["reason", "card", "tag", "launch"])
def test_bad_failed_launch_record_is_refused(tmp_path, field):
    fail, _ = committed_pair()
    bad = {k: v for k, v in fail.items() if k != field}
    with pytest.raises(RecordError, match=field):
        records.validate(bad)
    path = _write(tmp_path / "bad.jsonl", [bad])
    with pytest.raises(RecordError, match="bad.jsonl:1"):
        compare.compare([path], repredictions=False)
