"""Context parallel as the harness runs it: torch's ring attention, priced per block.

Source: torch/distributed/tensor/experimental/_context_parallel/_attention.py (torch 2.11
on the GPUs, 2.13 on CPU: the same code), with the options the harness sets
(bench/harness/context.py): `rotate_method = ALL_GATHER`, `convert_to_f32 = True`,
`enable_load_balance = True` (head-tail shares). On one rank of a cp group of c, per block
and micro-batch, with E = b s / c x n_heads head_dim / tp elements (the harness repeats
K and V to n_heads before SDPA, bench/harness/model.py, so K and V are E each):

- forward (`_templated_ring_attention`): `key.contiguous()`, `value.contiguous()`, one
  `torch.cat` of K and V into the send buffer, one all-gather of it (c x 4 E bytes out);
  step 0 runs causal SDPA on the local q, k; steps i >= 1 run non-causal SDPA on all of q
  and the first half of k, v (i <= rank) or the second half of q and all of k, v
  (i > rank); each output is upcast to fp32 and merged into the running fp32 output and
  log-sum-exp (`_SDPAMerger`), cast back to bf16 at the end;
- backward (`_templated_ring_attention_backward`): the same all-gather of K, V again;
  fp32 accumulators for dq, dk, dv (`zeros_like(..., dtype=float32)`); after every step
  the fp32 dk, dv of the chunk held are passed to the next rank (`_AllToAllRotater`,
  `ft_c.permute_tensor`: c sends of 8 E bytes), and cast to bf16 at the end.

Compiled (every block is), AOTAutograd's joint graph is de-duplicated before partitioning
(torch/_functorch/partitioners.py: `fx_graph_cse`, then `force_save_collectives`), so the
backward reuses the forward's gathered K, V, saved instead of gathered again. The kernel
tables agree: one all-gather per compiled SDPA fwd + bwd against two eager
(data/measurements/validate-h200x2-20261127/ring/profile.txt; profile/cp2-s16384.json).

The SDPA FLOPs stay in `compute` (the ring's tiles sum to the rank's 1/c share of the
plain causal call's); this module prices what the ring costs beyond them.
"""

from __future__ import annotations

import numpy as np

from trainplan.cost import comms
from trainplan.specs import ClusterSpec, GPUSpec, ModelSpec

BF16, FP32 = 2, 4
MiB = 2**20

# Bytes per E that one block's ring backward holds beyond plain SDPA's own (its output and
# dq, dk, dv: 8 E) and beyond the gathered K, V (4 c E), per compile mode, with a compiled
# constant; see `ring_peak_bytes`. Source: the ring microbenchmark's `peak_extra_bytes`
# (`bench.micro.ring`), exactly (4 c + 47) E eager and (4 c + 16) E + 60 MiB compiled over
# its 36 records at cp 2 and 4, s = 256-16384, 1.3B and 13B widths
# (validate-h200x2-20261127/ring/ring*.jsonl, validate-h200x4-20261127d/ring/ring4.jsonl).
BWD_TEMP_E_EAGER, BWD_TEMP_E_COMPILED = 39.0, 8.0
COMPILED_WORKSPACE_BYTES = 60 * MiB


def ring_elems(m: ModelSpec, *, seq_len, micro_batch, cp, tp):
    """E: elements of one rank's q (and of its K, V each) in one block: b s / cp x nh hd / tp."""
    tokens = np.asarray(micro_batch, dtype=float) * seq_len / np.asarray(cp, dtype=float)
    return tokens * m.n_heads * m.head_dim / np.asarray(tp, dtype=float)


def gather_time(cluster: ClusterSpec, *, elems, cp, tp):
    """Seconds of one all-gather of K and V (bf16) over the cp group: c x 4 E bytes out.

    `_AllGatherRotater.exchange_buffers`: `ft_c.all_gather_single` of the concatenated
    local K, V; the group spans cp x tp consecutive ranks (tp innermost, `comms`).
    """
    cp = np.asarray(cp, dtype=float)
    return comms.collective_time(cluster, "all_gather", cp * 2 * BF16 * np.asarray(elems), cp,
                                 cp * np.asarray(tp))


def dkv_send_time(cluster: ClusterSpec, *, elems, cp, tp):
    """Seconds of one `permute_tensor` of the fp32 dk, dv (8 E bytes) to the next cp rank.

    Each rank sends its whole buffer to one neighbour at once: one step of a ring
    all-gather, so it takes the all-gather's measured bus bandwidth and one latency
    (`comms.measured_link`; the cluster's figures where none is measured).
    """
    cp = np.asarray(cp, dtype=float)
    bw, lat = comms.measured_link(cluster, "all_gather", cp * np.asarray(tp),
                                  *comms.link(cluster, cp * np.asarray(tp)))
    return np.where(cp > 1, lat + 2 * FP32 * np.asarray(elems) / bw, 0.0)


