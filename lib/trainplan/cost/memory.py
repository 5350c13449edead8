"""Memory per GPU: weights, gradients, optimizer states, activations, buffers.

Every function takes layout degrees as numpy arrays (or scalars) and returns
bytes on the most loaded rank. `breakdown` sums the named terms.

Accounting follows ZeRO (Rajbhandari et al. 2020): mixed-precision Adam keeps
2 bytes of bf16 weights, 2 of bf16 gradients and 12 of fp32 master weights,
momentum and variance per parameter; stage 1 shards the 12, stage 2 the
gradients as well, stage 3 (= FSDP) the weights too. FSDP2 with fp32 sharded
parameters and fp32 gradient reduction holds 4 + 4 + 8 sharded instead: the
same 16 bytes per parameter at stage 3.
"""

from __future__ import annotations

import numpy as np

from trainplan.cost import memory_runtime as rt
from trainplan.cost import params, ring
from trainplan.cost.compute import BF16, FULL, SELECTIVE
from trainplan.errors import SpecError
from trainplan.specs import ModelSpec
from trainplan.specs.layouts import Layouts, shard_degree

WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12
FUSED_CHUNK = 4096  # tokens per chunk of the fused loss (--loss-chunk's default); a
# (4096, 32000) fp32 chunk is 0.5 GiB
LOSSES = ("standard", "fused")  # the harness's and the planner's --loss
NON_ALLOCATOR_GIB = 2.0  # CUDA context, NCCL and cuBLAS workspaces: outside PyTorch's allocator
NO_FP8 = (1.0, 0.0)  # fp8_kept of a bf16 block: (kept-bytes ratio, converted weight share)


def _sharded(m: ModelSpec, stage_params, zero, dp_shard, cp, ep, share, active_stage):
    """Per-rank count of stage parameters after ZeRO sharding; experts shard over dp / ep."""
    dense = stage_params * (1 - share) / shard_degree(zero, dp_shard, cp, active_stage)
    expert_group = np.maximum(shard_degree(zero, dp_shard, cp, active_stage) / np.asarray(ep), 1)
    return dense + stage_params * share / expert_group


def weights_bytes(m: ModelSpec, *, tp, pp, ep, zero, dp_shard, cp):
    """bf16 working weights: 2 bytes x stage params, sharded only at ZeRO-3."""
    p = params.stage_params_per_rank(m, tp, pp, ep)
    share = params.expert_share(m, tp, pp, ep)
    return WEIGHT_BYTES * _sharded(m, p, zero, dp_shard, cp, ep, share, 3)


def grads_bytes(m: ModelSpec, *, tp, pp, ep, zero, dp_shard, cp):
    """bf16 gradients: 2 bytes x stage params, sharded from ZeRO-2."""
    p = params.stage_params_per_rank(m, tp, pp, ep)
    share = params.expert_share(m, tp, pp, ep)
    return GRAD_BYTES * _sharded(m, p, zero, dp_shard, cp, ep, share, 2)


def optimizer_bytes(m: ModelSpec, *, tp, pp, ep, zero, dp_shard, cp):
    """fp32 master weights, Adam m and v: 12 bytes x stage params, sharded from ZeRO-1."""
    p = params.stage_params_per_rank(m, tp, pp, ep)
    share = params.expert_share(m, tp, pp, ep)
    return OPTIMIZER_BYTES * _sharded(m, p, zero, dp_shard, cp, ep, share, 1)


def activation_elements_per_token_per_layer(m: ModelSpec, *, tp, recompute, sequence_parallel):
    """Elements one block keeps for backward per token, derived tensor by tensor.

    Flash attention (no s x s scores kept), SwiGLU and GQA; the tensors, after
    Korthikanti et al. 2022 (sec. 4) re-derived for this block:
    - norms: the two norm inputs, 2 h (split over tp with sequence parallel),
      and the two norm outputs that feed linears, 2 h whole: with sequence
      parallel the column-parallel linears save their all-gathered input, as
      PyTorch's DTensor `SequenceParallel` + `PrepareModuleInput` do (the
      launch path, torchtitan); Megatron's re-gather in backward (Korthikanti
      sec. 4.2.2, which would make these 2 h / t too) is not assumed;
    - attention: q, k, v and the output o that flash attention saves,
      2 h + 2 h_kv, heads split over tp;
    - MLP: gate, up, act(gate) and the product, 4 f per routed expert (GELU:
      2 f), split over tp; MoE adds the permuted input and output, 2 h top_k.
    Selective recompute keeps the two block inputs, q, k, v, o and the gate
    and up outputs, redoing norms and the activation; with sequence parallel
    it also keeps the two all-gathered norm outputs (collective outputs are
    saved, `bench.parallelize._SAVE_OPS`). Full recompute keeps only the
    block input, h.
    """
    h, kv, f = m.hidden, m.kv_dim, m.ffn
    tp = np.asarray(tp)
    sp = np.asarray(sequence_parallel) & (tp > 1)
    sp_div = np.where(sp, tp, 1)
    mlp_per_f = 4.0 if m.mlp == "swiglu" else 2.0
    moe = 2.0 * h * m.top_k / tp if m.is_moe else 0.0
    attn = (2.0 * h + 2.0 * kv) / tp
    none = 2.0 * h / sp_div + 2.0 * h + attn + mlp_per_f * f * m.top_k / tp + moe
    selective = 2.0 * h / sp_div + np.where(sp, 2.0 * h, 0.0) + attn \
        + 2.0 * f * m.top_k / tp + moe
    full = 1.0 * h / sp_div
    recompute = np.asarray(recompute)
    return np.where(recompute == FULL, full, np.where(recompute == SELECTIVE, selective, none))


