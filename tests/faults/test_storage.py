"""What the disk does to checkpoints: corruption, a full or failing disk, a smaller world.

Corruption is detected by the manifest's per-file sha256 and size (DCP has
no checksums of its own); the folder is skipped with a one-line reason and
the one before is loaded. A write that fails (ENOSPC raised by the writer,
or a real EFBIG from the kernel under RLIMIT_FSIZE = 0, which works even as
root where a read-only folder would not) costs that checkpoint only:
training goes on and the last committed checkpoint stays. A 2-rank FSDP
checkpoint loads on 1 rank with DCP resharding, bit for bit.
"""

from __future__ import annotations

import math
import shutil

import pytest

from faults.harness import LAYOUT_2, copy_checkpoints, launch
from trainplan.bench.ckpt import manifest as mf

NEWEST, BEFORE = "step-000040", "step-000039"


def _truncate(folder):
    shard = folder / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _flip_byte(folder):
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _drop_manifest(folder):
    (folder / mf.MANIFEST).unlink()


CORRUPTIONS = {
    "truncated shard": (_truncate, "__1_0.distcp is "),
    "flipped byte": (_flip_byte, "__0_0.distcp sha256 mismatch"),
    "deleted manifest": (_drop_manifest, "no manifest"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corruption_is_detected_reported_in_one_line_and_the_previous_is_chosen(
        reference, tmp_path, kind):
    root = copy_checkpoints(reference, tmp_path / "ckpt")
    corrupt, reason = CORRUPTIONS[kind]
    assert mf.choose(root)[0].name == NEWEST  # intact, the newest is taken
    corrupt(root / NEWEST)
    path, manifest, line = mf.choose(root)
    print(f"{kind}: {line}")
    assert path is not None and path.name == BEFORE and manifest["step"] == 39
    assert "\n" not in line and f"skipped {NEWEST}: " in line and reason in line, line


@pytest.mark.slow
def test_resume_from_a_corrupted_newest_loads_the_previous_and_ends_identical(
        reference, tiny_yaml, tmp_path):
    root = copy_checkpoints(reference, tmp_path / "ckpt")
    _flip_byte(root / NEWEST)
    run = launch(tiny_yaml, root, [*LAYOUT_2, "--steps", "40", "--ckpt-every", "3", "--resume"])
    assert run.rc == 0, run.explain()
    reports = [x for x in run.stderr.splitlines() if x.startswith("trainplan ckpt: resuming")]
    assert len(reports) == 1 and "sha256 mismatch" in reports[0], run.explain()
    assert run.of("resume")[0]["step"] == 39
    assert run.digest(39, "load") == reference.digest(39)
    assert run.digest(40, "end") == reference.digest(40), "final state differs from the reference"


@pytest.mark.slow
def test_failed_writes_are_reported_training_goes_on_last_committed_survives(
        reference, tiny_yaml, tmp_path):
    # async saves; step 6: rank 1's writer raises ENOSPC; step 9: rank 0's file-size limit is 0
    fault = "oserror@save:writing:step:6:rank:1;full@save:staging:step:9:rank:0"
    run = launch(tiny_yaml, tmp_path / "ckpt",
                 [*LAYOUT_2, "--steps", "12", "--ckpt-every", "3", "--ckpt-keep", "3",
                  "--ckpt-async", "--resume"], fault=fault)
    assert run.rc == 0, run.explain()
    failed = {e["step"]: e for e in run.of("save_failed")}
    assert sorted(failed) == [6, 9], run.explain()
    assert "No space left on device" in failed[6]["error"], failed[6]
    assert "File too large" in failed[9]["error"], failed[9]  # EFBIG from the kernel
    assert failed[6]["last_committed"] == failed[9]["last_committed"] == 3
    reports = [x for x in run.stderr.splitlines() if "FAILED" in x]
    print("\n".join(reports))
    assert len(reports) == 2 and all("last committed checkpoint: step-000003" in x
                                     for x in reports)
    kept = sorted(d.name for _, d in mf.step_dirs(run.root))
    assert kept == ["step-000003", "step-000012"], kept  # no half-written 6 or 9 left behind
    assert all(mf.verify(run.root / name)[0] for name in kept)
    assert run.digest(12, "end") == reference.digest(12), "training was disturbed by the failure"


@pytest.mark.slow
def test_restart_on_fewer_ranks_reshards_to_the_same_state(reference, tiny_yaml, tmp_path):
    root = copy_checkpoints(reference, tmp_path / "ckpt", steps=[39])
    # one rank accumulating both ranks' micro-batches reads the same global batch
    run = launch(tiny_yaml, root, ["--dp", "1", "--grad-accum", "2", "--steps", "40",
                                   "--resume"], nproc=1)
    assert run.rc == 0, run.explain()
    assert run.of("resume")[0]["saved_world"] == 2
    assert run.digest(39, "load") == reference.digest(39), "resharded state differs"
    mine, ref = run.summary["losses"][0], reference.summary["losses"][39]
    print(f"step 40 loss on 1 rank {mine!r}, on 2 ranks {ref!r}")
    assert math.isclose(mine, ref, rel_tol=1e-5), "the 1-rank run did not read step 40's batch"
    shutil.rmtree(root)
