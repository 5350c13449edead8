"""Compute: FLOPs per token, and the time a rank spends computing one micro-batch.

Two counts of FLOPs, kept apart on purpose:
- model FLOPs (for MFU): 6 N + 12 l h s per token, N = `params.flop_params`,
  recompute never counted (Chowdhery et al. 2022 (PaLM), app. B);
- hardware FLOPs (for time): the same plus what recompute adds.

Time on a rank is the sum of three kinds of work, each at its own achieved rate: matrix
multiplies at `matmul_efficiency` of peak, fused attention at `attention_efficiency` of
peak, and memory-bound element-wise kernels (norms, RoPE, residual adds, activation, loss)
at `memory_efficiency` of HBM bandwidth. With a measured GEMM table (`GPUSpec.matmul_curve`)
each projection runs at the fraction measured for its shard's shape and token count instead.

Also here, memory-bound work that a layout adds on the compute stream:
DTensor's copies around sequence-parallel collectives, data parallelism's
copy kernels, gradient accumulation's adds.
"""

from __future__ import annotations

import numpy as np

from trainplan.cost import measured as overheads
from trainplan.cost import params
from trainplan.specs import GPUSpec, ModelSpec

# recompute codes used by vectorised layouts
NONE, SELECTIVE, FULL = 0, 1, 2
BF16 = 2  # bytes per element of activations and working weights


