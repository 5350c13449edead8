"""What the harness really keeps at the memory peak, beyond the ZeRO bookkeeping of `memory`.

`bench.parallelize.parallelize` runs one of four precision paths, and each
keeps different tensors:

- FSDP2 (dp > 1 with zero > 0, or beside tp / pp): fp32 sharded parameters,
  bf16 unsharded copies gathered per block (`MixedPrecisionPolicy(bf16,
  reduce fp32)`), a bf16 residual stream;
- autocast (one data-parallel rank: TP or PP alone): fp32 parameters under
  `torch.autocast(bf16)`, so the embedding's output and the residual stream
  are fp32 and each compiled block casts its weights to bf16 inside its
  graph, keeping the casts for backward;
- one GPU: the autocast path with the stream cast to bf16 after the
  embedding (`Transformer.autocast_stream`), the model compiled whole;
- DDP (dp > 1, zero 0, tp = pp = 1): the autocast path inside
  `DistributedDataParallel`, whose DDPOptimizer splits each compiled block's
  graph at bucket boundaries.

Each function returns bytes on the busiest rank and takes numpy arrays or
scalars. The two measured constants below come from microbenchmark records
(never from the end-to-end runs they are compared with).
"""

from __future__ import annotations

import numpy as np

from trainplan.cost import params
from trainplan.cost.compute import BF16, NONE, fsdp_layout
from trainplan.cost.measured import per_wrapper
from trainplan.specs import ModelSpec
from trainplan.specs.layouts import shard_degree

FSDP, AUTOCAST, DDP, SINGLE = 0, 1, 2, 3  # precision paths (`harness_path`)

# Extra bytes a DDP-wrapped compiled block keeps per token, over the same block
# unwrapped, as a share of `memory.layer_activation_bytes` (76,800 B/token for
# llama-1.3b): (99,432.06 - 76,136.06) / 76,800 = 0.3033. Source: the
# autocast-fp32 compiled block records with and without `wrapper: ddp,
# optimize_ddp: true`, data/measurements/micro-layouts-h200x4host-20261126.jsonl
# (records 3 and 4); with optimize_ddp false the wrapped block keeps the same
# bytes as the plain one, so the extra is the graph split, not the wrapper.
DDP_SPLIT_SCALE = 0.3033

# Share of the activation bytes the caching allocator holds reserved but not
# allocated on the compute stream (split blocks that later, differently sized
# activations and temporaries cannot reuse). An assumption, applied to the bytes
# that are freed and reallocated every micro-batch only (see `fragmentation_bytes`);
# the fallback wherever the card has no measured `GPUSpec.fragmentation_scales`.
FRAGMENTATION = 0.08

# The CUDA caching allocator's two modes (PYTORCH_CUDA_ALLOC_CONF), as `allocator_of`
# reads them: "expandable" (expandable_segments:True, what trainplan's harness, `train`
# and launch scripts set: one segment per stream that grows by mapping pages) and
# "caching" (the default: one cudaMalloc segment per large request, split and never merged).
EXPANDABLE, CACHING = "expandable", "caching"
ALLOCATORS = (EXPANDABLE, CACHING)
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# read in this order by the CUDA allocator (c10/cuda/CUDAAllocatorConfig.h): the first one set
ALLOC_CONF_ENVS = (ALLOC_CONF_ENV, "PYTORCH_ALLOC_CONF")
EXPANDABLE_CONF = "expandable_segments:True"


