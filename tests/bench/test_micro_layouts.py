"""Microbenchmarks for DDP, TP, PP and one GPU: variant lists, GEMM shapes, autocast pieces,
and a 2-rank gloo run whose records feed a calibration."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan import calibrate, records
from trainplan.bench import micro_layouts as lay
from trainplan.bench import micro_model
from trainplan.errors import SpecError
from trainplan.specs import load_gpu, load_model

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
    assert lay.whole_list("4096, 16384", "--matmul-tokens") == [4096, 16384]
    assert lay.whole_list(None, "--matmul-tp") == []
    for call, bad in ((lay.block_modes, "compiled"), (lay.block_modes, "compiled:none:fp8"),
                      (lay.block_modes, "compiled:none:pure:x"), (lay.head_modes, "jit"),
                      (lay.ddp_modes, "maybe"), (lay.ddp_modes, "")):
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
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trainplan.bench.micro", "--out", str(out), "--model", tiny,
           "--benches", "matmul,attention,head,block,ddp",
           "--block-modes", "compiled:none:autocast-fp32", "--head-modes", "eager,compiled",
           "--matmul-tp", "1,2", "--matmul-tokens", "64,128", "--tokens", "128",
           "--seq-len", "64", "--warmup", "1", "--iters", "2", "--repeats", "6"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = records.load(out)
    ddp = [r for r in got if r["bench"] == "block" and r["config"].get("wrapper") == "ddp"]
    assert [r["config"]["optimize_ddp"] for r in ddp] == [True, False]
    for r in ddp:
        c, res = r["config"], r["results"]
        assert r["gpus"] == c["world"] == 2 and c["backend"] == "gloo" and c["compile"]
        assert c["precision"] == "autocast-fp32" and c["micro_batch"] == 2
        assert c["grad_bytes"] == 4 * sum(p.numel() for p in lay._BlockNet(
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
    assert calibrate.apply(cpu, cal).calibration == cal["label"]
