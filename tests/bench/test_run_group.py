"""A launch that runs past its limit is stopped with every torchrun worker, not only torchrun."""

import os
import sys
import time
from pathlib import Path

import psutil

from trainplan.bench.suite import run_group

WORKER = """
import os, sys, time
open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
while True:  # a rank stuck in a collective, as far as anyone outside can tell
    time.sleep(0.1)
"""


def test_timed_out_torchrun_leaves_no_worker_behind(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    rc, _, _ = run_group(cmd, env, timeout_s=15.0)
    assert rc is None  # ran past its limit
    pids = [int(p.read_text()) for p in sorted(Path(tmp_path).glob("pid*"))]
    assert len(pids) == 2, "the workers never started; the test proves nothing"
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"workers {alive} outlived their launch"
    assert time.monotonic() - t0 < 60
