"""Measured overheads the analytic terms leave out, read from the card's calibration, each
neutral where nothing is measured.

- `tp_block_scale`: a tensor-parallel block's time over its priced compute, measured on one
  block laid out as the harness lays it out (`trainplan.calibrate.tp`); `fsdp_leak`, the
  share of FSDP2's overlapped traffic that still costs time, as that block was read.
- `host_time_per_microbatch`: the host's time to issue a micro-batch's blocks, measured on
  blocks too small to keep the GPU busy (`trainplan.calibrate.host`); `host_wait_per_step`
  turns it into the step's wait, which `perf.evaluate` adds where the host is the slower;
  `host_step_time`, the host's work a step outside the blocks (a constant and a part per
  layer of the stage), joins the last micro-batch's.
- `activation_scale`: the bytes a block keeps for backward, measured over analytic
  (`calibrate_pieces`), per compile mode and recompute.
"""

from __future__ import annotations

import numpy as np

from trainplan.specs import GPUSpec
from trainplan.specs.layouts import RECOMPUTE


def tp_block_scale(gpu: GPUSpec, tp, fsdp):
    """The measured TP block scale (`trainplan.calibrate.tp`) at degree `tp`, FSDP2 or not.

    Interpolated in log2(tp) between the measured degrees, from 1 at tp = 1, and held at
    the largest measured degree beyond it; a wrapper with no record of its own takes the
    other's. 1 where nothing is measured (the analytic terms alone).
    """
    tp = np.asarray(tp, dtype=float)
    fsdp = np.asarray(fsdp, dtype=bool)
    out = np.ones(np.broadcast(tp, fsdp).shape)
    rows = [(float(t), bool(f), float(s)) for t, f, s in gpu.tp_block_scales]
    for flag in (False, True):
        pts = sorted((t, s) for t, f, s in rows if f == flag) \
            or sorted((t, s) for t, f, s in rows if f != flag)
        if pts:
            x = np.log2([1.0] + [t for t, _ in pts])
            y = [1.0] + [s for _, s in pts]
            out = np.where(fsdp == flag, np.interp(np.log2(np.maximum(tp, 1.0)), x, y), out)
    return out


def fsdp_leak(gpu: GPUSpec, tp, fsdp):
    """Share (0-1) of FSDP2's gather and reduce-scatter time that costs step time even where
    compute could hide it.

    `overlap_exposed` (the overlap microbenchmark: a GEMM beside a collective) where FSDP2
    runs without tensor parallel. Beside tensor parallel, 1: the TP x FSDP2 block
    microbenchmark is read with FSDP2's traffic in full (`calibrate.tp.priced`; 13B width,
    TP 2 x FSDP 2: 17.7 ms a block, validate-h200x4-20261127/wide/), TP's collectives on
    the critical path sharing NVLink with it, so the step prices such a block as its scale
    was measured. Context parallel's ring beside FSDP2 keeps `overlap_exposed` (no block
    of the two together was measured).
    """
    tp, fsdp = np.asarray(tp), np.asarray(fsdp, dtype=bool)
    return np.where((tp > 1) & fsdp, 1.0, gpu.overlap_exposed)


def per_wrapper(rows, tp, fsdp):
    """Each layout's value from rows ((wrapper, seconds), ...) of "plain", "fsdp2", "tpN" and
    "tpN+fsdp2": "tpN+fsdp2" (tp > 1 with FSDP2), "tpN" (tp > 1), "fsdp2", else "plain". A
    TP degree not measured takes the nearest measured one's (in log2 tp), a TP wrapper with
    no degree measured the other TP wrapper's, then the non-TP one's; "fsdp2" unmeasured
    takes "plain"; 0 where nothing is measured."""
    table = {str(w): float(t) for w, t in rows}
    tp, fsdp = np.asarray(tp, dtype=float), np.asarray(fsdp, dtype=bool)
    shape = np.broadcast(tp, fsdp).shape
    plain = table.get("plain", 0.0)
    value = np.where(fsdp, table.get("fsdp2", plain), plain) * np.ones(shape)
    tp = np.broadcast_to(tp, shape)
    for flag, mine, other in ((False, "", "+fsdp2"), (True, "+fsdp2", "")):
        pts = {}
        for suffix in (mine, other):
            pts = pts or {float(w[2:len(w) - len(suffix)]): t for w, t in table.items()
                          if w.startswith("tp") and w[2:len(w) - len(suffix)].isdigit()
                          and w.endswith(suffix)}
        if pts:
            degs = np.array(sorted(pts))
            near = np.abs(np.log2(np.maximum(tp, 1.0))[..., None] - np.log2(degs)).argmin(-1)
            value = np.where((tp > 1) & (fsdp == flag), np.array([pts[d] for d in degs])[near],
                             value)
    return value


