"""Calibration from the model's own pieces: block, head, optimizer, HBM copy, overlap.

    microbenchmark records (`bench.micro.model`, `bench.micro.layouts`) -> scales -> GPUSpec

A GEMM and an attention kernel timed alone miss what a whole block does: the element-wise
kernels (norms, RoPE, SwiGLU, residuals; fused by `torch.compile` or not), the activation
bytes autograd really keeps, the output layer's loss, the optimizer's per-tensor work and
what a collective running beside compute costs it. `fit` sets each piece's analytic time
(the cost model's own functions, at the calibrated matmul and attention fractions) against
its measured time and keeps the ratio as a scale (dimensionless; each formula is in the
docstring of the function that fits it). The layouts other than FSDP2 (DDP, TP, PP, one
GPU) keep fp32 weights under `torch.autocast`, and all but one GPU an fp32 residual stream
(`cost.memory_runtime.fp32_stream`): their pieces are measured apart
(`bench.micro.model.PRECISIONS`, `bench.micro.layouts`) and give the autocast_, compiled_
and ddp_ scales. Host, tensor-parallel and allocator scales are fitted
in `calibrate.host`, `calibrate.tp` and `calibrate.memory` (fragmentation_scales).

Every scale is a ratio of measured to modelled work on a microbenchmark, so it carries over
to other widths only as far as the work's shape does; the calibration names the model it
was measured on.
"""

from __future__ import annotations

import dataclasses
import statistics

from trainplan.calibrate import host as calibrate_host
from trainplan.calibrate import memory as calibrate_memory
from trainplan.calibrate import tp as calibrate_tp
from trainplan.cost import compute, memory
from trainplan.cost.measured import activation_scale  # noqa: F401  (read here and by perf)
from trainplan.specs import GPUSpec, ModelSpec, load_model
from trainplan.specs.layouts import RECOMPUTE

PIECES = ("hbm", "head", "block", "optimizer", "overlap")
SCALE_NAMES = {  # the scales as the runbook names them, and their uncalibrated value
    "elementwise_scale": ("element-wise time / analytic, compiled blocks", "1 (analytic)"),
    "eager_elementwise_scale": ("element-wise time / analytic, eager blocks", "1 (analytic)"),
    "head_scale": ("output layer + loss time / analytic", "1 (analytic)"),
    "optimizer_scale": ("clip + fused AdamW time / analytic", "1 (analytic)"),
    "logits_scale": ("output layer + loss peak bytes / analytic", "1 (analytic)"),
    "overlap_exposed": ("share of overlapped all-reduce time still exposed", "0 (all hidden)"),
    "autocast_elementwise_scale": ("element-wise time / analytic, compiled, fp32 weights "
                                   "under autocast", "1 (analytic)"),
    "eager_autocast_elementwise_scale": ("element-wise time / analytic, eager, fp32 weights "
                                         "under autocast", "1 (analytic)"),
    "compiled_head_scale": ("output layer + compiled loss time / analytic", "1 (analytic)"),
    "compiled_logits_scale": ("output layer + compiled loss peak bytes / analytic",
                              "1 (analytic)"),
    "ddp_exposed": ("share of DDP's gradient all-reduce still exposed, DDPOptimizer on",
                    "overlap_exposed"),
    "ddp_exposed_unsplit": ("the same, DDPOptimizer off", "overlap_exposed"),
    "ddp_block_scale": ("DDP-wrapped compiled block time, less bucket copies / alone",
                        "1 (no slowdown)"),
}  # fsdp_block_scale joins when a calibration has it (a row here changes notebook 04's table)
NOT_PIECES = {"name", "bf16_tflops", "memory_gib", "hbm_tbps", "matmul_efficiency",  # GPUSpec
              "attention_efficiency", "fp8_tflops", "fp8_matmul_efficiency", "source",
              "calibration", "collectives"}
MIN_SCALE = 0.05  # a residual below this is noise, not a speed-up