def allocator_of(env, unset: str = CACHING) -> str:
    """The allocator mode of a process whose environment was `env` (a dict; a record's
    `provenance.env`): EXPANDABLE where the allocator's setting (PYTORCH_CUDA_ALLOC_CONF, else
    PYTORCH_ALLOC_CONF: `ALLOC_CONF_ENVS`) names expandable_segments:True, CACHING where
    it is set without it (a cudaMallocAsync backend included), `unset` where neither is set
    or `env` is None. Records: unset is CACHING (trainplan's processes record the setting
    since they make it). A process about to launch trainplan's harness: unset is EXPANDABLE
    (`bench.harness.host.allocator_env` sets it there unless the user did)."""
    conf = next((env[k] for k in ALLOC_CONF_ENVS if k in (env or {})), None)
    if conf is None:
        return unset
    opts = dict(kv.split(":", 1) for kv in str(conf).replace(" ", "").split(",") if ":" in kv)
    return EXPANDABLE if opts.get("expandable_segments") == "True" else CACHING  # c10's spelling


def harness_path(dp, tp, pp, zero, cp=1):
    """FSDP, AUTOCAST, DDP or SINGLE per layout, as `bench.parallelize.parallelize` chooses:
    FSDP2 where cp > 1 or dp > 1 and (zero > 0 or tp > 1 or pp > 1), DDP where dp > 1
    otherwise, SINGLE on one GPU, else the autocast path (TP or PP alone)."""
    dp, tp, pp, zero, cp = (np.asarray(a) for a in (dp, tp, pp, zero, cp))
    if np.any(dp < 1) or np.any(tp < 1) or np.any(pp < 1) or np.any(zero < 0):
        raise ValueError(f"dp, tp, pp must be >= 1 and zero >= 0; got dp={dp}, tp={tp}, "
                         f"pp={pp}, zero={zero}")
    fsdp = fsdp_layout(dp, zero, tp, pp, cp)
    one = (dp == 1) & (tp == 1) & (pp == 1) & (np.asarray(cp) == 1)
    return np.where(fsdp, FSDP, np.where(dp > 1, DDP, np.where(one, SINGLE, AUTOCAST)))


def fp32_stream(path):
    """True where the residual stream is fp32: the autocast and DDP paths, where the
    embedding's output is fp32 and `x + bf16` promotes to fp32; FSDP2's bf16 weights and
    one GPU's cast after the embedding make it bf16."""
    return (np.asarray(path) == AUTOCAST) | (np.asarray(path) == DDP)


def stream_bytes(path):
    """Bytes per element of the residual stream: 4 where it is fp32 (`fp32_stream`), else 2."""
    return np.where(fp32_stream(path), 4.0, 2.0)


def state_bytes(m: ModelSpec, *, path, tp, pp, ep, zero, dp_shard, cp):
    """(weights, optimizer) bytes that live through the step on the path's terms.

    FSDP2: the fp32 shard 4 S / d, plus the bf16 unsharded copy 2 S below ZeRO-3
    (`reshard_after_forward=False` keeps it from forward to backward); Adam's m and
    v 8 S / d. Autocast and DDP: fp32 weights 4 S, which are the master copy, and
    Adam 8 S. S = the stage's parameters on this rank, d = the shard degree
    (`memory.shard_degree`, 1 below ZeRO-1). Source: torch.distributed.fsdp
    `fully_shard` and `MixedPrecisionPolicy`; torch.optim.AdamW (fused).
    """

    s = params.stage_params_per_rank(m, tp, pp, ep)
    d = np.where(np.asarray(path) == FSDP, shard_degree(zero, dp_shard, cp, 1), 1)
    unsharded = np.where((np.asarray(path) == FSDP) & (np.asarray(zero) < 3), 2.0 * s, 0.0)
    return 4.0 * s / d + unsharded, 8.0 * s / d


def grad_bytes(m: ModelSpec, *, path, tp, pp, ep, zero, dp_shard, cp, grad_accum):
    """fp32 gradients: 4 S / d sharded under FSDP2, 4 S elsewhere.

    FSDP2 below ZeRO-3 with more than one micro-batch (grad_accum > 1, or any
    pipeline: the schedule turns gradient sync off until the last backward)
    accumulates unsharded gradients upcast to the fp32 reduce dtype, 4 S
    (`FSDPParam.to_accumulated_grad_if_needed`; torch.distributed.pipelining
    `backward_maybe_with_nosync`).
    """

    s = params.stage_params_per_rank(m, tp, pp, ep)
    fsdp = np.asarray(path) == FSDP
    d = np.where(fsdp, shard_degree(zero, dp_shard, cp, 2), 1)
    no_sync = fsdp & (np.asarray(zero) < 3) & ((np.asarray(grad_accum) > 1) | (np.asarray(pp) > 1))
    return np.where(no_sync, 4.0 * s, 4.0 * s / d)