def layer_activation_bytes(m: ModelSpec, *, seq_len, micro_batch, tp, cp, recompute,
                           sequence_parallel):
    """bf16 bytes one block keeps for one micro-batch on one rank (tokens = b s / cp)."""
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    elements = activation_elements_per_token_per_layer(
        m, tp=tp, recompute=recompute, sequence_parallel=sequence_parallel)
    return BF16 * tokens * elements


def microbatches_in_flight(pp, grad_accum, schedule_code, pp_virtual):
    """Micro-batches whose activations the first stage holds at the peak.

    No pipeline: 1 (accumulation runs micro-batches one after another).
    GPipe: all m. 1F1B: min(p, m) (Narayanan et al. 2021, sec. 2.2).
    Interleaved 1F1B with v chunks: min(p, m) x (1 + (p - 1) / (p v))
    (Korthikanti et al. 2022, sec. 4.2.3).
    Schedule codes: 0 = 1F1B, 1 = interleaved, 2 = GPipe.
    """
    pp, m_ = np.asarray(pp, dtype=float), np.asarray(grad_accum, dtype=float)
    base = np.minimum(pp, m_)
    interleaved = base * (1.0 + (pp - 1.0) / (pp * np.asarray(pp_virtual)))
    in_flight = np.where(schedule_code == 2, m_, np.where(schedule_code == 1, interleaved, base))
    return np.where(pp > 1, in_flight, 1.0)


def logits_bytes(m: ModelSpec, *, seq_len, micro_batch, tp, cp):
    """Output logits and loss on the last stage: 10 bytes per logit, vocab-parallel.

    bf16 logits (2) + their fp32 upcast for the loss (4) + fp32 gradient (4)
    for b s / cp tokens x V / tp columns.
    """
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    return 10.0 * tokens * m.vocab / np.asarray(tp)


def compiled_logits_bytes(m: ModelSpec, *, seq_len, micro_batch, tp, cp):
    """Output logits and loss on the last stage when the loss is compiled: 4 bytes per logit.

    Inductor fuses `F.cross_entropy(logits.float())` (the harness compiles it:
    `bench.harness.step.loss_function`) into one forward reduction (per-row fp32
    log-sum-exp, b s / cp x 4 bytes: negligible) and one backward kernel that
    writes the gradient in the logits' dtype. What is live at the head's peak
    is then the bf16 logits saved for backward (2) and their bf16 gradient (2),
    for b s / cp tokens x V / tp columns; the fp32 copy, softmax and fp32
    gradient of the unfused path (`logits_bytes`) never reach HBM.
    """
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    return 4.0 * tokens * m.vocab / np.asarray(tp)


def fused_logits_bytes(m: ModelSpec, *, seq_len, micro_batch, cp, chunk=FUSED_CHUNK):
    """Output layer and loss fused and chunked (`bench.harness.loss`, `--loss fused`).

    Per chunk of c = min(chunk, b s / cp) tokens: bf16 logits (2), their fp32
    upcast (4), the fp32 softmax turned gradient (4) and its bf16 cast (2), 12 c V
    bytes, freed before the next chunk; held to the backward: the gradient of the
    hidden states (2 b s / cp H) and of the output weight, accumulated in fp32 and
    kept in bf16 (6 V H). No tensor parallel (the harness refuses it). Not measured.
    """
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    chunk_tokens = np.minimum(chunk, tokens)
    return 12.0 * chunk_tokens * m.vocab + 2.0 * tokens * m.hidden + 6.0 * m.vocab * m.hidden