def _spec(record: dict) -> ModelSpec:
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
    mm_rate *= compute.block_matmul_efficiency(m, gpu.matmul_curve, tokens=tokens, tp=1,
                                               default=gpu.matmul_efficiency) \
        / gpu.matmul_efficiency  # the GEMMs at the curve's fraction for their size, as priced
    attn_rate *= compute.attention_efficiency_at(gpu, seq) / gpu.attention_efficiency
    code = RECOMPUTE.index(recompute)
    passes = 3.0 + float(compute.recompute_matmul_factor(code))
    return {
        "matmul": tokens * passes * compute.matmul_flops_per_token_per_layer(m, 1) / mm_rate,
        "attention": tokens * passes * compute.attention_flops_per_token_per_layer(m, seq, 1)
        / attn_rate,
        "elementwise": tokens * (1.0 + float(compute.recompute_elementwise_factor(code)))
        * float(compute.elementwise_bytes_per_token_per_layer(m, 1, False)) / mem_rate,
    }


def _precision(record: dict) -> str:
    return record["config"].get("precision", "pure")


def _plain(record: dict, precision: str = "pure") -> bool:
    """A block or head record measured alone (no DDP wrapper) in `precision`."""
    return _precision(record) == precision and record["config"].get("wrapper") is None


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
    """Analytic seconds of the output layer (3 passes of 2 V h) and the loss, tp = 1,
    as `compute.head_analytic_per_token` prices them."""
    return float(tokens * compute.head_analytic_per_token(m, gpu, tokens=tokens, tp=1))


def _median(values) -> float:
    return float(statistics.median(values))


def fit(by_bench: dict, gpu: GPUSpec) -> tuple[dict, list[dict]]:
    """Scales from the piece records in `by_bench` (bench -> records); and held-out checks.

        memory_efficiency = copy bandwidth (2 x bytes / t) / datasheet HBM rate
        elementwise_scale (compiled), eager_elementwise_scale
            = (t_block - t_matmul - t_attention) / t_elementwise   (`block_terms`)
        activation_scales = kept bytes / `memory.layer_activation_bytes`, per (compiled,
            recompute) measured
        optimizer_scale = t_per_param / (32 B / HBM rate), as `compute.optimizer_step_time`
        overlap_exposed = median (t_both - t_gemm) / t_allreduce, clamped to [0, 1]

    Element-wise scales come from blocks without recompute; those with it are held-out
    checks. The autocast_ keys are the same from the "autocast-fp32" blocks, against the same
    analytic (bf16) terms. The element-wise and head scales are fitted with `matmul_curve`
    applied, so that they and the cost model split the same measured times the same way."""
    given = by_bench.get("block", [])  # host-bench blocks (tiny): only calibrate_host reads them
    host = [r for r in given if calibrate_host.is_host(r)]
    stacks = [r for r in given if calibrate_memory.is_stack(r)]  # calibrate_memory's alone
    by_bench = {**by_bench, "block": [r for r in given if not calibrate_host.is_host(r)
                                      and not calibrate_memory.is_stack(r)]}
    out: dict = {}
    if by_bench.get("hbm"):
        tbps = _median(r["results"]["tbps"] for r in by_bench["hbm"])
        out["memory_efficiency"] = round(min(1.0, tbps / gpu.hbm_tbps), 4)
        gpu = dataclasses.replace(gpu, memory_efficiency=out["memory_efficiency"])
    mms = by_bench.get("matmul", [])
    if any(not r["config"].get("base", True) for r in mms):  # shapes asked for beyond the model's
        for key, head in (("matmul_curve", False), ("head_matmul_curve", True)):
            out[key] = matmul_curve(mms, gpu.bf16_tflops, head=head)
            gpu = dataclasses.replace(gpu, **{key: tuple(map(tuple, out[key]))})
    every = by_bench.get("block", [])
    blocks = [r for r in every if _plain(r)]
    for prefix, precision in (("", "pure"), ("autocast_", "autocast-fp32")):
        alone = [r for r in every if _plain(r, precision)]
        for compiled, key in ((True, f"{prefix}elementwise_scale"),
                              (False, f"eager_{prefix}elementwise_scale")):
            base = [r for r in alone if r["config"]["compile"] == compiled
                    and r["config"]["recompute"] == "none"]
            if base:
                out[key] = round(_median(_elementwise_scale(r, gpu) for r in base), 4)
        scales = {}
        for r in (r for r in alone if r["results"]["activation_bytes"] > 0):  # 0: not on CPU
            scales.setdefault((r["config"]["compile"], r["config"]["recompute"]), []).append(
                _activation_scale(r))
        if scales:
            out[f"{prefix}activation_scales"] = [[c, rc, round(_median(v), 4)]
                                                 for (c, rc), v in sorted(scales.items())]
    out.update(_head_scales(by_bench.get("head", []), gpu))
    out.update(_ddp_scales(every, gpu))
    out.update(_fsdp_scales(every, gpu))
    out.update(calibrate_host.host_scales(host))
    out.update(calibrate_host.ring_host_scales(by_bench.get("ring", [])))
    now = apply(gpu, out)
    out.update(calibrate_host.overlap_k(host, lambda r: block_predicted_s(r, now),
                                        out.get("host_block_s")))
    # priced at the element-wise and head scales and the host overlap just fitted, as the
    # planner prices a TP block
    out.update(calibrate_tp.tp_scales(every, now, _spec, out.get("host_block_s"),
                                      out.get("host_overlap_k", 0.0)))
    now = apply(gpu, out)
    out.update(calibrate_memory.fragmentation_scales(stacks, now, _spec))
    if by_bench.get("optimizer"):
        per_param = 32.0 / (gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)
        out["optimizer_scale"] = round(_median(
            r["results"]["time_s"] / r["config"]["params"] / per_param
            for r in by_bench["optimizer"]), 4)
    if by_bench.get("overlap"):
        out["overlap_exposed"] = round(min(1.0, max(0.0, _median(
            r["results"]["exposed_fraction"] for r in by_bench["overlap"]))), 4)
    checks = block_checks(blocks, apply(gpu, out))
    autocast = [r for r in every if _plain(r, "autocast-fp32")]
    if autocast:  # the same checks with the autocast scales in the pure scales' places
        renamed = {k.replace("autocast_", ""): v for k, v in out.items() if "autocast_" in k}
        checks += block_checks(autocast, apply(gpu, renamed))
    return out, checks


