"""The launcher's supervision of torchrun: output kept when a descendant holds the pipe, and
a hangup stops the ranks as SIGTERM does (with their checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainplan.bench.ckpt.faults import Signals
from trainplan.proctree import supervise

LEAVES_A_CHILD = ("import subprocess, sys; print('{\"summary\": 1}', flush=True); "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'])")


def test_stdout_is_kept_when_a_descendant_holds_the_pipe_open():
    start = time.monotonic()
    with open(os.devnull, "wb") as null:
        rc, out, received = supervise([sys.executable, "-c", LEAVES_A_CHILD], dict(os.environ),
                                      null.fileno(), drain_s=1.0)
    assert rc == 0 and received == []
    assert out.decode().strip() == '{"summary": 1}'  # written before the child was left
    assert time.monotonic() - start < 15  # the drain, not the child's 20 s
    subprocess.run(["pkill", "-f", "time.sleep(20)"], check=False)


def test_a_hangup_stops_the_loop_as_sigterm_does():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    try:
        Signals.received = []
        Signals.install()
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
        assert Signals.pending() == 2  # checkpoint, then stop
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert Signals.pending() == 1  # checkpoint, go on
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
