"""Run several harness layouts in one `torchrun` launch of CPU ranks
(`trainplan.bench.series.sweep`)
and return each run's line by tag: shared by the parity and compile tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

LIB = Path(__file__).resolve().parents[2] / "lib"


def sweep(runs: list[dict], ranks: int, tmp: Path, env: dict[str, str] | None = None,
          timeout: int = 240) -> dict[str, dict]:
    """{tag: the sweep's JSON line} of one launch of `runs`, [{"tag", "args"}, ...]."""
    spec = tmp / f"runs{ranks}.json"
    spec.write_text(json.dumps(runs))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}),
                    PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ranks), "-m", "trainplan.bench.series.sweep", str(spec)]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"tag"')]
    return {line["tag"]: line for line in lines}


def run_sweep(model: str, layouts: dict[str, str], base: list[str], ranks: int, tmp: Path,
              env: dict[str, str] | None = None) -> dict[str, dict]:
    """{tag: the sweep's JSON line} for train.py runs `--model model *base *layouts[tag]`."""
    runs = [{"tag": t, "args": ["--model", str(model), *base, *a.split()]}
            for t, a in layouts.items()]
    return sweep(runs, ranks, tmp, env)


def shared_sweep(tmp_path_factory, name: str, runs: list[dict], ranks: int,
                 timeout: int = 400) -> dict[str, dict]:
    """`sweep(runs, ranks)` launched once per test session for every test that asks for
    `name`, whichever xdist worker runs it: the first runs it under a file lock and keeps
    its lines, the others read them."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's
    done = shared / f"sweep-{name}.json"
    with FileLock(str(shared / f"sweep-{name}.lock")):
        if not done.is_file():  # not yet run, or a failed run: launch (again)
            folder = shared / f"sweep-{name}"
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(sweep(runs, ranks, folder, timeout=timeout)))
    return json.loads(done.read_text())