def _head_scales(heads: list[dict], gpu: GPUSpec) -> dict:
    """Time and peak-bytes scales of the head, per (compiled loss, precision) measured:

        head_scale = t_head / (output GEMMs + `compute.loss_bytes_per_token`)  (`head_time`)
        logits_scale = the head's peak bytes / `memory.logits_bytes`  (GPU only)

    and compiled_head_scale, compiled_logits_scale the same with the loss compiled (as
    `--compile` runs it), the bytes against `memory.compiled_logits_bytes`; from the "pure"
    heads. head_modes lists every variant: [compiled, precision, time scale, bytes scale]."""
    out, rows = {}, []
    modes = sorted({(r["config"].get("compile", False), _precision(r)) for r in heads})
    for compiled, precision in modes:
        recs = [r for r in heads if (r["config"].get("compile", False), _precision(r))
                == (compiled, precision)]
        t = round(_median(r["results"]["time_s"] / head_time(_spec(r), gpu,
                                                             r["config"]["tokens"])
                          for r in recs), 4)
        analytic = memory.compiled_logits_bytes if compiled else memory.logits_bytes
        peaks = [r["results"]["peak_bytes"] / float(analytic(
            _spec(r), seq_len=r["config"]["seq"], micro_batch=r["config"]["micro_batch"],
            tp=1, cp=1)) for r in recs if r["results"].get("peak_bytes")]  # GPU only
        b = round(_median(peaks), 4) if peaks else None
        rows.append([compiled, precision, t, b])
        if precision == "pure":
            prefix = "compiled_" if compiled else ""
            out[f"{prefix}head_scale"] = t
            if b is not None:
                out[f"{prefix}logits_scale"] = b
    if len(rows) > 1:
        out["head_modes"] = rows
    return out


def _alone(r: dict, blocks: list[dict]) -> float:
    """Median time of the unwrapped blocks in `blocks` of the wrapped block `r`'s model,
    shape, precision and compile mode, without recompute; 0 where none was measured."""
    c = r["config"]
    ref = [b["results"]["time_s"] for b in blocks if _plain(b, c["precision"])
           and (b["config"]["compile"], b["config"]["recompute"], b["config"]["micro_batch"],
                b["config"]["seq"]) == (c["compile"], "none", c["micro_batch"], c["seq"])
           and _spec(b) == _spec(r)]
    return _median(ref) if ref else 0.0


