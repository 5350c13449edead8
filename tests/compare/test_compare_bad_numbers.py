"""`trainplan compare` on record files with bad numbers or keys: one line naming the file,
line, field and value, exit 2, nothing on stdout; the committed records still compare."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainplan.cli import main

ROOT = Path(__file__).resolve().parents[2]
PRED = ROOT / "data/measurements/proxy-h200x2-20261126-predictions.jsonl"
MEAS = ROOT / "data/measurements/proxy-h200x2-20261126-measurements.jsonl"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tp2_file() -> list[dict]:
    """The committed TP 2 prediction (line 1) and its three launches (lines 2 to 4)."""
    pred = next(p for p in _lines(PRED) if p["config"]["tag"] == "tp2-mb8-c")
    return [pred, *[m for m in _lines(MEAS) if m["layout"]["tp"] == 2]]


def _set(line: int, path: str, value):
    """A change to the record on `line`: the field at dotted `path` set to `value`."""
    def change(recs):
        *parents, last = path.split(".")
        target = recs[line - 1]
        for key in parents:
            target = target[key]
        target[last] = value
    return change


def _compare(tmp_path, capsys, recs) -> tuple[int, str, str]:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code = main(["compare", "--records", str(path), "--no-repredict"])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_the_unchanged_records_compare(tmp_path, capsys):
    code, out, err = _compare(tmp_path, capsys, tp2_file())
    assert code == 0 and err == "" and "1 configs compared" in out


@pytest.mark.parametrize("changes, line, said", [
    ([_set(2, "tokens_per_s_per_gpu", 0), _set(2, "tokens_per_s_per_gpu_ci", [0, 0])], 2,
     ["'tokens_per_s_per_gpu' = 0", "1e-06 to 1e+09 tokens/s"]),
    ([_set(2, "peak_mem_reserved_gib", 1e300)], 2,
     ["'peak_mem_reserved_gib' = 1e+300", "1e-06 to 1e+06 GiB"]),
    ([_set(3, "peak_mem_reserved_gib", -5.0)], 3, ["'peak_mem_reserved_gib' = -5.0", "GiB"]),
    ([_set(2, "peak_mem_allocated_gib", 0.0)], 2, ["'peak_mem_allocated_gib' = 0.0", "GiB"]),
    ([_set(2, "step_time_s", 0)], 2, ["'step_time_s' = 0", "1e-09 to 1e+06 s"]),
    ([_set(2, "step_times_s", [])], 2, ["'step_times_s' is empty"]),
    ([_set(4, "step_times_s", [0.19, -0.19])], 4, ["'step_times_s[1]' = -0.19", "1e-09"]),
    ([_set(2, "tokens_per_step", 0)], 2, ["'tokens_per_step' = 0", "1 to 1e+12 tokens"]),
    ([_set(2, "mfu", -0.5)], 2, ["'mfu' = -0.5", "0 to 10"]),
    ([_set(2, "layout.tp", 0)], 2, ["'layout.tp' = 0", "1 to 1e+12"]),
    ([_set(2, "layout.zero", 7)], 2, ["'layout.zero' = 7", "0 to 3"]),
    ([_set(2, "gpus", 0)], 2, ["'gpus' = 0", "1 to 1e+12 GPUs"]),
    ([_set(1, "predicted.memory_gib.total", 0.0)], 1,
     ["'predicted.memory_gib.total' = 0.0", "GiB"]),
    ([_set(1, "predicted.step_time_s", -1.0)], 1, ["'predicted.step_time_s' = -1.0", "s"]),
    ([_set(1, "predicted.time_breakdown_s.compute", None)], 1,
     ["'predicted.time_breakdown_s.compute' = None", "expected number"]),
    ([_set(1, "predicted.memory_gib", 5)], 1, ["'predicted.memory_gib' = 5", "dict"]),
    ([_set(3, "tokens_per_step", 99)], 3,
     ["differ in 'tokens_per_step'", "99 here", "16384 at ", "r.jsonl:2"]),
    ([_set(2, "recorded_at", "2026-11-26T01:00:00")], 2,
     ["'2026-11-26T01:00:00'", "with its zone"]),
    ([_set(2, "tag", ["a"])], 2, ["'tag' = ['a']", "a string or null"]),
    ([_set(2, "seq_len", 0)], 2, ["'seq_len' = 0", "1 to 1e9"]),
    ([_set(2, "layout.pp_schedule", [1])], 2, ["'layout.pp_schedule' = [1]", "a string, number"]),
    ([_set(1, "config.full_layout", {"dp": {}})], 1, ["'config.full_layout.dp' = {}"]),
    ([_set(1, "config", 5)], 1, ["'config' = 5 is not a mapping"]),
])
def test_a_bad_record_is_one_line_naming_it_and_exit_2(tmp_path, capsys, changes, line, said):
    recs = copy.deepcopy(tp2_file())
    for change in changes:
        change(recs)
    code, out, err = _compare(tmp_path, capsys, recs)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert f"r.jsonl:{line}: " in err
    for text in said:
        assert text in err


def test_an_empty_record_file_is_refused_by_name(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["compare", "--records", str(empty), "--no-repredict"]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err.count("\n") == 1
    assert f"{empty}: the file is empty" in got.err


def test_an_empty_record_file_beside_others_is_skipped(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in tp2_file()))
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["compare", "--records", str(good), str(tmp_path / "empty.jsonl"),
                 "--no-repredict", "--json"]) == 0
    beside = json.loads(capsys.readouterr().out)
    assert main(["compare", "--records", str(good), "--no-repredict", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert beside.pop("files")[0] == alone.pop("files")[0] and beside == alone
