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


RANK_TAGS = re.compile(r"^((?:\[[A-Za-z_]*\d+\]:\s*)+)")  # [rank0]:, [default0]: (--tee), stacked
RAISED = re.compile(r"^[\w.]*(Error|Exception)\b")
LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")  # torchrun's: a rank died, not why
SIGNALLED = re.compile(r"Signal \d+ \(SIG\w+\) received by PID \d+")  # torchrun's root cause


def failure_reason(returncode: int, text: str) -> str:
    """One line of why a launch failed, from its output `text`: out of memory where it says
    so; else the run's own `error:` line; else the last exception of the first rank that
    raised one (a rank that dies takes others down with errors of their own); else the signal
    torchrun saw kill a rank; else the first exception or line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    low = text.lower()
    if "out of memory" in low or "outofmemoryerror" in low:
        line = next((ln for ln in lines if "out of memory" in ln.lower()), "")
        return f"out of memory (rc={returncode}): {RANK_TAGS.sub('', line)[:200]}"
    tagged = [(m.group(1).replace(" ", "") if (m := RANK_TAGS.match(ln)) else "",
               RANK_TAGS.sub("", ln)) for ln in lines]
    ours = [ln for _, ln in tagged if ln.lower().startswith("error:")]  # train.py's one line
    raised = [(tag, ln) for tag, ln in tagged if RAISED.match(ln)]
    by_ranks = [(tag, ln) for tag, ln in raised
                if not any(w in ln.split(":")[0] for w in LAUNCHER_ERRORS)
                and not ln.startswith("Exception ignored")]  # interpreter shutdown noise
    first = by_ranks[0][0] if by_ranks else None
    signalled = [m.group(0) for _, ln in tagged if (m := SIGNALLED.search(ln))]
    why = (ours[:1] or [ln for tag, ln in by_ranks if tag == first][-1:] or signalled[:1]
           or [ln for _, ln in raised][:1] or [ln for _, ln in tagged][:1] or ["no output"])
    return f"rc={returncode}: {why[0][:240]}"