def _ddp_scales(blocks: list[dict], gpu: GPUSpec) -> dict:
    """ddp_exposed(_unsplit), ddp_block_scale and ddp_activation_scales from DDP-wrapped
    compiled block records, each against the same block measured alone (`_alone`):

        ddp_exposed (DDPOptimizer on), ddp_exposed_unsplit (off)
            = (t_ddp_block - t_block - t_bucket_copies) / t_allreduce, clamped to [0, 1]
        ddp_block_scale = (t_ddp_block - t_bucket_copies) / t_block, >= 1, DDPOptimizer on
            (as the harness runs)

    t_allreduce: the block's gradient all-reduce timed alone on the same ranks;
    t_bucket_copies: `compute.dp_copy_time`'s 16 B per parameter. ddp_block_scale is the
    whole slowdown, applied to DDP blocks' compute (`compute.microbatch_compute_time`): it
    exceeds the all-reduce's own time (book/changelog.md, "Notes on measured constants"), so
    it is priced as compute (graph split at bucket boundaries, NCCL kernels beside it), not
    as traffic. ddp_activation_scales: the wrapped block's kept bytes / analytic."""
    out, kept, slowdowns = {}, [], []
    mem_rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    for on, key in ((True, "ddp_exposed"), (False, "ddp_exposed_unsplit")):
        fractions = []
        for r in (r for r in blocks if r["config"].get("wrapper") == "ddp"
                  and r["config"]["optimize_ddp"] == on):
            c, ref = r["config"], _alone(r, blocks)
            if ref:
                copy = 16.0 * c["grad_bytes"] / 4.0 / mem_rate  # compute.dp_copy_time, DDP
                fractions.append((r["results"]["time_s"] - ref - copy)
                                 / r["results"]["allreduce_s"])
                if on:
                    slowdowns.append((r["results"]["time_s"] - copy) / ref)
            if on and r["results"]["activation_bytes"] > 0:
                kept.append(_activation_scale(r))
        if fractions:
            out[key] = round(min(1.0, max(0.0, _median(fractions))), 4)
    if slowdowns:
        out["ddp_block_scale"] = round(max(1.0, _median(slowdowns)), 4)
    if kept:
        out["ddp_activation_scales"] = [[True, round(_median(kept), 4)]]
    return out


def _fsdp_scales(blocks: list[dict], gpu: GPUSpec) -> dict:
    """fsdp_block_scale (all stages pooled) and fsdp_block_scales [[zero, scale], ...] from
    FSDP2-wrapped block records (`bench.micro.layouts.bench_fsdp_block`), at least 1 and
    applied to FSDP2 layouts' blocks:

        s = (t_fsdp - t_copy - k t_ag - t_rs) / t_block,  k = 2 (ZeRO-3) or 1 (ZeRO-2)

    t_fsdp: the wrapped block's fwd + bwd; t_block: the same block unwrapped, same
    compute dtype and compile, in the same process (`alone_s`; else the plain block
    records of that shape); t_ag, t_rs: an all-gather of its bf16 and a reduce-scatter
    of its fp32 parameter bytes alone on the same ranks; t_copy: `compute.dp_copy_time`
    per micro-batch of its parameters at n = world. What `step_time.evaluate` prices for an
    FSDP2 block besides the block itself: the copies, in full (copy_mb), and the
    gathers and reduce-scatters as traffic (dp_mb) hidden under the other blocks'
    compute bar the first/last block's floor, plus `overlap_exposed` x the hidden part.
    With one block there is nothing to hide them under: its forward waits for its
    gather, ZeRO-3's backward for its second, and the root's final callback for the
    reduce-scatter, so they add their whole time and come off in full; nor does
    anything run beside them, so no leak is in the time to take off twice. What stays
    is what no term prices: FSDP2's hooks around the compiled graphs, the waits between
    its streams and the compute stream, the unsharded parameters' and gradients'
    allocations and frees, the casts of the inputs (and the root's per-call hooks,
    once a micro-batch in a step, here once per block: an upper bound).
    """
    by_zero: dict[int, list[float]] = {}
    for r in (r for r in blocks if r["config"].get("wrapper") == "fsdp2"):
        c, res = r["config"], r["results"]
        ref = res.get("alone_s") or _alone(r, blocks)
        if not ref:
            continue  # nothing to measure the wrapper against
        copy, _ = compute.dp_copy_time(gpu, c["params"], zero=c["zero"], shard_ranks=c["world"],
                                       dp_ranks=c["world"])
        comm = (2 if c["zero"] == 3 else 1) * res["allgather_s"] + res["reduce_scatter_s"]
        by_zero.setdefault(c["zero"], []).append((res["time_s"] - float(copy) - comm) / ref)
    if not by_zero:
        return {}
    pooled = _median(v for values in by_zero.values() for v in values)
    return {"fsdp_block_scale": round(max(1.0, pooled), 4),  # a wrapper never speeds it up
            "fsdp_block_scales": [[z, round(max(1.0, _median(v)), 4)]
                                  for z, v in sorted(by_zero.items())]}