def autocast_token_bytes(m: ModelSpec, *, path, tp, sequence_parallel):
    """Extra bytes per token per block where the stream is fp32 (`fp32_stream`): the block
    input saved in fp32, 2 bytes x h (over bf16), split over tp with sequence parallel.

    The autocast-fp32 compiled block keeps 76,136 B/token against 65,864 for bf16
    weights (micro-layouts-h200x4host-20261126.jsonl record 3; calibration block
    check): 4,096 = 2 h of this term, plus 6,176.5 = `weight_copy_bytes` / tokens.
    """
    tp = np.asarray(tp)
    sp_div = np.where(np.asarray(sequence_parallel) & (tp > 1), tp, 1)
    return np.where(fp32_stream(path), 2.0 * m.hidden / sp_div, 0.0)


def weight_copy_bytes(m: ModelSpec, *, path, tp, ep, recompute):
    """bf16 copies of one block's weights that its compiled graph keeps for backward, per
    micro-batch in flight: 2 bytes x the block's parameters on this rank.

    Under autocast the fp32 -> bf16 casts are inside each block's graph and the
    partitioner saves them for the weight-gradient matmuls; without recompute
    they make up the rest of the autocast block's extra bytes (6,176.5 B/token x
    16,384 tokens = 2 x 50,597,888 parameters, to 0.01 %). With recompute the
    casts are redone in backward (`bench.parallelize.save_policy` does not save
    them; full recompute keeps only the block input). FSDP2 gathers bf16
    weights that it frees itself: none here.
    """
    block = params.layer_params_per_rank(m, tp, ep)
    keeps = (np.asarray(path) != FSDP) & (np.asarray(recompute) == NONE)
    return np.where(keeps, BF16 * block, 0.0)


def ddp_split_scale(path, compiled):
    """`DDP_SPLIT_SCALE` where a compiled block runs inside DDP (DDPOptimizer splits its
    graph at bucket boundaries, so the partitioner saves what it would otherwise
    recompute); 0 elsewhere."""
    return np.where((np.asarray(path) == DDP) & np.asarray(compiled), DDP_SPLIT_SCALE, 0.0)


def head_input_bytes(m: ModelSpec, *, path, seq_len, micro_batch, tp, cp):
    """The head's inputs kept for backward, on the last stage.

    The final norm saves its input (the stream: 2 or 4 bytes x h per token) and the
    output layer its bf16 input (2 x h). Under autocast the output weight's bf16
    cast also stays in autocast's cache until the region exits (2 x V h / tp;
    `torch.autocast` caches casts of leaf weights). Under tensor parallel the
    output layer's `ColwiseParallel(output_layouts=Replicate())` hands the loss
    whole logits (`bench.parallelize.apply_tp`), which `memory` prices per rank.
    """
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    cache = np.where(np.asarray(path) == FSDP, 0.0, BF16 * m.vocab * m.hidden / np.asarray(tp))
    return tokens * m.hidden * (stream_bytes(path) + BF16) + cache


def replicate_gather_bytes(m: ModelSpec, *, seq_len, micro_batch, tp, cp):
    """The second whole copy of the logits while tensor parallel hands the loss Replicate
    logits (`head_input_bytes`), bytes: DTensor's Shard(-1) -> Replicate all-gathers the
    vocabulary shards along dim 0 into one buffer and concatenates its chunks along the
    vocabulary into another (torch.distributed._functional_collectives.all_gather_tensor),
    both whole, 2 bytes x b s / cp x V, until the first is freed. 0 without tensor parallel.
    Derived from that code. A check: in validate-h200x4-20261129/ (4 x H200) 8 of the 9 TP
    configs' measured peaks exceed the peak priced without this term by 0.89-1.18 x it.
    """
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    return np.where(np.asarray(tp) > 1, BF16 * tokens * m.vocab, 0.0)