def host_time_per_microbatch(gpu: GPUSpec, layers, tp, fsdp):
    """Seconds the host takes to issue one micro-batch's fwd + bwd of `layers` blocks:
    layers x `host_block_s` of the layout's block wrapper (`trainplan.calibrate.host`).

    Wrapper: "tpN+fsdp2" (tp > 1 with FSDP2), "tpN" (tp > 1), "fsdp2", else "plain" (one
    GPU, DDP, PP alone). A TP degree not measured takes the nearest measured one's (in
    log2 tp), a TP wrapper with no degree measured the other TP wrapper's, then the
    non-TP one's; "fsdp2" unmeasured takes "plain" (both lower bounds). 0 where nothing
    is measured: no host floor, the planner as before.
    """
    return np.asarray(layers, dtype=float) * per_wrapper(gpu.host_block_s, tp, fsdp)


def ring_host_time(gpu: GPUSpec, cp, compiled):
    """Seconds the host spends issuing one block's ring attention, fwd + bwd, beyond plain
    SDPA (`gpu.ring_host_s`, `trainplan.calibrate.host.ring_host_scales`).

    The ring's Python work runs once per ring step (cp - 1 of them, each way): a cp not
    measured takes the nearest measured cp's time per step, times its own cp - 1. 0 where
    cp = 1 or nothing is measured for the compile mode.
    """
    cp = np.asarray(cp, dtype=float)
    rows = [(float(c), float(s)) for c, comp, s in gpu.ring_host_s
            if bool(comp) == bool(compiled)]
    if not rows:
        return np.zeros(cp.shape) if cp.shape else 0.0
    cps = np.array([c for c, _ in rows])
    per_step = np.array([s / (c - 1.0) for c, s in rows])
    near = np.abs(np.log2(np.maximum(cp, 2.0))[..., None] - np.log2(cps)).argmin(-1)
    out = np.where(cp > 1, per_step[near] * (cp - 1.0), 0.0)
    return out if out.shape else float(out)


def host_step_time(gpu: GPUSpec, tp, fsdp, layers):
    """Seconds the host spends once a step outside the blocks of a stage of `layers` blocks:

        host_step_s[w] + layers x host_step_layer_s[w]

    of the layout's wrapper w (`trainplan.calibrate.host`; the same wrapper and
    nearest-TP-degree rules as `host_time_per_microbatch`), fitted to whole steps at
    micro-batch 1 and 64 tokens, timed at two depths, less their blocks. The constant: the
    embedding, compiled head and loss, FSDP2's root hooks, the feed, the optimizer's and
    clipping's fixed launch cost. Per layer: fused AdamW's step, zero_grad and
    clip_grad_norm_ run per (DTensor) parameter tensor, so a deeper stage pays more.

    Per stage, constant included: each pipeline stage steps its own optimizer and clips
    its own gradients, and the stages do so side by side, so the step waits on one
    stage's host work, not their sum. 0 where nothing is measured; without
    host_step_layer_s the constant alone (records timed at one depth)."""
    return per_wrapper(gpu.host_step_s, tp, fsdp) \
        + np.asarray(layers, dtype=float) * per_wrapper(gpu.host_step_layer_s, tp, fsdp)


def host_wait_per_step(gpu: GPUSpec, t_dev, *, layers, tp, fsdp, zero, grad_accum, cp=1,
                       pp=1, compiled=True):
    """Seconds a step waits on the host beyond the device time `t_dev` of each micro-batch.

    A micro-batch whose FSDP2 hooks gather and reduce-scatter costs the host the "fsdp2"
    wrapper's time (`host_time_per_microbatch`). Without resharding (ZeRO-1/2) the
    harness gathers once and reduce-scatters on the last micro-batch only
    (`bench.step._sync_context`), so the other m - 1 micro-batches cost what the block
    without FSDP2 costs (a lower bound: the hooks still run, doing no collective); under
    a pipeline (`pp` > 1) the last one too, as `torch.distributed.pipelining` skips every
    backward's reduce-scatter and issues the stage's at once after the last
    (`cost.step_time.fsdp_passes`; that tail's and the one gather's hooks unpriced, a lower
    bound as above). ZeRO-3 and layouts without FSDP2 pay their wrapper's
    time every micro-batch. Each micro-batch waits what `interleaved` adds to its device
    time.

    The step's host work outside the blocks (`host_step_time` of the stage's `layers`:
    head and loss, clipping, the optimizer's step and zero_grad, FSDP2's root) is issued
    once a step, after the last micro-batch's backward: `last_microbatch_time` says how it
    meets that micro-batch's device time. With no `host_step_s` nor `host_step_layer_s`
    the extra is 0. Context parallel adds each block's ring attention (`ring_host_time`).
    """
    ring = np.asarray(layers, dtype=float) * ring_host_time(gpu, cp, compiled)
    blocks = host_time_per_microbatch(gpu, layers, tp, fsdp) + ring
    no_sync = np.asarray(fsdp, dtype=bool) & (np.asarray(zero) < 3)
    light = np.where(no_sync, host_time_per_microbatch(gpu, layers, tp, False) + ring, blocks)
    ga = np.asarray(grad_accum, dtype=float)
    k = gpu.host_overlap_k
    last_blocks = np.where(no_sync & (np.asarray(pp) > 1), light, blocks)  # pipelining: none
    last = last_microbatch_time(t_dev, last_blocks, host_step_time(gpu, tp, fsdp, layers), k,
                                tail_phase=~np.asarray(fsdp, dtype=bool))
    return (last - t_dev) + (ga - 1.0) * (interleaved(t_dev, light, k) - t_dev)


