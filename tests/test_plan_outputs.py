"""`trainplan plan --json` answers every scenario as it did when tests/golden/plan-outputs.json
was captured (bceaca9, before the library was split into packages; rewritten since only for
deliberate changes of the planner, each named in its commit): a restructuring that changes
a number fails here. A deliberate change rewrites the file with
`python tools/plan_outputs.py --write tests/golden/plan-outputs.json` and says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plan_answers_of_every_scenario_are_unchanged():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plan_outputs.py"), "--check",
                           str(ROOT / "tests" / "golden" / "plan-outputs.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "identical" in proc.stdout