def pp_buffer_bytes(m: ModelSpec, *, path, seq_len, micro_batch, grad_accum, tp, cp, pp,
                    sequence_parallel, pp_virtual=1):
    """Receive buffers the first (or last) pipeline rank allocates once per micro-batch and
    keeps, bytes.

    `PipelineStage` makes one activation-receive buffer per micro-batch on every
    stage but the first and one gradient-receive buffer per micro-batch on every
    stage but the last (torch.distributed.pipelining.stage:
    `_setup_backward_recv_info`, `_prepare_forward_infra`), each the size of the
    stage boundary: tokens x h (/ tp with sequence parallel) in the stream's
    dtype. The first rank holds grad_accum of them per set; with v virtual stages
    (interleaved) it runs v stages, the first one and v - 1 inner ones, so 2 v - 1
    sets (the last rank alike). On 4 x H200 (validate-h200x4-20261129/), PP 4 x 2
    virtual at the 1.3B width, m = 16, rank 0 allocated 1.4 GiB over the peak priced
    with one set; the two sets more are 1.0 GiB of it. 0 without a pipeline.
    """
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    tp = np.asarray(tp)
    sp_div = np.where(np.asarray(sequence_parallel) & (tp > 1), tp, 1)
    boundary = tokens * m.hidden / sp_div * stream_bytes(path)
    sets = 2.0 * np.asarray(pp_virtual) - 1.0
    return np.where(np.asarray(pp) > 1, sets * np.asarray(grad_accum) * boundary, 0.0)


def root_group_params_per_rank(m: ModelSpec, tp, pp, ep):
    """Parameters of the stage's root FSDP group on one rank: what `stage_params_per_rank`
    holds outside the blocks (input table, final norm, output layer; vocab-parallel over tp).
    `bench.parallelize.apply_fsdp` shards each block, then the model as one root group."""
    blocks = (m.n_layers / np.asarray(pp)) * params.layer_params_per_rank(m, tp, ep)
    return params.stage_params_per_rank(m, tp, pp, ep) - blocks


