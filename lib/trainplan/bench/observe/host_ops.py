"""Where the host's time goes: the profiler's host operators, by thread, as self time per step.

    python -m trainplan.bench.observe.host_ops TRACE.json[.gz] [--steps N] [--top 15] [--json]

A host-bound step is paced by the threads that issue its work: the main thread (forward,
optimizer) and the autograd engine's thread (backward). The kernel buckets of
`observe.profile` cannot show them; this reads the host's events of a recorded window
(`observe.profile --trace-out`, or the profiler's events in process) and gives, per thread,
each operator's self time (its span less the parts of it its children cover, the nesting
read from the spans as the profiler records them) and calls per step, and the kernel
launches the thread issued. The steps are the trace's own `ProfilerStep#` ranges. The
profiler's own cost (a few microseconds an operator) is in every figure: compare windows
recorded the same way, not these times with an unprofiled step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import zlib
from collections import Counter, defaultdict
from pathlib import Path

from trainplan import loader
from trainplan.errors import TrainplanError

HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")  # Chrome trace's
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
STEP = "ProfilerStep#"  # the schedule's step ranges: they count the steps, they are not work
MAX_TRACE_BYTES = 2**26  # JSON of one trace, unzipped (4 steps of CP 2 on the 1.3B model: 24 MB)
TOO_LARGE = "record fewer steps (observe.profile --active)"


def _text(p: Path) -> str:
    """The JSON text of trace file `p`, unzipped where its name ends in .gz, at most
    MAX_TRACE_BYTES; TrainplanError (one line) otherwise."""
    if not p.name.endswith(".gz"):
        return loader.read_text(p, max_bytes=MAX_TRACE_BYTES, error=TrainplanError,
                                what="Chrome trace")
    if not p.is_file():
        why = "no such file" if not p.exists() else "not a regular file"
        raise TrainplanError(f"{loader.shown(p)}: {why}; give a Chrome trace "
                             "(observe.profile --trace-out)")
    try:
        with gzip.open(p, "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)
    except (OSError, EOFError, zlib.error) as err:
        raise TrainplanError(f"{loader.shown(p)}: not a gzipped Chrome trace "
                             f"({loader.quote(str(err))})") from None
    if len(raw) > MAX_TRACE_BYTES:
        raise TrainplanError(f"{loader.shown(p)}: more than {MAX_TRACE_BYTES:,} bytes of JSON "
                             f"once unzipped; {TOO_LARGE}")
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        raise TrainplanError(f"{loader.shown(p)}: not UTF-8 text once unzipped (byte "
                             f"0x{raw[err.start]:02x} at offset {err.start})") from None


def _event(e: dict) -> tuple | None:
    """(thread, start, end, name) of one host event of a trace, None for the others; None
    also marks a host event whose fields are not a thread id (int or text), finite numbers
    (start, duration >= 0) and a name."""
    tid, ts, dur, name = (e.get(k) for k in ("tid", "ts", "dur", "name"))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ts, dur))
    if not (isinstance(tid, (int, str)) and not isinstance(tid, bool) and numbers
            and isinstance(name, str) and math.isfinite(ts + dur) and dur >= 0):
        return None
    return str(tid), float(ts), float(ts) + float(dur), name


def from_chrome_trace(path: str | Path) -> list[tuple]:
    """(thread, start_us, end_us, name) of a Chrome trace's host events (`HOST_CATS`), the
    `ProfilerStep#` ranges included. The file is gzipped where its name ends in .gz, and
    read and parsed within `trainplan.loader`'s bounds; TrainplanError (one line) for a
    file that is none, too large or not a trace, or a host event with a field out of kind."""
    p = Path(path)
    trace = loader.parse_json(_text(p), loader.shown(p), error=TrainplanError)
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise TrainplanError(f"{loader.shown(p)}: no traceEvents list; give a Chrome trace "
                             "(observe.profile --trace-out)")
    out = []
    for i, e in enumerate(events):
        if not (isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in HOST_CATS):
            continue
        got = _event(e)
        if got is None:
            raise TrainplanError(f"{loader.shown(p)}: traceEvents[{i}] is a host event "
                                 f"without a thread id, finite start and duration (>= 0) and "
                                 f"a name: {loader.quote(e, 120)}")
        out.append(got)
    return out


def self_times(spans: list[tuple]) -> tuple[Counter, Counter]:
    """Self time and calls per operator name of one thread's (start, end, name) spans: each
    span's length less the parts of it its children (later spans that start inside it)
    cover, in the spans' unit. A child that outlasts its parent takes only the shared part
    from it, so the self times add up to the union of the spans."""
    own, calls = Counter(), Counter()
    stack: list[list] = []  # [end, name, self so far]
    for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][0] <= start:
            _, done, left = stack.pop()
            own[done] += left
        if stack:
            stack[-1][2] -= min(end, stack[-1][0]) - start
        stack.append([end, name, end - start])
        calls[name] += 1
    for _, done, left in stack:
        own[done] += left
    return own, calls


def recorded_steps(events: list[tuple]) -> int:
    """How many profiler steps the events span: their distinct `ProfilerStep#` ranges."""
    return len({name for _, _, _, name in events if name.startswith(STEP)})


def summarise(events: list[tuple], steps: int | None = None, top: int = 15,
              unit_s: float = 1e-6) -> dict:
    """Per thread (busiest first): self time of all its operators per step (s), the kernels
    it launched per step, and its `top` operators by self time (s and calls per step).
    `events`: (thread, start, end, name) in units of `unit_s` seconds (Chrome traces: us).
    `steps`: the steps recorded, by default the events' `ProfilerStep#` ranges; given where
    there are some, it must equal their count."""
    found = recorded_steps(events)
    if steps is None and not found:
        raise TrainplanError("host_ops: the trace has no ProfilerStep# ranges; give --steps, "
                             "the steps it recorded")
    if steps is not None and (steps < 1 or found and steps != found):
        raise TrainplanError(f"host_ops: steps = {steps}; the trace records "
                             f"{found or 'no'} profiler steps"
                             + (f", so give {found} or leave it out" if found else
                                ", give a whole number >= 1"))
    steps = steps or found
    by_thread = defaultdict(list)
    for tid, start, end, name in events:
        if not name.startswith(STEP):
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
    """The summary as text: a line per thread, then its operators (ms and calls per step);
    control characters in names are escaped, so a name cannot start a line of its own."""
    lines = []
    for t in summary["threads"]:
        total = t["self_s_per_step"]
        if total <= 0:
            continue
        lines.append(f"thread {loader.shown(t['thread'], 40)}: {total * 1e3:.1f} ms a step of "
                     f"host operators, {t['launches_per_step']:.0f} kernel launches")
        lines += [f"  {o['self_s_per_step'] * 1e3:8.2f} ms {o['calls_per_step']:8.1f} calls  "
                  f"{loader.shown(o['name'][:90], 90)}" for o in t["ops"]
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
    p.add_argument("--steps", type=_at_least_one, default=None,
                   help="steps the trace recorded (default: its ProfilerStep# ranges)")
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
