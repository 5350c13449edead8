"""Calibration from the model's own pieces: block, head, optimizer, HBM copy, overlap.

    microbenchmark records (bench/micro_model.py) -> scales on analytic terms -> GPUSpec

A GEMM and an attention kernel timed alone miss what a whole block does:
the element-wise kernels (norms, RoPE, SwiGLU, residuals; fused by
`torch.compile` or not), the activation bytes autograd really keeps, the
output layer's loss, the optimizer's per-tensor work and what a collective
running beside compute costs it. Each piece's analytic time (the cost model's
own functions, at the calibrated matmul and attention fractions) is set
against its measured time, and the ratio is kept as a scale:

- memory_efficiency = copy bandwidth (2 x bytes / t) / datasheet HBM rate;
- elementwise_scale (compiled) and eager_elementwise_scale =
  (t_block - t_matmul - t_attention) / t_elementwise, from the blocks
  without recompute; blocks with recompute are kept as held-out checks;
- activation_scales = kept bytes / `memory.layer_activation_bytes`, per
  (compiled, recompute) measured;
- head_scale = t_head / (output GEMMs + `compute.loss_bytes_per_token`);
- logits_scale = the head's peak bytes / `memory.logits_bytes` (GPU only);
- optimizer_scale = t_per_param / (32 B / HBM rate), as
  `compute.optimizer_step_time` prices it;
- overlap_exposed = median (t_both - t_gemm) / t_allreduce, clamped to [0, 1].

Every scale is a ratio of measured to modelled work on a microbenchmark, so
it carries over to other widths only as far as the work's shape does; the
calibration names the model it was measured on.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from trainplan import compute, memory
from trainplan.layouts import RECOMPUTE
from trainplan.specs import GPUSpec, ModelSpec

PIECES = ("hbm", "head", "block", "optimizer", "overlap")
SCALE_NAMES = {  # the scales as the runbook names them, and their uncalibrated value
    "elementwise_scale": ("element-wise time / analytic, compiled blocks", "1 (analytic)"),
    "eager_elementwise_scale": ("element-wise time / analytic, eager blocks", "1 (analytic)"),
    "head_scale": ("output layer + loss time / analytic", "1 (analytic)"),
    "optimizer_scale": ("clip + fused AdamW time / analytic", "1 (analytic)"),
    "logits_scale": ("output layer + loss peak bytes / analytic", "1 (analytic)"),
    "overlap_exposed": ("share of overlapped all-reduce time still exposed", "0 (all hidden)"),
}
MIN_SCALE = 0.05  # a residual below this is noise, not a speed-up


def _spec(record: dict) -> ModelSpec:
    from trainplan.specs import load_model

    cfg = record["config"]
    if isinstance(cfg.get("model_spec"), dict):
        return ModelSpec(**cfg["model_spec"])
    return load_model(cfg["model"])


def _rates(gpu: GPUSpec) -> tuple[float, float, float]:
    peak = gpu.bf16_tflops * 1e12
    return (peak * gpu.matmul_efficiency, peak * gpu.attention_efficiency,
            gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)


def block_terms(m: ModelSpec, gpu: GPUSpec, *, tokens: float, seq: int, recompute: str) -> dict:
    """Analytic seconds of one block's matmuls, attention and element-wise work (tp = 1)."""
    mm_rate, attn_rate, mem_rate = _rates(gpu)
    code = RECOMPUTE.index(recompute)
    passes = 3.0 + float(compute.recompute_matmul_factor(code))
    return {
        "matmul": tokens * passes * compute.matmul_flops_per_token_per_layer(m, 1) / mm_rate,
        "attention": tokens * passes * compute.attention_flops_per_token_per_layer(m, seq, 1)
        / attn_rate,
        "elementwise": tokens * (1.0 + float(compute.recompute_elementwise_factor(code)))
        * float(compute.elementwise_bytes_per_token_per_layer(m, 1, False)) / mem_rate,
    }


def _elementwise_scale(record: dict, gpu: GPUSpec) -> float:
    c = record["config"]
    t = block_terms(_spec(record), gpu, tokens=c["tokens"], seq=c["seq"], recompute=c["recompute"])
    rest = record["results"]["time_s"] - t["matmul"] - t["attention"]
    return float(max(rest / t["elementwise"], MIN_SCALE))


def _activation_scale(record: dict) -> float:
    c = record["config"]
    analytic = memory.layer_activation_bytes(
        _spec(record), seq_len=c["seq"], micro_batch=c["micro_batch"], tp=1, cp=1,
        recompute=RECOMPUTE.index(c["recompute"]), sequence_parallel=False)
    return float(record["results"]["activation_bytes"] / float(analytic))


def head_time(m: ModelSpec, gpu: GPUSpec, tokens: float) -> float:
    """Analytic seconds of the output layer (3 passes of 2 V h) and the loss, tp = 1."""
    mm_rate, _, mem_rate = _rates(gpu)
    return float(tokens * (3.0 * 2.0 * m.vocab * m.hidden / mm_rate
                           + float(compute.loss_bytes_per_token(m, 1)) / mem_rate))