def stream_pool_bytes(m: ModelSpec, *, path, tp, pp, ep, zero, dp_shard, cp):
    """Memory FSDP2's side streams hold reserved, which the compute stream cannot reuse.

    The caching allocator keeps free blocks per stream (a block is reused only
    by requests on the stream it was allocated on). Two side pools:

    - reduce-scatter stream: FSDP2 allocates the reduce-scatter output there
      and makes the sharded fp32 gradients views into it (`foreach_reduce`),
      so the pool holds 4 S / d through the next forward, after
      `zero_grad(set_to_none=True)` freed the gradients;
    - all-gather copy-in stream: `foreach_all_gather` casts each fp32 shard to
      bf16 (X / d for a group of X parameters), allocates the whole bf16
      all-gather output there (X) and frees the casts; an output is freed
      once the next gather has been issued. Forward starts with the root
      group's gather (casts R / d, then output R); the allocator's best fit
      then places each block's casts and output in what is free, else past
      the end. Where B (1 + 1 / d) <= R / d, the first block's casts and
      output fit where the root's casts were and the pool is 2 bytes x
      (R + R / d). Else, where B <= R, the first block's output goes past the
      end and every later gather fits: 2 bytes x (R + R / d + B). Where a
      block outweighs the root, its casts go there too (+ B / d), and the
      second block's output, where the stage holds one and B > R + R / d,
      fits in nothing freed before it (+ B).
      A check, not a fit: rank 0's copy-in pool (`memory_pools`) is this within
      0.03 GiB on every FSDP2 config of validate-h200x4-20261129/ (1.3B, 8B,
      13B and 70B widths, d = 2, 4; 70B: 4.82 GiB measured under ZeRO-3, 2.73
      under TP 2 x FSDP 2, 3.13 on a one-block pipeline stage; 8B at d = 2:
      1.48 and 2.95, where the root's freed casts hold the first block) and
      of proxy-h100x4-20261126c-measurements.jsonl; the caching allocator's
      pools in proxy-h200x4-20261128b-measurements.jsonl are the same within
      0.01 GiB.

    S = the stage's parameters on this rank, B = one block's, R = the root
    group's (`root_group_params_per_rank`), d = the shard degree. Source:
    torch.distributed.fsdp._fully_shard._fsdp_collectives (`foreach_all_gather`,
    `foreach_reduce`), c10/cuda/CUDACachingAllocator.cpp (per-stream pools).
    0 off FSDP2 or with a shard group of one.
    """

    s = params.stage_params_per_rank(m, tp, pp, ep)
    block = params.layer_params_per_rank(m, tp, ep)
    root = root_group_params_per_rank(m, tp, pp, ep)
    d = shard_degree(zero, dp_shard, cp, 1)
    on = (np.asarray(path) == FSDP) & (d > 1)
    in_casts = block * (1.0 + 1.0 / d) <= root / d  # the first block where the root's casts were
    outweighs = block > root
    second = outweighs & (block > root * (1.0 + 1.0 / d)) & (m.n_layers / np.asarray(pp) >= 2)
    copy_in = BF16 * (root + root / d + np.where(in_casts, 0.0, block)
                      + np.where(outweighs, block / d, 0.0) + np.where(second, block, 0.0))
    return np.where(on, 4.0 * s / d + copy_in, 0.0)


ROUND_LARGE = 2 * 2**20  # bytes: the caching allocator rounds large segments to 2 MiB


def head_block_bytes(m: ModelSpec, *, seq_len, micro_batch, cp, compiled_loss):
    """The largest single block the head frees before the end of backward: the logits of
    b s / cp tokens x V, whole on every rank (the loss takes Replicate logits under tensor
    parallel, `head_input_bytes`), in bf16 (2 bytes) when the loss is compiled, else their
    fp32 upcast (4 bytes; `memory.logits_bytes`). Bytes."""
    tokens = np.asarray(micro_batch) * seq_len / np.asarray(cp)
    return np.where(np.asarray(compiled_loss), 2.0, 4.0) * tokens * m.vocab


def root_reduce_bytes(m: ModelSpec, *, path, tp, pp, ep, zero, dp_shard, cp, head_block,
                      allocator=CACHING):
    """Compute-stream reserve of the root group's fp32 reduce-scatter input, 4 R bytes.

    FSDP2 reduces the root group (input table, final norm, output layer:
    `root_group_params_per_rank`, R on this rank before sharding) last, from
    `_root_post_backward_final_callback` on the compute stream, and `foreach_reduce`
    allocates its reduce-scatter input there, unsharded in the fp32 reduce dtype:
    4 R bytes in one block. The blocks' own inputs (4 B) are priced in
    `memory.buffer_bytes`; R is 5.5 B at llama3-8b's 128k vocabulary (1.05 G
    parameters: 3.9 GiB), where the root's input is the largest block of the step.
    The allocator never merges segments, so the block needs a segment of its own
    unless one freed block before it holds it: the largest is the head's logits
    (`head_block_bytes`, L); by best fit the next step's head takes its own
    segments again and this one stays idle at the peak. So 4 R where
    4 R > L + ROUND_LARGE (within one 2 MiB rounding step the two segments serve
    each other), else 0. A check, not a fit: on 4 x H200 (g8-z2-mb2-s4k, torch
    2.11) `torch.cuda.memory._snapshot()` at the peak reserved showed this
    segment, 4,010 MiB on the compute stream, wholly free (its step-1 twin 3,008
    MiB free), and the TP 2 x FSDP2 slice, where 4 R = L, none idle. Source:
    torch.distributed.fsdp._fully_shard (`_fsdp_state._root_post_backward_final_callback`,
    `_fsdp_collectives.foreach_reduce`), c10/cuda/CUDACachingAllocator.cpp (best fit,
    `kRoundLarge`). 0 off FSDP2 or with a shard group of one, and under the EXPANDABLE
    allocator, whose one segment per stream lends the freed block to the next step's head.
    """
    d = shard_degree(zero, dp_shard, cp, 1)
    on = (np.asarray(path) == FSDP) & (d > 1) & (allocator != EXPANDABLE)
    block = 4.0 * root_group_params_per_rank(m, tp, pp, ep)
    idle = block > np.asarray(head_block) + ROUND_LARGE
    return np.where(on & idle, block, 0.0)


