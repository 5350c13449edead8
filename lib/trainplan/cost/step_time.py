"""Step time, throughput and MFU: the visible sum of named terms.

    step = m t_mb + bubble + pipeline sends + blocking data-parallel traffic + optimizer
    t_mb = compute + tensor-parallel + expert all-to-all + ring attention
           + exposed per-micro-batch data-parallel traffic
    compute = blocks (GEMMs at the measured curve's fraction for their shape) + head
              + gradient accumulation's adds / m
    tensor-parallel = block collectives + embedding/norm/logits collectives
                      + DTensor's layout copies around sequence-parallel collectives

with m = grad_accum micro-batches per step. A micro-batch takes at least the host's time
to issue it (`overheads.host_wait_per_step`, `trainplan.calibrate.host`): host and GPU
overlap within a step and the slower sets the pace; the wait is a part of `compute_s`.
The step's host work outside the blocks (clipping, optimizer) joins the last micro-batch
(`overheads.last_microbatch_time`: a phase after the blocks where no FSDP2 runs).
The 1F1B bubble is (p - 1) / v micro-batch slots (Narayanan et al. 2021) of a stage
without the output layer and loss, which only the last stage runs.

The layout decides the precision the harness runs (`compute.autocast_layout`): without
FSDP2 the fp32 weights run under autocast, and on more than one GPU the residual stream, the
tensors TP gathers and the pipeline sends are fp32 and the blocks take the autocast
element-wise scale (one GPU casts its stream to bf16: `memory_runtime.fp32_stream`);
DDP-wrapped blocks take `ddp_block_scale`, FSDP2-wrapped ones `fsdp_block_scale`.

Data-parallel traffic (its copy kernels, `compute.dp_copy_time`; how often: `fsdp_passes`)
hides under the compute of the pass it runs in, except the first block's gather or the last
block's reduce (Zhao et al. 2023, PyTorch FSDP, sec. 3.4), and beside tensor parallel
(`measured.fsdp_leak`). Tensor- and expert-parallel collectives sit on the critical path.
Context parallel is torch's ring attention (`ring`): its K, V all-gathers and fp32 dk, dv
sends (exposed where compiled, slower beside FSDP2's traffic) and its fp32 merge and
accumulate passes, counted with it as DTensor's copies are with tensor parallel.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainplan.cost import comms, compute, fp8, memory, params, ring
from trainplan.cost import measured as overheads
from trainplan.cost import memory_runtime as rt
from trainplan.cost.measured import activation_scale
from trainplan.cost.memory_runtime import EXPANDABLE
from trainplan.specs import ClusterSpec, GPUSpec, ModelSpec
from trainplan.specs.layouts import Layouts, labels, shard_degree, strategy_family, strategy_label

GiB = 2**30
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "other", "total")
TIME_TERMS = ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")


def _exposed(comm, window, floor, leak=0.0):
    """Traffic not hidden under `window` seconds of compute, but never less than `floor`.

    `leak` is the fraction of the hidden part (what neither the window's excess nor the
    floor shows) that still costs time, so at 1 all of `comm` shows: NCCL's
    kernels take SMs and HBM bandwidth from the compute they run beside
    (measured by the overlap microbenchmark, `trainplan.calibrate.pieces`).
    """
    shown = np.maximum(comm - window, floor)
    return np.where(comm > 0, shown + leak * np.maximum(comm - shown, 0.0), 0.0)


def fsdp_passes(zero, pp) -> dict:
    """How often a step runs FSDP2's all-gather and reduce-scatter of a stage (zero 2-3):
    every micro-batch (`_mb`), once under one micro-batch's compute (`_once`), or once after
    the last backward with nothing to hide under (`_tail`).

    ZeRO-3 gathers for forward and again for backward and reduce-scatters, every
    micro-batch. ZeRO-2 keeps the gathered weights and defers the reduce-scatter to the last
    micro-batch (`bench.harness.step._sync_context`): once a step. Under a pipeline schedule
    every backward skips the reduce-scatter, which runs for the whole stage after the last
    backward (torch.distributed.pipelining's `backward_maybe_with_nosync` and
    `perform_reduce_grad`): ZeRO-2 then gathers once a step and reduces at the tail. ZeRO-3
    under a pipeline keeps each backward's weights gathered too, so it would gather about
    once a micro-batch and hold a stage's weights between micro-batches; neither is measured
    yet, and it stays priced as without a pipeline.
    """
    zero, piped = np.asarray(zero), np.asarray(pp) > 1
    z3, z2 = zero == 3, zero == 2
    return {"gathers_mb": np.where(z3, 2.0, 0.0),
            "reduces_mb": np.where(z3, 1.0, 0.0),
            "gathers_once": np.where(z2, 1.0, 0.0),
            "reduces_once": np.where(z2 & ~piped, 1.0, 0.0),
            "reduces_tail": np.where(z2 & piped, 1.0, 0.0)}


def evaluate(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, L: Layouts,
             seq_len: int, compiled: bool = True, precision: str = "bf16",
             fp8_recipe: str = "tensorwise", loss: str = "standard",
             allocator: str = EXPANDABLE) -> pd.DataFrame:
    """Memory, time breakdown, throughput and MFU of every layout in `L`, one row each.

    `compiled`: blocks run under `torch.compile` (fused element-wise work and
    the activations it keeps), as trainplan recommends; False prices eager.
    `precision` "fp8": the block linears `cost.fp8.converts` picks run torchao's float8
    with `fp8_recipe`, and fp8's terms (`cost.fp8`) join the bf16 ones; MFU stays quoted
    against the bf16 peak.
    `loss` "fused": the head's memory is the fused loss's (`memory.fused_logits_bytes`)
    where the harness builds it (`memory.fused_loss_on`; elsewhere standard), said per row
    in a `loss` column; its time stays the standard head's (the same matmul FLOPs; not
    measured). `allocator`: the CUDA caching allocator's mode the run uses
    (`memory_runtime.ALLOCATORS`; trainplan's runs set "expandable").
    """

    cluster = comms.with_measured_links(cluster, gpu)
    tp, pp, cp, ep, dp = L.tp, L.pp, L.cp, L.ep, L.dp
    mb, ga, v = L.micro_batch, L.grad_accum, L.pp_virtual
    sp = memory.sequence_parallel_on(L)
    full = L.recompute == compute.FULL
    layers = m.n_layers / pp
    world = L.world
    autocast = compute.autocast_layout(dp, L.zero, tp, pp, cp)  # fp32 weights
    stream32 = rt.fp32_stream(rt.harness_path(dp, tp, pp, L.zero, cp))  # and an fp32 stream
    stream = np.where(stream32, 2.0, 1.0)  # residual-stream bytes / bf16
    fused = memory.fused_loss_on(loss, tp=tp, pp=pp, cp=cp)

    is_fp8 = precision == "fp8"
    # a compiled fp8 block without recompute keeps less (the ratio is measured there only),
    # and no bf16 casts of its converted weights
    fp8_kept = (np.where(np.asarray(compiled) & (np.asarray(L.recompute) == compute.NONE),
                         fp8.kept_scale(gpu, fp8_recipe), 1.0),
                fp8.converted_share(m, fp8_recipe, tp, ep)) if is_fp8 else memory.NO_FP8
    mem = memory.breakdown(
        m, L, seq_len=seq_len, activation_scale=activation_scale(gpu, compiled, L.recompute),
        rebuilt_scale=activation_scale(gpu, compiled, 0), logits_scale=gpu.logits_scale,
        compiled_loss=compiled, gpu=gpu, fused_loss=fused, fp8_kept=fp8_kept,
        allocator=allocator)
    fp8_gather = ~autocast & (fp8_recipe == "tensorwise")  # FSDP2's float8 all-gather
    if is_fp8:
        extra_params, extra_other = fp8.memory_delta(
            m, recipe=fp8_recipe, tokens=mb * seq_len / cp, tp=tp, pp=pp, ep=ep, zero=L.zero,
            fsdp=~autocast, fp8_gather=fp8_gather)
        mem = {**mem, "params": mem["params"] + extra_params, "other": mem["other"] + extra_other}
        mem["total"] = sum(mem[k] for k in MEMORY_TERMS[:-1])

    # compute of one micro-batch on the slowest (last) stage
    compute_mb = compute.microbatch_compute_time(
        m, gpu, seq_len=seq_len, micro_batch=mb, tp=tp, cp=cp, pp=pp, recompute=L.recompute,
        sequence_parallel=sp, compiled=compiled, autocast=stream32,
        ddp=compute.ddp_layout(dp, L.zero, tp, pp, cp), fsdp=~autocast)
    # the output layer and loss run on the last stage only: the others fill and drain the pipe
    tokens_mb = mb * seq_len / cp
    head_mb = tokens_mb * compute.head_time_per_token(m, gpu, tokens=tokens_mb, tp=tp,
                                                      compiled=compiled)
    stage_params = params.stage_params_per_rank(m, tp, pp, ep)
    converted = fp8.converted_layer_params(m, fp8_recipe, tp, ep) * layers if is_fp8 else 0.0
    if is_fp8:  # converted GEMMs at the fp8 rate, and their casts
        compute_mb = compute_mb + compute.block_wrapper_scale(
            gpu, tp=tp, ddp=compute.ddp_layout(dp, L.zero, tp, pp, cp), fsdp=~autocast) * (
            fp8.gemm_delta_time(m, gpu, recipe=fp8_recipe, tokens=tokens_mb, tp=tp,
                                passes=3.0 + compute.recompute_matmul_factor(L.recompute),
                                layers=layers)) + fp8.cast_time(gpu, fp8.cast_bytes(
                                    m, recipe=fp8_recipe, tokens=tokens_mb, tp=tp,
                                    recompute=L.recompute, fp8_gather=fp8_gather, layers=layers),
                                    recipe=fp8_recipe)
    gathered = fp8.gather_params(stage_params, converted, fp8_gather) if is_fp8 else None
    # gradient accumulation's memory-bound adds, spread over the micro-batches they follow
    compute_mb = compute_mb + compute.grad_accum_time(
        gpu, stage_params, ga, zero=L.zero, shard_ranks=L.dp_shard * cp, fsdp=~autocast) / ga
    attn_fwd_layer = tokens_mb * compute.attention_flops_per_token_per_layer(m, seq_len, tp) / (
        gpu.bf16_tflops * 1e12 * compute.attention_efficiency_at(gpu, seq_len))

    # communication of one micro-batch
    act_bytes = compute.BF16 * tokens_mb * m.hidden
    tp_mb = comms.tp_microbatch_time(cluster, act_bytes=act_bytes, tp=tp, layers=layers,
                                     recompute_full=full, sequence_parallel=sp,
                                     stream_scale=stream) \
        + comms.tp_ends_time(cluster, act_bytes=act_bytes, tp=tp, sequence_parallel=sp,
                             logits_bytes=compute.BF16 * tokens_mb * m.vocab,
                             stream_scale=stream, first_stage=pp == 1) \
        + compute.tp_layout_copy_time(gpu, act_elems=tokens_mb * m.hidden, tp=tp,
                                      stream_bytes=stream * compute.BF16, layers=layers,
                                      recompute_full=full, sequence_parallel=sp, micro_batch=mb)
    ep_mb = comms.ep_microbatch_time(cluster, token_bytes=act_bytes * m.top_k, ep=ep, tp=tp,
                                     layers=layers) if m.is_moe else 0.0
    # FSDP2's gathers and reduce-scatters with their copy kernels, by when a step runs them
    ag, rs = comms.fsdp_collectives(cluster, stage_params=stage_params, dp_shard=L.dp_shard,
                                    cp=cp, tp=tp, gather_params=gathered)
    g_copy, r_copy = compute.fsdp_copy_times(gpu, stage_params, shard_ranks=L.dp_shard * cp)
    _, copy_step = compute.dp_copy_time(gpu, stage_params, zero=L.zero,
                                        shard_ranks=L.dp_shard * cp, dp_ranks=dp * cp)
    if is_fp8:
        g_copy = g_copy + fp8.cast_time(gpu, fp8.gather_copy_delta_bytes(
            converted, shard_ranks=L.dp_shard * cp, fp8_gather=fp8_gather))
        copy_step = copy_step + fp8.cast_time(gpu, fp8.step_copy_delta_bytes(
            converted, zero=L.zero, shard_ranks=L.dp_shard * cp, fp8_gather=fp8_gather))
    runs = fsdp_passes(L.zero, pp)
    # torch's ring attention: its exposed collectives, slowed by FSDP2's traffic on the same
    # links (`ring.shared_link_extra`), and its fp32 merge and add passes
    cp_comm, cp_passes = ring.ring_layer_time(m, gpu, cluster, seq_len=seq_len, micro_batch=mb,
                                              cp=cp, tp=tp, recompute_full=full,
                                              compiled=compiled, attn_fwd_s=attn_fwd_layer)
    fsdp_busy = (runs["gathers_mb"] * ag + runs["reduces_mb"] * rs + (
        runs["gathers_once"] * ag + runs["reduces_once"] * rs) / ga) / compute_mb
    cp_mb = layers * (cp_comm * (1.0 + ring.shared_link_extra(fsdp_busy)) + cp_passes)
    leak = overheads.fsdp_leak(gpu, tp, ~autocast)  # beside TP, FSDP2's traffic shows whole
    # FSDP2's root group (embedding, final norm, output; bench/parallelize.apply_fsdp) is
    # gathered first and reduced last, with no compute to hide under: the floor is the
    # larger of one block's and the stage's ends' share of the traffic
    ends = (params.output_params(m) + np.where(pp == 1, params.embedding_params(m), 0)) / tp
    first_last = np.minimum(
        np.maximum(params.layer_params_per_rank(m, tp, ep), ends) / stage_params, 1.0)

    def under_one_microbatch(gathers, reduces):
        traffic = gathers * ag + reduces * rs
        return _exposed(traffic, compute_mb, traffic * first_last, leak) \
            + gathers * g_copy + reduces * r_copy

    dp_mb_exposed = under_one_microbatch(runs["gathers_mb"], runs["reduces_mb"])
    dp_once = under_one_microbatch(runs["gathers_once"], runs["reduces_once"])
    dp_tail = runs["reduces_tail"] * (rs + r_copy)
    t_dev = compute_mb + tp_mb + ep_mb + cp_mb + dp_mb_exposed + dp_once / ga
    # the host's issue time sets a floor (a roofline's second roof; calibrate_host), the
    # step's host work outside the blocks priced for this stage's layers
    host_wait = overheads.host_wait_per_step(gpu, t_dev, layers=layers, tp=tp,
                                             fsdp=~autocast, zero=L.zero, grad_accum=ga,
                                             cp=cp, pp=pp, compiled=compiled)
    t_mb = t_dev + host_wait / ga  # 0 wait where device-bound or nothing measured

    # once per step
    bubble = np.where(pp > 1, (pp - 1) / v * (t_mb - head_mb), 0.0)
    boundary = stream * compute.BF16 * tokens_mb * m.hidden / np.where(sp, tp, 1)
    pp_sends = comms.pp_exposed_time(cluster, boundary_bytes=boundary, pp=pp,
                                     n_transfers=ga * v + pp - 1, stage_span=tp * cp * dp)
    overlappable, blocking = comms.dp_step_time(cluster, stage_params=stage_params, zero=L.zero,
                                                dp=dp, dp_shard=L.dp_shard, cp=cp, tp=tp,
                                                gather_params=gathered)
    dp_step = _exposed(overlappable, 2.0 / 3.0 * compute_mb, overlappable / layers, leak) \
        + blocking + copy_step
    held = stage_params / shard_degree(L.zero, L.dp_shard, cp, 1)
    optimizer = compute.optimizer_step_time(gpu, held)

    # plan's time_breakdown_s (plan.TIME_KEYS) and its readers (compare, trace_split,
    # figures) know four terms: the host wait is folded into compute, host_wait_s a part of it
    compute_s = ga * compute_mb + host_wait
    exposed = ga * (tp_mb + ep_mb + cp_mb + dp_mb_exposed) + dp_once + dp_tail + pp_sends \
        + dp_step
    step = compute_s + exposed + bubble + optimizer

    tokens_per_step = dp * mb * ga * seq_len
    tokens_per_s = tokens_per_step / step
    mfu = tokens_per_s * compute.model_flops_per_token(m, seq_len) / (
        world * gpu.bf16_tflops * 1e12)

    df = L.frame()
    df["strategy"] = labels(L, strategy_label)
    df["family"] = labels(L, strategy_family)
    if is_fp8:  # fp8 plans are trusted only on fp8 measurements (`compare.trust`)
        df["family"] = df["family"] + (" fp8 rowwise" if fp8_recipe == "rowwise" else " fp8")
        df["precision"] = precision  # bf16 tables keep their columns (notebooks show them)
        df["fp8_recipe"] = fp8_recipe
    if loss == "fused":  # standard tables keep their columns, as bf16 ones do
        df["loss"] = np.where(np.broadcast_to(fused, len(L)), "fused", "standard")
    for name in MEMORY_TERMS:
        df[f"{name}_gib"] = np.broadcast_to(mem[name], len(L)) / GiB
    df["fits"] = memory.fits(mem["total"], gpu.memory_gib)
    df["compute_s"] = compute_s
    df["host_wait_s"] = host_wait
    df["exposed_comm_s"] = exposed
    df["tp_comm_s"] = ga * tp_mb
    df["dp_comm_s"] = ga * dp_mb_exposed + dp_once + dp_tail + dp_step
    df["pp_comm_s"] = pp_sends
    df["cp_comm_s"] = ga * cp_mb
    df["ep_comm_s"] = np.broadcast_to(ga * ep_mb, len(L))
    df["bubble_s"] = bubble
    df["optimizer_s"] = optimizer
    df["step_time_s"] = step
    df["tokens_per_step"] = tokens_per_step
    df["tokens_per_s"] = tokens_per_s
    df["tokens_per_s_per_gpu"] = tokens_per_s / world
    df["mfu"] = mfu
    return df


def time_to_train(token_budget: float, tokens_per_s: float, gpus: int) -> dict:
    """Wall time and GPU-hours to train on `token_budget` tokens at a steady `tokens_per_s`.

    days = D / (T x 86400); GPU-hours = gpus x D / T / 3600. Steady state only:
    failures, restarts and checkpoint stalls come on top (runbook page 5).
    """
    seconds = token_budget / tokens_per_s
    return {"seconds": seconds, "days": seconds / 86400.0,
            "gpu_hours": gpus * seconds / 3600.0}