def model_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token for MFU: 6 N + 12 l h s.

    1. 6 N: each active parameter does one multiply-add (2 FLOPs) forward and
       two backward (input and weight gradients) (Kaplan et al. 2020).
    2. 12 l h s: attention scores Q K^T and the weighted sum A V, 2 s h FLOPs
       each per token per layer forward, times 3 for backward; causal kernels
       skip about half, the convention (PaLM, app. B) counts all of it.
    3. Not counted: recompute, element-wise work, the embedding lookup.
    """
    return 6.0 * params.flop_params(m) + 12.0 * m.n_layers * m.hidden * seq_len


def matmul_ceiling_tokens_per_s(m: ModelSpec, gpu: GPUSpec, seq_len: int) -> float:
    """Tokens per second per GPU if every model FLOP ran at the card's dense-matmul rate
    (`gpu.matmul_efficiency` of peak: microbenchmarked where the card is calibrated): an
    MFU no run reaches, since attention and element-wise work run slower. The physical
    ceiling a band around a prediction is capped at."""
    return gpu.bf16_tflops * 1e12 * gpu.matmul_efficiency / model_flops_per_token(m, seq_len)


def matmul_flops_per_token_per_layer(m: ModelSpec, tp):
    """Forward matmul FLOPs per token of one block on one rank: 2 x active matrix params / tp."""
    matrices = (params.attention_params(m) + m.top_k * params.expert_params(m)
                + params.router_params(m))
    return 2.0 * matrices / np.asarray(tp)


def attention_flops_per_token_per_layer(m: ModelSpec, seq_len: int, tp):
    """Forward attention-core FLOPs per token of one block on one rank: 4 s h / tp.

    Q K^T and A V each cost 2 s h per token (all heads). Heads split over tp;
    with context parallel a rank holds s / cp queries of each sequence but
    still attends over all s keys, so the per-token cost is unchanged.
    """
    return 4.0 * seq_len * m.hidden / np.asarray(tp)


def elementwise_bytes_per_token_per_layer(m: ModelSpec, tp, sequence_parallel):
    """HBM bytes moved per token by the memory-bound kernels of one block, forward + backward.

    Counted per element read or written in the forward pass (bf16): two norms
    4 h, two residual adds 6 h, RoPE on q and k 2 (h + h_kv), SwiGLU 3 f (read
    gate and up, write product; GELU 2 f), for top_k experts. Backward moves
    about twice the forward (Korthikanti et al. 2022 count the same tensors),
    so the total is 3 x forward. Norm and residual work is split over tp only
    with sequence parallel; per-head and per-f work always is.
    """
    h, kv, f = m.hidden, m.kv_dim, m.ffn
    tp = np.asarray(tp)
    per_token_hidden = 10.0 * h / np.where(sequence_parallel, tp, 1)
    rope = 2.0 * (h + kv) if m.positions == "rope" else 0.0
    act = (3.0 if m.mlp == "swiglu" else 2.0) * f * m.top_k
    return 3.0 * BF16 * (per_token_hidden + (rope + act) / tp)


def loss_bytes_per_token(m: ModelSpec, tp):
    """HBM bytes per token of the output softmax and cross-entropy: 20 V / tp.

    Five passes over the fp32 logits row (upcast write, max/sum read, softmax
    write, gradient read and write): 5 x 4 bytes x V, vocab-parallel over tp.
    """
    return 20.0 * m.vocab / np.asarray(tp)


def recompute_matmul_factor(recompute):
    """Extra forward passes of the block matmuls: full recompute repeats the forward (1), else 0."""
    return np.where(np.asarray(recompute) == FULL, 1.0, 0.0)


def recompute_elementwise_factor(recompute):
    """Extra element-wise forward work: full and selective both redo the block's element-wise ops.

    Selective recompute (as trainplan defines it) keeps the matmul outputs and
    redoes norms, RoPE and the activation in backward: one more forward pass
    of element-wise traffic, a third of the fwd + bwd total.
    """
    return np.where(np.asarray(recompute) == NONE, 0.0, 1.0 / 3.0)


def autocast_layout(dp, zero, tp, pp, cp=1):
    """True where the harness keeps fp32 weights under `torch.autocast` (see fp32_stream too).

    trainplan's harness (bench/train.py, bench/parallelize.py) uses FSDP2's
    bf16 mixed precision where FSDP2 runs: any cp > 1 (it shards over dp_shard x
    cp), dp > 1 with zero > 0, or beside tp or pp; everything else (one GPU, DDP,
    TP or PP alone) autocasts fp32 weights; `memory_runtime.fp32_stream` says where the
    residual stream is fp32 as well (not on one GPU, which casts it to bf16)."""
    dp, zero, tp, pp, cp = map(np.asarray, (dp, zero, tp, pp, cp))
    return ~((cp > 1) | ((dp > 1) & ((zero > 0) | (tp > 1) | (pp > 1))))


def ddp_layout(dp, zero, tp, pp, cp=1):
    """True where the harness wraps the model in DDP: dp > 1, zero 0, no tp, pp or cp."""
    dp, zero, tp, pp, cp = map(np.asarray, (dp, zero, tp, pp, cp))
    return (dp > 1) & (zero == 0) & (tp == 1) & (pp == 1) & (cp == 1)


def fsdp_layout(dp, zero, tp, pp, cp=1):
    """True where the harness wraps every block in FSDP2 (`fully_shard`): the layouts that do
    not autocast, any cp > 1, or dp > 1 with zero > 0 or beside tp or pp
    (bench/harness/parallelize.py)."""
    return ~autocast_layout(dp, zero, tp, pp, cp)


def _interp_log(x, xs, ys):
    """np.interp in log x, held flat beyond the ends."""
    return np.interp(np.log(x), np.log(np.asarray(xs, dtype=float)), np.asarray(ys, dtype=float))


def attention_efficiency_at(gpu: GPUSpec, seq_len):
    """Dense-equivalent fraction of peak of causal SDPA (fwd + bwd) at sequence length `seq_len`.

    From `gpu.attention_curve` (attention records at several lengths,
    `calibrate_pieces.attention_curve`), interpolated in log seq and held flat beyond
    the lengths measured: FlashAttention's tiles fill the SMs better and its per-call
    work shrinks in share as the sequence grows. Without a curve, the single
    `gpu.attention_efficiency`.
    """
    seq = np.asarray(seq_len, dtype=float)
    if not len(gpu.attention_curve):
        out = np.full(seq.shape, float(gpu.attention_efficiency))
    else:
        rows = np.asarray(gpu.attention_curve, dtype=float)
        out = np.interp(np.log(seq), np.log(rows[:, 0]), rows[:, 1])
    return out if out.shape else float(out)


def matmul_efficiency_at(curve, tokens, width, default: float):
    """Fraction of peak of a (tokens x n) @ (n x k)-shaped GEMM with width = n k (its weight size).

    `curve` rows are (tokens, width, median measured fraction) (`bench.micro`
    matmul records, `calibrate_pieces.matmul_curve`). Interpolated in log
    width among the shapes measured at each token count, then in log tokens
    between the token counts; held flat beyond the measured ranges (no
    extrapolation). TP shards (narrower n or k) and small micro-batches
    (fewer rows) are smaller GEMMs: fewer output tiles to fill the SMs and
    shorter K loops. Without a curve, `default` (the single matmul fraction).
    """
    tokens, width = np.broadcast_arrays(np.asarray(tokens, dtype=float),
                                        np.asarray(width, dtype=float))
    if not len(curve):
        out = np.full(tokens.shape, float(default))
        return out if out.shape else float(out)
    rows = np.asarray(curve, dtype=float)
    counts = np.unique(rows[:, 0])
    per_count = [_interp_log(width, rows[rows[:, 0] == c, 1], rows[rows[:, 0] == c, 2])
                 for c in counts]
    out = per_count[0]
    for lo, hi, e_lo, e_hi in zip(counts[:-1], counts[1:], per_count[:-1], per_count[1:],
                                  strict=True):
        w = np.clip(np.log(tokens / lo) / np.log(hi / lo), 0.0, 1.0)
        out = np.where(tokens > lo, (1.0 - w) * e_lo + w * e_hi, out)
    return out if out.shape else float(out)


def block_matmul_efficiency(m: ModelSpec, curve, *, tokens, tp, default: float):
    """Effective fraction of one block's forward GEMMs on one rank at `tokens` rows and `tp`:
    sum F / sum (F / e) over q, k, v, out, gate/up, down (`bench.shapes.gemm_shapes`),
    e from `matmul_efficiency_at` for each shard's shape, so that their summed FLOPs at
    peak x this fraction take the summed time. Vectorised."""
    t, tp = np.asarray(tokens, dtype=float), np.asarray(tp, dtype=float)
    h, kv, f = m.hidden, m.kv_dim, m.ffn
    ups = m.top_k * (2 if m.mlp == "swiglu" else 1)
    shapes = [(1, h / tp, h), (2, kv / tp, h), (1, h, h / tp), (ups, f / tp, h),
              (m.top_k, h, f / tp)]  # (count, n, k) with m = tokens rows
    flops = [count * 2.0 * t * n * k for count, n, k in shapes]
    time = sum(fl / matmul_efficiency_at(curve, t, n * k, default)
               for fl, (_, n, k) in zip(flops, shapes, strict=True))
    return sum(flops) / time


def elementwise_scale(gpu: GPUSpec, compiled, autocast):
    """The card's measured element-wise scale for (compiled, fp32 weights under autocast).

    Falls back to the bf16 scale of the same compile mode where autocast was not measured.
    """
    pure = np.where(compiled, gpu.elementwise_scale, gpu.eager_elementwise_scale)
    amp = np.where(compiled, gpu.autocast_elementwise_scale,
                   gpu.eager_autocast_elementwise_scale)
    return np.where(np.asarray(autocast) & (amp > 0), amp, pure)


def head_analytic_per_token(m: ModelSpec, gpu: GPUSpec, *, tokens, tp):
    """Unscaled seconds per token of the output layer and loss on one rank.

    Output GEMM: 3 passes of 2 V h / tp FLOPs at the fraction of a (tokens x V/tp x h)
    GEMM on the output layer's own curve (`head_matmul_curve`, else `matmul_curve`).
    Loss: `loss_bytes_per_token` of the whole vocabulary: the harness gathers the
    logits (`ColwiseParallel(output_layouts=Replicate())` in bench/parallelize.apply_tp),
    so every TP rank computes the full loss; there is no vocab-parallel loss.
    """
    tp = np.asarray(tp, dtype=float)
    flops = 2.0 * m.vocab / tp * m.hidden
    eff = matmul_efficiency_at(gpu.head_matmul_curve or gpu.matmul_curve, tokens,
                               m.vocab / tp * m.hidden, gpu.matmul_efficiency)
    mem_rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    return 3.0 * flops / (gpu.bf16_tflops * 1e12 * eff) + loss_bytes_per_token(m, 1) / mem_rate


def head_time_per_token(m: ModelSpec, gpu: GPUSpec, *, tokens, tp, compiled):
    """`head_analytic_per_token` times the card's measured head scale: the compiled-loss
    one where the loss is compiled (as `--compile` runs it) and measured, else the eager one."""
    scale = np.where(np.asarray(compiled) & (gpu.compiled_head_scale > 0),
                     gpu.compiled_head_scale, gpu.head_scale)
    return scale * head_analytic_per_token(m, gpu, tokens=tokens, tp=tp)


def block_wrapper_scale(gpu: GPUSpec, *, tp, ddp, fsdp):
    """The measured factor on a block's time for what wraps it: `tp_block_scale` where
    tp > 1, else `ddp_block_scale` (DDP) or `fsdp_block_scale` (FSDP2), else 1."""
    return np.where(np.asarray(tp) > 1, overheads.tp_block_scale(gpu, tp, fsdp),
                    np.where(ddp, gpu.ddp_block_scale, np.where(fsdp, gpu.fsdp_block_scale,
                                                                1.0)))


def microbatch_compute_time(m: ModelSpec, gpu: GPUSpec, *, seq_len, micro_batch, tp, cp, pp,
                            recompute, sequence_parallel, last_stage=True, compiled=True,
                            autocast=False, ddp=False, fsdp=False):
    """Seconds one rank of a pipeline stage computes one micro-batch, forward and backward.

    Sum of matmul, attention and element-wise terms over the stage's
    n_layers / pp blocks; the output layer and loss are added on the last
    stage, which is the slowest and so sets the pace of the pipeline. GEMMs
    run at the measured curve's fraction for their shard and token count
    (`block_matmul_efficiency`). The element-wise term and the head carry the
    card's measured scales (`trainplan.calibrate.pieces`; 1 when
    uncalibrated), chosen by compile mode and by `autocast` (fp32 weights).
    `ddp`: the blocks run DDP-wrapped, at the measured `ddp_block_scale`
    (DDPOptimizer's graph split and NCCL beside compute; bench.micro_layouts).
    `fsdp`: the blocks run FSDP2-wrapped, at the measured `fsdp_block_scale` (its hooks
    and stream waits; its copies and collectives are priced apart, `perf.evaluate`).
    Tensor-parallel blocks (tp > 1) take `tp_block_scale` instead, which was measured with
    the same wrapper (FSDP2 or none) around the TP block.
    """
    tokens = micro_batch * seq_len / np.asarray(cp)  # tokens of this rank
    layers = m.n_layers / np.asarray(pp)
    peak = gpu.bf16_tflops * 1e12
    mm_rate = peak * block_matmul_efficiency(m, gpu.matmul_curve, tokens=tokens, tp=tp,
                                             default=gpu.matmul_efficiency)
    attn_rate = peak * attention_efficiency_at(gpu, seq_len)
    mem_rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency

    passes = 3.0 + recompute_matmul_factor(recompute)  # fwd = 1, bwd = 2, recompute = +1
    mm = passes * matmul_flops_per_token_per_layer(m, tp) * layers
    attn = passes * attention_flops_per_token_per_layer(m, seq_len, tp) * layers
    elem = elementwise_scale(gpu, compiled, autocast) * (
        1.0 + recompute_elementwise_factor(recompute)) * layers * \
        elementwise_bytes_per_token_per_layer(m, tp, sequence_parallel)
    blocks = block_wrapper_scale(gpu, tp=tp, ddp=ddp, fsdp=fsdp) * (
        mm / mm_rate + attn / attn_rate + elem / mem_rate)
    head = head_time_per_token(m, gpu, tokens=tokens, tp=tp, compiled=compiled) \
        if last_stage else 0.0
    return tokens * (blocks + head)


def tp_layout_copy_time(gpu: GPUSpec, *, act_elems, stream_bytes, tp, layers, recompute_full,
                        sequence_parallel, micro_batch):
    """Seconds of the copies DTensor adds around one micro-batch's sequence-parallel collectives.

    The harness shards the (B, S, H) stream on dim 1. `all_gather_single`
    with gather_dim != 0 gathers along dim 0 and concatenates the chunks
    along dim 1 (`_maybe_view_chunk_cat`: a view only when B = 1), and
    `reduce_scatter_single` with scatter_dim != 0 first copies the chunks
    into dim-0 order (`_chunk_or_narrow_cat`; torch/distributed/
    _functional_collectives.py). Each reads and writes the whole tensor once.
    Per sublayer: forward all-gather (stream dtype) and reduce-scatter (bf16),
    backward the reverse pair; full recompute repeats the forward.
    """
    e = np.asarray(act_elems, dtype=float)
    ag = np.where(np.asarray(micro_batch) > 1, 1.0, 0.0)
    fwd = 2.0 * e * (ag * stream_bytes + BF16)  # AG of the norm output, RS of the projection
    bwd = 2.0 * e * (stream_bytes + ag * BF16)  # RS of its gradient, AG of the other's
    per_block = 2.0 * (fwd * (1.0 + np.where(recompute_full, 1.0, 0.0)) + bwd)
    t = per_block * layers / (gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)
    return np.where(np.asarray(sequence_parallel) & (np.asarray(tp) > 1), t, 0.0)


def optimizer_step_time(gpu: GPUSpec, params_held):
    """Seconds of the AdamW update over the parameters this rank owns: 32 bytes each / HBM rate.

    A fused AdamW reads fp32 param, grad, m, v (16 B) and writes param, m, v
    (12 B); the gradient-norm clip reads the grad once more (4 B). Memory
    bound, so bytes / achieved bandwidth, times the card's measured scale
    (per-tensor launch and clip overheads; `trainplan.calibrate.pieces`).
    """
    return gpu.optimizer_scale * 32.0 * np.asarray(params_held) / (
        gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)


def dp_copy_bytes_per_param(zero, shard_ranks, dp_ranks):
    """HBM bytes per stage parameter that data parallelism's own copy kernels move.

    (per micro-batch, per step). FSDP2 (`torch.distributed.fsdp`,
    `_fsdp_collectives.py`), n = shard_ranks > 1:
    - all-gather copy-in: the fp32 shard cast into the bf16 send buffer,
      read 4 / n + write 2 / n;
    - all-gather copy-out (`split_with_sizes_copy` into each parameter):
      read 2 + write 2 of the whole unsharded block;
    - reduce-scatter copy-in (`_chunk_cat` of the bf16 gradients into the
      fp32 reduce buffer): read 2 + write 4.
    ZeRO-3 gathers twice and reduces once per micro-batch, ZeRO-2 gathers and
    reduces once (as `comms.dp_microbatch_time`); ZeRO-1 does the same once
    per step. DDP (zero 0, dp_ranks > 1) copies every fp32 gradient into its
    bucket and the reduced bucket back (gradient_as_bucket_view=False, the
    default; Li et al. 2020, sec. 4.2.1): 4 x 4 = 16 bytes per step.
    """
    n = np.maximum(np.asarray(shard_ranks, dtype=float), 1.0)
    zero = np.where(n > 1, np.asarray(zero), 0)
    gather, reduce = fsdp_copy_bytes_per_param(n)
    per_mb = np.where(zero == 3, 2 * gather + reduce, np.where(zero == 2, gather + reduce, 0.0))
    ddp = np.where(np.asarray(dp_ranks) > 1, 16.0, 0.0)
    per_step = np.where(zero == 1, gather + reduce, np.where(zero == 0, ddp, 0.0))
    return per_mb, per_step


def fsdp_copy_bytes_per_param(n):
    """(one all-gather's, one reduce-scatter's) FSDP2 copy bytes a stage parameter, n > 0."""
    return 4.0 + 6.0 / n, 6.0


def fsdp_copy_times(gpu: GPUSpec, stage_params, *, shard_ranks):
    """(one all-gather's, one reduce-scatter's) copy seconds over a stage at the achieved HBM
    rate (`dp_copy_bytes_per_param`); 0 on a shard group of one rank."""
    n = np.maximum(np.asarray(shard_ranks, dtype=float), 1.0)
    p = np.where(n > 1, np.asarray(stage_params, dtype=float), 0.0)
    rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    return tuple(b * p / rate for b in fsdp_copy_bytes_per_param(n))


def dp_copy_time(gpu: GPUSpec, stage_params, *, zero, shard_ranks, dp_ranks):
    """(per micro-batch, per step) seconds of `dp_copy_bytes_per_param` at the achieved HBM rate
    (`memory_efficiency` x datasheet bandwidth, from the copy microbenchmark)."""
    per_mb, per_step = dp_copy_bytes_per_param(zero, shard_ranks, dp_ranks)
    rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    p = np.asarray(stage_params, dtype=float)
    return per_mb * p / rate, per_step * p / rate


def grad_accum_bytes_per_param(grad_accum, *, zero, shard_ranks, fsdp):
    """HBM bytes per stage parameter, per step, of accumulating gradients over micro-batches.

    Each micro-batch after the first adds its gradient to the held one, a
    memory-bound pass (what Megatron-Core's gradient_accumulation_fusion
    folds into the weight-gradient GEMM; Narayanan et al. 2021):
    - fp32 parameters (autocast; DDP's no_sync): AccumulateGrad's in-place
      add, read 4 + 4, write 4 = 12 B;
    - FSDP2 without resharding (ZeRO-1/2, `set_requires_gradient_sync(False)`):
      the unsharded bf16 gradient is upcast to the fp32 reduce dtype once
      (read 2, write 4) then added to it (read 4 + 2, write 4 = 10 B;
      `FSDPParam.accumulate_unsharded_grad_if_needed`);
    - FSDP2 ZeRO-3 reduce-scatters every micro-batch and adds the fp32 shard:
      12 B / shard_ranks.
    """
    extra = np.maximum(np.asarray(grad_accum, dtype=float) - 1.0, 0.0)
    n = np.maximum(np.asarray(shard_ranks, dtype=float), 1.0)
    fsdp, zero = np.asarray(fsdp), np.asarray(zero)
    per_param = np.where(fsdp, np.where(zero == 3, 12.0 * extra / n,
                                        10.0 * extra + np.where(extra > 0, 6.0, 0.0)),
                         12.0 * extra)
    return per_param


def grad_accum_time(gpu: GPUSpec, stage_params, grad_accum, *, zero, shard_ranks, fsdp):
    """Seconds per step of `grad_accum_bytes_per_param` at the achieved HBM rate."""
    rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    return grad_accum_bytes_per_param(grad_accum, zero=zero, shard_ranks=shard_ranks,
                                      fsdp=fsdp) * np.asarray(stage_params, dtype=float) / rate