def fused_loss_on(loss: str, *, tp, pp, cp):
    """Where `loss` ("standard" | "fused") is priced as the fused loss: asked for, and on a
    layout the harness builds it on (no tensor, pipeline or context parallel:
    `bench.harness.loss.check`); elsewhere the standard loss. A boolean per layout."""
    if loss not in LOSSES:
        raise SpecError(f"loss = {loss!r} is not valid; use one of {list(LOSSES)}")
    one = (np.asarray(tp) == 1) & (np.asarray(pp) == 1) & (np.asarray(cp) == 1)
    return one & (loss == "fused")


def head_peak_bytes(m: ModelSpec, *, seq_len, micro_batch, tp, cp, compiled_loss,
                    logits_scale=1.0, fused_loss=False):
    """The head's peak bytes: `fused_logits_bytes` for the fused loss, else
    `compiled_logits_bytes` if the loss is compiled, else `logits_scale` x `logits_bytes`
    (the scale is measured on the unfused, eager head)."""
    kw = dict(seq_len=seq_len, micro_batch=micro_batch, tp=tp, cp=cp)
    return np.where(fused_loss, fused_logits_bytes(m, seq_len=seq_len, micro_batch=micro_batch,
                                                   cp=cp),
                    np.where(compiled_loss, compiled_logits_bytes(m, **kw),
                             logits_scale * logits_bytes(m, **kw)))


def layer_kept_bytes(m: ModelSpec, *, seq_len, micro_batch, tp, cp, recompute,
                     sequence_parallel, scale=1.0, path=rt.FSDP, compiled=True, ep=1,
                     fp8_kept=NO_FP8):
    """Bytes one block keeps for one micro-batch on the harness's precision `path`: the
    analytic `layer_activation_bytes` at the measured `scale` (plus DDP's split graph,
    `memory_runtime.ddp_split_scale`), the autocast path's fp32 block input per token and
    its bf16 weight casts (`memory_runtime.autocast_token_bytes`, `weight_copy_bytes`).
    fp8 (`fp8_kept`, (ratio, converted share): `cost.fp8.kept_scale`, `converted_share`)
    scales all but the weight casts by the measured ratio and drops the converted weights'.
    The per-layer term of `activation_bytes`; `trainplan.calibrate.memory` prices a
    microbenchmark's blocks with it."""
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    analytic = layer_activation_bytes(m, seq_len=seq_len, micro_batch=micro_batch, tp=tp, cp=cp,
                                      recompute=recompute, sequence_parallel=sequence_parallel)
    ratio, converted = fp8_kept
    return ratio * ((scale + rt.ddp_split_scale(path, compiled)) * analytic
                    + tokens * rt.autocast_token_bytes(m, path=path, tp=tp,
                                                       sequence_parallel=sequence_parallel)) \
        + (1.0 - converted) * rt.weight_copy_bytes(m, path=path, tp=tp, ep=ep,
                                                   recompute=recompute)


def sequence_parallel_on(L: Layouts):
    """Where sequence parallel acts: asked for and tensor parallel (it needs tp > 1)."""
    return L.sequence_parallel & (L.tp > 1)


