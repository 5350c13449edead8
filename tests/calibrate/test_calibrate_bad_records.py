"""`trainplan calibrate` on microbenchmark records with bad numbers, types or missing fields:
one line naming the file, line, field and value, exit 2, no calibration written; the committed
records all pass."""

from __future__ import annotations

import copy
import glob
import json
from pathlib import Path

import pytest

from trainplan.calibrate import inputs as calibrate_inputs
from trainplan.cli import main
from trainplan.errors import RecordError
from trainplan.records import schema as records

ROOT = Path(__file__).resolve().parents[2]
MICRO = ROOT / "data/measurements/micro-h100x2-20261126.jsonl"  # every piece bench, 2 x H100
# lines of MICRO: 1 matmul, 59 attention, 61 head, 63 block, 68 all_reduce, 113 overlap,
# 114 DDP block, 116 FSDP2 block, 118 TP block, 124 host TP block


def _calibrate(tmp_path, capsys, line: int, change) -> tuple[int, str, str, Path]:
    recs = [json.loads(text) for text in MICRO.read_text().splitlines()]
    change(recs[line - 1])
    path, out = tmp_path / "micro.jsonl", tmp_path / "cal.yaml"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code = main(["calibrate", "--records", str(path), "--gpu", "h100-sxm", "--out", str(out),
                 "--json"])
    got = capsys.readouterr()
    return code, got.out, got.err, out


def _put(part: str, name: str, value):
    return lambda r: r[part].__setitem__(name, value)


def _drop(part: str, name: str):
    return lambda r: r[part].pop(name)


@pytest.mark.parametrize("line, change, said", [
    (1, _put("results", "time_s", 0), ["'results.time_s' = 0", "a time from 1e-09 to 1e+06 s"]),
    (1, _put("results", "time_s", -1e-4), ["'results.time_s' = -0.0001"]),
    (1, _put("config", "m", "big"), ["'config.m' = 'big'", "a whole number from 1 to 1e12"]),
    (1, _put("config", "k", 0), ["'config.k' = 0", "a whole number"]),
    (1, _put("config", "name", ["q"]), ["'config.name' = ['q']", "a string"]),
    (1, _put("results", "tflops", 0.0), ["'results.tflops' = 0.0", "a rate from 1e-06"]),
    (1, _drop("config", "n"), ["matmul record is missing config.n"]),
    (59, _put("config", "seq", -1), ["'config.seq' = -1", "a whole number"]),
    (61, _put("config", "tokens", 0), ["'config.tokens' = 0"]),
    (63, _put("config", "recompute", "some"),
     ["'config.recompute' = 'some'", "one of none, selective, full"]),
    (63, _put("config", "compile", "yes"), ["'config.compile' = 'yes'", "true or false"]),
    (63, _put("config", "model_spec", {"hidden": 64}), ["'config.model_spec'", "hidden"]),
    (61, lambda r: (r["config"].pop("model_spec", None), r["config"].update(model="nope")),
     ["unknown model 'nope'"]),
    (68, _put("config", "op", "all_gather"), ["'config.op' = 'all_gather'", "all_reduce"]),
    (68, _put("config", "size_bytes", 1.5), ["'config.size_bytes' = 1.5"]),
    (113, _put("results", "exposed_fraction", -0.2),
     ["'results.exposed_fraction' = -0.2", "from 0 to 100"]),
    (113, _put("results", "exposed_fraction", 1e9), ["'results.exposed_fraction' = 1000000000.0"]),
    (114, _drop("config", "grad_bytes"), ["block record is missing config.grad_bytes"]),
    (114, _put("results", "allreduce_s", 0.0), ["'results.allreduce_s' = 0.0"]),
    (116, _put("results", "allgather_s", "x"), ["'results.allgather_s' = 'x'"]),
    (116, _put("config", "zero", 5), ["'config.zero' = 5", "0, 1, 2 or 3"]),
    (118, _drop("config", "tp"), ["block record is missing config.tp"]),
    (124, _drop("config", "tp"), ["block record is missing config.tp"]),
])
def test_a_bad_record_is_one_line_and_nothing_is_written(tmp_path, capsys, line, change, said):
    code, out, err, written = _calibrate(tmp_path, capsys, line, change)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert f"micro.jsonl:{line}: " in err and not written.exists()
    for text in said:
        assert text in err


def test_an_exposed_share_above_one_is_priced_as_one_and_said(tmp_path, capsys):
    code, out, err, written = _calibrate(tmp_path, capsys, 113,
                                         _put("results", "exposed_fraction", 1.7))
    cal = json.loads(out)
    assert code == 0 and written.is_file() and cal["pieces"]["overlap_exposed"] == 1.0
    assert any("exposed share, 1.70, is above 1" in n for n in cal["notes"])
    code, out, _, _ = _calibrate(tmp_path, capsys, 113, lambda r: None)  # as measured: 0.16
    assert code == 0 and not any("exposed share" in n for n in json.loads(out)["notes"])


def test_every_committed_microbenchmark_record_passes():
    files = sorted(glob.glob(str(ROOT / "data/measurements/**/micro*.jsonl"), recursive=True))
    assert len(files) > 10
    for path in files:
        for n, r in enumerate(records.load(path), start=1):
            if r["kind"] == "microbenchmark":
                assert calibrate_inputs.check_record(r, f"{path}:{n}") is r


def test_the_check_names_where_it_was_told():
    r = {"bench": "matmul", "config": {"m": 1, "n": 1}, "results": {"time_s": 1.0}}
    with pytest.raises(RecordError, match=r"^x\.jsonl:7: matmul record is missing config\.k$"):
        calibrate_inputs.check_record(r, "x.jsonl:7")


def test_the_summary_of_a_calibration_without_preset_or_world_still_shows():
    """A calibration file written by hand or by an older fit may lack the datasheet figures
    and the group size of its collectives: page 4's table says so instead of failing."""
    from trainplan.calibrate import fit, store

    cal = copy.deepcopy(store.load("h200-sxm"))
    cal.pop("preset")
    for f in cal["collectives"].values():
        f.pop("world", None)
    table = fit.summary_table(cal)
    assert table.loc["matmul fraction of peak", "preset"] == "not recorded"
    assert "all-reduce: latency, bus bandwidth" in table.index
