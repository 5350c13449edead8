"""Host time per block and per step: the floor the host issuing the work sets.

    host-bench records (bench.micro --benches host,host-step)
        -> host_block_s, host_step_s, host_step_layer_s -> GPUSpec -> perf

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
"fsdp2", "tpN" or "tpN+fsdp2". Per block is where the launches scale with depth;
the head, loss and optimizer's host work comes once a step (`host_step_s`, below).

The max is a lower bound where the two are close: on 4 x H100 ZeRO-2 at
micro-batch 4 (device 0.14 s, host 0.14 s a micro-batch) ran 9% over it, TP 4
16%. The host bench therefore also times the plain compiled block at
micro-batches 1, 2 and 4 of the full sequence (`"purpose": "interleave"`),
where its GPU time crosses its host time, and `overlap_k` fits the exponent of
a smooth maximum (d^k + h^k)^(1/k) to those blocks alone
(`overheads.interleaved`); k = 0, not measured, keeps the max.

The step outside the blocks (`host_step_s`). A step's host work is not only its
blocks': the embedding, the compiled head and loss, `clip_grad_norm_`, fused AdamW's
`step()` and `zero_grad()` over (DTensor) parameters, FSDP2's root hooks and the data
feed run once a step, and nothing above prices them. On 4 x H100 the host-bound layouts
ran over the block floor: FSDP2 ZeRO-2 at micro-batch 1 on 2 GPUs 0.164-0.168 s a step
against 0.132 s priced, TP 4 mb 8 0.19-0.24 s against 0.193. The host bench therefore
also times a whole step of the whole model under each wrapper at micro-batch 1 and
HOST_SEQ tokens (`bench.micro_step`, `"purpose": "host-step"`; time_s the host's time to
issue the step, the optimizer's device work left to the planner's `optimizer_s`), and

    host_step_s[wrapper] = median(step time_s - layers x host_block_s[wrapper]), >= 0

which `overheads.host_wait_per_step` adds once a step, to the last micro-batch's host
time. A wrapper whose block was not timed has no row (nothing to subtract). The plain
step runs the harness's fp32 weights under autocast while the plain block is timed in
pure bf16: autocast's casts in the blocks land in the plain row too.

Outside the blocks, per layer (`host_step_layer_s`). On 2 x H100 (32 CPU cores) the first
whole-step run (llama-1.3b, 24 layers, micro-batch 1, 64 tokens) issued a step in 52.6 ms
plain, 124 ms FSDP2 ZeRO-2 and 178 ms TP 2, against blocks of 2.84, 5.31 and 4.73 ms:
host_step_s 0, 0 and 0.065 s. Charged once a step, TP 2's 65 ms put a 2-layer slice of
the 13B model at 0.082 s a step where it measured 0.056 s (+46%), while its 4-layer twin
was right (+4%): most of it grows with depth. Fused AdamW's `step()`, `zero_grad()` and
`clip_grad_norm_` over DTensor parameters run per parameter tensor, so per layer, and a
pipeline stage pays only its own layers' share. The step bench therefore times each
wrapper at two depths, the model's full depth and its first few blocks
(`bench.micro_step.step_depths`, `config["layers"]`), and fits a line by least squares
through the medians per depth L:

    time_s = a + L x b
    host_step_s[wrapper] = max(0, a)             once a step (head, loss, feed, roots)
    host_step_layer_s[wrapper] = max(0, b - host_block_s[wrapper])
                                                 per layer, outside its fwd + bwd

With one depth a line is not determined: the rule above (everything in host_step_s), so
older records calibrate as before and no host_step_layer_s is written. Where some
wrappers have two depths and others one, the latter's host_step_layer_s row is 0: their
whole-step constant already holds their per-layer work, which must not borrow another
wrapper's through the planner's fallbacks (`measured.per_wrapper`).
"""

from __future__ import annotations

import statistics

import numpy as np

PURPOSE = "host"
SWEEP = "interleave"  # the plain block at micro-batches where host and GPU time are close
STEP = "host-step"  # the whole model's step at the host bench's size (bench.micro_step)
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
    step as a constant a and a part b per layer (the module docstring; measured on the
    host-step bench's records, `bench.micro_step`)."""
    depth = np.array(sorted(times_by_depth), dtype=float)
    t = np.array([statistics.median(times_by_depth[int(n)]) for n in depth], dtype=float)
    dx = depth - depth.mean()
    b = float(np.sum(dx * (t - t.mean())) / np.sum(dx * dx))
    return float(t.mean() - b * depth.mean()), b


def _step_scales(host_records: list[dict], blocks: dict[str, float]) -> dict:
    """host_step_s (and host_step_layer_s where a wrapper was timed at two depths or more)
    from the step records of the wrappers in `blocks` (the module docstring's rules)."""
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
        else:  # one depth: everything outside the blocks is the constant (as before)
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

    host_block_s: time_s is one block's fwd + bwd (the TP bench's per-block time included).
    host_step_s: a wrapper's step at one depth: the median over its step records of
    time_s - layers x its host_block_s, clamped at 0; at two depths or more: the intercept
    of `step_line`, clamped at 0, and host_step_layer_s its slope less host_block_s,
    clamped at 0: the step's host work outside the blocks, once a step and per layer."""
    blocks = {w: round(float(statistics.median(v)), 7)
              for w, v in _by_wrapper(host_records, PURPOSE, lambda r: r["results"]["time_s"])
              .items()}
    out = {"host_block_s": [[w, t] for w, t in sorted(blocks.items())]} if blocks else {}
    out.update(_step_scales(host_records, blocks))
    return out


def overlap_k(host_records: list[dict], device_time, host_block_s) -> dict:
    """{"host_overlap_k": k} fitted to the sweep's blocks; {} without them or a plain host time.

    Each sweep record is one plain compiled block (fwd + bwd) at a micro-batch where its GPU
    time d (`device_time(record)`: the calibrated analytic terms, as `block_checks` prices
    the block) is near the host's h (host_block_s "plain"). k minimises the squared log error
    of (d^k + h^k)^(1/k) against the measured time over K_GRID (`overheads.interleaved`);
    microbenchmarks only, no end-to-end run.
    """
    from trainplan.cost.measured import interleaved

    h = dict((str(w), float(t)) for w, t in host_block_s or ()).get("plain")
    sweep = [r for r in host_records if r.get("purpose") == SWEEP
             and wrapper_name(r["config"]) == "plain"]
    if not sweep or not h:
        return {}
    d = np.array([device_time(r) for r in sweep])
    t = np.array([float(r["results"]["time_s"]) for r in sweep])
    loss = [float(np.sum(np.log(interleaved(d, h, k) / t) ** 2)) for k in K_GRID]
    return {"host_overlap_k": float(K_GRID[int(np.argmin(loss))])}
