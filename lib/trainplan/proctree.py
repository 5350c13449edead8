"""Launched process trees: stop one and everything below it (torchrun's workers leave its
session), say in one line why one died, run one to its end with our signals passed on
(`supervise`) and its stderr shown as it comes (`Relay`), and keep a launched process
writing when the reader of its output is gone (`survive_closed_output`)."""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # passed on by `supervise`
REFUSAL = "error: "  # a rank's one line for input it refuses (exit 2); a failure: "failed: "


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


def own_error(line: str) -> str | None:
    """The message of a rank's own one-line refusal (`error: MESSAGE`, as `train.loop.main`
    prints it, rank tags allowed; not logging's `ERROR:`, not the trainer's `failed: ` line
    of a run that failed), else None."""
    body = RANK_TAGS.sub("", line.strip())
    if not body.startswith(REFUSAL):
        return None
    return body[len(REFUSAL):].strip() or None


PARTIAL_TAG = re.compile(r"\[[A-Za-z_]*\d*\]?")  # the start of a rank tag, cut by a read


def may_refuse(start: str) -> bool:
    """Whether a line that begins with `start` (its end not read yet) may still be a rank's
    refusal (`own_error`): it can be held back until its end without holding up a progress
    line (`\\r` updates), which shows as it comes."""
    body = RANK_TAGS.sub("", start.lstrip())
    return (body.startswith(REFUSAL) or REFUSAL.startswith(body)
            or PARTIAL_TAG.fullmatch(body) is not None)


class Relay:
    """The launched tree's stderr, read from file descriptor `fd` on a thread to its end,
    copied to our stderr as its bytes come, until a line is a rank's refusal (`own_error`):
    that line and all after it (the other ranks' copies, torchrun's traceback of the ranks
    that exited) go to `held`, for the caller to show or drop. Where our stderr fails (its
    reader gone), the tree's output is still read, so that no rank blocks writing it."""

    def __init__(self, fd: int):
        self.fd = fd
        self.refusal: str | None = None
        self.held: list[str] = []
        self._line = ""  # the start of the current line, not shown yet: it may be a refusal
        self._shown = False  # the current line is shown as it comes: it is no refusal
        self._quiet = False
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self.thread = threading.Thread(target=self._run, name="stderr-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 16):
                self._feed(self._decode(chunk))
            self._feed(self._decode(b"", final=True) + ("\n" if self._line else ""))
        finally:
            os.close(self.fd)

    def _feed(self, text: str) -> None:
        show = []
        for part in re.split(r"(?<=\n)", text):  # whole lines with their ends, then the rest
            if not part:
                continue
            if self.refusal is not None:
                self.held.append(part)
                continue
            self._line += part
            ends = part.endswith("\n")
            if not self._shown and ends and (message := own_error(self._line)):
                self.refusal = message
                self.held.append(self._line)
                self._line = ""
                continue
            if self._shown or ends or not may_refuse(self._line):
                show.append(self._line)
                self._line, self._shown = "", not ends
        self.show("".join(show))

    def show(self, text: str) -> None:
        """`text` on our stderr, flushed; nothing more once that failed."""
        if not text or self._quiet:
            return
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):  # ValueError: a closed stream
            self._quiet = True


def supervise(cmd: list[str], env: dict, stderr: int, drain_s: float = 10.0
              ) -> tuple[int, bytes, list[int]]:
    """Run `cmd` to its end, its stdout kept, its stderr to file descriptor `stderr`. While
    it runs, SIGTERM, SIGINT and SIGHUP to this process are passed on to it instead of ending
    this process (torchrun passes them on to its ranks, which save a checkpoint on SIGTERM
    and write as they stop). Returns (exit code, its stdout, the signals passed on); stdout
    still open `drain_s` seconds after it exited (a descendant left) is not waited for."""
    received: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        if started:
            started[0].send_signal(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED} if main else {}
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr)
        started.append(proc)
        for signum in list(received):  # those that came while it started
            proc.send_signal(signum)
        out: list[bytes] = []
        def read() -> None:  # in chunks: what came is kept where a descendant holds it open
            for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
                out.append(chunk)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        rc = None
        while rc is None:  # short waits: a signal taken by another thread is handled at once
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = proc.wait(timeout=1.0)
        reader.join(drain_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return rc, b"".join(list(out)), received


class _Survivor:
    """A text stream that turns into os.devnull at its first OSError, its other attributes
    the stream's (`survive_closed_output`)."""

    def __init__(self, stream):
        self._stream = stream

    def _call(self, name: str, *args):
        try:
            return getattr(self._stream, name)(*args)
        except OSError:  # BrokenPipeError, EIO: whoever read it is gone
            self._stream = open(os.devnull, "w", encoding="utf-8")
            return getattr(self._stream, name)(*args)

    def write(self, text: str) -> int:
        return self._call("write", text)

    def writelines(self, lines) -> None:
        return self._call("writelines", lines)

    def flush(self) -> None:
        return self._call("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_closed_output() -> None:
    """Make sys.stdout and sys.stderr of this (launched) process write on to os.devnull from
    their first OSError on: where the launcher reading them through pipes has died (killed
    with its process group while torchrun passes SIGTERM on to the ranks), a progress or
    log line must not fail the run or its emergency checkpoint."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Survivor):
            setattr(sys, name, _Survivor(stream))