def activation_bytes(m: ModelSpec, L: Layouts, *, seq_len, scale=1.0, full_scale=1.0,
                     logits_scale=1.0, compiled_loss=False, path=None, compiled=None,
                     fused_loss=False, fp8_kept=NO_FP8, allocator=rt.EXPANDABLE):
    """Peak activation bytes on the worst stage of each layout in `L`: the first (most in
    flight) or the last (logits).

    Full recompute also rebuilds one block's complete activations during its
    backward, so one such block is added on top of the blocks' kept bytes. Under the
    EXPANDABLE allocator it stands beside the head's logits, not with them: the loss and
    the output layer's backward free the logits before the last block is rebuilt, and
    the segment lends their pages to it. The caching allocator strands freed segments
    in other sizes (`memory_runtime.fragmentation_bytes`), so there both count (`allocator`:
    `memory_runtime.ALLOCATORS`). Context parallel's compiled blocks each
    keep the gathered K, V (`ring.ring_kept_bytes`), and the ring holds its buffers
    during a block's backward (`ring.ring_peak_bytes`): the last stage's peak is the
    larger of the head's logits and the ring's buffers (with the rebuilt block, under
    EXPANDABLE). `scale` (and `full_scale`
    for the rebuilt block) are the measured kept / analytic bytes of a block,
    `logits_scale` the eager head's measured peak / analytic logits bytes
    (`trainplan.calibrate.pieces`; 1 when uncalibrated); a compiled loss is
    priced by `compiled_logits_bytes` instead, the fused loss (`fused_loss`) by
    `fused_logits_bytes` (`head_peak_bytes`).

    `path` (`memory_runtime.harness_path`; None = the analytic terms alone) adds
    what the harness's precision path keeps on top, each term in `memory_runtime`:
    the fp32 block input and the DDP graph split per token, the blocks' bf16
    weight casts per micro-batch in flight, the head's inputs, and the
    pipeline's receive buffers. `fp8_kept`: as `layer_kept_bytes` takes it.
    """
    tp, pp, cp, ep = L.tp, L.pp, L.cp, L.ep
    micro_batch, grad_accum, recompute = L.micro_batch, L.grad_accum, L.recompute
    sequence_parallel = sequence_parallel_on(L)
    extras = path is not None
    path = rt.FSDP if path is None else path
    compiled = compiled_loss if compiled is None else compiled
    layers = m.n_layers / np.asarray(pp)
    kw = dict(seq_len=seq_len, micro_batch=micro_batch, tp=tp, cp=cp,
              sequence_parallel=sequence_parallel)
    full = np.asarray(recompute) == FULL
    ring_kw = dict(seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp, compiled=compiled,
                   recompute_full=full)
    # context parallel: compiled blocks keep the gathered K, V (`ring.ring_kept_bytes`)
    per_layer = layer_kept_bytes(m, recompute=recompute, scale=scale, path=path,
                                 compiled=compiled, ep=ep, fp8_kept=fp8_kept, **kw) \
        + ring.ring_kept_bytes(m, **ring_kw)
    rebuilt = np.where(full,
                       full_scale * layer_activation_bytes(m, recompute=0, **kw), 0.0)
    in_flight = microbatches_in_flight(pp, grad_accum, L.pp_schedule, L.pp_virtual)
    head_tp = np.where(np.asarray(tp) > 1, 1, tp) if extras else tp  # `head_input_bytes`
    logits = head_peak_bytes(m, seq_len=seq_len, micro_batch=micro_batch, tp=head_tp, cp=cp,
                             compiled_loss=compiled_loss, logits_scale=logits_scale,
                             fused_loss=fused_loss) \
        + extras * rt.head_input_bytes(m, path=path, seq_len=seq_len, micro_batch=micro_batch,
                                       tp=tp, cp=cp) \
        + extras * rt.replicate_gather_bytes(m, seq_len=seq_len, micro_batch=micro_batch, tp=tp,
                                             cp=cp)
    buffers = extras * rt.pp_buffer_bytes(m, path=path, seq_len=seq_len, micro_batch=micro_batch,
                                          grad_accum=grad_accum, tp=tp, cp=cp, pp=pp,
                                          sequence_parallel=sequence_parallel,
                                          pp_virtual=L.pp_virtual)
    # context parallel: the ring's buffers during a block's backward, when every block's
    # activations are held and the head's logits are already freed (`ring.ring_peak_bytes`)
    ring_peak = ring.ring_peak_bytes(m, **ring_kw)
    first = per_layer * layers * in_flight + rebuilt + buffers + ring_peak
    beside = np.where(allocator == rt.EXPANDABLE, rebuilt, 0.0)  # the logits' pages reused
    last = per_layer * layers + rebuilt - beside + np.maximum(logits, beside + ring_peak) \
        + buffers
    return np.where(np.asarray(pp) > 1, np.maximum(first, last), last)


def buffer_bytes(m: ModelSpec, *, tp, pp, ep, zero, dp, dp_shard, cp):
    """Communication buffers, stated as such.

    ZeRO-3 gathers the current and the prefetched block in bf16 (2 x 2 bytes x
    block params) and reduce-scatters one block's fp32 gradient (4 bytes);
    ZeRO-1/2 keep the fp32 reduce buffer of one block. DDP's reducer copies
    every fp32 gradient into its buckets (4 bytes x the stage's params: PyTorch
    DDP with its default gradient_as_bucket_view=False; Li et al. 2020, sec.
    4.2); one replica has no reducer. A ZeRO stage over a group of one rank
    shards nothing and is priced as DDP.
    """
    block = params.layer_params_per_rank(m, tp, ep)
    stage = params.stage_params_per_rank(m, tp, pp, ep)
    zero = np.where(np.asarray(dp_shard) * np.asarray(cp) > 1, zero, 0)
    ddp = np.where(np.asarray(dp) * np.asarray(cp) > 1, 4.0 * stage, 0.0)
    return np.where(zero == 3, 8.0 * block, np.where(zero >= 1, 4.0 * block, ddp))


