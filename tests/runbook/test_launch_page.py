"""Page 6 for a model the trainer does not run (a mixture of experts): no commands, and why.

The page's cells come in two cases, tagged `launchable` and `not-launchable`; a scenario's
build keeps one (`build.other_case_tags`), and the shared code cell glues the explanation
from `decision.no_launch`. Fast: no kernel, no search (the plan's row is given).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainplan.errors import TrainplanError
from trainplan.launch import job
from trainplan.runbook import build, decision
from trainplan.runbook.pages import DEFAULT_SCENARIO, resolve_inputs

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "notebooks" / "06_launch.ipynb"
MOE = "mixtral-8x7b-64xh100"
ROW = {"ep": 8, "tokens_per_s_per_gpu": 1234.5}  # page 1's plan, as much of it as is read
GLUE = re.compile(r"\{glue(?::\w+)?\}`(\w+)[^`]*`")


def _cells(launchable: bool) -> list[dict]:
    nb = json.loads(PAGE.read_text())
    inputs = resolve_inputs(DEFAULT_SCENARIO if launchable else MOE)
    return build.drop_cells(nb, build.other_case_tags(inputs))["cells"]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


def test_a_mixture_of_experts_gets_the_explanation_not_the_launch_s_refusal():
    inputs = resolve_inputs(MOE)
    out = decision.no_launch(inputs, ROW)
    assert out is not None
    m = inputs.model
    assert out.values == {"experts_model": m.name, "n_experts": m.n_experts,
                          "experts_top_k": m.top_k, "experts_ep": 8,
                          "planned_tokens_per_s_per_gpu": 1234.5}
    assert m.n_experts > 1 and "mixture of experts" in out.markdown["no_launch_why"]
    listed = out.markdown["launch_scenarios"]
    assert f"`{DEFAULT_SCENARIO}`" in listed and MOE not in listed
    with pytest.raises(TrainplanError, match=re.escape(out.markdown["no_launch_why"])):
        job.best_runnable(m, inputs.gpu, inputs.cluster, gpus=inputs.gpus,
                          seq_len=inputs.seq_len, global_batch_tokens=inputs.global_batch_tokens,
                          gpus_per_node=inputs.gpus_per_node)  # the launch: the same rule
    assert decision.no_launch(resolve_inputs(DEFAULT_SCENARIO), ROW) is None


def test_the_build_keeps_one_case_of_page_six():
    assert build.other_case_tags(resolve_inputs(MOE)) == ("launchable",)
    assert build.other_case_tags(resolve_inputs(DEFAULT_SCENARIO)) == ("not-launchable",)
    for launchable in (True, False):
        cells = _cells(launchable)
        first = _text(cells[0])
        assert first.startswith("(page-launch)=\n# Train your model")
        assert ":::{admonition} In plain words" in first
        assert sum(":::{admonition} In plain words" in _text(c) for c in cells) == 1
        assert ("three commands below" in first) == launchable
        assert ("No launch commands" in first) != launchable
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                assert cells[i - 1]["cell_type"] == "markdown", f"code cell {i} unintroduced"


def test_the_explanation_s_cells_use_only_what_the_page_glues_for_it():
    """`--in-place` executes every cell for the default scenario: the `not-launchable` ones
    are prose, and their glue comes from `no_launch` or from the cells both cases share."""
    nb = json.loads(PAGE.read_text())
    tags = [set(c.get("metadata", {}).get("tags", [])) for c in nb["cells"]]
    shared = {o["metadata"]["scrapbook"]["name"] for c, t in zip(nb["cells"], tags, strict=True)
              if c["cell_type"] == "code" and not t & set(build.CASE_TAGS.values())
              for o in c["outputs"] if "scrapbook" in o.get("metadata", {})}
    out = decision.no_launch(resolve_inputs(MOE), ROW)
    glued = shared | set(out.values) | set(out.markdown)
    moe = [c for c, t in zip(nb["cells"], tags, strict=True) if "not-launchable" in t]
    assert moe and all(c["cell_type"] == "markdown" for c in moe)
    used = {key for c in moe for key in GLUE.findall(_text(c))}
    assert used and used <= glued, used - glued


def test_the_dropped_cells_never_reach_the_kernel(tmp_path, monkeypatch):
    import papermill

    src = tmp_path / "src"
    src.mkdir()
    cells = [{"cell_type": "markdown", "metadata": {"tags": [tag]}, "source": tag}
             for tag in ("launchable", "not-launchable", "other")]
    (src / "01_a.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                "nbformat_minor": 5}))
    ran = []

    def fake_execute(input_path, output_path, **kw):
        ran.append([c["source"] for c in json.loads(Path(input_path).read_text())["cells"]])
        Path(output_path).write_text(Path(input_path).read_text())

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    dest = tmp_path / "_generated"
    out = build.execute_all([src / "01_a.ipynb"], dest, {"scenario": "x"}, log=lambda _: None,
                            scratch=tmp_path, drop_tags=("launchable",))
    assert ran == [["not-launchable", "other"]]
    assert [p.name for p in dest.iterdir()] == ["01_a.ipynb"] and out == [dest / "01_a.ipynb"]
