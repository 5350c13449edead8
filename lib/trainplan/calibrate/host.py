"""Host time per block and per step: the floor the host issuing the work sets.

    host-bench records (bench.micro --benches host,host-step)
        -> host_block_s, host_overlap_k, host_step_s, host_step_layer_s -> GPUSpec -> cost

Source: microbenchmark records only (`"purpose"` host, interleave or host-step), which
`trainplan.calibrate.pieces.fit` keeps away from every other scale and hands here. Times
are seconds, per block wrapper (`wrapper_name`): "plain" (one GPU, DDP, PP alone), "fsdp2",
"tpN" or "tpN+fsdp2"; a wrapper whose block was not timed has no row. The harness syncs
once a step, so host and GPU overlap, and the planner (`trainplan.cost.measured`) prices a
micro-batch as a roofline with the host as the second roof:

    t_mb = max(t_device, layers x host_block_s[wrapper])

smoothed where the two are close by host_overlap_k (`overlap_k`), plus the host's work
outside the blocks, once a step and per layer (host_step_s, host_step_layer_s:
`_step_scales`). Each key's measurement and fit: `host_scales`, `overlap_k`, `_step_scales`.
"""

from __future__ import annotations

import statistics

import numpy as np

from trainplan.cost.measured import interleaved

PURPOSE = "host"
SWEEP = "interleave"  # the plain block at micro-batches where host and GPU time are close
STEP = "host-step"  # the whole model's step at the host bench's size (bench.micro.step)
K_GRID = np.round(np.arange(1.0, 12.01, 0.1), 2)  # past 12 the smooth max is the max within 1%


def is_host(record: dict) -> bool:
    """True for a host-bench record (`bench.micro --benches host,host-step`): blocks, the
    sweep and whole steps."""
    return record.get("purpose") in (PURPOSE, SWEEP, STEP)


def wrapper_name(config: dict) -> str | None:
    """"plain", "fsdp2", "tpN" or "tpN+fsdp2" from a block record's config (wrapper, tp);
    None for a wrapper the planner has no host term for (DDP)."""
    wrapper = config.get("wrapper")
    if wrapper in (None, "plain"):  # the block benches write none, the step bench "plain"
        return "plain"
    if wrapper == "fsdp2":
        return "fsdp2"
    if wrapper in ("tp", "tp+fsdp2"):
        return f"tp{int(config['tp'])}" + ("+fsdp2" if wrapper == "tp+fsdp2" else "")
    return None


def _by_wrapper(records: list[dict], purpose: str, value) -> dict[str, list[float]]:
    by: dict[str, list[float]] = {}
    for r in (r for r in records if r.get("purpose") == purpose):
        name = wrapper_name(r["config"])
        if name is not None:
            by.setdefault(name, []).append(float(value(r)))
    return by


def step_line(times_by_depth: dict[int, list[float]]) -> tuple[float, float]:
    """(a, b) of the line time_s = a + L x b through the median step time at each depth L,
    by least squares (exact through two depths); two or more depths. The host's work a
    step as a constant a and a part b per layer (`_step_scales`; measured on the
    host-step bench's records, `bench.micro.step`)."""
    depth = np.array(sorted(times_by_depth), dtype=float)
    t = np.array([statistics.median(times_by_depth[int(n)]) for n in depth], dtype=float)
    dx = depth - depth.mean()
    b = float(np.sum(dx * (t - t.mean())) / np.sum(dx * dx))
    return float(t.mean() - b * depth.mean()), b


def _step_scales(host_records: list[dict], blocks: dict[str, float]) -> dict:
    """host_step_s (and host_step_layer_s where a wrapper was timed at two depths or more)
    from the step records of the wrappers in `blocks` (host_block_s by wrapper).

    The records are whole steps of the model at micro-batch 1 and HOST_SEQ tokens
    (`bench.micro.step`, "host-step"; time_s the host's time to issue the step), at the
    depths of `bench.micro.step.step_depths`: the host's work outside the blocks (embedding,
    compiled head and loss, `clip_grad_norm_`, fused AdamW's `step()` and `zero_grad()`,
    FSDP2's root hooks, the data feed). Through the medians per depth L (`step_line`):

        time_s = a + L x b
        host_step_s[wrapper] = max(0, a)                               once a step
        host_step_layer_s[wrapper] = max(0, b - host_block_s[wrapper])  per layer

    `cost.measured.host_wait_per_step` adds both once a step, to the last micro-batch; the
    optimizer and clipping run per parameter tensor, so per layer, and a pipeline stage pays
    only its own layers' share. With one depth, host_step_s = median(time_s - layers x
    host_block_s), >= 0, and no host_step_layer_s; where other wrappers have two depths, a
    one-depth wrapper's host_step_layer_s is 0, so that the planner's fallbacks
    (`measured.per_wrapper`) do not lend it another wrapper's per-layer work. The plain step
    runs fp32 weights under autocast while the plain block runs pure bf16, so autocast's
    casts land in the plain row."""
    steps: dict[str, dict[int, list[float]]] = {}
    for r in (r for r in host_records if r.get("purpose") == STEP):
        name = wrapper_name(r["config"])
        if name in blocks:
            steps.setdefault(name, {}).setdefault(int(r["config"]["layers"]), []).append(
                float(r["results"]["time_s"]))
    const, per_layer = {}, {}
    for w, by_depth in steps.items():
        if len(by_depth) > 1:
            const[w], b = step_line(by_depth)
            per_layer[w] = b - blocks[w]
        else:  # one depth: everything outside the blocks is the constant
            const[w] = float(statistics.median(t - n * blocks[w] for n, ts in by_depth.items()
                                               for t in ts))
    out = {}
    if const:
        out["host_step_s"] = [[w, round(max(0.0, a), 7)] for w, a in sorted(const.items())]
    if per_layer:
        out["host_step_layer_s"] = [[w, round(max(0.0, per_layer.get(w, 0.0)), 7)]
                                    for w in sorted(const)]
    return out


