"""Where the host's time goes: the profiler's host operators, by thread, as self time per step.

    python -m trainplan.bench.observe.host_ops TRACE.json[.gz] --steps 4 [--top 15] [--json]

A host-bound step is paced by the threads that issue its work: the main thread (forward,
optimizer) and the autograd engine's thread (backward). The kernel buckets of
`observe.profile` cannot show them; this reads the host's events of a recorded window
(`observe.profile --trace-out`, or the profiler's events in process) and gives, per thread,
each operator's self time (its span less its children's, the nesting read from the spans
as the profiler records them: a child starts and ends inside its parent) and calls per
step, and the kernel launches the thread issued. The profiler's own cost (a few
microseconds an operator) is in every figure: compare windows recorded the same way, not
these times with an unprofiled step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from trainplan.errors import TrainplanError

HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")  # Chrome trace's
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
SKIP = ("ProfilerStep#",)  # the schedule's step ranges span everything: not work


def from_chrome_trace(path: str | Path) -> list[tuple]:
    """(thread, start_us, end_us, name) of a Chrome trace's host events (`HOST_CATS`),
    the file gzipped where its name ends in .gz; TrainplanError for a file that is not one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        text = gzip.decompress(raw) if p.name.endswith(".gz") else raw
        events = json.loads(text)["traceEvents"]
        return [(e["tid"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
                for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    except (OSError, ValueError, KeyError, TypeError, EOFError) as err:
        raise TrainplanError(f"host_ops: {str(path)!r} is not a readable Chrome trace "
                             f"(a profiler's --trace-out file): {err}") from None


def self_times(spans: list[tuple]) -> tuple[Counter, Counter]:
    """Self time and calls per operator name of one thread's (start, end, name) spans: each
    span's length less its direct children's (spans nested inside it), in the spans' unit."""
    own, calls = Counter(), Counter()
    stack: list[list] = []  # [end, name, self so far]
    for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][0] <= start:
            _, done, left = stack.pop()
            own[done] += left
        if stack:
            stack[-1][2] -= end - start
        stack.append([end, name, end - start])
        calls[name] += 1
    for _, done, left in stack:
        own[done] += left
    return own, calls


def summarise(events: list[tuple], steps: int, top: int = 15, unit_s: float = 1e-6) -> dict:
    """Per thread (busiest first): self time of all its operators per step (s), the kernels
    it launched per step, and its `top` operators by self time (s and calls per step).
    `events`: (thread, start, end, name) in units of `unit_s` seconds (Chrome traces: us)."""
    if steps < 1:
        raise TrainplanError(f"host_ops: steps = {steps}; give the recorded steps, >= 1")
    by_thread = defaultdict(list)
    for tid, start, end, name in events:
        if not name.startswith(SKIP):
            by_thread[tid].append((start, end, name))
    threads = []
    for tid, spans in by_thread.items():
        own, calls = self_times(spans)
        threads.append({
            "thread": str(tid), "self_s_per_step": sum(own.values()) * unit_s / steps,
            "launches_per_step": sum(calls[n] for n in LAUNCHES) / steps,
            "ops": [{"name": n, "self_s_per_step": t * unit_s / steps,
                     "calls_per_step": calls[n] / steps} for n, t in own.most_common(top)]})
    threads.sort(key=lambda t: -t["self_s_per_step"])
    return {"steps": steps, "threads": threads}


def table(summary: dict, min_share: float = 0.01) -> str:
    """The summary as text: a line per thread, then its operators (ms and calls per step)."""
    lines = []
    for t in summary["threads"]:
        total = t["self_s_per_step"]
        if total <= 0:
            continue
        lines.append(f"thread {t['thread']}: {total * 1e3:.1f} ms a step of host operators, "
                     f"{t['launches_per_step']:.0f} kernel launches")
        lines += [f"  {o['self_s_per_step'] * 1e3:8.2f} ms {o['calls_per_step']:8.1f} calls  "
                  f"{o['name'][:90]}" for o in t["ops"]
                  if o["self_s_per_step"] >= min_share * total]
    return "\n".join(lines)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use a whole number >= 1")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.observe.host_ops",
                                description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome trace (observe.profile --trace-out)")
    p.add_argument("--steps", type=_at_least_one, required=True,
                   help="steps the trace recorded")
    p.add_argument("--top", type=_at_least_one, default=15, help="operators listed per thread")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    try:
        summary = summarise(from_chrome_trace(args.trace), args.steps, args.top)
    except TrainplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
