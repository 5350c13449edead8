"""Run `trainplan.bench.micro.run` under a real `torchrun` of CPU ranks (gloo) and read its records:
shared by the microbenchmark and calibration tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

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


def shared_micro(tmp_path_factory, name: str, model: str, ranks: int, *flags: str,
                 timeout: int = 400) -> tuple[list[dict], str]:
    """`run_micro(out, ranks, "--model", tiny.yaml, *flags)` launched once per test session
    for every test that asks for `name`, whichever xdist worker runs it: the first runs it
    under a file lock, the others read its records. `model` is the text of tiny.yaml."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's
    root = shared / f"micro-{name}"
    done = root / "stdout.txt"
    with FileLock(str(shared / f"micro-{name}.lock")):
        if not done.is_file():  # not yet run, or a failed run: launch (again)
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            (root / "tiny.yaml").write_text(model)
            _, stdout = run_micro(root / "micro.jsonl", ranks, "--model",
                                  str(root / "tiny.yaml"), *flags, timeout=timeout)
            done.write_text(stdout)
    return list(records.load(root / "micro.jsonl")), done.read_text()
