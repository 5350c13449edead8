"""Stop a launched process and everything below it: torchrun's workers leave its session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End `proc`, its process group and every descendant, whatever session it moved to.

    `proc` must lead its own process group (Popen(start_new_session=True)).
    torchrun starts each worker in a session of its own (start_new_session), so
    killing torchrun's group leaves the workers running: a worker stuck in a
    collective then spins its GPU at 100% under the next launch. SIGTERM first
    (torchrun forwards it and reaps its workers), then SIGKILL to all that is left.
    """
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with _quiet():
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with _quiet():
        os.killpg(proc.pid, signal.SIGKILL)
    for child in family:
        with _quiet():
            child.kill()
    psutil.wait_procs(family, timeout=grace_s)
    with _quiet():
        proc.wait(timeout=grace_s)


def _quiet():
    import psutil
    return contextlib.suppress(ProcessLookupError, PermissionError, psutil.NoSuchProcess,
                               subprocess.TimeoutExpired)
