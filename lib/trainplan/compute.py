"""Compute: FLOPs per token, and the time a rank spends computing one micro-batch.

Two counts of FLOPs, kept apart on purpose:
- model FLOPs (for MFU): 6 N + 12 l h s per token, N = `params.flop_params`,
  recompute never counted (FACTS.md; PaLM, Chowdhery et al. 2022, app. B);
- hardware FLOPs (for time): the same plus what recompute adds.

Time on a rank is the sum of three kinds of work, each at its own achieved
rate: matrix multiplies at `matmul_efficiency` of peak, fused attention at
`attention_efficiency` of peak, and memory-bound element-wise kernels (norms,
RoPE, residual adds, activation, loss) at `memory_efficiency` of HBM bandwidth.
"""

from __future__ import annotations

import numpy as np

from trainplan import params
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
       skip about half, the convention counts all of it (FACTS.md).
    3. Not counted: recompute, element-wise work, the embedding lookup.
    """
    return 6.0 * params.flop_params(m) + 12.0 * m.n_layers * m.hidden * seq_len


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


def microbatch_compute_time(m: ModelSpec, gpu: GPUSpec, *, seq_len, micro_batch, tp, cp, pp,
                            recompute, sequence_parallel, last_stage=True, compiled=True):
    """Seconds one rank of a pipeline stage computes one micro-batch, forward and backward.

    Sum of matmul, attention and element-wise terms over the stage's
    n_layers / pp blocks; the output layer and loss are added on the last
    stage, which is the slowest and so sets the pace of the pipeline. The
    element-wise term and the head carry the card's measured scales
    (`trainplan.calibrate_pieces`; 1 when uncalibrated), the element-wise one
    chosen by whether the blocks are compiled (fused) or eager.
    """
    tokens = micro_batch * seq_len / np.asarray(cp)  # tokens of this rank
    layers = m.n_layers / np.asarray(pp)
    mm_rate = gpu.bf16_tflops * 1e12 * gpu.matmul_efficiency
    attn_rate = gpu.bf16_tflops * 1e12 * gpu.attention_efficiency
    mem_rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency

    passes = 3.0 + recompute_matmul_factor(recompute)  # fwd = 1, bwd = 2, recompute = +1
    mm = passes * matmul_flops_per_token_per_layer(m, tp) * layers
    attn = passes * attention_flops_per_token_per_layer(m, seq_len, tp) * layers
    scale = np.where(compiled, gpu.elementwise_scale, gpu.eager_elementwise_scale)
    elem = scale * (1.0 + recompute_elementwise_factor(recompute)) * layers * \
        elementwise_bytes_per_token_per_layer(m, tp, sequence_parallel)
    head = 0.0
    if last_stage:
        head = gpu.head_scale * (3.0 * 2.0 * m.vocab * m.hidden / np.asarray(tp) / mm_rate
                                 + loss_bytes_per_token(m, tp) / mem_rate)
    return tokens * (mm / mm_rate + attn / attn_rate + elem / mem_rate + head)


def optimizer_step_time(gpu: GPUSpec, params_held):
    """Seconds of the AdamW update over the parameters this rank owns: 32 bytes each / HBM rate.

    A fused AdamW reads fp32 param, grad, m, v (16 B) and writes param, m, v
    (12 B); the gradient-norm clip reads the grad once more (4 B). Memory
    bound, so bytes / achieved bandwidth, times the card's measured scale
    (per-tensor launch and clip overheads; `trainplan.calibrate_pieces`).
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
    gather, reduce = 4.0 + 6.0 / n, 6.0
    per_mb = np.where(zero == 3, 2 * gather + reduce, np.where(zero == 2, gather + reduce, 0.0))
    ddp = np.where(np.asarray(dp_ranks) > 1, 16.0, 0.0)
    per_step = np.where(zero == 1, gather + reduce, np.where(zero == 0, ddp, 0.0))
    return per_mb, per_step


def dp_copy_time(gpu: GPUSpec, stage_params, *, zero, shard_ranks, dp_ranks):
    """(per micro-batch, per step) seconds of `dp_copy_bytes_per_param` at the achieved HBM rate
    (`memory_efficiency` x datasheet bandwidth, from the copy microbenchmark)."""
    per_mb, per_step = dp_copy_bytes_per_param(zero, shard_ranks, dp_ranks)
    rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    p = np.asarray(stage_params, dtype=float)
    return per_mb * p / rate, per_step * p / rate