def matmul_curve(recs: list[dict], peak_tflops: float, head: bool = False) -> list[list[float]]:
    """[[tokens m, width n k, median fraction of peak of that shape], ...] sorted, for
    `compute.matmul_efficiency_at`; shapes of one width (q, k, v, out; one model's or
    several's) pool their records. The block GEMMs' curve, or with `head` the output
    layer's alone: its vocabulary-wide GEMM runs at its own rate, and pooled by width it
    would stand for a block GEMM of the same n k (a 1.3B output layer for an 8B MLP).
    `fit` writes them only where shapes beyond the model's own were measured
    (`bench.micro --matmul-tp/--matmul-tokens`)."""
    by_shape: dict[tuple[float, float], list[float]] = {}
    for r in (r for r in recs if (r["config"].get("name") == "output") == head):
        c = r["config"]
        by_shape.setdefault((float(c["m"]), float(c["n"] * c["k"])), []).append(
            r["results"]["tflops"] / peak_tflops)
    return [[m, w, round(_median(v), 4)] for (m, w), v in sorted(by_shape.items())]


matmul_efficiency_at = compute.matmul_efficiency_at  # kept here for callers of the fit
block_matmul_efficiency = compute.block_matmul_efficiency


def block_checks(blocks: list[dict], gpu: GPUSpec) -> list[dict]:
    """Each block record beside the calibrated prediction of its time and kept bytes."""
    rows = []
    for r in blocks:
        c, m = r["config"], _spec(r)
        predicted = block_predicted_s(r, gpu)
        kept = float(memory.layer_activation_bytes(
            m, seq_len=c["seq"], micro_batch=c["micro_batch"], tp=1, cp=1,
            recompute=RECOMPUTE.index(c["recompute"]), sequence_parallel=False))
        kept *= activation_scale(gpu, c["compile"], RECOMPUTE.index(c["recompute"]))
        rows.append({"model": m.name, "micro_batch": c["micro_batch"], "compile": c["compile"],
                     "precision": _precision(r),
                     "recompute": c["recompute"], "measured_s": r["results"]["time_s"],
                     "predicted_s": round(float(predicted), 6),
                     "measured_mib": round(r["results"]["activation_bytes"] / 2**20, 2),
                     "predicted_mib": round(float(kept) / 2**20, 2)})
    return rows


def block_predicted_s(r: dict, gpu: GPUSpec) -> float:
    """The calibrated GPU time of a block record's fwd + bwd: its analytic terms, element-wise
    work at the compiled or eager scale."""
    c = r["config"]
    t = block_terms(_spec(r), gpu, tokens=c["tokens"], seq=c["seq"], recompute=c["recompute"])
    scale = gpu.elementwise_scale if c["compile"] else gpu.eager_elementwise_scale
    return float(t["matmul"] + t["attention"] + scale * t["elementwise"])


def apply(gpu: GPUSpec, scales: dict) -> GPUSpec:
    """`gpu` with the piece scales of a calibration (missing ones keep the spec's).

    A scale is passed on only where GPUSpec has a field of its name: numbers
    as floats, tables as tuples of tuples (activation scales typed). Those without one
    (autocast_activation_scales, compiled_logits_scale, the ddp_exposed fractions,
    fsdp_block_scales per ZeRO stage) are read from the calibration file by memory and
    the reports.
    """
    fields = {f.name for f in dataclasses.fields(GPUSpec)} - NOT_PIECES
    kw = {k: float(v) for k, v in scales.items()
          if k in fields and v is not None and not isinstance(v, (list, tuple))}
    for key, table in scales.items():
        if key in fields and isinstance(table, (list, tuple)) and table:
            if key.endswith("activation_scales") and len(table[0]) == 3:
                kw[key] = tuple((bool(c), str(rc), float(s)) for c, rc, s in table)
            else:
                kw[key] = tuple(tuple(row) if isinstance(row, (list, tuple)) else row
                                for row in table)
    return dataclasses.replace(gpu, **kw)
