"""Runs over checkpoints that do not verify, and a run whose final save fails.

Retention counts only verified checkpoints: with the newest `keep` folders corrupt, a run
started again (--resume --fresh) keeps its own new checkpoints, so a kill before it
passes the corrupt steps loses nothing, and the next resume continues from the newest
verified one, ending bit-identical to the uninterrupted run. --resume where every
checkpoint fails verification refuses in one line (exit 2) instead of starting at step 0.
A run whose final checkpoint fails exits non-zero, saying so in one line. The last two
run one process without torchrun, so the exit code is the harness's own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from faults.harness import BASE, LAYOUT_2, LIB, copy_checkpoints, launch
from trainplan.bench.ckpt import manifest as mf

CORRUPT = [36, 39, 40]  # the reference's last three (every 3, keep 3)


def _flip_a_shard(folder) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _corrupt_copy(reference, root):
    copy_checkpoints(reference, root, steps=CORRUPT)
    for step in CORRUPT:
        _flip_a_shard(root / mf.step_name(step))
    return root


def _one_process(tiny_yaml, root, args, fault="") -> subprocess.CompletedProcess:
    """The harness in this one process's world (no torchrun): its exit code is main's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRAINPLAN_FAULT=fault,
               PYTHONPATH=os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "trainplan.bench.harness.train", "--model", tiny_yaml, *BASE,
           "--ckpt-dir", str(root), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_retention_keeps_the_newest_verified_when_newer_ones_are_corrupt(
        reference, tiny_yaml, tmp_path):
    """The issue's reproduction on the shared run's cadence (every 3, keep 3): corrupt the
    last three checkpoints, start again, kill at step 11; saves 3, 6 and 9 must survive."""
    root = _corrupt_copy(reference, tmp_path / "ckpt")
    flags = [*LAYOUT_2, "--steps", "12", "--ckpt-every", "3", "--ckpt-keep", "3", "--resume"]
    killed = launch(tiny_yaml, root, [*flags, "--fresh"], fault="kill@step:11:rank:1")
    assert killed.rc != 0 and killed.of("resume")[0]["step"] == 0, killed.explain()
    left = [d.name for _, d in mf.step_dirs(root)]
    print(f"after the kill: {left}")
    assert left == [mf.step_name(s) for s in (40, 39, 36, 9, 6, 3)], killed.explain()
    run = launch(tiny_yaml, root, flags, digest="12")
    assert run.rc == 0, run.explain()
    resumed = run.of("resume")[-1]  # the log holds the killed run's events too
    line = resumed["line"]
    assert resumed["step"] == 9 and line.startswith("resuming from step-000009"), line
    assert "skipped step-000040, step-000039, step-000036: __0_0.distcp sha256 mismatch" in line
    assert run.digest(12, "end") == reference.digest(12), "final state differs from the reference"


@pytest.mark.slow
def test_resume_with_every_checkpoint_corrupt_refuses_with_exit_2(reference, tiny_yaml,
                                                                  tmp_path):
    root = _corrupt_copy(reference, tmp_path / "ckpt")
    (root / mf.step_name(36) / mf.MANIFEST).write_text('{"step": 36}')  # damaged another way
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    proc = _one_process(tiny_yaml, root, ["--steps", "12", "--resume"])
    errors = proc.stderr.strip().splitlines()
    print(errors)
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: --resume: no verified checkpoint in ")
    assert "--fresh" in errors[0] and len(errors[0]) <= 300, errors[0]
    assert "step-000040, step-000039: __0_0.distcp sha256 mismatch" in errors[0], errors[0]
    assert "step-000036: manifest has no checksum" in errors[0], errors[0]
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing touched


@pytest.mark.slow
def test_a_failed_final_save_exits_non_zero_in_one_line(tiny_yaml, tmp_path):
    root = tmp_path / "ckpt"
    proc = _one_process(tiny_yaml, root, ["--steps", "4", "--ckpt-every", "3"],
                        fault="oserror@save:writing:step:4")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    print(proc.stderr.strip().splitlines()[-2:])
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "final checkpoint was not saved" in errors[0] and "step-000003" in errors[0]
    assert [d.name for _, d in mf.step_dirs(root)] == ["step-000003"]
