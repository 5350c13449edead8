"""What the launch tests share: the tiny CPU proxy, the `launch` verb, the run's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "lib"
TINY = "n_layers: 2\nhidden: 32\nn_heads: 4\nn_kv_heads: 2\nffn: 64\nvocab: 128\n"
# a 2-rank data-parallel layout of the tiny model, every dimension pinned
TINY_LAYOUT = ["--gpu", "h100-sxm", "--dp", "2", "--tp", "1", "--pp", "1", "--zero", "0",
               "--micro-batch", "2", "--recompute", "none", "--seq-len", "32",
               "--global-batch-tokens", "128", "--cpu", "--synthetic", "--warmup", "1"]


def tiny_yaml(folder: Path) -> str:
    path = folder / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def launch(args, cwd, timeout=120) -> subprocess.CompletedProcess:
    """`python -m trainplan.cli launch ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "trainplan.cli", "launch", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env=run_env())


def launch_json(args, cwd) -> dict:
    proc = launch([*args, "--json"], cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def run_env(**extra) -> dict:
    """This interpreter's torchrun and python first on PATH, the library importable."""
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=os.pathsep.join([bindir, os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def summaries(text: str) -> list[dict]:
    """The harness's JSON summary lines (rank 0 prints one per completed run)."""
    out = []
    for line in text.splitlines():
        line = line[line.find("{"):] if "{" in line else ""
        if line.startswith('{"model"'):
            out.append(json.loads(line))
    return out