def _median(values) -> float:
    return float(statistics.median(values))


def fit(by_bench: dict, gpu: GPUSpec) -> tuple[dict, list[dict]]:
    """Scales from the piece records in `by_bench` (bench -> records); and held-out checks."""
    out: dict = {}
    if by_bench.get("hbm"):
        tbps = _median(r["results"]["tbps"] for r in by_bench["hbm"])
        out["memory_efficiency"] = round(min(1.0, tbps / gpu.hbm_tbps), 4)
        gpu = dataclasses.replace(gpu, memory_efficiency=out["memory_efficiency"])
    blocks = by_bench.get("block", [])
    for compiled, key in ((True, "elementwise_scale"), (False, "eager_elementwise_scale")):
        base = [r for r in blocks if r["config"]["compile"] == compiled
                and r["config"]["recompute"] == "none"]
        if base:
            out[key] = round(_median(_elementwise_scale(r, gpu) for r in base), 4)
    scales = {}
    for r in (r for r in blocks if r["results"]["activation_bytes"] > 0):  # 0: not on CPU
        scales.setdefault((r["config"]["compile"], r["config"]["recompute"]), []).append(
            _activation_scale(r))
    if scales:
        out["activation_scales"] = [[c, rc, round(_median(v), 4)]
                                    for (c, rc), v in sorted(scales.items())]
    if by_bench.get("head"):
        out["head_scale"] = round(_median(
            r["results"]["time_s"] / head_time(_spec(r), gpu, r["config"]["tokens"])
            for r in by_bench["head"]), 4)
    heads = [r for r in by_bench.get("head", []) if r["results"].get("peak_bytes")]  # GPU only
    if heads:
        out["logits_scale"] = round(_median(
            r["results"]["peak_bytes"] / float(memory.logits_bytes(
                _spec(r), seq_len=r["config"]["seq"], micro_batch=r["config"]["micro_batch"],
                tp=1, cp=1)) for r in heads), 4)
    if by_bench.get("optimizer"):
        per_param = 32.0 / (gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)
        out["optimizer_scale"] = round(_median(
            r["results"]["time_s"] / r["config"]["params"] / per_param
            for r in by_bench["optimizer"]), 4)
    if by_bench.get("overlap"):
        out["overlap_exposed"] = round(min(1.0, max(0.0, _median(
            r["results"]["exposed_fraction"] for r in by_bench["overlap"]))), 4)
    return out, block_checks(blocks, apply(gpu, out))


def block_checks(blocks: list[dict], gpu: GPUSpec) -> list[dict]:
    """Each block record beside the calibrated prediction of its time and kept bytes."""
    rows = []
    for r in blocks:
        c, m = r["config"], _spec(r)
        t = block_terms(m, gpu, tokens=c["tokens"], seq=c["seq"], recompute=c["recompute"])
        scale = gpu.elementwise_scale if c["compile"] else gpu.eager_elementwise_scale
        predicted = t["matmul"] + t["attention"] + scale * t["elementwise"]
        kept = float(memory.layer_activation_bytes(
            m, seq_len=c["seq"], micro_batch=c["micro_batch"], tp=1, cp=1,
            recompute=RECOMPUTE.index(c["recompute"]), sequence_parallel=False))
        kept *= activation_scale(gpu, c["compile"], RECOMPUTE.index(c["recompute"]))
        rows.append({"model": m.name, "micro_batch": c["micro_batch"], "compile": c["compile"],
                     "recompute": c["recompute"], "measured_s": r["results"]["time_s"],
                     "predicted_s": round(float(predicted), 6),
                     "measured_mib": round(r["results"]["activation_bytes"] / 2**20, 2),
                     "predicted_mib": round(float(kept) / 2**20, 2)})
    return rows


def activation_scale(gpu: GPUSpec, compiled, recompute_code):
    """The measured kept-bytes scale for (compiled, recompute), vectorised over layouts.

    Falls back to the same compile mode without recompute, then to 1.
    """
    compiled = np.asarray(compiled, dtype=bool)
    code = np.asarray(recompute_code)
    table = {(bool(c), RECOMPUTE.index(rc)): float(s) for c, rc, s in gpu.activation_scales}
    out = np.ones(np.broadcast(compiled, code).shape)
    for mode in (True, False):
        base = table.get((mode, 0), 1.0)
        for rc in range(len(RECOMPUTE)):
            out = np.where((compiled == mode) & (code == rc), table.get((mode, rc), base), out)
    return out if out.shape else float(out)


def apply(gpu: GPUSpec, scales: dict) -> GPUSpec:
    """`gpu` with the piece scales of a calibration (missing ones keep the spec's)."""
    kw = {k: float(v) for k, v in scales.items()
          if k in ("memory_efficiency", "elementwise_scale", "eager_elementwise_scale",
                   "head_scale", "optimizer_scale", "overlap_exposed", "logits_scale")
          and v is not None}
    if scales.get("activation_scales"):
        kw["activation_scales"] = tuple((bool(c), str(rc), float(s))
                                        for c, rc, s in scales["activation_scales"])
    return dataclasses.replace(gpu, **kw)
