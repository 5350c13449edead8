"""fp8 in the harness on CPU (`bench.harness.float8`): which linears torchao converts, a
converted block's forward and backward, the refusal where fp8 cannot run, the suite's
precision field, the records' precision, and the fp8 GEMM microbenchmark with its fit."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trainplan.bench.harness import float8
from trainplan.bench.harness import train as harness
from trainplan.bench.harness.model import Transformer
from trainplan.bench.micro import fp8 as micro_fp8
from trainplan.bench.micro import report as micro_report
from trainplan.bench.series import suite
from trainplan.calibrate import fp8 as calibrate_fp8
from trainplan.calibrate.store import load_gpu
from trainplan.compare.matching import same_config
from trainplan.cost import fp8 as fp8_cost
from trainplan.errors import SpecError, TrainplanError
from trainplan.records import schema as records
from trainplan.specs import ModelSpec, load_model

ROOT = Path(__file__).resolve().parents[2]
BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
         "feed_forward.w2", "feed_forward.w3")


def _converted(recipe: str, fsdp: bool = False) -> list[str]:
    with torch.device("meta"):  # the 1.3B proxy's shapes, no memory
        model = Transformer.from_spec(load_model("llama-1.3b"), max_seq_len=64)
    return float8.convert(model, recipe, fsdp=fsdp)


def test_tensorwise_converts_every_block_linear_but_not_the_output():
    names = _converted("tensorwise", fsdp=True)
    assert len(names) == 24 * len(BLOCK)
    assert {n.split(".", 2)[2] for n in names} == set(BLOCK)
    assert "output" not in names


def test_rowwise_converts_only_the_wide_linears():
    names = _converted("rowwise")  # h 2048: q, k, v, o and down (N = 2048) are too small
    assert {n.split(".", 2)[2] for n in names} == {"feed_forward.w1", "feed_forward.w3"}


def test_filter_rule_and_skips():
    keep = float8.module_filter("tensorwise")
    assert keep(nn.Linear(2048, 2048), "layers.0.attention.wq")
    assert not keep(nn.Linear(2048, 2056), "layers.0.attention.wq")  # 2056 % 16 = 8
    assert not keep(nn.Linear(4096, 1024), "layers.0.feed_forward.w2")  # K <= 4096, N <= 1024
    assert not keep(nn.Linear(2048, 32000), "output")  # the output layer, by name
    assert not keep(nn.Embedding(10, 2048), "tok_embeddings")


def test_converted_block_trains_on_cpu():
    # the narrowest block whose every linear the rule converts (N > 1024): CPU's
    # torch._scaled_mm is a slow reference kernel
    spec = ModelSpec(name="wide", n_layers=1, hidden=1152, n_heads=9, ffn=1152, vocab=256)
    torch.manual_seed(0)
    model = Transformer.from_spec(spec, max_seq_len=16)
    names = float8.convert(model, "tensorwise", fsdp=False)
    assert len(names) == len(BLOCK)
    x = torch.randint(0, 256, (1, 16))
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.layers["0"].feed_forward.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_fp8_refused_on_cpu_with_one_line():
    args = harness.parse_args(["--precision", "fp8", "--cpu", "--model", "llama-1.3b"])
    with pytest.raises(TrainplanError, match="compute capability >= 8.9"):
        harness.check_args(args)
    out = subprocess.run([sys.executable, "-m", "trainplan.cli", "bench", "--model",
                          "llama-1.3b", "--cpu", "--precision", "fp8", "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if "error" in ln] == [
        next(ln for ln in out.stderr.splitlines() if "--precision fp8 needs" in ln)]


def test_bf16_records_say_so():
    args = harness.parse_args(["--model", "llama-1.3b"])
    assert float8.layout_fields(args) == {"precision": "bf16"}
    args = harness.parse_args(["--precision", "fp8", "--fp8-recipe", "rowwise"])
    assert float8.layout_fields(args) == {"precision": "fp8", "fp8_recipe": "rowwise"}


def test_suite_precision_reaches_the_launch_and_the_prediction():
    s = {"model": "llama-1.3b", "seq_len": 512, "configs": [
        {"tag": "a", "gpus": 2, "precision": "fp8", "layout": {"dp": 2, "zero": 2}},
        {"tag": "b", "gpus": 2, "layout": {"dp": 2, "zero": 2}}]}
    fp8_cfg, bf16_cfg = s["configs"]
    argv = suite.train_args(s, fp8_cfg, Path("out"), "r")
    assert argv[argv.index("--precision") + 1] == "fp8"
    assert argv[argv.index("--fp8-recipe") + 1] == "tensorwise"
    assert "--precision" not in suite.train_args(s, bf16_cfg, Path("out"), "r")
    low, high = (suite.predict(s, c, "NVIDIA H100 80GB HBM3", "r") for c in (fp8_cfg, bf16_cfg))
    assert low["layout"]["precision"] == "fp8" and high["layout"]["precision"] == "bf16"
    assert low["predicted"]["step_time_s"] != high["predicted"]["step_time_s"]  # priced apart
    meas = records.measurement_record(
        model="llama-1.3b", impl="trainplan", layout={**high["layout"], "precision": "fp8",
                                                      "fp8_recipe": "tensorwise"},
        gpus=2, card="NVIDIA H100 80GB HBM3", run_id="r", step_times_s=[1.0, 1.1],
        tokens_per_step=1024, flops_per_token=1e9, peak_tflops=989.0,
        peak_mem_reserved_gib=1.0, peak_mem_allocated_gib=1.0, warmup_steps_dropped=1,
        extra={"seq_len": 512, "tag": "a"})
    meas["provenance"]["env"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert same_config(low, meas) and not same_config({**high, "config": {
        **high["config"], "tag": "a"}}, meas)


def test_suite_refuses_an_unknown_precision(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: llama-1.3b\nconfigs:\n  - {tag: a, gpus: 2, precision: fp4, "
                    "layout: {dp: 2}}\n")
    with pytest.raises(SpecError, match="precision"):
        suite.load_suite(str(path))


def test_fp8_gemm_bench_and_its_curve():
    spec = load_model("llama-1.3b")
    tasks = micro_fp8.fp8_tasks(spec, 1, 64, [], [])
    assert {kw["recipe"] for _, kw in tasks} == {"tensorwise", "rowwise"}
    assert not any(kw["name"] == "output" for _, kw in tasks)
    assert {kw["name"] for _, kw in tasks if kw["recipe"] == "rowwise"} == {"gate_up"}
    recs = [micro_fp8.bench_matmul_fp8(64, n, k, recipe=r, device="cpu", warmup=1, iters=1,
                                       repeats=2) for n, k, r in ((64, 128, "tensorwise"),
                                                                   (128, 64, "rowwise"))]
    for r in recs:
        assert records.validate(r)["bench"] == "matmul-fp8" and r["results"]["tflops"] > 0
    peak = 2 * recs[0]["results"]["tflops"]  # a CPU's rate as if it were half a card's peak
    gpu = dataclasses.replace(load_gpu("h100-sxm", calibrated=False), fp8_tflops=peak)
    curves = calibrate_fp8.curves(recs, gpu)
    assert curves["fp8_matmul_curve"] == [[64.0, 64.0 * 128, 0.5]]
    assert curves["fp8_rowwise_matmul_curve"][0][2] == pytest.approx(
        min(1.0, recs[1]["results"]["tflops"] / peak), abs=1e-4)
    fitted = dataclasses.replace(gpu, fp8_matmul_curve=tuple(map(tuple,
                                                                 curves["fp8_matmul_curve"])))
    assert fp8_cost.fp8_efficiency_at(fitted, "tensorwise", 64, 8192) == \
        curves["fp8_matmul_curve"][0][2]
    with pytest.raises(SpecError, match="no fp8 peak"):
        calibrate_fp8.curves(recs, load_gpu("a100-80gb", calibrated=False))


def test_fp8_linear_bench_and_its_cast_scale():
    """The whole converted linear is timed beside its bf16 twin; calibrate reads its time less
    the GEMMs as the casts' and finds the scale that made the record (each recipe apart)."""
    spec = load_model("llama-1.3b")
    tasks = micro_fp8.fp8_tasks(spec, 1, 64, [], [], bench=micro_fp8.LINEAR_BENCH)
    assert {b for b, _ in tasks} == {"fp8-linear"} and len(tasks) == len(
        micro_fp8.fp8_tasks(spec, 1, 64, [], []))
    rec = micro_fp8.bench_fp8_linear(16, 2048, 256, recipe="tensorwise", device="cpu",
                                     warmup=1, iters=1, repeats=2)
    assert records.validate(rec)["bench"] == "fp8-linear"
    assert rec["results"]["time_s"] > 0 and rec["config"]["bf16_time_s"] > 0
    bench, shape, _, rate = micro_report.summary(rec)  # the table run.py prints at the end
    assert bench == "fp8-linear" and shape.endswith(" 16x2048x256 tensorwise")
    assert rate.endswith("x bf16")
    with pytest.raises(SpecError, match="not converted"):
        micro_fp8.bench_fp8_linear(16, 512, 256, recipe="tensorwise", device="cpu")
    gpu = load_gpu("h100-sxm", calibrated=False)

    def made(recipe, n, k, scale):  # a record whose casts took `scale` x the analytic time
        m = 8192
        gemms = 6.0 * m * n * k / (gpu.fp8_tflops * 1e12 * fp8_cost.fp8_efficiency_at(
            gpu, recipe, m, n * k))
        casts = fp8_cost.cast_time(gpu, fp8_cost.linear_cast_bytes(m, n, k))
        return {"bench": "fp8-linear", "config": {"m": m, "n": n, "k": k, "recipe": recipe},
                "results": {"time_s": float(gemms + scale * casts)}}

    recs = [made("tensorwise", 5120, 5120, 1.5), made("tensorwise", 13824, 5120, 1.7),
            made("tensorwise", 5120, 13824, 1.6), made("rowwise", 13824, 5120, 3.0)]
    scales = calibrate_fp8.cast_scales(recs, gpu)
    assert scales == {"fp8_cast_scale": pytest.approx(1.6, abs=1e-3),
                      "fp8_rowwise_cast_scale": pytest.approx(3.0, abs=1e-3)}
    assert calibrate_fp8.cast_scales([], gpu) == {}
    fitted = dataclasses.replace(gpu, fp8_rowwise_cast_scale=scales["fp8_rowwise_cast_scale"])
    nbytes = fp8_cost.linear_cast_bytes(8192, 13824, 5120)
    assert fp8_cost.cast_time(fitted, nbytes, "rowwise") == pytest.approx(
        3.0 * fp8_cost.cast_time(fitted, nbytes), rel=1e-3)
    assert fp8_cost.cast_time(fitted, nbytes, "tensorwise") == fp8_cost.cast_time(fitted, nbytes)