def grads_at_peak(grads, activations, *, grad_accum, pp):
    """Gradient bytes live at the step's memory peak.

    They outlive a micro-batch where gradients accumulate (grad_accum > 1) or
    a pipeline interleaves forwards with backwards (pp > 1): all of them
    count. Otherwise the step starts with none (the harness's
    `zero_grad(set_to_none=True)`), and backward creates them block by block
    as it frees that block's activations, so the peak is at one end of
    backward: activations with no gradients, or gradients with no
    activations; what gradients add over the activations is max(0, G - A).
    """
    accumulates = (np.asarray(grad_accum) > 1) | (np.asarray(pp) > 1)
    return np.where(accumulates, grads, np.maximum(grads - activations, 0.0))


def breakdown(m: ModelSpec, L: Layouts, *, seq_len, activation_scale=1.0, rebuilt_scale=1.0,
              logits_scale=1.0, compiled_loss=False, compiled=None, gpu=None,
              fused_loss=False, fp8_kept=NO_FP8, allocator=rt.EXPANDABLE) -> dict:
    """Bytes per GPU at the step's peak of each layout in `L`, by term: params, grads,
    optimizer, activations, other, total.

    The terms are those of the harness's precision path
    (`memory_runtime.harness_path`): FSDP2 (fp32 shards, bf16 unsharded
    copies), or fp32 weights under autocast (one data-parallel rank, DDP; one GPU with a
    bf16 stream).
    `grads` are those live at the peak (`grads_at_peak`). `other` is the
    communication buffers (`buffer_bytes`), the memory FSDP2's side streams
    hold reserved (`memory_runtime.stream_pool_bytes`), the compute stream's segment
    for FSDP2's root reduce-scatter input (`memory_runtime.root_reduce_bytes`) and its
    fragmentation (`memory_runtime.fragmentation_bytes`, at the card `gpu`'s
    measured `fragmentation_scales` for the layout's wrapper; None or none measured:
    `memory_runtime.FRAGMENTATION`): the peak is `torch.cuda.max_memory_reserved`.
    Memory outside PyTorch's allocator (NON_ALLOCATOR_GIB) is subtracted from the card
    instead, in `fits`. `compiled` (default: `compiled_loss`) says the blocks run compiled;
    `fused_loss` that the loss is the harness's `--loss fused` (`fused_logits_bytes`);
    `fp8_kept` what fp8 does to a block's kept bytes (`layer_kept_bytes`); `allocator` the
    caching allocator's mode (`memory_runtime.ALLOCATORS`; the root segment and the
    fragmentation are the caching mode's only).
    """
    dp, tp, pp, cp, ep, zero, dp_shard = L.dp, L.tp, L.pp, L.cp, L.ep, L.zero, L.dp_shard
    grad_accum = L.grad_accum
    path = rt.harness_path(dp, tp, pp, zero, cp)
    sharding = dict(tp=tp, pp=pp, ep=ep, zero=zero, dp_shard=dp_shard, cp=cp)
    activations = activation_bytes(
        m, L, seq_len=seq_len, scale=activation_scale, full_scale=rebuilt_scale,
        logits_scale=logits_scale, compiled_loss=compiled_loss, path=path, compiled=compiled,
        fused_loss=fused_loss, fp8_kept=fp8_kept, allocator=allocator)
    weights, optimizer = rt.state_bytes(m, path=path, **sharding)
    grads = rt.grad_bytes(m, path=path, grad_accum=grad_accum, **sharding)
    terms = {
        "params": weights,
        "grads": grads_at_peak(grads, activations, grad_accum=grad_accum, pp=pp),
        "optimizer": optimizer,
        "activations": activations,
    }
    buffers = buffer_bytes(m, tp=tp, pp=pp, ep=ep, zero=zero, dp=dp, dp_shard=dp_shard, cp=cp)
    buffers = np.where(path == rt.FSDP, buffers, np.where(path == rt.DDP, buffers, 0.0))
    head = rt.head_block_bytes(m, seq_len=seq_len, micro_batch=L.micro_batch, cp=cp,
                               compiled_loss=compiled_loss)
    reserved = rt.stream_pool_bytes(m, path=path, **sharding) \
        + rt.root_reduce_bytes(m, path=path, head_block=head, allocator=allocator, **sharding) \
        + rt.fragmentation_bytes(activations, gpu, tp=tp, fsdp=path == rt.FSDP, zero=zero,
                                 allocator=allocator)
    terms["other"] = buffers + reserved
    terms["total"] = sum(terms.values())
    return terms


def fits(total_bytes, memory_gib: float):
    """True where the total stays within the card less what lives outside the allocator."""
    return np.asarray(total_bytes) <= (memory_gib - NON_ALLOCATOR_GIB) * 2**30