def last_microbatch_time(device_s, blocks_host_s, step_host_s, k: float, tail_phase):
    """Seconds of a step's last micro-batch with the step's host work outside the blocks.

    d = `device_s` (the micro-batch's GPU time), h_b = `blocks_host_s` (the host's issue
    time of its blocks, `host_time_per_microbatch`), h_s = `step_host_s` (`host_step_time`).

    Where `tail_phase` (the layouts without FSDP2: TP alone, PP alone, DDP, one GPU; fp32
    weights under autocast): two phases,

        max(interleaved(d, h_b, k), h_b + h_s)

    The smooth maximum's k (`calibrate_host.overlap_k`) was measured on one block, whose
    host and GPU work alternate kernel by kernel; the clipping, optimizer step and
    zero_grad that make up most of h_s (`bench.harness.step.train_step`) come after the
    last backward is issued, with no host-device sync in between (the timed step syncs
    before its feed and after the optimizer only, `bench.harness.train`). The host issues
    them while the GPU drains the backward it has queued, so they cost time only where
    the host, done with the blocks at h_b, finishes them after the GPU finishes its queue:
    the roofline's max of two pipelined phases (Williams, Waterman and Patterson 2009,
    sec. 3). TP alone makes h_s
    largest (host_step_s tp4 28 ms on H200, against 3 ms plain), and the one-phase form
    priced its coupling at up to 2^(1/k) - 1 (22% at k = 3.5) of the whole step.

    Elsewhere (FSDP2 layouts) one phase, interleaved(d, h_b + h_s, k), as before: the
    same argument holds there, but those layouts' host work is measured less completely
    (the "fsdp2" block at ZeRO-2 only; TP x FSDP2's link sharing unpriced) and the
    coupling's premium stands in for it until it is measured.
    """
    coupled = interleaved(device_s, np.asarray(blocks_host_s) + np.asarray(step_host_s), k)
    tail = np.maximum(interleaved(device_s, blocks_host_s, k),
                      np.asarray(blocks_host_s) + np.asarray(step_host_s))
    return np.where(np.asarray(tail_phase, dtype=bool), tail, coupled)


def interleaved(device_s, host_s, k: float):
    """Seconds a piece of work takes whose GPU time is `device_s` and host issue time `host_s`.

    k = 0 (not measured): max(device, host), the roofline: the slower side sets the pace and
    the other hides under it. Measured (`calibrate_host.overlap_k`, one block timed at
    micro-batches where the two are close): (device^k + host^k)^(1/k), a smooth maximum,
    the max as k grows and their sum at k = 1: measured work runs below a roofline near
    its ridge point (Williams, Waterman and Patterson 2009, Roofline, sec. 3).
    """
    d = np.asarray(device_s, dtype=float)
    h = np.asarray(host_s, dtype=float)
    if not k:
        return np.maximum(d, h)
    top = np.maximum(np.maximum(d, h), 1e-30)  # scaled: no overflow for large k
    return top * ((d / top) ** k + (h / top) ** k) ** (1.0 / k)


def activation_scale(gpu: GPUSpec, compiled, recompute_code):
    """The measured kept-bytes scale for (compiled, recompute), vectorised over layouts.

    Falls back to the same compile mode without recompute, then to 1.
    """
    compiled = np.asarray(compiled, dtype=bool)
    code = np.asarray(recompute_code)
    table = {(bool(c), RECOMPUTE.index(rc)): float(s) for c, rc, s in gpu.activation_scales}
    out = np.ones(np.broadcast(compiled, code).shape)
    for mode in (True, False):
        base = table.get((mode, 0), 1.0)
        for rc in range(len(RECOMPUTE)):
            out = np.where((compiled == mode) & (code == rc), table.get((mode, rc), base), out)
    return out if out.shape else float(out)