def test_block_fp8_bench_and_its_kept_ratio(tmp_path):
    """The block bench keeps its fp8 block's bytes beside the bf16 twin's; calibrate reads
    their ratio with the autocast path's bf16 weight casts set aside, per recipe."""
    from trainplan.cost import memory_runtime as rt
    from trainplan.cost.compute import NONE

    tiny = tmp_path / "tiny.yaml"  # tensorwise converts its gate and up (1040 x 64) only
    tiny.write_text("n_layers: 1\nhidden: 64\nn_heads: 4\nffn: 1040\nvocab: 256\n")
    rec = micro_fp8.bench_block_fp8(str(tiny), 1, 16, recipe="tensorwise", device="cpu",
                                    warmup=1, iters=1, repeats=2)
    assert records.validate(rec)["bench"] == "block-fp8"
    assert rec["config"]["recipe"] == "tensorwise" and "bf16_activation_bytes" in rec["config"]
    assert micro_report.summary(rec)[0] == "block-fp8"
    assert calibrate_fp8.activation_ratios([rec]) == {}  # CPU: no allocator bytes, no ratio
    m = load_model(str(tiny))
    copies = float(rt.weight_copy_bytes(m, path=rt.AUTOCAST, tp=1, ep=1, recompute=NONE))
    share = float(fp8_cost.converted_share(m, "tensorwise"))
    assert copies > 0 and 0 < share < 1  # the attention and down projections stay bf16

    def made(recipe, precision, bf16, ratio):
        keeps = copies if precision == "autocast-fp32" else 0.0
        return {"bench": "block-fp8", "results": {"activation_bytes": ratio * (bf16 - keeps)
                                                  + (1 - share) * keeps},
                "config": {"model_spec": dataclasses.asdict(m), "recipe": recipe,
                           "precision": precision, "bf16_activation_bytes": bf16}}

    recs = [made("tensorwise", "pure", 6e6, 0.7), made("tensorwise", "autocast-fp32", 9e6, 0.72),
            made("tensorwise", "autocast-fp32", 1.5e7, 0.74)]
    assert calibrate_fp8.activation_ratios(recs) == {
        "fp8_activation_ratio": pytest.approx(0.72, abs=1e-4)}