def pass_bytes_per_elem(cp, compiled):
    """(forward, backward, SDPA calls) HBM bytes per E the ring moves beyond plain SDPA.

    Counted on the slowest rank (rank c - 1: every step i >= 1 takes all of q, so its
    merges and dq adds cover all of E). Eager, op by op:
    - forward: `contiguous` K, V 8 (read + write bf16); the send `cat` 8, repeated at
      steps 1..c-2 although `_AllGatherRotater` ignores it; step 0's upcast 6; per step
      i >= 1 the upcast 6 and the merge `out - sigmoid(.) * (out - block_out)` 32 (three
      fp32 ops); the final cast 6: 20 + 46 (c - 1);
    - backward: `contiguous` + `cat` 16, dead `cat`s 8 (c - 2), fp32 zeros of dq, dk, dv 12
      and step 0's adds 30, the first dk, dv send `cat` 16; per step i >= 1 the dk, dv adds
      (`_partial_update`: half add 10 + its `cat` 16) + send `cat` 16 + dq add 10 = 52;
      the final casts 18: 84 + 60 (c - 1).
    Compiled (the blocks run under `torch.compile`, which traces the ring and fuses it):
    the dead `cat`s go, each merge or add with its casts and `cat`s is one read-modify-write
    (fp32 4 + 4 and the bf16 block 2): forward 16 + 10 (c - 1), backward 16 + 18 + 30 (c - 1)
    + 18 = 52 + 30 (c - 1).
    SDPA calls: each step i >= 1 is an extra call that writes its own bf16 output (2) and,
    backward, re-reads O and dO (4) and zeroes, adds and casts its fp32 dq workspace (10)
    (FlashAttention-2's backward): 16 (c - 1), compiled or not.
    """
    k = np.asarray(cp, dtype=float) - 1.0
    compiled = np.asarray(compiled, dtype=bool)
    fwd = np.where(compiled, 16.0 + 10.0 * k, 20.0 + 46.0 * k)
    bwd = np.where(compiled, 52.0 + 30.0 * k, 84.0 + 60.0 * k)
    return fwd, bwd, 16.0 * k


def gathers_per_block(compiled, recompute_full):
    """All-gathers of K, V per block and micro-batch (count).

    Eager: the forward's, the backward's (`_templated_ring_attention_backward` gathers
    again), and full recompute's replay of the forward: 2, 3 with full recompute.
    Compiled: the backward's merges into the forward's (the joint graph's CSE; module
    docstring), so 1; under full recompute the partitioner replays the forward's gather
    in the backward (a user-annotated checkpoint region may recompute collectives,
    `must_recompute`), which the backward's again merges into: 2.
    """
    redo = np.where(np.asarray(recompute_full), 1.0, 0.0)
    return np.where(np.asarray(compiled, dtype=bool), 1.0, 2.0) + redo


def ring_layer_time(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, *, seq_len, micro_batch,
                    cp, tp, recompute_full, compiled, attn_fwd_s):
    """(exposed collectives, HBM passes) seconds the ring adds to one block and micro-batch.

    Collectives: `gathers_per_block` all-gathers of K, V (eager: forward, again in full
    recompute's replay, and backward; compiled: the backward's merged into the forward's)
    and c sends of the fp32 dk, dv (`gather_time`, `dkv_send_time`). Compiled, none hides:
    while tracing, a functional collective is waited at once
    (`_functional_collectives._maybe_wrap_tensor` returns `wait_tensor(...)`) and
    inductor moves no compute between them (`reorder_for_compute_comm_overlap` and
    `aten_distributed_optimizations.enable_overlap_scheduling` are off by default, and the
    harness sets neither). Eager, the forward gather is waited before step 1 so it hides
    under step 0's SDPA (1/c of the rank's attention forward `attn_fwd_s`), the backward
    gather under step 0's SDPA backward (2/c of it), and each dk, dv send under the next
    step's; the last send is waited after the loop.
    HBM passes: `pass_bytes_per_elem` x E at the measured copy bandwidth
    (`memory_efficiency` x datasheet HBM), forward ones twice under full recompute.
    0 where cp = 1.
    """
    cp = np.asarray(cp, dtype=float)
    e = ring_elems(m, seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp)
    ag = gather_time(cluster, elems=e, cp=cp, tp=tp)
    send = dkv_send_time(cluster, elems=e, cp=cp, tp=tp)
    redo = np.where(np.asarray(recompute_full), 1.0, 0.0)
    step_fwd = np.asarray(attn_fwd_s, dtype=float) / np.maximum(cp, 1.0)
    eager = (1.0 + redo) * np.maximum(ag - step_fwd, 0.0) + np.maximum(ag - 2 * step_fwd, 0.0) \
        + (cp - 1.0) * np.maximum(send - 2 * step_fwd, 0.0) + send
    gathers = gathers_per_block(True, recompute_full)
    exposed = np.where(np.asarray(compiled, dtype=bool), gathers * ag + cp * send, eager)
    fwd, bwd, calls = pass_bytes_per_elem(cp, compiled)
    rate = gpu.hbm_tbps * 1e12 * gpu.memory_efficiency
    passes = ((1.0 + redo) * fwd + bwd + calls) * e / rate
    on = cp > 1
    return np.where(on, exposed, 0.0), np.where(on, passes, 0.0)


