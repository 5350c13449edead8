"""The contract every CLI run must keep, and a fixture that runs the CLI against it.

Contract (DESIGN.md, "Command-line contract"): exit 0 with one JSON object on stdout (and
no traceback or warning on stderr), or exit 2 with nothing on stdout and one line of at
most `MAX_LINE` characters on stderr; either within `LIMIT_S` seconds (of CPU: wall time on
a shared machine measures the neighbours too; a run waiting on nothing is stopped at six
times that of wall time) and `LIMIT_MIB` of memory (the run's peak resident set above the
warmed-up process it forked from).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LIMIT_S = 10.0
LIMIT_MIB = 1024.0
MAX_LINE = 300


class Runner:
    """The forking helper (`runner.py`), fed one request a line."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "runner.py")], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def run(self, argv, cwd, timeout_s: float = LIMIT_S) -> dict:
        req = {"argv": [str(a) for a in argv], "cwd": str(cwd), "timeout_s": timeout_s}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def broken(result: dict) -> str | None:
    """What a run did against the contract, or None when it kept it."""
    rc, out, err = result["rc"], result["stdout"], result["stderr"]
    if rc in (-14, -27) or result["cpu_seconds"] > LIMIT_S:
        return (f"ran {result['cpu_seconds']:.1f} s of CPU ({result['seconds']:.1f} s of wall "
                f"time), past {LIMIT_S:g} s")
    if result["rss_growth_mib"] > LIMIT_MIB:
        return f"took {result['rss_growth_mib']:.0f} MiB, past {LIMIT_MIB:g} MiB"
    if rc == 0:
        try:
            json.loads(out)
        except ValueError:
            return f"exit 0 without one JSON object on stdout: {out[:300]!r}"
        if "Traceback" in err or "Warning" in err:
            return f"exit 0 with a traceback or warning on stderr: {err[-600:]}"
        return None
    if rc != 2:
        return f"exit {rc}: {err[-1500:]}"
    lines = err.splitlines()
    if out or len(lines) != 1 or not err.endswith("\n"):
        return f"exit 2 with {len(lines)} stderr lines and {len(out)} stdout chars: {err[:600]!r}"
    if len(lines[0]) > MAX_LINE or not lines[0].startswith("trainplan: error: "):
        return f"exit 2 with a line of {len(lines[0])} characters: {lines[0][:400]!r}"
    return None


@pytest.fixture(scope="session")
def cli_runner():
    runner = Runner()
    yield runner
    runner.close()
