"""Run several harness layouts in one `torchrun` launch of CPU ranks
(`trainplan.bench.series.sweep`)
and return each run's line by tag: shared by the parity and compile tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "lib"


def run_sweep(model: str, layouts: dict[str, str], base: list[str], ranks: int, tmp: Path,
              env: dict[str, str] | None = None) -> dict[str, dict]:
    """{tag: the sweep's JSON line} for train.py runs `--model model *base *layouts[tag]`."""
    runs = [{"tag": t, "args": ["--model", str(model), *base, *a.split()]}
            for t, a in layouts.items()]
    spec = tmp / f"runs{ranks}.json"
    spec.write_text(json.dumps(runs))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}),
                    PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ranks), "-m", "trainplan.bench.series.sweep", str(spec)]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"tag"')]
    return {line["tag"]: line for line in lines}
