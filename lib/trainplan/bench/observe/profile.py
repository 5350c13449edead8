"""Where a step's time goes: one harness run under `torch.profiler`, kernels in named buckets.

    torchrun --standalone --nproc-per-node 2 -m trainplan.bench.observe.profile \
        --profile-out prof.json [--impl trainplan|hf-baseline|hf-trainer] [--sdpa cudnn] \
        [--active 3] [--every-rank] [--trace-out trace.json.gz] [train.py flags]

Profile before optimising. The run is train.py's own (its loop,
data, loss, optimizer and layout: nothing copied), or with `--impl hf-trainer` transformers'
Trainer's (`harness.hf_trainer`); this entry only counts `step.train_step` calls (Trainer's
step ends) to drive the profiler's schedule (skip the warm-up
steps, record `--active` steps) and, on rank 0, writes a JSON file with GPU
kernel time per step in buckets (matmul, attention, fused element-wise
(Triton), collectives, optimizer, copies, other), the top kernels, and the
timed step of the same steps, so that the gap to the matmul ceiling is a sum
of named terms. Collective kernels overlap compute, so the buckets can add up
to more than the step: `busy_s` is the union's upper bound, not the wall.
`--every-rank`: the other ranks write their own buckets beside it
(prof.rank1.json, ...), where ranks do different work (pipeline stages).
Each file also has the GPU timeline's terms (`timeline`): over the recorded window, the
span of its kernels, the union of the compute kernels and the rest, the time in which no
compute kernel runs on that GPU (a pipeline stage's bubble shows there), and the longest
of those stretches with the kernels either side (`gaps`), and the host's side (`host`,
`observe.host_ops`): per thread, the operators' self time and kernel launches per step.

`--sdpa` picks the attention backend before anything is compiled (the
choice is baked into compiled graphs): default, flash, cudnn, efficient.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch

from trainplan import loader
from trainplan.bench.harness import hf_trainer, train
from trainplan.bench.harness import step as step_mod
from trainplan.bench.observe import host_ops
from trainplan.compare.trace_split import is_annotation  # one rule, shared with the JSON reader
from trainplan.records.provenance import provenance
from trainplan.records.schema import IMPLS

BUCKETS = (  # first match wins; names of CUDA kernels as the profiler reports them
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("collectives", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm90|sm80", re.I)),
    ("elementwise_fused", re.compile(r"triton", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy|cat_|CatArray", re.I)),
)
SDPA = ("default", "flash", "cudnn", "efficient")


def set_sdpa_backend(name: str) -> None:
    """Leave only `name` (and the math fallback) enabled for scaled_dot_product_attention."""
    if name == "default":
        return
    cuda = torch.backends.cuda
    cuda.enable_flash_sdp(name == "flash")
    cuda.enable_cudnn_sdp(name == "cudnn")
    cuda.enable_mem_efficient_sdp(name == "efficient")


def bucket_of(kernel: str) -> str:
    return next((name for name, pattern in BUCKETS if pattern.search(kernel)), "other")


def summarise(events, active: int, device: bool = True) -> dict:
    """Per-step kernel seconds by bucket, and the 15 longest kernels, from `key_averages()`.

    `device=False` (a CPU run) buckets the operators' own CPU time instead. User annotations
    (`is_annotation`: the profiler step, nccl: and optimizer-step ranges) are not counted.
    """
    from torch.autograd import DeviceType

    buckets: dict[str, float] = {}
    kernels = []
    for e in events:
        if device and e.device_type == DeviceType.CPU:
            continue  # an operator: its kernels are listed as events of their own
        if is_annotation(e):
            continue  # a range around kernels that are listed themselves
        t = e.self_device_time_total if device else e.self_cpu_time_total
        if t <= 0:
            continue
        seconds = t / 1e6 / active
        buckets[bucket_of(e.key)] = buckets.get(bucket_of(e.key), 0.0) + seconds
        kernels.append({"kernel": e.key[:120], "bucket": bucket_of(e.key),
                        "s_per_step": seconds, "calls_per_step": e.count / active})
    kernels.sort(key=lambda k: -k["s_per_step"])
    return {"buckets_s_per_step": dict(sorted(buckets.items(), key=lambda kv: -kv[1])),
            "busy_s": sum(buckets.values()), "top_kernels": kernels[:15]}


def union_s(intervals) -> float:
    """Seconds covered by the union of (start_ns, end_ns) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total / 1e9


GAP_NS = 500_000  # idle stretches of the compute kernels listed by `timeline`: >= 0.5 ms
MAX_GAPS = 60


