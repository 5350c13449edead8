"""Per-step monitoring of the proxy run: what the operations page (runbook page 6) reads.

With `--metrics PATH`, rank 0 appends one JSON line per step (format: bench/README.md,
"Per-step metrics"), every rank's numbers gathered in one all_gather of four floats, so an
operator tails one file per job. Step time is the slowest rank's; tokens/s/GPU and MFU
follow train.py's summary. Stragglers: a rank's own time is `host_s + min(step_s)` (the
others wait for it in the gradient collective), and one whose median over the last
`--straggler-window` steps exceeds the median over ranks by `--straggler-tolerance` is
listed. Alerts: after `--alert-window` measured steps, a rate below
`--alert-tokens-per-s-per-gpu` writes one alert line, and again only after it recovered.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainplan.bench.flags import add_monitor_arguments as add_arguments  # noqa: F401
from trainplan.errors import TrainplanError

if TYPE_CHECKING:
    import pandas as pd

GiB = 1024**3


def peak_memory(device) -> dict:
    """The run's peak memory, GiB: the largest over ranks of `torch.cuda.max_memory_allocated`
    and `max_memory_reserved`, each rank's pair in rank order (`peak_mem_by_rank_gib`:
    [allocated, reserved]; a pipeline's stages differ, and the two largest may be two ranks'),
    and rank 0's reserved memory by stream (`pools_by_stream`). None off CUDA. Every rank
    calls it: one all_gather of two floats."""
    if device.type != "cuda":
        return dict.fromkeys(("peak_mem_allocated_gib", "peak_mem_reserved_gib",
                              "peak_mem_by_rank_gib", "memory_pools"))
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / GiB,
                         torch.cuda.max_memory_reserved(device) / GiB], dtype=torch.float64,
                        device=device)
    rows = [mine]
    if dist.is_initialized():
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
    # nothing was emptied since the peak: this rank's pools still hold what they reserved
    return {**peaks_over_ranks([r.tolist() for r in rows]),
            "memory_pools": pools_by_stream(torch.cuda.memory_snapshot(), device.index or 0)}


def peaks_over_ranks(by_rank: list[list[float]]) -> dict:
    """`peak_memory`'s figures from every rank's [allocated, reserved] peak, GiB, in rank order:
    the largest of each over ranks (unrounded) and the pairs rounded to 0.1 MiB."""
    return {"peak_mem_allocated_gib": max(r[0] for r in by_rank),
            "peak_mem_reserved_gib": max(r[1] for r in by_rank),
            "peak_mem_by_rank_gib": [[round(v, 4) for v in r] for r in by_rank]}


def pools_by_stream(segments: list[dict], device_index: int) -> dict[str, dict]:
    """{stream: {"reserved_gib", "allocated_gib", "segments"}} of one device's caching-allocator
    segments (`torch.cuda.memory_snapshot()`): which stream's pool holds the memory reserved
    beyond what is allocated (FSDP2's copy-in and reduce-scatter streams keep their own)."""
    out: dict[str, dict] = {}
    for seg in segments:
        if seg.get("device", device_index) != device_index:
            continue
        pool = out.setdefault(str(seg.get("stream", 0)),
                              {"reserved_gib": 0.0, "allocated_gib": 0.0, "segments": 0})
        pool["reserved_gib"] += seg.get("total_size", 0) / GiB
        pool["allocated_gib"] += seg.get("allocated_size", 0) / GiB
        pool["segments"] += 1
    return {k: {**v, "reserved_gib": round(v["reserved_gib"], 4),
                "allocated_gib": round(v["allocated_gib"], 4)} for k, v in out.items()}


class MonitorError(TrainplanError):
    """A monitoring flag that cannot be used."""


def launch_flags(watch: dict, path: str = "metrics.jsonl") -> list[str]:
    """The flags that make a launched run watch itself against its plan.

    `watch` is `trainplan.launch.artefacts.watch(...)`: its alert line (a share of the
    plan's tokens/s/GPU) becomes the alert threshold, and its straggler line (a
    ratio over the plan's step time) the tolerance, so the metrics file and the
    runbook's table use the same numbers.
    """
    ratio = watch["straggler_step_time_s"] / watch["step_time_s"]
    return ["--metrics", path,
            "--alert-tokens-per-s-per-gpu", f"{watch['alert_tokens_per_s_per_gpu']:.0f}",
            "--straggler-tolerance", f"{ratio - 1:.2f}"]


def check_args(args) -> None:
    """MonitorError naming the first monitoring flag out of its range (nan is in none)."""
    if not (math.isfinite(args.straggler_tolerance) and args.straggler_tolerance >= 0):
        raise MonitorError(f"--straggler-tolerance = {args.straggler_tolerance} must be a "
                           "finite number >= 0 (a share above the median over ranks)")
    for name in ("straggler_window", "alert_window"):
        if getattr(args, name) < 1:
            raise MonitorError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    threshold = args.alert_tokens_per_s_per_gpu
    if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
        raise MonitorError(f"--alert-tokens-per-s-per-gpu = {threshold} must be a finite "
                           "number > 0 (leave it out for no alert)")


class Monitor:
    """One run's monitor: `step()` after every timed step on every rank, `finish()` at the end."""

    def __init__(self, args, *, tokens_per_step: int, flops_per_token: float,
                 peak: float | None, device, rank: int, world: int):
        check_args(args)
        self.args, self.device, self.rank, self.world = args, device, rank, world
        self.tokens_per_step, self.flops_per_token, self.peak = (tokens_per_step,
                                                                 flops_per_token, peak)
        self.on = bool(args.metrics) or args.alert_tokens_per_s_per_gpu is not None
        self.own = deque(maxlen=args.straggler_window)  # per step: each rank's own time
        self.rates = deque(maxlen=args.alert_window)  # per step: step time (max over ranks)
        self.calls, self.alerting, self.alerts = 0, False, 0
        self.last = time.perf_counter()  # end of the previous step (or of the set-up)
        self.file = None
        if args.metrics and rank == 0:
            Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(args.metrics, "a")  # appended: a resumed run continues the file

    def step(self, step: int, step_time_s: float) -> dict | None:
        """Gather this step's numbers; rank 0 writes them. Every rank must call it."""
        now = time.perf_counter()
        host_s = max(0.0, now - step_time_s - self.last)
        self.calls += 1
        if not self.on:
            self.last = now
            return None
        cuda = self.device.type == "cuda"
        mine = torch.tensor([step_time_s, host_s,
                             torch.cuda.memory_allocated(self.device) / GiB if cuda else math.nan,
                             torch.cuda.memory_reserved(self.device) / GiB if cuda else math.nan],
                            dtype=torch.float64, device=self.device)
        rows = [mine]
        if dist.is_initialized() and self.world > 1:
            rows = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(rows, mine)
        per_rank = torch.stack(rows).cpu().tolist()  # (world, 4)
        self.last = time.perf_counter()  # the gather's own time is not the next step's host
        if self.rank != 0:
            return None
        return self._record(step, per_rank)

    def _record(self, step: int, per_rank: list[list[float]]) -> dict:
        step_s = [r[0] for r in per_rank]
        host_s = [r[1] for r in per_rank]
        warmup = self.calls <= self.args.warmup
        slowest = max(step_s)
        rate = self.tokens_per_step / slowest / self.world if slowest > 0 else 0.0
        stragglers = []
        if not warmup:
            self.own.append([h + min(step_s) for h in host_s])
            self.rates.append(slowest)
            stragglers = self._stragglers()
        line = {"step": step, "t": time.time(), "warmup": warmup, "step_time_s": slowest,
                "step_s": step_s, "host_s": host_s, "tokens_per_s_per_gpu": rate,
                "mfu": rate * self.flops_per_token / self.peak if self.peak else None,
                "mem_allocated_gib": _or_none([r[2] for r in per_rank]),
                "mem_reserved_gib": _or_none([r[3] for r in per_rank]),
                "stragglers": stragglers}
        self._write(line)
        self._alert(step)
        return line

    def _stragglers(self) -> list[int]:
        """Ranks whose own time (median over the window) is above the median over ranks."""
        own = [statistics.median(col) for col in zip(*self.own, strict=True)]
        middle = statistics.median(own)
        return [r for r, t in enumerate(own)
                if t > middle * (1 + self.args.straggler_tolerance)]

    def _alert(self, step: int) -> None:
        threshold = self.args.alert_tokens_per_s_per_gpu
        if threshold is None or len(self.rates) < self.rates.maxlen:
            return
        rate = self.tokens_per_step * len(self.rates) / sum(self.rates) / self.world
        low = rate < threshold
        if low and not self.alerting:
            self.alerts += 1
            self._write({"alert": "throughput", "step": step, "t": time.time(),
                         "tokens_per_s_per_gpu": rate, "threshold": threshold,
                         "window": len(self.rates)})
            print(f"trainplan monitor: ALERT step {step}: {rate:,.0f} tokens/s/GPU over the "
                  f"last {len(self.rates)} steps, below {threshold:,.0f}", file=sys.stderr,
                  flush=True)
        self.alerting = low

    def _write(self, line: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()  # an operator tails it while the run goes on

    def finish(self) -> dict:
        """Close the file; the summary's `monitor` entry."""
        if self.file is not None:
            self.file.close()
            self.file = None
        return {"metrics": self.args.metrics, "alerts": self.alerts}


def _or_none(values: list[float]) -> list[float] | None:
    return None if all(math.isnan(v) for v in values) else values


def read(path) -> pd.DataFrame:
    """A metrics file as a table, one row per line in order: step lines, and alert lines
    (the `alert` column set, NaN on step lines). Per-rank columns hold lists. pandas is
    imported here, not at the top: the ranks of a run never need it."""
    import pandas as pd

    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    frame = pd.DataFrame(rows)
    if "alert" not in frame.columns:
        frame["alert"] = None
    return frame
