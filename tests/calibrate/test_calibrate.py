"""Calibration: fits against synthetic records with known constants, loading, applying, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainplan.calibrate import fit as calibrate
from trainplan.calibrate import store as calibration
from trainplan.calibrate.store import CalibrationError, load_gpu
from trainplan.cli import main
from trainplan.cost import comms
from trainplan.specs import ClusterSpec

PEAK = 989.0
MICRO = "data/measurements/micro-h200x2-20261126.jsonl"
COMMITTED_MICRO = ["data/measurements/validate-h200x4-20261126d/vA/micro.jsonl",  # its records
                   "data/measurements/validate-h200x4-20261127/wide/micro-wide.jsonl",
                   "data/measurements/validate-h200x4-20261127c/micro/attn.jsonl",
                   "data/measurements/validate-h200x2-20261127/ring/ring-host.jsonl",
                   "data/measurements/validate-h200x4-20261127d/ring/ring4.jsonl",
                   "data/measurements/validate-h200x2-20261127b/host/fp8.jsonl",
                   "data/measurements/validate-h200x2-20261127c/micro/fp8lin.jsonl",
                   "data/measurements/validate-h200x2-20261127c/micro/blockfp8.jsonl",
                   "data/measurements/validate-h200x2-20261128/vA/gemm-models.jsonl"]
PROV = {"git_commit": "abc", "date": "2026-11-26T00:00:00+00:00"}


def _micro(bench: str, config: dict, results: dict, gpus: int = 1, i: int = 0) -> dict:
    return {"kind": "microbenchmark", "recorded_at": f"2026-11-26T01:00:{i:02d}+00:00",
            "bench": bench, "config": config, "results": results, "gpus": gpus,
            "card": "NVIDIA H200", "run_id": "synthetic", "model": "llama-1.3b",
            "provenance": PROV}


def synthetic_records(mm=0.6, attn=0.5, alpha=20e-6, busbw=300e9) -> list[dict]:
    """Records whose timings follow known constants exactly."""
    recs = []
    for i, (name, n, k) in enumerate([("q", 2048, 2048), ("gate_up", 5504, 2048),
                                      ("output", 32000, 2048)]):
        f = 2.0 * 16384 * n * k
        t = f / (mm * PEAK * 1e12)
        recs.append(_micro("matmul", {"name": name, "m": 16384, "n": n, "k": k},
                           {"time_s": t, "tflops": f / t / 1e12}, i=i))
    f = 12.0 * 8 * 16 * 2048**2 * 128 / 2  # causal: half the dense-equivalent FLOPs
    t = 2 * f / (attn * PEAK * 1e12)
    recs.append(_micro("attention", {"batch": 8, "heads": 16, "seq": 2048, "head_dim": 128,
                                     "causal": True}, {"time_s": t, "tflops": f / t / 1e12}))
    for op in calibrate.COLLECTIVES:
        for j, size in enumerate(2 ** np.arange(16, 31, 2)):
            x = float(calibrate.ring_bytes(op, size, 2))
            t = alpha + x / busbw
            recs.append(_micro(op, {"op": op, "size_bytes": int(size), "world": 2},
                               {"time_s": t, "algbw_gbps": size / t / 1e9,
                                "busbw_gbps": x / t / 1e9}, gpus=2, i=j))
    return recs


def _write(path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_fit_recovers_known_constants(tmp_path):
    path = _write(tmp_path / "micro.jsonl", synthetic_records())
    cal = calibrate.build([path], load_gpu("h200-sxm", calibrated=False))
    assert cal["matmul_efficiency"] == pytest.approx(0.6, abs=1e-4)
    assert cal["attention_efficiency"] == pytest.approx(0.5, abs=1e-4)
    for op in calibrate.COLLECTIVES:
        fit = cal["collectives"][op]
        assert fit["latency_us"] == pytest.approx(20.0, abs=0.01)
        assert fit["busbw_gbps"] == pytest.approx(300.0, abs=0.1)
        assert fit["rel_error_max"] < 1e-3
    assert cal["sources"][0]["records"] == len(synthetic_records())


def test_alpha_beta_clips_negative_latency():
    x = np.array([1e6, 1e7, 1e8])
    alpha, bw = calibrate.fit_alpha_beta(x, x / 100e9 * np.array([0.9, 1.0, 1.1]))
    assert alpha == 0.0 and bw > 0
    with pytest.raises(CalibrationError, match=">= 2 positive points"):
        calibrate.fit_alpha_beta([1e6], [1e-5])


def test_committed_calibration_matches_its_records():
    cal = calibrate.build(COMMITTED_MICRO, load_gpu("h200-sxm", calibrated=False))
    stored = calibration.load("h200-sxm")
    assert stored is not None
    for key in ("matmul_efficiency", "attention_efficiency", "label", "pieces"):
        assert stored[key] == cal[key]
    assert stored["label"] == "h200-sxm (411 microbenchmark records, 2026-11-28)"
    widths = {w for m, w, _ in stored["pieces"]["matmul_curve"] if m == 4096}
    assert 14336 * 4096 in widths and 28672 * 8192 in widths  # 8B and 70B MLPs, their own
    assert 32000 * 2048 not in widths  # the 1.3B output layer: in head_matmul_curve alone
    assert 32000 * 2048 in {w for _, w, _ in stored["pieces"]["head_matmul_curve"]}
    assert {"fp8_matmul_curve", "fp8_rowwise_matmul_curve", "fp8_cast_scale",
            "fp8_rowwise_cast_scale", "fp8_activation_ratio"} <= stored["pieces"].keys()
    assert stored["pieces"]["attention_curve"][0][0] == 2048.0  # longer lengths measured
    assert [row[:2] for row in stored["pieces"]["ring_host_s"]] == [[2, 0], [2, 1], [4, 0], [4, 1]]


def test_load_gpu_uses_calibration_where_present(monkeypatch):
    h200, a100 = load_gpu("h200-sxm"), load_gpu("a100-80gb")  # a100: no calibration file
    assert h200.calibration.startswith("h200-sxm (411 microbenchmark records")
    assert h200.fp8_matmul_curve and h200.fp8_cast_scale > 1.0  # measured: fp8-linear records
    assert 0.0 < h200.fp8_activation_ratio < 1.0  # block-fp8: an fp8 block keeps less
    assert h200.matmul_efficiency == calibration.load("h200-sxm")["matmul_efficiency"]
    assert {op for op, *_ in h200.collectives} == set(calibrate.COLLECTIVES)
    assert a100.calibration == "datasheet" and a100.collectives == ()
    assert load_gpu("h100-sxm").calibration == calibration.load("h100-sxm")["label"]
    assert calibration.load("h100-sxm")["label"].startswith("h100-sxm (128 microbenchmark records")
    assert load_gpu("h200-sxm", calibrated=False).calibration == "datasheet"
    monkeypatch.setenv(calibration.OFF_ENV, "off")
    assert load_gpu("h200-sxm").calibration == "datasheet"


@pytest.mark.parametrize("text, match", [
    ("gpu: x\n", "missing field 'label'"),
    ("[1, 2]\n", "expected a mapping"),
    ("gpu: x\ncard: [c]\nlabel: y\nmatmul_efficiency: 1.5\nattention_efficiency: 0.5\n"
     "collectives: {}\n",
     "matmul_efficiency = 1.5"),
    ("gpu: x\ncard: [c]\nlabel: y\nmatmul_efficiency: 0.5\nattention_efficiency: 0.5\n"
     "collectives: {all_reduce: {latency_us: 1, busbw_gbps: 0}}\n", "collectives.all_reduce"),
    ("gpu: [unclosed\n", "not valid YAML"),
    ("gpu: x\nlabel: y\nmatmul_efficiency: 0.5\nattention_efficiency: 0.5\ncollectives: {}\n",
     "missing field 'card'"),
    ("gpu: h200-sxm\ncard: [NVIDIA H200]\nlabel: y\nmatmul_efficiency: 0.5\n"
     "attention_efficiency: 0.5\ncollectives: {}\n", "stands for preset 'h100-sxm'"),
])
def test_malformed_calibration_is_one_clear_error(tmp_path, monkeypatch, text, match):
    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    (tmp_path / "h100-sxm.yaml").write_text(text)
    with pytest.raises(CalibrationError, match=match) as err:
        load_gpu("h100-sxm")
    assert "\n" not in str(err.value) and "h100-sxm.yaml" in str(err.value)


def test_absent_calibration_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    assert calibration.load("h200-sxm") is None
    assert load_gpu("h200-sxm").calibration == "datasheet"


def test_calibrated_collectives_reach_the_cost_model():
    cl = ClusterSpec(name="c", gpus_per_node=8, intra_node_gbps=100, inter_node_gbps=10,
                     intra_node_latency_us=50, inter_node_latency_us=50,
                     intra_node_efficiency=1.0, inter_node_efficiency=1.0,
                     collectives=(("all_gather", 20.0, 300.0),))
    t = comms.collective_time(cl, "all_gather", 1e9, 2, 2)
    assert float(t) == pytest.approx(20e-6 + 0.5e9 / 300e9)
    t_rs = comms.collective_time(cl, "reduce_scatter", 1e9, 2, 2)  # no fit: the cluster's
    assert float(t_rs) == pytest.approx(50e-6 + 0.5e9 / 100e9)
    t_out = comms.collective_time(cl, "all_gather", 1e9, 16, 16)  # across nodes: the cluster's
    assert float(t_out) == pytest.approx(50e-6 * 4 + 15 / 16 * 1e9 / 10e9)


def test_cli_calibrate_writes_and_refuses(tmp_path, capsys):
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--records", MICRO, "--gpu", "h200-sxm", "--out", str(out),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["path"] == str(out) and out.is_file()
    assert calibration.load("h200-sxm", out)["matmul_efficiency"] == got["matmul_efficiency"]
    bad = tmp_path / "bad.yaml"
    assert main(["calibrate", "--records", MICRO, "--gpu", "h100-sxm", "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is h200-sxm, not h100-sxm" in err and err.count("\n") == 1 and not bad.exists()


def test_plan_says_which_constants(capsys):
    args = ["plan", "--model", "llama-1.3b", "--gpus", "2", "--top", "1", "--json", "--gpu"]
    assert main([*args, "h200-sxm"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"].startswith("h200-sxm (411 ")
    assert main([*args, "a100-80gb"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == "datasheet"