def gaps(compute, t0: int) -> list[dict]:
    """The longest stretches (>= GAP_NS, at most MAX_GAPS, in time order) in which none of the
    `compute` kernels (stream, start_ns, end_ns, name) runs: start after `t0` and length (s),
    the kernels either side."""
    spans = sorted((a, b, name) for _, a, b, name in compute)
    out, end, before = [], None, None
    for a, b, name in spans:
        if end is not None and a - end >= GAP_NS:
            out.append({"at_s": (end - t0) / 1e9, "s": (a - end) / 1e9,
                        "after": before[:80], "before": name[:80]})
        if end is None or b > end:
            end, before = b, name
    return sorted(sorted(out, key=lambda g: -g["s"])[:MAX_GAPS], key=lambda g: g["at_s"])


def timeline(kernels) -> dict:
    """From (stream, start_ns, end_ns, name) of the recorded GPU kernels, in seconds over the
    recorded window: its span (first kernel's start to last one's end), the union of the
    compute kernels (every bucket but collectives, any stream) and the rest, the time no
    compute kernel runs (a pipeline stage's bubble, a host-bound gap), the idle share of the
    span, each stream's union, and the longest idle stretches (`gaps`).

    Totals and a share, not per step: the window holds the kernels of the recorded steps and
    of whatever was still queued from the step before, so dividing by the steps counted
    would overstate a step. The buckets
    (`summarise`) add kernel times and count overlap twice; this counts it once.
    """
    if not kernels:
        return {}
    compute = [k for k in kernels if bucket_of(k[3]) != "collectives"]
    t0 = min(a for _, a, _, _ in kernels)
    span = (max(b for _, _, b, _ in kernels) - t0) / 1e9
    busy = union_s((a, b) for _, a, b, _ in compute)
    streams = {}
    for stream, a, b, _ in kernels:
        streams.setdefault(str(stream), []).append((a, b))
    return {"window_s": span, "compute_busy_s": busy, "compute_idle_s": span - busy,
            "compute_idle_share": (span - busy) / span if span > 0 else 0.0,
            "stream_busy_s": {k: union_s(v) for k, v in streams.items()},
            "compute_gaps": gaps(compute, t0)}


