"""Host time per block: the floor the host issuing the work sets under a micro-batch.

    host-bench records (bench.micro --benches host) -> host_block_s -> GPUSpec -> perf

What it measures: the block benchmarks the other scales come from
(`bench.micro_model.bench_block`, `bench.micro_layouts.bench_fsdp_block`,
`bench.micro_tp.bench_tp_block`), run at micro-batch 1 and a tiny sequence
(`bench.micro.HOST_SEQ`), where every GPU kernel takes microseconds. A fwd +
bwd there is then the host's time to issue one block: Python, the compiled
graphs' guards and launches, FSDP2's and DTensor's hooks, the collectives'
calls. The records carry a top-level `"purpose": "host"`; `calibrate_pieces.fit`
keeps them away from every other scale and hands them here.

Why: on 4 x H100 the 1.3B proxy (24 layers, seq 2048, FSDP2 ZeRO-2, compiled
blocks) measured 0.152 s a step at micro-batch 1, 0.176 s at 4 and 0.277 s at
8, where the planner, pricing GPU work only, said 0.051 s and 0.147 s: below
about micro-batch 4 the step hardly shrinks with the GPU work. TP 4 (0.21 s a
step with little GPU work) shows the same. The host sets a floor.

The model (`overheads.host_time_per_microbatch`, `perf.evaluate`): the harness
syncs once a step, so within a step the host runs ahead of the GPU and the two
overlap; a micro-batch takes the larger of its device time and its host time,
a roofline with the host as the second roof:

    t_mb = max(t_device, layers x host_block_s[wrapper])

with wrapper the layout's block wrapper: "plain" (one GPU, DDP, PP alone),
"fsdp2", "tpN" or "tpN+fsdp2". The head, loss and optimizer's host work is not
measured apart; per block is where the launches scale with depth.

The max is a lower bound where the two are close: on 4 x H100 ZeRO-2 at
micro-batch 4 (device 0.14 s, host 0.14 s a micro-batch) ran 9% over it, TP 4
16%. The host bench therefore also times the plain compiled block at
micro-batches 1, 2 and 4 of the full sequence (`"purpose": "interleave"`),
where its GPU time crosses its host time, and `overlap_k` fits the exponent of
a smooth maximum (d^k + h^k)^(1/k) to those blocks alone
(`overheads.interleaved`); k = 0, not measured, keeps the max.
"""

from __future__ import annotations

import statistics

import numpy as np

PURPOSE = "host"
SWEEP = "interleave"  # the plain block at micro-batches where host and GPU time are close
K_GRID = np.round(np.arange(1.0, 12.01, 0.1), 2)  # past 12 the smooth max is the max within 1%


def is_host(record: dict) -> bool:
    """True for a host-bench record (`bench.micro --benches host`), the sweep's included."""
    return record.get("purpose") in (PURPOSE, SWEEP)


def wrapper_name(config: dict) -> str | None:
    """"plain", "fsdp2", "tpN" or "tpN+fsdp2" from a block record's config (wrapper, tp);
    None for a wrapper the planner has no host term for (DDP)."""
    wrapper = config.get("wrapper")
    if wrapper is None:
        return "plain"
    if wrapper == "fsdp2":
        return "fsdp2"
    if wrapper in ("tp", "tp+fsdp2"):
        return f"tp{int(config['tp'])}" + ("+fsdp2" if wrapper == "tp+fsdp2" else "")
    return None


def host_scales(host_records: list[dict]) -> dict:
    """{"host_block_s": [[wrapper, median results.time_s], ...]} sorted by wrapper; {} if none.

    time_s is one block's fwd + bwd (the TP bench's per-block time included)."""
    by: dict[str, list[float]] = {}
    for r in (r for r in host_records if r.get("purpose") == PURPOSE):
        name = wrapper_name(r["config"])
        if name is not None:
            by.setdefault(name, []).append(float(r["results"]["time_s"]))
    if not by:
        return {}
    return {"host_block_s": [[w, round(float(statistics.median(v)), 7)]
                             for w, v in sorted(by.items())]}


def overlap_k(host_records: list[dict], device_time, host_block_s) -> dict:
    """{"host_overlap_k": k} fitted to the sweep's blocks; {} without them or a plain host time.

    Each sweep record is one plain compiled block (fwd + bwd) at a micro-batch where its GPU
    time d (`device_time(record)`: the calibrated analytic terms, as `block_checks` prices
    the block) is near the host's h (host_block_s "plain"). k minimises the squared log error
    of (d^k + h^k)^(1/k) against the measured time over K_GRID (`overheads.interleaved`);
    microbenchmarks only, no end-to-end run.
    """
    from trainplan.overheads import interleaved

    h = dict((str(w), float(t)) for w, t in host_block_s or ()).get("plain")
    sweep = [r for r in host_records if r.get("purpose") == SWEEP
             and wrapper_name(r["config"]) == "plain"]
    if not sweep or not h:
        return {}
    d = np.array([device_time(r) for r in sweep])
    t = np.array([float(r["results"]["time_s"]) for r in sweep])
    loss = [float(np.sum(np.log(interleaved(d, h, k) / t) ** 2)) for k in K_GRID]
    return {"host_overlap_k": float(K_GRID[int(np.argmin(loss))])}
