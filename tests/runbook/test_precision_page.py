"""Page 3's bf16 and fp8 section shows what `trainplan plan` decides with and without
`--precision fp8`, and says so in one sentence where the scenario's GPU has no fp8.

The numbers are checked twice against the command line run as a user runs it: through the
helpers the page calls (`runbook.precision`), and in the committed notebook's table, the
page as nbval and the book see it. No kernel starts here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from trainplan.cost.step_time import time_to_train
from trainplan.runbook import decision, figures, precision
from trainplan.runbook.figures.precision import ROWS
from trainplan.runbook.pages import DEFAULT_SCENARIO, resolve_inputs
from trainplan.specs import Scenario, load_scenario, preset_names

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "notebooks" / "03_throughput.ipynb"
PARALLEL = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "recompute")


def plan_cli(scenario: str, *extra) -> subprocess.CompletedProcess:
    """`trainplan plan --json` for the scenario's model, GPU, cluster, GPUs, sequence and batch."""
    sc = load_scenario(scenario)
    args = ["plan", "--model", sc.model, "--gpu", sc.gpu, "--cluster", sc.cluster,
            "--gpus", sc.gpus, "--seq-len", sc.seq_len, "--global-batch-tokens",
            sc.global_batch_tokens, "--json", *extra]
    return subprocess.run([sys.executable, "-m", "trainplan.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def answers() -> dict:
    """`plan --json`'s answers for the default scenario: {"bf16": ..., "fp8": ...}."""
    out = {}
    for name, extra in (("bf16", ()), ("fp8", ("--precision", "fp8"))):
        proc = plan_cli(DEFAULT_SCENARIO, *extra)
        assert proc.returncode == 0, proc.stderr
        out[name] = json.loads(proc.stdout)
    return out


def _page_table() -> dict:
    """The committed page's bf16 / fp8 table: {row label: (bf16 cell, fp8 cell)}."""
    cells = json.loads(PAGE.read_text())["cells"]
    label = ROWS["mfu"][0]
    html = [o["data"]["text/html"] for c in cells if c["cell_type"] == "code"
            for o in c["outputs"] if label in "".join(o.get("data", {}).get("text/html", ""))]
    assert len(html) == 1, "page 3 shows one bf16 / fp8 table"
    rows = re.findall(r"<th>([^<]+)</th>\s*<td>([^<]*)</td>\s*<td>([^<]*)</td>", "".join(html[0]))
    return {r[0]: (r[1], r[2]) for r in rows}


def _glued(name: str) -> str:
    cells = json.loads(PAGE.read_text())["cells"]
    return next(o["data"]["application/papermill.record/text/markdown"]
                for c in cells if c["cell_type"] == "code" for o in c["outputs"]
                if o.get("metadata", {}).get("scrapbook", {}).get("name") == name)


def _shown(plan: dict, inputs) -> dict:
    """What the page's table shows of a `plan --json` plan, formatted as the table formats."""
    train = time_to_train(inputs.token_budget, plan["tokens_per_s"], inputs.gpus)
    raw = {"strategy": plan["strategy"], "micro_batch": plan["parallel"]["micro_batch"],
           "recompute": plan["parallel"]["recompute"], "step_time_s": plan["step_time_s"],
           "tokens_per_s_per_gpu": plan["tokens_per_s_per_gpu"], "mfu": plan["mfu"],
           "total_gib": plan["memory_gib"]["total"], "days": train["days"],
           "gpu_hours": train["gpu_hours"]}
    return {label: fmt.format(raw[key]) for key, (label, fmt) in ROWS.items()}


def test_the_fp8_section_shows_plan_precision_fp8_s_decision(answers):
    inputs = resolve_inputs(DEFAULT_SCENARIO)
    fp8 = precision.decided(inputs)
    _, d = decision.decided(inputs)
    cli = answers["fp8"]
    assert cli["precision"] == "fp8" and fp8.summary == cli["fp8"]
    want = cli["decision"]["plan"]
    got = fp8.chosen
    assert got["strategy"] == want["strategy"]
    assert {k: got[k] for k in PARALLEL} == {k: want["parallel"][k] for k in PARALLEL}
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "tokens_per_s"):
        assert got[key] == pytest.approx(want[key], rel=1e-9), key
    assert got["total_gib"] == pytest.approx(want["memory_gib"]["total"], abs=1e-3)
    rows = precision.side_by_side(inputs, d.chosen, fp8)
    train = time_to_train(inputs.token_budget, want["tokens_per_s"], inputs.gpus)
    assert rows.loc["fp8", "days"] == pytest.approx(train["days"], rel=1e-9)
    assert rows.loc["fp8", "gpu_hours"] == pytest.approx(train["gpu_hours"], rel=1e-9)
    # the committed page: its fp8 column is the fp8 decision, its bf16 column plain `plan`'s
    table = _page_table()
    for column, name in ((1, "fp8"), (0, "bf16")):
        shown = _shown(answers[name]["decision"]["plan"], inputs)
        assert {label: table[label][column] for label in shown} == shown, name


def test_the_words_on_fp8_follow_its_validated_flag(answers):
    inputs = resolve_inputs(DEFAULT_SCENARIO)
    fp8 = precision.decided(inputs)
    words = "not measured on this card"
    assert (words in _glued("precision_note")) == (not answers["fp8"]["fp8"]["validated"])
    for validated in (False, True):
        other = precision.Fp8Plan(fp8.decision, {**fp8.summary, "validated": validated},
                                  fp8.family_measured)
        assert (words in precision.status(inputs.gpu, other)) == (not validated)


def test_mfu_of_both_columns_is_on_the_bf16_peak(answers):
    """fp8's MFU is quoted on the bf16 peak: fp8 at the same rate as bf16 would show the same
    MFU, so MFU over tokens/s per GPU is one constant for both answers."""
    per_rate = [a["decision"]["plan"]["mfu"] / a["decision"]["plan"]["tokens_per_s_per_gpu"]
                for a in answers.values()]
    assert per_rate[0] == pytest.approx(per_rate[1], rel=1e-9)


def test_an_a100_scenario_says_fp8_is_unavailable():
    a100 = [n for n in preset_names(Scenario) if "a100" in load_scenario(n).gpu]
    assert a100, "a scenario on A100s"
    inputs = resolve_inputs(a100[0])
    assert precision.decided(inputs) is None
    _, d = decision.decided(inputs)
    rows = precision.side_by_side(inputs, d.chosen, None)
    assert list(rows.index) == ["bf16"]
    note = precision.note(inputs, rows, None)
    assert "no fp8" in note and inputs.gpu.name in note and note.count(". ") == 0
    fig = figures.precision_bars(rows, None)
    assert any("no fp8" in t.get_text() for t in fig.axes[0].texts)
    plt.close(fig)
    proc = plan_cli(a100[0], "--precision", "fp8")  # the command line refuses it too
    assert proc.returncode == 2 and "no fp8" in proc.stderr
    assert precision.unavailable(resolve_inputs(DEFAULT_SCENARIO).gpu) is None