def gpu_kernels(prof) -> list[tuple]:
    """(stream, start_ns, end_ns, name) of each GPU activity the profiler kept (kernels,
    copies, sets), user annotations left out (`is_annotation`'s ranges on the GPU)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CUDA or e.is_user_annotation():
            continue
        out.append((e.device_resource_id(), e.start_ns(), e.start_ns() + e.duration_ns(),
                    e.name()))
    return out


def host_events(prof) -> list[tuple]:
    """(thread, start_ns, end_ns, name) of each host event the profiler kept (operators,
    annotations, CUDA runtime and driver calls), for `host_ops.summarise`."""
    from torch.autograd import DeviceType

    return [(e.start_thread_id(), e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
            for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CPU]


def host_summary(prof, active: int) -> dict:
    """`host_ops.summarise` of the recorded window: per step of its ProfilerStep# ranges,
    else of the `active` steps the schedule recorded."""
    events = host_events(prof)
    return host_ops.summarise(events, None if host_ops.recorded_steps(events) else active,
                              unit_s=1e-9)


def write_trace(prof, path: str | None, rank: int) -> None:
    """The recorded window's Chrome trace to `path` (rank > 0: `rank_path`), after the
    profile's own file; torch gzips it where the name ends in .gz."""
    if path:
        prof.export_chrome_trace(str(rank_path(path, rank) if rank else path))


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.observe.profile", add_help=False)
    p.add_argument("--profile-out", required=True)
    p.add_argument("--impl", choices=IMPLS, default="trainplan")
    p.add_argument("--sdpa", choices=SDPA, default="default")
    p.add_argument("--active", type=int, default=3, help="steps recorded after the warm-up")
    p.add_argument("--every-rank", action="store_true",
                   help="ranks other than 0 also write their kernel buckets, to PATH's name "
                   "with .rankN before its suffix (pipeline stages differ)")
    p.add_argument("--trace-out", default=None, metavar="PATH",
                   help="also the recorded steps' Chrome trace, host ops by thread and "
                   "kernels (PATH.json or PATH.json.gz; other ranks as for --every-rank)")
    return p.parse_known_args(argv)


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def rank_path(path: str, rank: int) -> Path:
    """Where rank `rank` (> 0) writes its file: .rankN before the suffix, both suffixes of a
    gzipped trace (prof.json -> prof.rank1.json, trace.json.gz -> trace.rank1.json.gz)."""
    out = Path(path)
    if out.name.endswith(".json.gz"):
        return out.with_name(f"{out.name[:-len('.json.gz')]}.rank{rank}.json.gz")
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def unwritable(flag: str, path: str | None) -> str | None:
    """Why `path` (given with `flag`) cannot be written when the run ends, or None: a file
    name (not a folder) of the OS's name length in a folder this user can write in; a
    trace's name ends in .json or .json.gz. Checked before the run starts."""
    if path is None:
        return None
    p, name = Path(path), loader.shown(path)
    if path.endswith(("/", ".")) or p.name in ("", ".", ".."):
        return f"{flag} {name}: a folder, not a file name; name the file"
    if flag == "--trace-out" and not path.endswith((".json", ".json.gz")):
        return f"{flag} {name}: name a .json or .json.gz file (Chrome trace)"
    above, why = loader.nearest_existing(p.parent)
    if why or above is None or above != p.parent.absolute():
        return (f"{flag} {name}: no folder {loader.shown(p.parent)} to write it into "
                f"({why or 'make it first'})")
    too_long = loader.long_name(p, above, extra=len(".rank999"))
    if too_long:
        return f"{flag} {name}: {too_long}"
    return f"{flag} {name}: a folder, not a file name; name the file" if p.is_dir() else None


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile, schedule

    mine, rest = parse(list(sys.argv[1:] if argv is None else argv))
    why = unwritable("--profile-out", mine.profile_out) or unwritable("--trace-out",
                                                                      mine.trace_out)
    if not why and mine.trace_out and Path(mine.trace_out).absolute() == \
            Path(mine.profile_out).absolute():
        why = f"--trace-out {loader.shown(mine.trace_out)}: the same file as --profile-out"
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    trainer = mine.impl == hf_trainer.IMPL  # its own module: no --impl flag
    impl = [] if trainer else ["--impl", mine.impl]
    targs = train.parse_args([*rest, *impl])
    set_sdpa_backend(mine.sdpa)
    active = max(1, min(mine.active, targs.steps - targs.warmup - 1))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    prof = profile(activities=activities,
                   schedule=schedule(wait=targs.warmup, warmup=1, active=active, repeat=1))
    real_step, seen = step_mod.train_step, []

    def counted(*a, **kw):
        out = real_step(*a, **kw)
        if torch.cuda.is_available():  # the step's kernels end before its window does
            torch.cuda.synchronize()   # (train.py syncs just after: its clock is unchanged)
        prof.step()
        seen.append(1)
        return out

    summary = {}
    real_summarise = train.summarise

    def keep(*a, **kw):
        summary.update(real_summarise(*a, **kw))
        return summary

    step_mod.train_step, train.summarise = counted, keep
    try:
        with prof:
            code = (hf_trainer.main(rest, [hf_trainer.on_step_end(prof.step)]) if trainer
                    else train.main([*rest, *impl]))
    finally:
        step_mod.train_step, train.summarise = real_step, real_summarise
    rank = _rank()
    if code or (rank != 0 and not mine.every_rank):
        return code
    if rank != 0:  # its own kernels only: the step's summary is rank 0's
        with open(rank_path(mine.profile_out, rank), "w") as f:
            json.dump({"rank": rank, "active_steps": active, "provenance": provenance(),
                       **summarise(prof.key_averages(), active,
                                   device=torch.cuda.is_available()),
                       **timeline(gpu_kernels(prof)),
                       "host": host_summary(prof, active)}, f, indent=1)
        write_trace(prof, mine.trace_out, rank)
        return 0
    # the profiler's active steps; the last one also runs the profiler's stop and trace
    # collection (0.4-0.9 s on 4 x H100), so the step is their median, not their mean
    recorded = summary.get("step_times_s", [])[1:1 + active]

    out = {"impl": mine.impl, "sdpa": mine.sdpa, "layout": summary.get("layout"),
           "card": summary.get("card"), "active_steps": active,
           # what trace_split.pair matches a compare row on (tag: --tag, as a suite passes)
           "tag": summary.get("tag"), "model": summary.get("model"),
           "gpus": summary.get("gpus"), "seq_len": summary.get("seq_len"),
           "host_gpus": torch.cuda.device_count(), "provenance": provenance(),
           "step_time_s": statistics.median(recorded) if recorded else None,
           "step_times_s_profiled": recorded,
           "step_time_s_unprofiled_median": summary.get("step_time_s"),
           **summarise(prof.key_averages(), active, device=torch.cuda.is_available()),
           **timeline(gpu_kernels(prof)),
           "host": host_summary(prof, active)}
    with open(mine.profile_out, "w") as f:
        json.dump(out, f, indent=1)
    write_trace(prof, mine.trace_out, rank)
    print(json.dumps({k: out.get(k) for k in ("impl", "sdpa", "step_time_s", "busy_s",
                                              "compute_idle_share",
                                              "buckets_s_per_step")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
