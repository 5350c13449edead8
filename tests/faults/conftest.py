"""Fixtures of the fault-injection tests: the tiny model file and the uninterrupted reference.

The reference run is shared by every test through a session fixture; under
pytest-xdist each worker is its own session, so the first worker runs it
under a file lock and the others read its result.
"""

from __future__ import annotations

import json
import shutil

import pytest
from filelock import FileLock

from faults.harness import DIGEST_STEPS, LAYOUT_2, REF_EVERY, REF_STEPS, TINY, Run, launch


@pytest.fixture(scope="session")
def tiny_yaml(tmp_path_factory) -> str:
    path = tmp_path_factory.getbasetemp() / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_yaml, worker_id) -> Run:
    """The uninterrupted run: 2 ranks, REF_STEPS steps, a checkpoint every REF_EVERY (keep 3),
    digests at DIGEST_STEPS. Run once per test session, shared by the xdist workers."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # this session's, either way
    root = shared / "faults-reference"
    done = shared / "faults-reference.json"
    with FileLock(str(shared / "faults-reference.lock")):
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)
            run = launch(tiny_yaml, root, [*LAYOUT_2, "--steps", str(REF_STEPS), "--ckpt-every",
                                           str(REF_EVERY), "--ckpt-keep", "3"],
                         digest=DIGEST_STEPS)
            assert run.rc == 0, run.explain()
            done.write_text(json.dumps({k: getattr(run, k) for k in
                                        ("rc", "stdout", "stderr", "wall_s", "events")}))
    saved = json.loads(done.read_text())
    return Run(saved["rc"], saved["stdout"], saved["stderr"], root, saved["wall_s"],
               saved["events"])
