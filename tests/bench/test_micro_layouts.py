"""Microbenchmarks for DDP, TP, PP and one GPU: variant lists, GEMM shapes, autocast pieces,
and a 2-rank gloo run whose records feed a calibration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainplan.bench.micro import layouts as lay
from trainplan.bench.micro import model as micro_model
from trainplan.calibrate import fit as calibrate
from trainplan.calibrate import store as calibration
from trainplan.calibrate.store import load_gpu
from trainplan.errors import SpecError
from trainplan.records import schema as records
from trainplan.specs import load_model

from .micro_runs import run_micro

ROOT = Path(__file__).resolve().parents[2]
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def test_variant_lists():
    assert lay.block_modes("compiled:none, eager:full:autocast-fp32") == [
        (True, "none", "pure"), (False, "full", "autocast-fp32")]
    assert lay.head_modes("eager,compiled:autocast-fp32") == [(False, "pure"),
                                                              (True, "autocast-fp32")]
    assert lay.ddp_modes("on,off") == [True, False]
    assert lay.fsdp_modes("z2, z3") == [2, 3] and lay.fsdp_modes("z3") == [3]
    assert lay.whole_list("4096, 16384", "--matmul-tokens") == [4096, 16384]
    assert lay.whole_list(None, "--matmul-tp") == []
    for call, bad in ((lay.block_modes, "compiled"), (lay.block_modes, "compiled:none:fp8"),
                      (lay.block_modes, "compiled:none:pure:x"), (lay.head_modes, "jit"),
                      (lay.ddp_modes, "maybe"), (lay.ddp_modes, ""), (lay.fsdp_modes, "z1"),
                      (lay.fsdp_modes, "2,3"), (lay.fsdp_modes, " , ")):
        with pytest.raises(SpecError, match="is not valid") as err:
            call(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="--matmul-tp '0,x'"):
        lay.whole_list("0,x", "--matmul-tp")


def test_matmul_tasks_add_the_tp_shards_and_pipeline_micro_batches():
    spec = load_model("llama-1.3b")
    tasks = lay.matmul_tasks(spec, 1, 16384, [1, 2], [4096, 16384])
    base = [kw for _, kw in tasks if kw["base"]]
    extra = [(kw["m"], kw["n"], kw["k"]) for _, kw in tasks if not kw["base"]]
    assert len(set(extra)) == len(extra) == 4 + 5 + 5  # (1, 4096), (2, 4096), (2, 16384)
    assert not set(extra) & {(kw["m"], kw["n"], kw["k"]) for kw in base}  # ... nor a base one
    shapes = {(kw["m"], kw["n"], kw["k"]): kw for kw in reversed([kw for _, kw in tasks])}
    assert [kw["name"] for kw in base] == ["q", "kv", "out", "gate_up", "down", "output"]
    assert all(kw["tp"] == 1 and kw["m"] == 16384 for kw in base)
    for mnk, name in (((16384, 1024, 2048), "q"), ((16384, 2752, 2048), "gate_up"),
                      ((16384, 2048, 2752), "down"), ((16384, 16000, 2048), "output")):
        assert shapes[mnk]["name"] == name and shapes[mnk]["tp"] == 2
        assert not shapes[mnk]["base"]
    assert shapes[(4096, 2048, 2048)]["tp"] == 1  # full width at the PP micro-batch
    assert shapes[(4096, 2048, 5504)]["name"] == "down"
    assert len(lay.matmul_tasks(spec, 1, 16384, [], [])) == 6  # defaults: the model's own only
    with pytest.raises(SpecError, match="tp = 3 does not divide"):
        lay.matmul_tasks(spec, 1, 16384, [3], [])


def test_autocast_block_and_compiled_head_records_on_cpu(tiny):
    kw = dict(dtype="float32", device="cpu", warmup=1, iters=1, repeats=2)
    pure = micro_model.bench_block(tiny, 2, 32, compile=False, **kw)
    amp = micro_model.bench_block(tiny, 2, 32, compile=False, precision="autocast-fp32", **kw)
    assert (pure["config"]["precision"], pure["config"]["autocast_dtype"]) == ("pure", None)
    # on CPU the compute dtype is fp32: autocast then runs bf16, as the GPUs do
    assert (amp["config"]["precision"], amp["config"]["autocast_dtype"]) == (
        "autocast-fp32", "bfloat16")
    for r in (pure, amp):
        assert records.validate(r) is r and r["bench"] == "block"
        assert r["results"]["time_s"] > 0 and r["results"]["activation_bytes"] == 0  # CPU: 0
    head = micro_model.bench_head(tiny, 2, 32, compile=True, **kw)
    assert head["config"]["compile"] is True and head["results"]["time_s"] > 0
    with pytest.raises(SpecError, match="precision 'fp8'"):
        micro_model.bench_block(tiny, 2, 32, compile=False, precision="fp8", **kw)


@pytest.mark.slow
def test_two_rank_ddp_block_and_layout_pieces_feed_a_calibration(tmp_path, tiny):
    """Real torchrun, 2 gloo ranks: DDP block (optimize_ddp on and off), autocast block,
    compiled head, extra GEMM shapes; then a calibration from them."""
    out = tmp_path / "micro.jsonl"
    got, _ = run_micro(out, 2, "--model", tiny, "--benches", "matmul,attention,head,block,ddp",
                       "--block-modes", "compiled:none:autocast-fp32",
                       "--head-modes", "eager,compiled", "--matmul-tp", "1,2",
                       "--matmul-tokens", "64,128", "--tokens", "128", "--seq-len", "64",
                       "--warmup", "1", "--iters", "2", "--repeats", "6")
    ddp = [r for r in got if r["bench"] == "block" and r["config"].get("wrapper") == "ddp"]
    assert [r["config"]["optimize_ddp"] for r in ddp] == [True, False]
    for r in ddp:
        c, res = r["config"], r["results"]
        assert r["gpus"] == c["world"] == 2 and c["backend"] == "gloo" and c["compile"]
        assert c["precision"] == "autocast-fp32" and c["micro_batch"] == 2
        assert c["grad_bytes"] == 4 * sum(p.numel() for p in lay.BlockNet(
            load_model(tiny)).parameters())
        assert res["time_s"] > 0 and res["allreduce_s"] > 0 and len(res["times_s"]) == 6
        assert res["activation_bytes"] == res["peak_bytes"] == 0  # CPU: not measured
    heads = [(r["config"]["compile"], r["config"]["precision"]) for r in got
             if r["bench"] == "head"]
    assert heads == [(False, "pure"), (True, "pure")]
    mms = [r["config"] for r in got if r["bench"] == "matmul"]
    assert sum(c["base"] for c in mms) == 6 and any(c["tp"] == 2 for c in mms)
    assert {c["m"] for c in mms} == {64, 128}
    cpu = dataclasses.replace(load_gpu("h100-sxm", calibrated=False), name="cpu",
                              bf16_tflops=0.5, hbm_tbps=0.2)
    cal = calibrate.build([out], cpu)
    pieces = cal["pieces"]
    assert {"autocast_elementwise_scale", "head_scale", "compiled_head_scale", "head_modes",
            "matmul_curve"} <= set(pieces)
    assert 0.0 <= pieces["ddp_exposed"] <= 1.0 and 0.0 <= pieces["ddp_exposed_unsplit"] <= 1.0
    assert cal["matmul"]["token_counts"] == [128]  # the single fraction: the model's own shapes
    assert calibration.apply(cpu, cal).calibration == cal["label"]


def test_bad_fsdp_flags_give_one_line_and_exit_2(tmp_path, tiny, capsys):
    from trainplan.bench.micro import run as micro

    out = tmp_path / "micro.jsonl"
    assert micro.main(["--out", str(out), "--model", tiny, "--benches", "fsdp",
                       "--fsdp-modes", "z2,z4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("trainplan.bench.micro.run: --fsdp-modes 'z2,z4' is not valid; use a comma "
                   "list of z2, z3")
    assert not out.exists()
    assert micro.main(["--out", str(out), "--model", tiny, "--benches", "fsdp,zero"]) == 2
    assert "--benches 'zero' is not valid" in capsys.readouterr().err
    with pytest.raises(SpecError, match="zero = 1 is not valid for the fsdp block; use 2 or 3"):
        lay.bench_fsdp_block(tiny, 2, 32, zero=1)


@pytest.mark.slow
def test_two_rank_fsdp_block_records_feed_fsdp_block_scale(tmp_path, tiny):
    """Real torchrun, 2 gloo ranks: the FSDP2-wrapped compiled block, ZeRO-2 and ZeRO-3, each
    beside the block alone and its collectives alone; then the scale fitted from them."""
    out = tmp_path / "micro.jsonl"
    got, _ = run_micro(out, 2, "--model", tiny, "--benches", "fsdp", "--fsdp-modes", "z2,z3",
                       "--tokens", "128", "--seq-len", "64")
    assert [(r["bench"], r["config"]["wrapper"], r["config"]["zero"]) for r in got] == [
        ("block", "fsdp2", 2), ("block", "fsdp2", 3)]
    params = sum(p.numel() for p in lay.BlockNet(load_model(tiny)).parameters())
    for r in got:
        c, res = r["config"], r["results"]
        assert records.validate(r) is r
        assert r["gpus"] == c["world"] == 2 and c["backend"] == "gloo" and c["compile"]
        assert c["reshard_after_forward"] is (c["zero"] == 3)
        assert (c["precision"], c["recompute"], c["micro_batch"], c["seq"]) == ("pure", "none",
                                                                                  2, 64)
        assert c["params"] == params and c["param_bytes"] == 4 * params
        assert c["param_dtype"] == c["reduce_dtype"] == "float32"  # CPU: no bf16 policy
        for key in ("time_s", "alone_s", "allgather_s", "reduce_scatter_s"):
            assert res[key] > 0, key
        assert len(res["times_s"]) == len(res["alone_times_s"]) == 6
        assert res["activation_bytes"] == res["peak_bytes"] == 0  # CPU: not measured
    cpu = dataclasses.replace(load_gpu("h100-sxm", calibrated=False), name="cpu",
                              bf16_tflops=0.5, hbm_tbps=0.2)
    from trainplan.calibrate import pieces as calibrate_pieces

    pieces, checks = calibrate_pieces.fit({"block": got}, cpu)
    assert pieces["fsdp_block_scale"] >= 1.0 and checks == []  # no plain block to check
    assert [z for z, _ in pieces["fsdp_block_scales"]] == [2, 3]
    assert calibration.apply(cpu, {"label": "t", "matmul_efficiency": 0.5,
                                 "attention_efficiency": 0.5, "collectives": {},
                                 "pieces": pieces}).fsdp_block_scale == pieces["fsdp_block_scale"]
