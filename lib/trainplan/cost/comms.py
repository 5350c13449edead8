"""Communication: bytes and seconds per collective, per parallel dimension.

Alpha-beta model: time = latency + ring bytes / bus bandwidth, where a ring
moves 2 (n-1)/n S per rank for all-reduce and (n-1)/n S for reduce-scatter,
all-gather and all-to-all (nccl-tests PERFORMANCE.md; Thakur et al. 2005).
The latency grows with log2 n, as NCCL's tree and LL protocols do for the
small messages where latency matters.

Rank order, innermost first: tp, cp, data-parallel shard, data-parallel
replicate, pp (Megatron-Core's order). A group whose consecutive span fits in
a node rides NVLink; one that spans nodes is limited by each GPU's own NIC.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trainplan.specs import ClusterSpec

REDUCE_BYTES = 4  # gradients are reduced in fp32 (reduce_dtype=float32)
GATHER_BYTES = 2  # weights are gathered in bf16

_RING = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "all_to_all": 1.0}


def ring_bytes(kind: str, nbytes, n):
    """Bytes each rank sends: 2 (n-1)/n S for all-reduce, (n-1)/n S for the others."""
    n = np.asarray(n, dtype=float)
    return _RING[kind] * (n - 1.0) / n * np.asarray(nbytes, dtype=float)


def link(cluster: ClusterSpec, span):
    """(bus bandwidth in bytes/s, latency in s) of a group spanning `span` consecutive ranks."""
    inside = np.asarray(span) <= cluster.gpus_per_node
    bw = np.where(inside, cluster.intra_node_gbps * cluster.intra_node_efficiency,
                  cluster.inter_node_gbps * cluster.inter_node_efficiency) * 1e9
    lat = np.where(inside, cluster.intra_node_latency_us, cluster.inter_node_latency_us) * 1e-6
    return bw, lat


def measured_link(cluster: ClusterSpec, kind: str, span, bw, lat):
    """(bw, lat) with a calibrated alpha-beta of `kind` for groups inside a node, if one exists.

    `cluster.collectives` holds (op, latency_us, busbw_gbps) fitted to
    microbenchmarks (trainplan.calibrate.fit); ops without a fit keep the cluster's.
    """
    for op, latency_us, busbw_gbps in cluster.collectives:
        if op == kind:
            inside = np.asarray(span) <= cluster.gpus_per_node
            return (np.where(inside, busbw_gbps * 1e9, bw),
                    np.where(inside, latency_us * 1e-6, lat))
    return bw, lat


def with_measured_links(cluster: ClusterSpec, gpu) -> ClusterSpec:
    """`cluster` with a calibrated card's measured in-node collectives (`gpu.collectives`),
    unless the cluster carries its own; unchanged for an uncalibrated card."""
    if gpu.collectives and not cluster.collectives:
        return dataclasses.replace(cluster, collectives=gpu.collectives)
    return cluster


def collective_time(cluster: ClusterSpec, kind: str, nbytes, n, span):
    """Seconds for one collective of S = nbytes over n ranks spanning `span` ranks; 0 if n = 1."""
    n = np.asarray(n, dtype=float)
    bw, lat = measured_link(cluster, kind, span, *link(cluster, span))
    t = lat * np.log2(np.maximum(n, 2.0)) + ring_bytes(kind, nbytes, n) / bw
    return np.where(n > 1, t, 0.0)


def p2p_time(cluster: ClusterSpec, nbytes, span):
    """Seconds for one point-to-point send of nbytes between ranks `span` apart or closer."""
    bw, lat = link(cluster, span)
    return lat + np.asarray(nbytes, dtype=float) / bw


# ---------------------------------------------------------------- data parallel


def fsdp_collectives(cluster: ClusterSpec, *, stage_params, dp_shard, cp, tp,
                     gather_params=None):
    """(all-gather, reduce-scatter) seconds of one pass of FSDP2 over a stage: its weights
    gathered in bf16 and its gradients reduce-scattered in fp32 over the shard group
    (dp_shard x cp ranks, spanning x tp). `gather_params`: what the all-gather moves in
    bf16 units where it differs from `stage_params` (fp8 weights, `cost.fp8.gather_params`).
    """
    n = np.asarray(dp_shard) * np.asarray(cp)
    span = n * np.asarray(tp)
    gathered = stage_params if gather_params is None else gather_params
    return (collective_time(cluster, "all_gather", GATHER_BYTES * gathered, n, span),
            collective_time(cluster, "reduce_scatter", REDUCE_BYTES * stage_params, n, span))


def dp_microbatch_time(cluster: ClusterSpec, *, stage_params, zero, dp_shard, cp, tp,
                       gather_params=None):
    """Data-parallel traffic of one micro-batch that FSDP2 runs alone (one block timed).

    ZeRO-3: all-gather the bf16 weights for forward and again for backward,
    reduce-scatter fp32 gradients. ZeRO-2 (no reshard after forward): one
    all-gather and one reduce-scatter. ZeRO-0/1: nothing (see `dp_step_time`).
    How often a step repeats them: `cost.step_time.fsdp_passes`.
    """
    ag, rs = fsdp_collectives(cluster, stage_params=stage_params, dp_shard=dp_shard, cp=cp,
                              tp=tp, gather_params=gather_params)
    zero = np.asarray(zero)
    return np.where(zero == 3, 2 * ag + rs, np.where(zero == 2, ag + rs, 0.0))


def dp_step_time(cluster: ClusterSpec, *, stage_params, zero, dp, dp_shard, cp, tp,
                 gather_params=None):
    """Data-parallel traffic once per optimizer step: (overlappable, blocking) seconds.

    ZeRO-0 (DDP): all-reduce fp32 gradients over dp x cp, overlapped with the
    last backward (Li et al. 2020, PyTorch DDP). HSDP (a shard group smaller
    than dp): all-reduce of the sharded gradients across replicas, overlapped
    likewise. ZeRO-1: reduce-scatter gradients and all-gather the updated bf16
    weights around the optimizer step, blocking. `gather_params` as in
    `dp_microbatch_time`.
    """
    zero = np.asarray(zero)
    n_all = np.asarray(dp) * np.asarray(cp)
    span_all = n_all * np.asarray(tp)
    ar = collective_time(cluster, "all_reduce", REDUCE_BYTES * stage_params, n_all, span_all)
    n_shard = np.asarray(dp_shard) * np.asarray(cp)
    span_shard = n_shard * np.asarray(tp)
    rs = collective_time(cluster, "reduce_scatter", REDUCE_BYTES * stage_params, n_shard,
                         span_shard)
    gathered = stage_params if gather_params is None else gather_params
    ag = collective_time(cluster, "all_gather", GATHER_BYTES * gathered, n_shard, span_shard)
    replicas = np.asarray(dp) // np.asarray(dp_shard)
    hsdp = collective_time(cluster, "all_reduce", REDUCE_BYTES * stage_params / n_shard,
                           replicas, span_all)
    overlappable = np.where(zero == 0, ar, hsdp)
    blocking = np.where(zero == 1, rs + ag, 0.0)
    return overlappable, blocking


# ---------------------------------------------------------------- model parallel


def tp_pair_time(cluster: ClusterSpec, *, act_bytes, tp, sequence_parallel=False):
    """Seconds of one tensor-parallel exchange of the b s h activation.

    Without sequence parallel an all-reduce; with it an all-gather before the
    block's column-parallel linears and a reduce-scatter after its
    row-parallel one (Korthikanti et al. 2022, sec. 4.2.2): the same ring
    bytes, but two collectives, each with its own latency and its own
    calibrated bus bandwidth (`collective_time`; alpha-beta fits per op).
    """
    ar = collective_time(cluster, "all_reduce", act_bytes, tp, tp)
    ag_rs = (collective_time(cluster, "all_gather", act_bytes, tp, tp)
             + collective_time(cluster, "reduce_scatter", act_bytes, tp, tp))
    return np.where(np.asarray(sequence_parallel), ag_rs, ar)


def tp_sublayer_time(cluster: ClusterSpec, *, act_bytes, tp, sequence_parallel=False,
                     stream_scale=1.0):
    """(forward, backward) seconds of the tensor-parallel collectives around one sublayer.

    A sublayer is attention or the MLP (Korthikanti et al. 2022, sec. 4.2.2).
    With sequence parallel: forward all-gathers the norm's output and
    reduce-scatters the row-parallel projection's; backward does the reverse
    (reduce-scatter of the input gradient, all-gather of the output
    gradient). Without it: one all-reduce each way. The norm's output and its
    gradient have the residual stream's dtype, `stream_scale` x bf16 (2 where
    fp32 weights run under autocast: RMSNorm stays fp32); the projection's
    output and its gradient are bf16. `act_bytes`: the b s h tensor in bf16.
    """
    s = stream_scale * np.asarray(act_bytes, dtype=float)

    def coll(kind, nbytes):
        return collective_time(cluster, kind, nbytes, tp, tp)

    sp = np.asarray(sequence_parallel)
    fwd = np.where(sp, coll("all_gather", s) + coll("reduce_scatter", act_bytes),
                   coll("all_reduce", act_bytes))
    bwd = np.where(sp, coll("reduce_scatter", s) + coll("all_gather", act_bytes),
                   coll("all_reduce", s))
    return fwd, bwd


def tp_microbatch_time(cluster: ClusterSpec, *, act_bytes, tp, layers, recompute_full,
                       sequence_parallel=False, stream_scale=1.0):
    """Tensor-parallel traffic of one micro-batch's blocks on one stage, never overlapped.

    Per block two sublayers (`tp_sublayer_time`), forward and backward; full
    recompute repeats the forward's. Nothing hides them: the harness runs
    DTensor TP without async TP (no `_micro_pipeline_tp`), so each collective
    waits for its producer and blocks its consumer.
    """
    fwd, bwd = tp_sublayer_time(cluster, act_bytes=act_bytes, tp=tp,
                                sequence_parallel=sequence_parallel, stream_scale=stream_scale)
    return 2.0 * layers * (fwd + bwd + np.where(recompute_full, fwd, 0.0))


def tp_ends_time(cluster: ClusterSpec, *, act_bytes, logits_bytes, tp, sequence_parallel,
                 stream_scale=1.0, first_stage=True, last_stage=True):
    """Tensor-parallel traffic of one micro-batch outside the blocks, on one rank.

    As bench/parallelize.apply_tp lays it out: the vocab-split embedding
    (`RowwiseParallel`, output the stream) reduce-scatters forward and
    all-gathers backward (an all-reduce without sequence parallel); the final
    norm's output is all-gathered for the output layer and its gradient
    reduce-scattered; the column-parallel output layer's logits are gathered
    whole (`output_layouts=Replicate()`, b s V in bf16) for the loss, whose
    backward is a local slice. Stream tensors: `stream_scale` x bf16.
    """
    s = stream_scale * np.asarray(act_bytes, dtype=float)

    def coll(kind, nbytes):
        return collective_time(cluster, kind, nbytes, tp, tp)

    sp = np.asarray(sequence_parallel)
    pair = np.where(sp, coll("all_gather", s) + coll("reduce_scatter", s), coll("all_reduce", s))
    last = coll("all_gather", logits_bytes) + pair
    t = np.where(first_stage, pair, 0.0) + np.where(last_stage, last, 0.0)
    return np.where(np.asarray(tp) > 1, t, 0.0)


def ep_microbatch_time(cluster: ClusterSpec, *, token_bytes, ep, tp, layers):
    """Expert-parallel all-to-all: dispatch and combine, forward and backward, per MoE block."""
    one = collective_time(cluster, "all_to_all", token_bytes, ep, np.asarray(ep) * np.asarray(tp))
    return 4.0 * one * layers


def pp_exposed_time(cluster: ClusterSpec, *, boundary_bytes, pp, n_transfers, stage_span):
    """Pipeline sends on the critical path: activations forward, gradients back.

    Counted for every micro-batch slot of the schedule, (m v + p - 1), both
    directions: torch.distributed.pipelining does not overlap them with compute.
    """
    pp = np.asarray(pp)
    t = 2.0 * np.asarray(n_transfers) * p2p_time(cluster, boundary_bytes, 2 * stage_span)
    return np.where(pp > 1, t, 0.0)