def _stage_rows(rows, zero3: bool) -> list[tuple[str, float]]:
    """`fragmentation_scales` rows as one ZeRO stage reads them: a wrapper's "W:z3" row for
    ZeRO-3 layouts and its "W" row for the others, each taking the other stage's row where
    only that one was measured; "plain" is FRAGMENTATION where it was not measured."""
    table = {"plain": FRAGMENTATION}
    for own in (not zero3, zero3):  # the other stage's rows first, the layout's own last
        table.update({str(w).removesuffix(":z3"): float(s) for w, s in rows
                      if str(w).endswith(":z3") == own})
    return list(table.items())


def fragmentation_scale(gpu, *, tp, fsdp, zero):
    """The compute stream's reserve per byte of activations, per layout.

    `gpu.fragmentation_scales` ((wrapper, scale), ...; `trainplan.calibrate.memory`) where
    measured, read as `measured.per_wrapper` reads the host rows: "tpN+fsdp2", "tpN",
    "fsdp2" or "plain" by the layout's `tp` and whether FSDP2 wraps it (`fsdp`), with its
    fallbacks (the nearest TP degree, the other TP wrapper, then the non-TP one; "fsdp2"
    takes "plain"); ZeRO-3 layouts (`zero` 3) read the "W:z3" rows (`_stage_rows`).
    FRAGMENTATION wherever nothing applies, and everywhere when `gpu` is None or has no
    rows (the planner bit for bit as before).
    """
    rows = tuple(getattr(gpu, "fragmentation_scales", ()) or ())
    if not rows:
        return FRAGMENTATION

    return np.where(np.asarray(zero) == 3, per_wrapper(_stage_rows(rows, True), tp, fsdp),
                    per_wrapper(_stage_rows(rows, False), tp, fsdp))


def fragmentation_bytes(activations, gpu=None, *, tp=1, fsdp=False, zero=0,
                        allocator=CACHING):
    """Reserved over allocated on the compute stream: `fragmentation_scale` x the activations.

    Bytes. Weights, states and buckets are allocated once and reused exactly every
    step; activations and temporaries are freed and reallocated every micro-batch in
    other sizes and orders, and the caching allocator's best-fit splitting strands
    part of its segments (PyTorch "CUDA memory management" notes: `memory_reserved`
    vs `memory_allocated`). The scale is per wrapper where the card has
    `fragmentation_scales` (`trainplan.calibrate.memory`: the reserve's growth per
    layer in the memory-stack microbenchmark over the planner's kept bytes of one
    block), else the assumption FRAGMENTATION. 0 under the EXPANDABLE allocator: its segment
    grows by pages and a freed block is reused by any request it holds; the memory-stack
    bench at the 13B width keeps 0.03-0.08 GiB a layer beyond allocated there, 0.67 in the
    caching mode (data/measurements/allocator-h200-20261128/).
    """
    if allocator == EXPANDABLE:
        return 0.0 * np.asarray(activations)
    return fragmentation_scale(gpu, tp=tp, fsdp=fsdp, zero=zero) * np.asarray(activations)