def shared_link_extra(busy):
    """Extra share of the ring's exposed collectives' time when FSDP2's gathers and
    reduce-scatters hold the same links for a share `busy` of the micro-batch's compute.

    Both run on NCCL over one NVLink fabric, which serves concurrent transfers by sharing
    its bandwidth, so a ring exchange issued while FSDP2's traffic is in flight slows.
    Processor sharing at load rho stretches a job of t seconds to t / (1 - rho) (Kleinrock
    1976, Queueing Systems vol. 2, sec. 4.4: M/G/1-PS), an extra rho / (1 - rho). `busy` is
    held at 0.9 so the stretch stays finite (10x) as the traffic nears the whole window,
    where `step_time._exposed` prices the part that no longer hides.
    Unfitted; the profiles in data/measurements/profile-cp-h200x4-20261128/ show the
    compute stream waiting on the ring's exchanges where the traffic runs beside them.
    """
    rho = np.clip(np.asarray(busy, dtype=float), 0.0, 0.9)
    return rho / (1.0 - rho)


def ring_kept_bytes(m: ModelSpec, *, seq_len, micro_batch, cp, tp, compiled, recompute_full):
    """Bytes one block keeps from forward to backward beyond plain SDPA's, per micro-batch.

    Compiled: the gathered K, V of the whole sequence, c x 4 E bytes (bf16; the forward's
    `all_gather_single` output, which the backward reuses, module docstring), saved like
    any activation while later blocks run. Not under full recompute (the block keeps its
    input only; the gather is replayed) and not eager (the forward's buffer is freed when
    the forward returns; the backward gathers its own, `ring_peak_bytes`). A check, not a
    fit: at the 1.3B width and the same tokens a rank, p-cp4-z3-mb1-s16k's peak allocated
    exceeds p-cp2-fsdp2-mb1-s8k's by 1.58 GiB (validate-h200x4-20261127d/vB), where 24
    blocks x 4 (c4 - c2) E = 1.50 GiB. 0 where cp = 1.
    """
    cp = np.asarray(cp, dtype=float)
    e = ring_elems(m, seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp)
    keeps = np.asarray(compiled, dtype=bool) & ~np.asarray(recompute_full, dtype=bool) & (cp > 1)
    return np.where(keeps, 4.0 * cp * e, 0.0)


def ring_peak_bytes(m: ModelSpec, *, seq_len, micro_batch, cp, tp, compiled, recompute_full):
    """Bytes the ring holds during one block's backward beyond plain SDPA and beyond what
    the block keeps (`ring_kept_bytes`): a transient on top of every block's kept bytes.

    Eager: the gathered K, V again (c x 4 E) and 39 E of fp32 and bf16 temporaries (the
    fp32 dq accumulator 4 E, the fp32 dk, dv three times over 24 E: the buffer received
    from the previous rank and added into, the `cat` sent on and the next
    `permute_tensor`'s output; each step's bf16 dq, dk, dv 6 E; the dead send `cat` of
    K, V 4 E; 1 E unassigned). Compiled: 8 E (inductor fuses the adds, casts and `cat`s)
    and a constant 60 MiB, with the gathered K, V counted where it is kept, and as a
    transient under full recompute (replayed). Both measured on the ring microbenchmark
    (BWD_TEMP_E_EAGER, BWD_TEMP_E_COMPILED, COMPILED_WORKSPACE_BYTES; their source there),
    whose peak is this plus the kept bytes plus plain SDPA's 8 E. 0 where cp = 1.
    """
    cp = np.asarray(cp, dtype=float)
    e = ring_elems(m, seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp)
    compiled = np.asarray(compiled, dtype=bool)
    gathered = 4.0 * cp * e - ring_kept_bytes(m, seq_len=seq_len, micro_batch=micro_batch,
                                              cp=cp, tp=tp, compiled=compiled,
                                              recompute_full=recompute_full)
    temps = np.where(compiled, BWD_TEMP_E_COMPILED * e + COMPILED_WORKSPACE_BYTES,
                     BWD_TEMP_E_EAGER * e)
    return np.where(cp > 1, gathered + temps, 0.0)


def micro_peak_bytes(m: ModelSpec, *, seq_len, micro_batch, cp, tp, compiled):
    """Bytes the ring microbenchmark records as `peak_extra_bytes` (`bench.micro.ring`): the
    peak of one SDPA fwd + bwd under context parallel over its q, k, v and grad-out shards.

    Plain SDPA's own output and dq, dk, dv (4 x 2 E, bf16; its fp32 log-sum-exp, 4 E / hd,
    left out) plus what the ring adds: `ring_kept_bytes` (held until the backward ends)
    and `ring_peak_bytes`. 0 where cp = 1 (the benchmark runs cp > 1 only).
    """
    cp = np.asarray(cp, dtype=float)
    e = ring_elems(m, seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp)
    kw = dict(seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp, compiled=compiled,
              recompute_full=False)
    extra = ring_kept_bytes(m, **kw) + ring_peak_bytes(m, **kw)
    return np.where(cp > 1, 4.0 * BF16 * e + extra, 0.0)
