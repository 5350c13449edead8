"""Time the full strategy search: Llama 13B on 32 H100s (4 nodes x 8), the runbook's default.

    .venv/bin/python tools/search_speed.py [--repeat 20] [--cli-repeat 5]

One warm-up search, then `--repeat` timed searches (enumerate every valid
layout, price them all, rank); prints the median and the minimum, the layouts
searched per second, the machine, and the wall time of the command a user
types (`trainplan plan ... --json`, a fresh process each time, imports
included). The README quotes the one-line summary this prints last.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import pandas as pd

from trainplan.calibrate.store import load_gpu
from trainplan.plan.search import search
from trainplan.specs import load_cluster, load_model

SCENARIO = dict(model="llama-13b", gpu="h100-sxm", cluster="dgx-h100", gpus=32, seq_len=4096,
                global_batch_tokens=4 * 2**20)


def cpu_model() -> str:
    """platform.processor(), plus the model name from /proc/cpuinfo where there is one."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({name})"
    except OSError:
        pass
    return name


def machine() -> str:
    cpu = cpu_model()
    return (f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, numpy {np.__version__}, "
            f"pandas {pd.__version__}")


def time_search(repeat: int) -> tuple[list[float], int]:
    m = load_model(SCENARIO["model"])
    gpu = load_gpu(SCENARIO["gpu"])
    cluster = load_cluster(SCENARIO["cluster"])
    kw = dict(gpus=SCENARIO["gpus"], seq_len=SCENARIO["seq_len"],
              global_batch_tokens=SCENARIO["global_batch_tokens"])
    searched = search(m, gpu, cluster, **kw).searched  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = search(m, gpu, cluster, **kw)
        times.append(time.perf_counter() - start)
        assert result.searched == searched and result.table["fits"].iloc[0]
    return times, searched


def time_cli(repeat: int) -> list[float]:
    argv = [sys.executable, "-m", "trainplan.cli", "plan", "--model", SCENARIO["model"],
            "--gpu", SCENARIO["gpu"], "--gpus", str(SCENARIO["gpus"]), "--json"]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20, help="timed searches after one warm-up")
    p.add_argument("--cli-repeat", type=int, default=5, help="timed CLI runs (0 to skip)")
    args = p.parse_args(argv)

    print(f"machine: {machine()}")
    times, searched = time_search(args.repeat)
    med, best = statistics.median(times), min(times)
    print(f"search: {SCENARIO['model']} on {SCENARIO['gpus']} x {SCENARIO['gpu']} "
          f"({SCENARIO['cluster']}), seq {SCENARIO['seq_len']}, "
          f"{SCENARIO['global_batch_tokens']:,} tokens a step")
    print(f"  layouts searched: {searched:,}")
    print(f"  {args.repeat} runs after 1 warm-up: median {med:.3f} s, min {best:.3f} s, "
          f"max {max(times):.3f} s")
    print(f"  layouts per second: {searched / med:,.0f} (median), {searched / best:,.0f} (best)")
    cli = ""
    if args.cli_repeat > 0:
        ctimes = time_cli(args.cli_repeat)
        cmed = statistics.median(ctimes)
        print(f"cli: trainplan plan --model {SCENARIO['model']} --gpu {SCENARIO['gpu']} --gpus "
              f"{SCENARIO['gpus']} --json, {args.cli_repeat} fresh processes: median {cmed:.2f} s "
              f"wall, min {min(ctimes):.2f} s")
        cli = f"; the CLI answers in {cmed:.2f} s wall (median of {args.cli_repeat})"
    print(f"summary: full 13B / 32 x H100 search of {searched:,} layouts in {med:.3f} s median "
          f"({best:.3f} s min, {searched / med:,.0f} layouts/s){cli}; {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
