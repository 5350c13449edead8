"""Run `trainplan.bench.micro.run` under a real `torchrun` of CPU ranks (gloo) and read its records:
shared by the microbenchmark and calibration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainplan.records import schema as records

LIB = Path(__file__).resolve().parents[2] / "lib"


def run_micro(out: Path, ranks: int, *flags: str, timeout: int = 400) -> tuple[list[dict], str]:
    """(the records appended to `out`, stdout) of `torchrun --nproc-per-node ranks -m
    trainplan.bench.micro.run --out out *flags`; a failed run fails the test with its stderr."""
    env = {**os.environ, "PYTHONPATH": str(LIB), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), "-m", "trainplan.bench.micro.run", "--out", str(out), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(records.load(out)), proc.stdout
