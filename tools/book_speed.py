"""Time `make book` for the default scenario: papermill, the strict HTML build and the PDF.

    .venv/bin/python tools/book_speed.py [--runs 1] [--scenario llama-13b-32xh100]

Runs `make book` `--runs` times (after installation: the .venv must exist, and
the first run pays no install), each a fresh process tree, and prints the wall
time of each with the time of each stage read from its output (every notebook's
papermill time, the Sphinx build, the PDF), then the machine and the load
average while it ran. The target (issue 8): under 5 minutes on the project's
2-core machine. The README quotes the one-line summary this prints last.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 300.0
sys.path.insert(0, str(ROOT / "bench"))
from search_speed import cpu_model  # noqa: E402  (the machine line, as bench-search prints it)


def one_run(scenario: str) -> tuple[float, str]:
    env = {**os.environ, "MAKEFLAGS": ""}
    t0 = time.perf_counter()
    proc = subprocess.run(["make", "--no-print-directory", "book", f"SCENARIO={scenario}"],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"book_speed: make book failed (exit {proc.returncode}): "
                 f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return wall, proc.stdout + proc.stderr


def stages(log: str) -> dict[str, float]:
    """Seconds per stage, from the lines `make book` prints."""
    out = {m[1]: float(m[2]) for m in re.finditer(r"\[\d+/\d+\] (\S+)\s+([\d.]+) s", log)}
    done = re.search(r"done: \d+ notebooks in ([\d.]+) s", log)
    pdf = re.search(r"pdf: .*\((\d+) pages, ([\d.]+) s\)", log)
    if done:
        out["papermill (all notebooks)"] = float(done[1])
    if pdf:
        out[f"pdf ({pdf[1]} pages)"] = float(pdf[2])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="timed runs of make book (default 1)")
    p.add_argument("--scenario", default="llama-13b-32xh100", help="SCENARIO for make book")
    args = p.parse_args()
    if args.runs < 1:
        print(f"book_speed: --runs {args.runs}: use 1 or more", file=sys.stderr)
        return 2
    walls = []
    for i in range(args.runs):
        wall, log = one_run(args.scenario)
        walls.append(wall)
        print(f"run {i + 1}: make book {wall:.1f} s")
        parts = stages(log)
        for name, seconds in parts.items():
            print(f"  {name:<28} {seconds:6.1f} s")
        rest = wall - sum(v for k, v in parts.items() if not k[:2].isdigit())
        print(f"  {'html build and the rest':<28} {rest:6.1f} s")
    load = os.getloadavg()
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    median = statistics.median(walls)
    verdict = "under" if median < TARGET_S else "OVER"
    print(f"make book ({args.scenario}): {median:.1f} s median of {len(walls)} run(s), "
          f"{verdict} the {TARGET_S:.0f} s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
