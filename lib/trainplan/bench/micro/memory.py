"""The memory-stack bench: the caching allocator's reserve as the model deepens, per wrapper.

`--benches memory-stack` (opt-in: not in the default `--benches`, so `trainplan validate`'s
launch does not run it; records marked top-level `"purpose": "memory-stack"`) trains the
model (`--model`) cut to its first N blocks, for each N of `--memory-layers` (2, 4), under
the wrappers the host-step bench uses: "plain" (rank 0's own model, fp32 weights under
autocast, as one GPU runs), and where there are two ranks or more FSDP2 ZeRO-2, FSDP2
ZeRO-3 and each runnable `--tp-modes` mode (TP with sequence parallel, alone or with FSDP2
on the other mesh dimension). Micro-batch --tokens / --seq-len (at least 1) of --seq-len
tokens, as the block benches take them. The model is built, wrapped, compiled and stepped
as `bench.micro_step` builds the host-step bench's (`micro_step._build`: the harness's
`parallelize` steps in order; AdamW by `train.make_optimizer`; the compiled loss; the
synthetic feed; `step.train_step` with clipping).

Measured per depth: after `warmup` steps (the first compiles; the optimizer's states are
made), `torch.cuda.reset_peak_memory_stats()` and `steps` more steps; then
`max_memory_reserved` and `max_memory_allocated` (bytes; the peak allocation of the
measured steps, the reserve as the warm-up left it and the steps grew it, as an end-to-end
run's peak holds it) and the bytes reserved in the pools of streams other than the compute
stream (FSDP2's copy-in and reduce-scatter streams, read from `torch.cuda.memory_snapshot()`
right after the steps; `bench.harness.monitor.pools_by_stream` gives rank 0's per stream too), each
figure the max over ranks. The record is a `block` record (the measured steps' wall times,
the slowest rank's, as time_s; activation_bytes 0, not measured here) whose purpose keeps
it out of every other fit; `trainplan.calibrate.memory` turns the depths into a reserve per
layer.
Everything is freed between depths (gc, `empty_cache`), so a depth starts from an empty
pool. On CPU there are no allocator statistics: the bench runs (for the plumbing) and
writes None for every byte field, which the calibration skips.

The step is `micro_step.harness_step`'s; the loop is this bench's own, for the peak reset
between warm-up and measured steps.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch

from trainplan.bench.harness.monitor import pools_by_stream
from trainplan.bench.micro.layouts import whole_list
from trainplan.bench.micro.shapes import whole
from trainplan.bench.micro.step import harness_step, step_config, wrapper_setup
from trainplan.bench.micro.timing import card, slowest, sync, timed_results
from trainplan.errors import SpecError
from trainplan.records.schema import microbenchmark_record
from trainplan.specs import load_model

BYTES = ("peak_reserved_bytes", "peak_allocated_bytes", "side_pool_bytes")


def stack_tasks(args, rank: int, world: int, tps: list) -> list[tuple[str, dict]]:
    """One task per (wrapper, depth): plain on rank 0; with world > 1 FSDP2 ZeRO-2 and ZeRO-3
    and the runnable TP modes `tps` on every rank; each at the depths of --memory-layers, at
    micro-batch --tokens / --seq-len of --seq-len tokens."""
    depths = sorted(set(whole_list(args.memory_layers, "--memory-layers")))
    full = load_model(args.model).n_layers
    if not depths or depths[-1] > full:
        raise SpecError(f"--memory-layers {args.memory_layers!r} is not valid; use a comma list "
                        f"of depths 1..{full} (the blocks of {args.model}), e.g. 2,4")
    bad = [t for t, _ in tps if args.seq_len % t]
    if bad:
        raise SpecError(f"--seq-len {args.seq_len} is not valid for bench memory-stack: "
                        f"tp = {bad[0]} must divide it (sequence parallel splits it)")
    base = {"model": args.model, "micro_batch": max(1, args.tokens // args.seq_len),
            "seq": args.seq_len}
    pairs = ([(1, 0)] if rank == 0 else []) + ([(1, 2), (1, 3), *tps] if world > 1 else [])
    return [("memory-stack", {**base, "tp": t, "zero": z, "layers": (n,)})
            for t, z in pairs for n in depths]


def side_pool_bytes(segments: list[dict], device_index: int, stream: int) -> int:
    """Bytes reserved in one device's pools of streams other than `stream` (the compute
    stream): whole segments of `torch.cuda.memory_snapshot()`, allocated or not."""
    return sum(int(s.get("total_size", 0)) for s in segments
               if s.get("device", device_index) == device_index and s.get("stream", 0) != stream)


def _free(dev) -> None:
    torch._dynamo.reset()  # compiled graphs may hold the last depth's modules alive
    gc.collect()  # the last depth's model and optimizer went with `_stack_peaks`
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the next depth's reserve, not this one's


def _stack_peaks(spec, micro_batch: int, seq: int, *, tp: int, zero: int, dev, low: bool,
                 compile: bool, mesh, warmup: int, steps: int, max_norm: float):
    """(wall seconds of each measured step, [peak reserved, peak allocated, side pools] bytes
    or None off CUDA, rank 0's pools by stream or None) of `steps` steps after `warmup`,
    the model built and stepped as `micro_step._timed_steps` does."""
    step = harness_step(spec, micro_batch, seq, tp=tp, zero=zero, dev=dev, low=low,
                        compile=compile, mesh=mesh, max_norm=max_norm)
    for _ in range(warmup):
        step()
    sync(dev)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        wall.append(time.perf_counter() - t0)
    if not cuda:
        return wall, None, None
    segments = torch.cuda.memory_snapshot()  # nothing emptied since the steps: pools intact
    side = side_pool_bytes(segments, dev.index or 0, torch.cuda.current_stream(dev).cuda_stream)
    peaks = [float(torch.cuda.max_memory_reserved(dev)),
             float(torch.cuda.max_memory_allocated(dev)), float(side)]
    return wall, peaks, pools_by_stream(segments, dev.index or 0)


def bench_memory_stack(model: str, micro_batch: int, seq: int, *, tp: int = 1, zero: int = 0,
                       layers=(2, 4), compile: bool = True, dtype: str = "bfloat16",
                       warmup: int = 3, steps: int = 3, max_norm: float = 1.0,
                       run_id: str | None = None, extra: dict | None = None) -> list[dict]:
    """One record per depth N of `layers`: the peaks of `steps` training steps of the model's
    first N blocks under one wrapper (the module docstring).

    tp = 1, zero = 0: "plain", this rank's own model (the caller's rank alone); else every
    rank calls it: a (world / tp, tp) mesh, tensor parallel with sequence parallel where
    tp > 1, FSDP2 over the first dimension where zero is 2 or 3. config["model"] stays the
    model's name, config["layers"] is N and model_spec the model as built."""

    whole(micro_batch=micro_batch, seq=seq, steps=steps, tp=tp)
    whole(low=0, warmup=warmup)
    depths = [int(n) for n in layers]
    spec = load_model(model)
    if not depths or any(isinstance(n, bool) or not 1 <= n <= spec.n_layers for n in depths):
        raise SpecError(f"layers = {tuple(layers)!r} is not valid: depths 1..{spec.n_layers} "
                        f"(the blocks of {spec.name!r})")
    alone, n, low, dev, mesh = wrapper_setup(tp, zero, seq, dtype, "the memory stack")
    warmup = max(1, warmup)  # the first step compiles: never measured
    tokens = micro_batch * seq
    out = []
    for depth in depths:
        cut = dataclasses.replace(spec, n_layers=depth)
        _free(dev)
        wall, peaks, pools = _stack_peaks(cut, micro_batch, seq, tp=tp, zero=zero, dev=dev,
                                          low=low, compile=compile, mesh=mesh, warmup=warmup,
                                          steps=steps, max_norm=max_norm)
        _free(dev)
        if not alone:  # the slowest rank's steps, the largest rank's bytes
            (wall,) = slowest(wall, dev=dev)
            (peaks,) = slowest(peaks, dev=dev) if peaks else (None,)
        results = {**timed_results(wall, tokens, "tokens_per_s", 1.0), "activation_bytes": 0,
                   **dict(zip(BYTES, [int(b) for b in peaks] if peaks else [None] * 3,
                              strict=True)),
                   "memory_pools": pools}  # activation_bytes: not measured here
        config = {**step_config(cut, setup=(alone, n, low, dev, mesh), tp=tp, zero=zero,
                                micro_batch=micro_batch, seq=seq, compile=compile,
                                max_norm=max_norm, dtype=dtype, warmup=warmup),
                  "steps": steps, "peaks": "after warm-up (reset_peak_memory_stats)"}
        out.append(microbenchmark_record(bench="block", config=config, results=results,
                                         gpus=1 if alone else n, card=card(dev), run_id=run_id,
                                         extra=extra))
    return out
