"""`tp_block_scales`: what a tensor-parallel block costs beyond the terms that price it.

From the records of `bench.micro_tp.bench_tp_block` (one harness block under
TP with sequence parallel, alone or with FSDP2 on the other mesh dimension):

    s = (t_block - t_tp - t_copy - t_fsdp) / t_compute

t_block: the measured fwd + bwd of one block on one rank (the slowest):
`results["time_s"]`, which in records that time two nets (config `blocks: [1, 2]`)
is the per-block difference two_blocks_s - one_block_s, so the once-per-call
work of the net as FSDP2's and DTensor's root (`results["root_s"]`, paid once
per step in the real model) is left out; where that difference was not positive
(`per_block_from`) and in older records, the one-block time.
t_compute: `compute.microbatch_compute_time` of one layer at the record's shard
(tp), tokens and precision (fp32 weights under autocast for TP alone, bf16
weights under FSDP2), head excluded: the GEMMs, attention and element-wise work.
t_tp: `comms.tp_microbatch_time` of one layer (the sequence-parallel all-gathers
and reduce-scatters, none overlapped) and `compute.tp_layout_copy_time` (the
copies DTensor adds around them), at the calibrated collectives. t_copy + t_fsdp:
for a block FSDP2 wraps, its copies (`compute.dp_copy_time`) and its gathers and
reduce-scatter (`comms.dp_microbatch_time`) in full: alone, nothing hides them.

So s x t_compute + t_tp + ... reproduces the block's time, and the planner
(`overheads.tp_block_scale`) prices every TP block of that degree at s x its
compute. What s holds is what no term prices: DTensor's and FSDP2's hooks on
the host, the waits between collectives and their consumers, and a block that
is host-bound (the host issuing its kernels more slowly than the GPU runs
them: then s grows as the shard shrinks). Calculon (Isaev et al. 2023) takes
measured per-op efficiencies in the same spirit; here the op is the block.
"""

from __future__ import annotations

import dataclasses
import statistics

from trainplan.calibrate import host as calibrate_host
from trainplan.cost import comms, compute
from trainplan.specs import SUITE_CLUSTER, GPUSpec, ModelSpec, load_cluster

MIN_TP_SCALE = 0.5  # below this a residual is the comm model's error, not a faster block
HOST_BOUND = 1.25  # a block measured below this x its host time is host-bound (no GPU scale)


def priced(spec: ModelSpec, gpu: GPUSpec, config: dict) -> tuple[float, float]:
    """(t_compute, what else the planner prices) for one TP block record's config."""
    one = dataclasses.replace(spec, n_layers=1)
    tp, mb, seq = config["tp"], config["micro_batch"], config["seq"]
    fsdp = config.get("wrapper") == "tp+fsdp2"
    autocast = config.get("precision") == "autocast-fp32"
    stream = 2.0 if autocast else 1.0
    t_compute = float(compute.microbatch_compute_time(
        one, gpu, seq_len=seq, micro_batch=mb, tp=tp, cp=1, pp=1, recompute=compute.NONE,
        sequence_parallel=True, last_stage=False, compiled=config.get("compile", True),
        autocast=autocast))
    cluster = comms.with_measured_links(load_cluster(SUITE_CLUSTER), gpu)
    act = compute.BF16 * mb * seq * spec.hidden
    rest = comms.tp_microbatch_time(cluster, act_bytes=act, tp=tp, layers=1,
                                    recompute_full=False, sequence_parallel=True,
                                    stream_scale=stream) \
        + compute.tp_layout_copy_time(gpu, act_elems=mb * seq * spec.hidden,
                                      stream_bytes=stream * compute.BF16, tp=tp, layers=1,
                                      recompute_full=False, sequence_parallel=True,
                                      micro_batch=mb)
    if fsdp:
        held = config["params"] / tp  # one layer's weights on this tp rank, before sharding
        dp, zero = config["dp"], config["zero"]
        copy, _ = compute.dp_copy_time(gpu, held, zero=zero, shard_ranks=dp, dp_ranks=dp)
        rest = rest + copy + comms.dp_microbatch_time(cluster, stage_params=held, zero=zero,
                                                      dp_shard=dp, cp=1, tp=tp)
    return t_compute, float(rest)


def device_part(measured_s: float, host_s: float, k: float) -> float | None:
    """Seconds of GPU work d inside a block measured at t = `measured_s` whose host issue
    time is h = `host_s`: the inverse of `cost.measured.interleaved`, (t^k - h^k)^(1/k),
    and t itself where k = 0 (the plain maximum) or nothing was measured for the host.
    None where t < HOST_BOUND x h: near the host's time the inverse amplifies the noise
    of t (its slope is (t/d)^(k-1)), and the block says little about the GPU."""
    if host_s <= 0.0:
        return measured_s
    if measured_s < HOST_BOUND * host_s:
        return None
    if not k:
        return measured_s
    return float((measured_s ** k - host_s ** k) ** (1.0 / k))


def tp_scales(blocks: list[dict], gpu: GPUSpec, spec_of, host_block_s=(), k: float = 0.0) -> dict:
    """{"tp_block_scales": [[tp, fsdp 0|1, s], ...]} (medians per degree and wrapper) from the
    TP block records among `blocks`; {} where none is left. `spec_of(record)` -> ModelSpec.

    The planner prices a micro-batch as the smooth maximum of its GPU time and the host's
    issue time (`cost.measured.interleaved`, exponent `k` = host_overlap_k), so the block's
    GPU time is taken out of its measured time the same way (`device_part`) before the
    priced terms are: s then holds GPU work only, and the host's share is not counted
    twice. Host times are `host_block_s` (rows [wrapper, s], `calibrate_host.host_scales`);
    host-bound records are left out."""
    host = {str(w): float(t) for w, t in host_block_s or ()}
    by_key: dict[tuple[int, int], list[float]] = {}
    for r in blocks:
        c = r["config"]
        if c.get("wrapper") not in ("tp", "tp+fsdp2"):
            continue
        t_device = device_part(float(r["results"]["time_s"]),
                               host.get(calibrate_host.wrapper_name(c), 0.0), k)
        if t_device is None:
            continue  # host-bound: its time is the host's, which host_block_s prices
        t_compute, rest = priced(spec_of(r), gpu, c)
        by_key.setdefault((int(c["tp"]), int(c["wrapper"] == "tp+fsdp2")), []).append(
            (t_device - rest) / t_compute)
    if not by_key:
        return {}
    return {"tp_block_scales": [[tp, f, round(max(MIN_TP_SCALE, statistics.median(v)), 4)]
                                for (tp, f), v in sorted(by_key.items())]}
