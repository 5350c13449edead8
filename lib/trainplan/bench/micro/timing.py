"""Timing of the microbenchmarks: synchronised blocks of calls, medians with intervals.

Each benchmark times `repeats` blocks of `iters` calls after `warmup` calls (CUDA events on
a GPU, the wall clock on CPU) and reports the median with its rank-based 95% interval
(`trainplan.records.stats.median_ci`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from trainplan.bench.micro.shapes import whole
from trainplan.errors import SpecError
from trainplan.records.stats import median_ci

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FROM_DIFFERENCE = "two blocks - one block"
FROM_ONE_BLOCK = "one block (difference not positive)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_blocks(fn, device: torch.device, warmup: int, iters: int, repeats: int,
                 before_block=None) -> list[float]:
    """Seconds per call of `fn`, one figure per timed block of `iters` calls."""
    whole(iters=iters, repeats=repeats)
    whole(low=0, warmup=warmup)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if before_block:
            before_block()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) / iters)
    return times


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SpecError(f"dtype {name!r} is not valid; use one of {list(DTYPES)}")
    return DTYPES[name]


def card(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def timed_results(times: list[float], work: float, unit: str, scale: float) -> dict:
    """time_s (median) with its interval, and the rate `work / time / scale` with its own."""
    iv = median_ci(times)
    return {"time_s": iv.estimate, "time_s_ci": iv.as_list(), "times_s": times,
            unit: work / iv.estimate / scale, f"{unit}_ci": [work / iv.high / scale,
                                                             work / iv.low / scale],
            "ci_enough_samples": iv.enough}


def slowest(*rows: list[float], dev: torch.device) -> list[list[float]]:
    """Each row of per-block times as the slowest rank's (element-wise max over ranks)."""
    t = torch.tensor(rows, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def per_block(one: list[float], two: list[float], tokens: int) -> dict:
    """The results of a block timed as `two` (two blocks) minus `one` (one block), repeat by
    repeat: time_s = median(two) - median(one), its interval the conservative
    [two.low - one.high, two.high - one.low], times_s the paired differences, root_s what
    one call pays once (one_block_s - time_s); the rate's upper bound is None where the
    interval reaches 0. A difference that is not positive falls back to the one-block
    figures (root_s 0)."""
    a, b = median_ci(one), median_ci(two)
    diff = b.estimate - a.estimate
    if diff > 0:
        low, high = b.low - a.high, b.high - a.low
        results = {"time_s": diff, "time_s_ci": [low, high],
                   "times_s": [y - x for x, y in zip(one, two, strict=True)],
                   "tokens_per_s": tokens / diff,
                   "tokens_per_s_ci": [tokens / high, tokens / low if low > 0 else None],
                   "ci_enough_samples": a.enough and b.enough, "per_block_from": FROM_DIFFERENCE}
    else:
        results = {**timed_results(one, tokens, "tokens_per_s", 1.0),
                   "per_block_from": FROM_ONE_BLOCK}
    results.update({"one_block_s": a.estimate, "two_blocks_s": b.estimate,
                    "one_block_times_s": list(one), "two_blocks_times_s": list(two),
                    "root_s": a.estimate - results["time_s"]})
    return results
