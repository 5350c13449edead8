"""`trainplan plan --json` for every scenario, as one canonical JSON file: the check that a
change of structure left the planner's answers byte for byte as they were.

    .venv/bin/python tools/plan_outputs.py --write tests/golden/plan-outputs.json
    .venv/bin/python tools/plan_outputs.py --check tests/golden/plan-outputs.json

Each scenario of data/scenarios/ is planned through the command line a user types (a fresh
process, `--top 20`); `elapsed_s`, which depends on the machine, and the bands the committed
records give (each plan's `validation`, the decision's `memory_margin`) are dropped. The
verdicts stay (the decision, each plan's `memory_fits_band`): a record that changes what a
scenario launches is a change to name in a commit. `--check` exits 1 and names the first
scenario whose answer differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "data" / "scenarios"


def plan_args(scenario: dict) -> list[str]:
    """The `trainplan plan` flags of one scenario file."""
    return ["--model", scenario["model"], "--gpu", scenario["gpu"],
            "--cluster", scenario["cluster"], "--gpus", str(scenario["gpus"]),
            "--seq-len", str(scenario["seq_len"]),
            "--global-batch-tokens", str(scenario["global_batch_tokens"]), "--top", "20"]


def outputs() -> dict[str, str]:
    """Scenario name -> its plan answer as canonical JSON text (sorted keys, no elapsed_s)."""
    out = {}
    for path in sorted(SCENARIOS.glob("*.yaml")):
        scenario = yaml.safe_load(path.read_text())
        proc = subprocess.run([sys.executable, "-m", "trainplan.cli", "plan",
                               *plan_args(scenario), "--json"],
                              capture_output=True, text=True, cwd=ROOT, check=True)
        answer = json.loads(proc.stdout)
        answer.pop("elapsed_s")
        for plan in answer["plans"]:  # the records' bands, not the planner's answer
            plan.pop("validation")
        decision = answer["decision"]
        for plan in (decision["plan"], decision["passed_over"] or {}):
            plan.pop("memory_margin", None)
        out[path.stem] = json.dumps(answer, sort_keys=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/plan_outputs.py")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, help="write the answers to this file")
    mode.add_argument("--check", type=Path, help="compare the answers with this file")
    args = p.parse_args(argv)
    now = outputs()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(now, indent=0, sort_keys=True) + "\n")
        print(f"{len(now)} scenarios -> {args.write}")
        return 0
    before = json.loads(args.check.read_text())
    for name in sorted(before.keys() | now.keys()):
        if before.get(name) != now.get(name):
            print(f"plan answer of scenario {name!r} differs from {args.check}")
            return 1
    print(f"{len(now)} scenarios: plan answers identical to {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
