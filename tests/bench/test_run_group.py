"""A launch that runs past its limit is stopped with every torchrun worker, not only torchrun."""

import os
import sys
import time
from pathlib import Path

import psutil

from trainplan.bench.series.suite import run_group

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


def test_gpu_process_lines_are_parsed():
    from trainplan.bench.series.suite import gpu_processes

    text = "1004, 11006\n1005, 3556\n[N/A], [N/A]\n\n"
    assert gpu_processes(text) == [(1004, 11006), (1005, 3556)]


def test_busy_gpus_refuse_to_be_measured(tmp_path, monkeypatch):
    import pytest

    from trainplan.bench.series.suite import check_gpus_idle
    from trainplan.errors import TrainplanError

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '1004, 11006'\necho '1005, 3556'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(TrainplanError, match=r"GPUs busy: 2 other process\(es\).*pid 1004"):
        check_gpus_idle()
    smi.write_text("#!/bin/sh\n")  # idle: no compute apps
    check_gpus_idle()
