"""What the browser tests share: the default scenario's strict build (the `built_book`
fixture of tests/book/conftest.py runs `build_default` once per session) and the check of
where a page's plain-words box ends."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan.runbook import site
from trainplan.runbook.build import notebook_paths
from trainplan.runbook.pages import DEFAULT_SCENARIO
from trainplan.runbook.pdf import BROWSERS

ROOT = Path(__file__).resolve().parents[2]
HTML = site.html_dir(DEFAULT_SCENARIO)
GENERATED = ROOT / "book" / "_generated"

# where the page's plain-words box ends, in CSS pixels from the top (None: no box)
BOX_JS = """(() => { const b = document.querySelector("div.admonition.tip");
                     return b ? b.getBoundingClientRect().bottom + window.scrollY : null; })()"""
FIRST_SCREEN = (1280, 800)

needs_chromium = pytest.mark.skipif(
    not any(shutil.which(b) for b in BROWSERS),
    reason="no chromium: run `make system-deps` (make test does)")


def run(cmd, timeout):
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def build_default() -> str:
    """Build the default scenario's HTML once per test run (xdist workers share it through a
    lock and a stamp): papermill only where book/_generated/ lacks that scenario's
    notebooks, then `python -m trainplan.runbook.site` as `make book` runs it; its output."""
    HTML.parent.mkdir(parents=True, exist_ok=True)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    stamp = ROOT / "_build" / ".browser-test-build"
    with open(ROOT / "_build" / ".browser-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text().startswith(run_id + "\n"):
            return stamp.read_text().split("\n", 1)[1]
        pages = {p.name for p in notebook_paths(ROOT / "notebooks")}
        if not pages <= {p.name for p in GENERATED.glob("*.ipynb")} \
                or site.generated_scenario() != DEFAULT_SCENARIO:
            proc = run([sys.executable, "-m", "trainplan.runbook.build"], timeout=600)
            assert proc.returncode == 0, proc.stderr
        proc = run([sys.executable, "-m", "trainplan.runbook.site"], timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        stamp.write_text(f"{run_id}\n{log}")
        return log