def host_scales(host_records: list[dict]) -> dict:
    """{"host_block_s": [[wrapper, median results.time_s], ...], "host_step_s": [[wrapper,
    seconds], ...], "host_step_layer_s": [[wrapper, seconds], ...]} sorted by wrapper; a
    key without records is left out ({} if none).

    host_block_s: the median fwd + bwd (time_s) of one block (`bench.micro.model.bench_block`,
    `bench.micro.layouts.bench_fsdp_block`, the per-block time of
    `bench.micro.tp.bench_tp_block`) at micro-batch 1 and `bench.micro.run.HOST_SEQ` tokens,
    where every GPU kernel takes microseconds: the host's time to issue the block (Python,
    guards and launches of the compiled graphs, FSDP2's and DTensor's hooks, the
    collectives' calls). host_step_s, host_step_layer_s: the step's host work outside the
    blocks, once a step and per layer (`_step_scales`)."""
    blocks = {w: round(float(statistics.median(v)), 7)
              for w, v in _by_wrapper(host_records, PURPOSE, lambda r: r["results"]["time_s"])
              .items()}
    out = {"host_block_s": [[w, t] for w, t in sorted(blocks.items())]} if blocks else {}
    out.update(_step_scales(host_records, blocks))
    return out


def overlap_k(host_records: list[dict], device_time, host_block_s) -> dict:
    """{"host_overlap_k": k} fitted to the sweep's blocks; {} without them or a plain host time.

    k is the exponent of the smooth maximum (d^k + h^k)^(1/k) (`cost.measured.interleaved`)
    that replaces max(d, h) where the two are close; k = 0 keeps the max. Each sweep record
    ("interleave") is the plain compiled block (fwd + bwd) at micro-batch 1, 2 or 4 of the
    full sequence, where its GPU time d (`device_time(record)`: the calibrated analytic
    terms, as `block_checks` prices the block) crosses the host's h (host_block_s "plain").
    k minimises the squared log error of the smooth maximum against the measured time over
    K_GRID; microbenchmarks only, no end-to-end run.
    """
    h = dict((str(w), float(t)) for w, t in host_block_s or ()).get("plain")
    sweep = [r for r in host_records if r.get("purpose") == SWEEP
             and wrapper_name(r["config"]) == "plain"]
    if not sweep or not h:
        return {}
    d = np.array([device_time(r) for r in sweep])
    t = np.array([float(r["results"]["time_s"]) for r in sweep])
    loss = [float(np.sum(np.log(interleaved(d, h, k) / t) ** 2)) for k in K_GRID]
    return {"host_overlap_k": float(K_GRID[int(np.argmin(loss))])}


RING_HOST_SEQ = 1024  # at or below it one block's SDPA, plain or ring, is host-bound on Hopper


def ring_host_scales(ring_records: list[dict]) -> dict:
    """ring_host_s: [[cp, compiled 0|1, s], ...], the host's issue time of one block's
    attention under torch's ring attention (fwd + bwd) beyond plain SDPA's.

    From `bench.micro.ring` records at sequences of at most `RING_HOST_SEQ`, where both
    calls are host-bound (their GPU work a fraction of the host's): ring `time_s` less
    `plain_s`, the median over models and lengths for each (cp, compiled). {} without them.
    """
    by_key: dict[tuple[int, int], list[float]] = {}
    for r in ring_records:
        c = r["config"]
        if c["seq"] <= RING_HOST_SEQ:
            by_key.setdefault((int(c["cp"]), int(bool(c["compile"]))), []).append(
                max(0.0, r["results"]["time_s"] - r["results"]["plain_s"]))
    if not by_key:
        return {}
    return {"ring_host_s": [[cp, comp, round(statistics.median(v), 6)]
                            for (cp, comp), v in sorted(by_key.items())]}
