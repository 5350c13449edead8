"""`trainplan calibrate --host-records`: the host terms from another machine's host-bench
records, every other term from the committed records; the set-aside count; bad input."""

from __future__ import annotations

import json

import pytest

from trainplan.calibrate import fit as calibrate
from trainplan.calibrate import store as calibration
from trainplan.calibrate.host import is_host
from trainplan.calibrate.store import load_gpu
from trainplan.cli import main
from trainplan.records import schema as records

MICRO = "data/measurements/validate-h200x4-20261126d/vA/micro.jsonl"  # H200, host benches too
H100_MICRO = "data/measurements/micro-h100x2-20261126.jsonl"  # H100, host benches too
HOST_KEYS = ("host_block_s", "host_overlap_k", "host_step_s", "host_step_layer_s")
HOST_DEPENDENT = ("tp_block_scales",)  # the host's time is taken out of the TP blocks'
SLOWER = 2.0  # the other machine's host issues the same work this many times slower


def _write(path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


@pytest.fixture
def files(tmp_path):
    """The committed records split as the ad-hoc script split them, and a slower host's."""
    recs = records.load(MICRO)
    host = [r for r in recs if is_host(r)]
    assert host and len(host) < len(recs)
    for r in host:
        r["results"]["time_s"] *= SLOWER
    return {"slow_host": _write(tmp_path / "host.jsonl", host),
            "no_host": _write(tmp_path / "no-host.jsonl", [r for r in recs if not is_host(r)]),
            "n_host": len(host), "dir": tmp_path}


def _gpu():
    return load_gpu("h200-sxm", calibrated=False)


def _rows(cal: dict, key: str) -> dict:
    return dict(cal["pieces"][key])


def test_host_records_change_exactly_the_host_terms(files):
    base = calibrate.build([MICRO], _gpu())
    moved = calibrate.build([MICRO], _gpu(), [files["slow_host"]])
    # every host time is the slower host's: the old ones were set aside, not pooled
    for key in ("host_block_s", "host_step_s", "host_step_layer_s"):
        old, new = _rows(base, key), _rows(moved, key)
        assert new.keys() == old.keys()
        for wrapper, seconds in old.items():
            assert new[wrapper] == pytest.approx(SLOWER * seconds, rel=1e-3, abs=2e-7)
    assert moved["pieces"]["host_overlap_k"] != base["pieces"]["host_overlap_k"]
    # nothing else moves but what is priced against the host's time
    same = set(base["pieces"]) - set(HOST_KEYS) - set(HOST_DEPENDENT)
    assert same and {k: moved["pieces"].get(k) for k in same} == {
        k: base["pieces"][k] for k in same}
    for key in ("matmul", "attention", "collectives", "block_checks", "card",
                "matmul_efficiency", "attention_efficiency", "memory_efficiency"):
        assert moved[key] == base[key], key


def test_host_records_equal_the_copied_files_less_their_host_records(files):
    """The option gives what the ad-hoc route gave: the committed file less its host-bench
    records, and the new host's file, both as --records."""
    by_hand = calibrate.build([files["no_host"], files["slow_host"]], _gpu())
    option = calibrate.build([MICRO], _gpu(), [files["slow_host"]])
    for key in ("pieces", "block_checks", "matmul", "attention", "collectives", "card"):
        assert option[key] == by_hand[key], key
    same = calibrate.build([MICRO], _gpu(), [MICRO])  # its own host records back: no change
    assert same["pieces"] == calibrate.build([MICRO], _gpu())["pieces"]
    n = len([r for r in records.load(MICRO) if r["kind"] == "microbenchmark"])
    assert same["sources"][1]["host_only"] and same["sources"][1]["records"] == files["n_host"]
    assert same["sources"][1]["not_host_left_out"] == n - files["n_host"]  # its others: out


def test_sources_and_set_aside_count(files, capsys):
    out = files["dir"] / "cal.yaml"
    argv = ["calibrate", "--records", MICRO, "--host-records", files["slow_host"],
            "--gpu", "h200-sxm", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["host_records"] == {"from": [files["slow_host"]], "set_aside": files["n_host"]}
    stored = calibration.load("h200-sxm", out)  # the store still reads it
    mine, host = stored["sources"]
    n = len([r for r in records.load(MICRO) if r["kind"] == "microbenchmark"])
    assert mine["path"] == "validate-h200x4-20261126d/vA/micro.jsonl"  # from data/measurements
    assert mine["host_set_aside"] == files["n_host"]
    assert mine["records"] == n - files["n_host"] and "host_only" not in mine
    assert host == {**host, "path": files["slow_host"], "records": files["n_host"],
                    "host_only": True}
    assert stored["pieces"] == got["pieces"] and "host.jsonl" in stored["label"]
    assert main(argv) == 0
    assert f"{files['n_host']} host-bench record(s) of --records set aside" in \
        capsys.readouterr().out
    assert main(["calibrate", "--records", MICRO, "--gpu", "h200-sxm", "--out", str(out),
                 "--json"]) == 0  # without the option: as before
    plain = json.loads(capsys.readouterr().out)
    assert "host_records" not in plain and all(
        "host_only" not in s and "host_set_aside" not in s for s in plain["sources"])


@pytest.mark.parametrize("host, match", [
    ("missing.jsonl", "missing.jsonl: cannot read (no such file)"),
    ("no_host", "no-host.jsonl: no host-bench record"),
    (H100_MICRO, "is h100-sxm, not h200-sxm"),
])
def test_bad_host_records_are_one_line_and_write_nothing(files, capsys, host, match):
    path = files.get(host, host if "/" in host else str(files["dir"] / host))
    out = files["dir"] / "cal.yaml"
    assert main(["calibrate", "--records", MICRO, "--host-records", path, "--gpu", "h200-sxm",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_committed_with_host_records_remakes_a_sessions_calibration(tmp_path):
    """The 2 x H200 session's calibration (its machine's host terms, every other term as
    committed), made there by hand from copied files, remade from the repository alone:
    its host terms are remade; the committed calibration has since gained fp8 terms and the
    GEMMs of more models (so the terms priced on the GEMM curve moved), which come along;
    against the committed file only the host terms (and the TP block scales priced with
    them) differ."""
    run = "data/measurements/validate-h200x2-20261127b/host"
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--gpu", "h200-sxm", "--committed", "--host-records",
                 f"{run}/host.jsonl", "--out", str(out)]) == 0
    made, then = calibration.load("h200-sxm", out), calibration.load("h200-sxm",
                                                                      f"{run}/h200-sxm.yaml")
    later = {"fp8_cast_scale", "fp8_rowwise_cast_scale", "fp8_activation_ratio",
             "fp8_rowwise_activation_ratio"}
    assert not later & then["pieces"].keys() and later <= made["pieces"].keys()
    host = {"host_block_s", "host_overlap_k", "host_step_layer_s", "host_step_s"}
    assert {k: made["pieces"][k] for k in host} == {k: then["pieces"][k] for k in host}
    assert made["label"].endswith("; host terms from host.jsonl)")
    committed_pieces = calibration.load("h200-sxm")["pieces"]
    differ = {k for k in made["pieces"] if made["pieces"][k] != committed_pieces.get(k)}
    assert differ == host | {"tp_block_scales"}
    committed = [str(p.relative_to(calibration.RECORDS_DIR))
                 for p in calibration.committed_sources("h200-sxm")]
    assert [s["path"] for s in made["sources"]] == [*committed,
                                                    "validate-h200x2-20261127b/host/host.jsonl"]


def test_committed_without_its_files_or_without_any_records_is_one_line(tmp_path, capsys,
                                                                        monkeypatch):
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--gpu", "h200-sxm", "--out", str(out)]) == 2
    assert "give --records FILE ..., --committed, or both" in capsys.readouterr().err
    monkeypatch.setattr(calibration, "RECORDS_DIR", tmp_path)
    assert main(["calibrate", "--gpu", "h200-sxm", "--committed", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "validate-h200x4-20261126d/vA/micro.jsonl" in err and "not found under" in err
    assert err.count("\n") == 1 and not out.exists()
    assert main(["calibrate", "--gpu", "a100-80gb", "--committed", "--out", str(out)]) == 2
    assert "no committed calibration of a100-80gb" in capsys.readouterr().err

