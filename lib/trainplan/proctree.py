"""Launched process trees: stop one and everything below it (torchrun's workers leave its
session), and say in one line why one died."""

from __future__ import annotations

import contextlib
import os
import re
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


RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")  # torchrun's per-rank line tag
LAUNCHER_ERRORS = ("ChildFailedError",)  # torchrun's own: says a rank failed, never why


def failure_reason(returncode: int, text: str) -> str:
    """One line: out of memory where the run says so, else the run's own error line, else
    the last exception a rank raised (torchrun's ChildFailedError names none), else the
    first line of output."""
    low = text.lower()
    if "out of memory" in low or "outofmemoryerror" in low:
        line = next((ln.strip() for ln in text.splitlines() if "out of memory" in ln.lower()), "")
        return f"out of memory (rc={returncode}): {RANK_PREFIX.sub('', line)[:200]}"
    lines = [RANK_PREFIX.sub("", ln.strip()) for ln in text.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.lower().startswith("error:")]  # train.py's one line
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    by_ranks = [ln for ln in raised if not any(w in ln.split(":")[0] for w in LAUNCHER_ERRORS)]
    why = ours[:1] or by_ranks[-1:] or raised[:1] or lines[:1] or ["no output"]
    return f"rc={returncode}: {why[0][:240]}"
