"""No number is typed into a notebook's code: every number on a page comes from the library
or a committed record (markdown is checked by tests/runbook/test_book.py, which allows digits only
inside roles, code spans and labels).

A code cell may hold numbers only from a short allow-list: indexes and counts (0, 1, 2),
unit conversions (1e3, 1e6, 1e9, 1e12; 60, 3600, 86400 seconds; 100 for per cent), the
digits of display rounding (`round(4)`), and the few method settings listed in EXCEPTIONS
with their reason. The parameters cell is exempt: its values are empty defaults that the
scenario file fills in.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from trainplan.runbook.build import PARAMETERS_TAG, notebook_paths

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {0, 1, 2, 100, 60, 3600, 86400, 1e3, 1e6, 1e9, 1e12}
ROUNDING = {"round"}  # f(x).round(4), round(x, 4): digits to show, not a number shown
EXCEPTIONS = {
    ("05_checkpoint", 10_000): "simulated runs: the Monte Carlo sample size, shown as sim_runs",
    ("07_recipe", 4): "gradient accumulations tabulated for the study's skip rules",
    ("07_recipe", 8): "gradient accumulations tabulated for the study's skip rules",
}


def typed_numbers(nb: dict, page: str) -> list[str]:
    """'cell N line L: value' for each numeric literal outside the allow-list."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or PARAMETERS_TAG in cell["metadata"].get("tags", []):
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        tree = ast.parse(src)
        rounding = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) in ROUNDING
                    for arg in node.args[-1:] + [k.value for k in node.keywords]}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
                continue
            if node.value in ALLOWED or id(node) in rounding or (page, node.value) in EXCEPTIONS:
                continue
            found.append(f"cell {i} line {node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("path", notebook_paths(ROOT / "notebooks"), ids=lambda p: p.stem)
def test_no_number_is_typed_into_a_notebook(path):
    assert typed_numbers(json.loads(path.read_text()), path.stem) == []


def _doctored(cells: list[str]) -> dict:
    return {"cells": [{"cell_type": "code", "metadata": {}, "source": c} for c in cells]}


@pytest.mark.parametrize("source", [
    "pages.glue_values(tokens_per_s=123456)",  # a result typed in
    "days = budget / (tps * 86400) * 1.1",  # a fudge factor
    "gpus = inputs.gpus or 32",  # a default that bypasses the scenario
    "mfu = -0.5",
])
def test_a_doctored_notebook_is_caught(source):
    assert typed_numbers(_doctored(["x = table.iloc[0]", source]), "01_strategy")


def test_what_is_allowed_passes():
    ok = ["chosen = table.iloc[0]", "ms = 1e3 * seconds", "table.round(4)",
          "hours = seconds / 3600", "share = 100 * part / whole"]
    assert typed_numbers(_doctored(ok), "01_strategy") == []


def test_the_parameters_cell_is_exempt_and_exceptions_are_per_page():
    nb = {"cells": [{"cell_type": "code", "metadata": {"tags": [PARAMETERS_TAG]},
                     "source": "gpus: int = 32  # GPUs"},
                    {"cell_type": "code", "metadata": {}, "source": "runs = 10_000"}]}
    assert typed_numbers(nb, "05_checkpoint") == []
    assert typed_numbers(nb, "01_strategy") == ["cell 1 line 1: 10000"]
