"""Microbenchmarks on CPU: shapes, FLOP conventions, records, and a 2-rank gloo run."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainplan.bench.micro import run as micro
from trainplan.errors import SpecError
from trainplan.records import schema as records
from trainplan.specs import load_model

from .micro_runs import run_micro

ROOT = Path(__file__).resolve().parents[2]


def test_gemm_shapes_of_the_proxy_model():
    shapes = {g.name: g for g in micro.gemm_shapes("llama-1.3b", tp=1, tokens=4096)}
    assert (shapes["q"].m, shapes["q"].n, shapes["q"].k) == (4096, 2048, 2048)
    assert (shapes["kv"].n, shapes["kv"].count) == (2048, 2)
    assert (shapes["out"].n, shapes["out"].k) == (2048, 2048)
    assert (shapes["gate_up"].n, shapes["gate_up"].k, shapes["gate_up"].count) == (5504, 2048, 2)
    assert (shapes["down"].n, shapes["down"].k) == (2048, 5504)
    assert (shapes["output"].n, shapes["output"].per_layer) == (32000, False)


def test_gemm_flops_per_layer_are_two_flops_per_weight_per_token():
    spec = load_model("llama-13b")
    for tp in (1, 2, 4, 8):
        layer = sum(g.flops * g.count for g in micro.gemm_shapes(spec, tp, 1000) if g.per_layer)
        h, f = spec.hidden, spec.ffn
        weights = 4 * h * h + 3 * h * f  # q, k, v, out + gate, up, down (no GQA in 13B)
        assert layer * tp == 2 * 1000 * weights


def test_gemm_shapes_refuse_a_tp_that_does_not_divide():
    with pytest.raises(SpecError, match="tp = 3 does not divide"):
        micro.gemm_shapes("llama-1.3b", tp=3)


def test_attention_flops_convention():
    # forward 4 b a s^2 d; forward + backward 3x; causal half
    assert micro.attention_flops(2, 3, 8, 4, causal=False, backward=False) == 4 * 2 * 3 * 64 * 4
    assert micro.attention_flops(2, 3, 8, 4, causal=False) == 12 * 2 * 3 * 64 * 4
    assert micro.attention_flops(2, 3, 8, 4) == 6 * 2 * 3 * 64 * 4


@pytest.mark.parametrize("op, n, factor", [("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75),
                                           ("reduce_scatter", 4, 0.75), ("all_gather", 8, 0.875),
                                           ("all_reduce", 1, 0.0)])
def test_bus_factors_follow_nccl_tests(op, n, factor):
    assert micro.bus_factor(op, n) == pytest.approx(factor)


def test_sizes():
    sizes = micro.parse_sizes("64K..1G")
    assert sizes[0] == 65536 and sizes[-1] == 2**30 and len(sizes) == 15
    assert micro.parse_sizes("64KiB, 1M,4096") == [65536, 2**20, 4096]
    for bad in ("64X", "1G..64K", ""):
        with pytest.raises(SpecError):
            micro.parse_sizes(bad)


def test_matmul_record_on_cpu():
    r = micro.bench_matmul(32, 48, 16, dtype="float32", device="cpu", warmup=1, iters=3,
                           repeats=6, name="q")
    assert records.validate(r) is r and r["bench"] == "matmul" and r["card"] == "cpu"
    res = r["results"]
    assert len(res["times_s"]) == 6 and res["time_s_ci"][0] <= res["time_s"] <= res["time_s_ci"][1]
    assert res["tflops"] == pytest.approx(2 * 32 * 48 * 16 / res["time_s"] / 1e12)
    assert res["tflops_ci"][0] <= res["tflops"] <= res["tflops_ci"][1]
    assert r["config"]["flops"] == 2 * 32 * 48 * 16


def test_attention_record_on_cpu():
    r = micro.bench_attention(1, 2, 16, 8, dtype="float32", device="cpu", warmup=1, iters=2,
                              repeats=3)
    res = r["results"]
    assert res["tflops"] == pytest.approx(micro.attention_flops(1, 2, 16, 8) / res["time_s"] / 1e12)
    assert res["tflops_dense_equiv"] == pytest.approx(2 * res["tflops"])
    assert not res["ci_enough_samples"]  # 3 repeats: min/max, flagged


def test_bad_dtype_and_counts():
    with pytest.raises(SpecError, match="dtype 'fp7'"):
        micro.bench_matmul(4, 4, 4, dtype="fp7", device="cpu")
    with pytest.raises(SpecError, match="iters = 0"):
        micro.bench_matmul(4, 4, 4, dtype="float32", device="cpu", iters=0)


def test_main_refuses_bad_input_with_one_line(tmp_path, capsys):
    assert micro.main(["--out", str(tmp_path / "m.jsonl"), "--benches", "gemm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--benches 'gemm' is not valid" in err and "\n" not in err
    assert not (tmp_path / "m.jsonl").exists()


def test_main_single_process_records_matmul_and_attention(tmp_path):
    out = tmp_path / "m.jsonl"
    code = micro.main(["--out", str(out), "--tokens", "16", "--seq-len", "8", "--warmup", "0",
                       "--iters", "1", "--repeats", "1", "--model", "llama-1.3b", "--tp", "8",
                       "--benches", "matmul,attention"])
    got = records.load(out)
    assert code == 0 and [r["bench"] for r in got] == ["matmul"] * 6 + ["attention"]
    assert got[0]["config"]["m"] == 16 and got[-1]["config"]["heads"] == 2  # 16 heads / tp 8


@pytest.mark.slow
def test_two_rank_gloo_collectives(tmp_path):
    out = tmp_path / "coll.jsonl"
    got, stdout = run_micro(out, 2, "--benches", "collectives", "--sizes", "4K,64K",
                            "--warmup", "1", "--iters", "3", "--repeats", "6", "--run-id", "t1",
                            timeout=120)
    assert [(r["bench"], r["config"]["size_bytes"]) for r in got] == [
        (op, size) for op in ("all_reduce", "reduce_scatter", "all_gather")
        for size in (4096, 65536)]
    for r in got:
        res, expected = r["results"], {"all_reduce": 1.0}.get(r["bench"], 0.5)
        assert r["gpus"] == r["config"]["world"] == 2 and r["config"]["backend"] == "gloo"
        assert res["busbw_factor"] == expected and r["run_id"] == "t1"
        assert res["algbw_gbps"] == pytest.approx(r["config"]["size_bytes"] / res["time_s"] / 1e9)
        assert res["busbw_gbps"] == pytest.approx(res["algbw_gbps"] * expected)
        assert res["ci_enough_samples"]  # 6 repeats reach a 95% rank interval
    assert "busbw" in stdout  # the table
