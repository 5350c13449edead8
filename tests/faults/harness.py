"""Launching faulted runs under real torchrun; the tiny run they all share.

Every run trains the same tiny Llama (2 layers, hidden 64, vocab 256,
sequence 32) in fp32 on CPU with gloo, FSDP2 ZeRO-3 over 2 ranks (so the
model and optimizer state really are sharded, and a 1-rank resume really
reshards), on deterministic synthetic batches. The run is bit-for-bit
deterministic, so "the final state equals the uninterrupted run" is tested
exactly: `TRAINPLAN_DIGEST` makes the run log a sha256 over every model and
optimizer tensor at the steps asked for, and at the end.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: since torch 2.4 torchrun shares its
rendezvous TCPStore with the workers, and on a restart (torch 2.13 here) the
new workers read the previous attempt's keys: a `new_group` then connects to
a dead rank ("Connection refused", pytorch/pytorch#135712). With the opt-out
each attempt gets a fresh store. Production launches need the same setting.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "lib"
TINY = "n_layers: 2\nhidden: 64\nn_heads: 4\nn_kv_heads: 2\nffn: 128\nvocab: 256\n"
BASE = ["--seq-len", "32", "--micro-batch", "2", "--warmup", "1", "--lr", "3e-3", "--seed", "0",
        "--synthetic", "--cpu", "--json"]
LAYOUT_2 = ["--dp", "2", "--zero", "3"]
REF_STEPS = 40
REF_EVERY = 3
DIGEST_STEPS = "8,12,39,40"


@dataclass
class Run:
    """One torchrun launch: exit code, output, the checkpoint folder and its event log."""

    rc: int
    stdout: str
    stderr: str
    root: Path
    wall_s: float
    events: list[dict] = field(default_factory=list)
    started: float = 0.0  # time.time() at launch

    @property
    def summary(self) -> dict | None:
        lines = [x for x in self.stdout.splitlines() if x.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    def of(self, kind: str, **match) -> list[dict]:
        return [e for e in self.events
                if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]

    def digest(self, step: int, when: str | None = None) -> str:
        found = [e["digest"] for e in self.of("digest", step=step)
                 if when is None or e["when"] == when]
        assert found, f"no digest of step {step} logged; stderr tail:\n{self.stderr[-3000:]}"
        return found[-1]

    def explain(self) -> str:
        return (f"rc {self.rc}\nevents:\n" + "\n".join(json.dumps(e) for e in self.events)
                + f"\nstderr tail:\n{self.stderr[-4000:]}")


def launch(tiny_yaml: str, root: Path, args: list[str], *, nproc: int = 2, restarts: int = 0,
           fault: str = "", digest: str = "1", timeout: float = 150) -> Run:
    """torchrun --standalone --nproc-per-node NPROC --max-restarts RESTARTS train.py ..."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               TRAINPLAN_FAULT=fault, TRAINPLAN_DIGEST=digest,
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
           "-m", "trainplan.bench.harness.train", "--model", tiny_yaml, *BASE,
           "--ckpt-dir", str(root), *args]
    started, start = time.time(), time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, root, time.monotonic() - start,
              started=started)
    log = root / "events.jsonl"
    if log.is_file():
        run.events = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return run


def copy_checkpoints(reference: Run, dest: Path, steps: list[int] | None = None) -> Path:
    """A private copy of the reference's checkpoint folders (all, or those of `steps`)."""
    dest.mkdir(parents=True, exist_ok=True)
    for d in sorted(reference.root.glob("step-*")):
        if steps is None or int(d.name.split("-")[1]) in steps:
            shutil.copytree(d, dest / d.name)
    return dest
