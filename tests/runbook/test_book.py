"""The runbook's notebooks and their papermill runner (`python -m trainplan.runbook.build`).

Fast: nothing here starts a kernel. Execution itself is checked by `make book`
(strict build) and by nbval over the committed notebooks (`make test`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan.runbook import build as book
from trainplan.runbook import decision, pages
from trainplan.runbook import version as bookinfo
from trainplan.runbook.build import (
    execute_all,
    notebook_paths,
    parse_parameters,
    read_parameters,
)
from trainplan.runbook.pages import DEFAULT_SCENARIO, ParameterError, resolve_inputs
from trainplan.specs import Scenario, preset_names

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = notebook_paths(ROOT / "notebooks")
EXPECTED_PARAMETERS = ["scenario", "model", "gpu", "cluster", "gpus", "gpus_per_node", "seq_len",
                       "global_batch_tokens", "token_budget"]
PAGES = ["01_strategy", "02_memory", "03_throughput", "04_validation", "05_checkpoint",
         "06_launch", "07_recipe", "08_gallery", "09_provenance", "10_validation_detail"]
# 07-10: appendices, framed like the six pages (recipe, scenario gallery, data provenance,
# page 4's validation in detail)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def run_book(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainplan.runbook.build", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- the notebooks


def test_the_six_pages_and_the_recipe_appendix_are_there_in_order():
    assert [p.stem for p in NOTEBOOKS] == PAGES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_exactly_one_parameters_cell(path):
    tagged = [c for c in _cells(path) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    assert tagged[0]["cell_type"] == "code"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_parses(path):
    params = read_parameters(path)
    assert list(params) == EXPECTED_PARAMETERS
    assert params["scenario"].default == DEFAULT_SCENARIO
    for p in params.values():
        assert p.help, f"{p.name} has no `# help` comment"
        assert p.type in ("str", "int", "float"), "papermill reads plain annotations only"
        if p.name != "scenario":
            assert not p.default, f"{p.name}: empty, so the scenario file gives the default"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_code_cell_is_introduced_by_markdown(path):
    cells = _cells(path)
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            assert i > 0 and cells[i - 1]["cell_type"] == "markdown", (
                f"code cell {i} of {path.name} has no sentence before it")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_page_opens_with_label_title_and_plain_words_box(path):
    first = _source(_cells(path)[0])
    assert re.match(r"\(page-[a-z]+\)=\n# \S", first), "label, then title"
    assert ":::{admonition} In plain words" in first
    for part in ("**The decision.**", "**The number that matters.**", "**The risk.**",
                 "{{ version }}"):  # the version: trainplan.runbook.version's Sphinx substitution
        assert part in first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_executed_and_clean(path):
    """nbval compares against these outputs: every code cell ran, none failed, no timings."""
    nb = json.loads(path.read_text())
    assert "papermill" not in nb["metadata"]
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        assert cell["execution_count"] is not None, "run `make notebooks`"
        assert not [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not [o for o in cell["outputs"] if o.get("name") == "stderr"], "warnings"
        assert "papermill" not in cell["metadata"] and "execution" not in cell["metadata"]
        assert "injected-parameters" not in cell["metadata"].get("tags", [])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_tables_show_every_row_and_whole_cells(path):
    """pandas cuts a cell at 50 characters and a table at 60 rows unless the page says not to
    (`pages.display_whole_tables`); a reader of the page cannot undo it."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            html = "".join(out.get("data", {}).get("text/html", ""))
            cut = re.findall(r"<t[dh]>[^<]*\.\.\.</t[dh]>", html)
            assert not cut, f"cut table cells: {cut[:3]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_types_no_results(path):
    """Numbers reach the text through glue; markdown holds no typed-in results.

    Digits are allowed in code spans, roles, labels and a few fixed phrases
    (page cross-references, the 95% interval of the measurement protocol).
    """
    allowed = re.compile(r"`[^`]*`|\(page-[a-z]+\)=|95%|\{[a-z:]+\}")
    for cell in _cells(path):
        if cell["cell_type"] == "markdown":
            text = allowed.sub("", _source(cell))
            assert not re.search(r"\d", text), f"a typed number in {path.name}: {text!r}"


GLUE_REF = re.compile(r"\{glue(?::\w+)?\}`(?:(?P<doc>[^`:]+\.ipynb)::)?(?P<key>\w+)[^`]*`"
                      r"|```\{glue:\w+\} (?P<block>\w+)")


def _glued_keys(path: Path) -> set[str]:
    return {o["metadata"]["scrapbook"]["name"] for c in _cells(path) if c["cell_type"] == "code"
            for o in c["outputs"] if "scrapbook" in o.get("metadata", {})}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_glue_reference_has_a_glued_value(path):
    """Caught here, without a book build: a `{glue:...}` key that no cell glues. (Cells of
    the case the default scenario's page drops are tests/runbook/test_launch_page.py's.)"""
    glued = _glued_keys(path)
    assert glued, "no glued values: is the notebook executed?"
    default = book.other_case_tags(resolve_inputs(DEFAULT_SCENARIO))
    for cell in book.drop_cells({"cells": _cells(path)}, default)["cells"]:
        if cell["cell_type"] == "markdown":
            for m in GLUE_REF.finditer(_source(cell)):
                assert (m["key"] or m["block"]) in glued, f"{path.name}: {m[0]}"


def test_front_page_glue_comes_from_page_one():
    text = (ROOT / "book" / "index.md").read_text()
    refs = [m for m in GLUE_REF.finditer(text) if m["doc"]]
    assert refs
    for m in refs:
        assert m["key"] in _glued_keys(ROOT / "notebooks" / Path(m["doc"]).name)


# ---------------------------------------------------------------- parameters


def test_parse_parameters_reads_type_default_and_help():
    params = parse_parameters('gpus: int = 0  # GPUs in the job\nname: str = "x"  # n')
    assert params["gpus"].type == "int" and params["gpus"].default == 0
    assert params["gpus"].help == "GPUs in the job"
    assert params["name"].default == "x"


@pytest.mark.parametrize("source", ["gpus = 3", "x: int", "import os", "gpus: int = f(3)"])
def test_parse_parameters_refuses_other_statements(source):
    with pytest.raises((ParameterError, ValueError)):
        parse_parameters(source)


def test_resolve_inputs_takes_the_scenario_and_applies_overrides():
    base = resolve_inputs(DEFAULT_SCENARIO)
    assert base.gpus > 0 and base.seq_len > 0 and base.token_budget > 0
    more = resolve_inputs(DEFAULT_SCENARIO, gpus=2 * base.gpus, gpus_per_node=4)
    assert more.gpus == 2 * base.gpus and more.gpus_per_node == 4
    assert more.model == base.model


def test_empty_parameters_take_the_scenarios_values():
    assert resolve_inputs(DEFAULT_SCENARIO, model="", gpus=0, token_budget=0.0) == \
        resolve_inputs(DEFAULT_SCENARIO)


@pytest.mark.parametrize("kw", [{"gpus": -8}, {"seq_len": -1}, {"gpus": 2.5},
                                {"token_budget": -1.0}, {"gpus_per_node": -8},
                                {"model": "no-such-model"}])
def test_resolve_inputs_refuses_bad_values(kw):
    with pytest.raises(book.TrainplanError):
        resolve_inputs(DEFAULT_SCENARIO, **kw)


# ---------------------------------------------------------------- the command line


def _one_line_exit_2(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def _book_files() -> list[str]:
    """book/'s entries but the hidden scratch folders of a build another test may be running."""
    return sorted(p.name for p in (ROOT / "book").iterdir() if not p.name.startswith("."))


def test_bad_scenario_is_one_line_exit_2_and_writes_nothing():
    before = _book_files()
    proc = run_book("--scenario", "no-such-scenario")
    _one_line_exit_2(proc, "no-such-scenario", DEFAULT_SCENARIO)
    assert _book_files() == before


@pytest.mark.parametrize("args,needles", [
    (["-p", "gpus=abc"], ["gpus='abc'", "whole number"]),
    (["-p", "nope=1"], ["'nope'", "gpus_per_node"]),
    (["-p", "gpus"], ["NAME=VALUE"]),
    (["-p", "gpus=0"], ["gpus='0'", "scenario's value"]),
    (["-p", "token_budget=-1e9"], ["token_budget='-1e9'"]),
    (["-p", "model="], ["model=''"]),
    (["-p", "model=gpt-17"], ["gpt-17", "llama-13b"]),
    (["--in-place", "--scenario", "other"], ["--in-place"]),
    (["--bogus"], ["--bogus"]),
    (["-p", "global_batch_tokens=1000"], ["1000"]),  # no layout reaches the batch
    (["-p", "gpus=12"], ["12", "gpus-per-node"]),  # not whole nodes
    (["-p", "model=llama-70b", "-p", "gpus=2", "-p", "gpus_per_node=2"], ["nothing fits"]),
])
def test_bad_input_is_one_line_exit_2(args, needles):
    _one_line_exit_2(run_book(*args), *needles)


def test_cli_passes_scenario_and_overrides_to_papermill(monkeypatch):
    calls = []
    monkeypatch.setattr(book, "execute_all", lambda paths, dest, params, in_place, **kw:
                        calls.append((dest, params, in_place, kw)))
    assert book.main(["--scenario", DEFAULT_SCENARIO, "-p", "gpus=64", "-p", "seq_len=2048"]) == 0
    assert calls[-1] == (book.GENERATED, {"scenario": DEFAULT_SCENARIO, "gpus": 64,
                                          "seq_len": 2048}, False,
                         {"drop_tags": ("not-launchable",)})
    assert book.main(["--in-place"]) == 0
    assert calls[-1] == (book.NOTEBOOKS, {}, True, {"drop_tags": ()}), \
        "in place: no injected parameters, every cell kept"


def test_failed_notebook_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    import papermill

    dest = tmp_path / "_generated"
    dest.mkdir()
    (dest / "old.ipynb").write_text("{}")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("01_a.ipynb", "02_b.ipynb"):
        (src / name).write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                            "nbformat_minor": 5}))

    def fake_execute(input_path, output_path, **kw):
        if "02_b" in input_path:
            raise papermill.PapermillExecutionError(0, 1, "boom", "SpecError", "bad", [])
        Path(output_path).write_text(Path(input_path).read_text())

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    monkeypatch.setattr(book, "REPORTS", tmp_path / "reports")
    with pytest.raises(book.NotebookFailed) as err:
        execute_all(sorted(src.iterdir()), dest, {"scenario": "x"}, log=lambda _: None,
                    scratch=tmp_path)
    assert err.value.ename == "SpecError"
    assert [p.name for p in dest.iterdir()] == ["old.ipynb"]
    assert not list(tmp_path.glob(".trainplan-book-*")), "temporary folder left behind"


# ---------------------------------------------------------------- scenarios, version, records


SCENARIOS = preset_names(Scenario)


def test_the_issue_s_five_scenarios_are_there():
    assert DEFAULT_SCENARIO in SCENARIOS and len(SCENARIOS) >= 5


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_has_a_plan_that_fits(name):
    inputs = resolve_inputs(name)
    _, chosen, _, _ = decision.decide(inputs)
    assert chosen["fits"] and chosen["tokens_per_s"] > 0
    assert inputs.title and inputs.title != name, "a title in plain words"


def test_the_gallery_has_every_scenario_and_marks_this_build():
    current = resolve_inputs(DEFAULT_SCENARIO, gpus=64)
    rows, decisions = pages.gallery(current)
    assert len(rows) == len(SCENARIOS)
    marked = [i for i in rows.index if i.endswith("(this build)")]
    assert marked == [f"{DEFAULT_SCENARIO} (this build)"]
    assert rows.loc[marked[0], "gpus"] == 64, "this build's row takes its overrides"
    assert decisions.count("\n- ") == len(SCENARIOS) - 1
    assert list(pages.gallery_table(rows).index) == list(rows.index)


def test_records_note_says_so_when_the_card_was_not_measured():
    a100 = resolve_inputs(DEFAULT_SCENARIO, gpu="a100-80gb")
    assert "no proxy records for this card" in pages.records_note(a100, ["NVIDIA H200"], 2)
    h200 = resolve_inputs(DEFAULT_SCENARIO, gpu="h200-sxm")
    assert "the card of this scenario" in pages.records_note(h200, ["NVIDIA H200"], 2)


def test_the_decision_passes_over_what_the_trainer_cannot_run():
    """70B: every layout of the search runs (context parallel included), and the fastest fits
    with its memory band, so it is the decision. A mixture of experts is not launchable."""
    _, d = decision.decided(resolve_inputs("llama-70b-256xh100"))
    assert d.not_runnable is None and d.chosen.name == d.fastest.name
    assert d.fits_band and decision.passed_over(d) == ""
    _, d = decision.decided(resolve_inputs("mixtral-8x7b-64xh100"))
    assert not d.launchable and "mixture of experts" in d.not_runnable
    assert "Not launchable yet" in decision.passed_over(d)
    _, d = decision.decided(resolve_inputs(DEFAULT_SCENARIO))
    assert d.not_runnable is None and "Not launchable" not in decision.passed_over(d)


def test_version_is_package_plus_short_commit(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "9.8.7"\n')
    assert bookinfo.version(tmp_path, environ={"TRAINPLAN_GIT_COMMIT": "0123456789abcdef"}) \
        == "9.8.7+0123456"
    assert bookinfo.version(tmp_path, environ={}) == "9.8.7+unknown", "no git here"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*\+\S+", bookinfo.version())


def test_provenance_table_names_every_record_file():
    files = bookinfo.records_used()
    assert files and all(f.is_file() for f in files)
    table = bookinfo.provenance_table(files)
    assert len(table) == len(files)
    jsonl = table[[i.endswith(".jsonl") for i in table.index]]
    assert (jsonl["records"] > 0).all() and (jsonl["card"] != "not recorded").all()


def test_pdf_without_a_build_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainplan.runbook.pdf", "--html", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    _one_line_exit_2(proc, "make book")


def test_the_gallery_adds_a_scenario_file_from_elsewhere(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((ROOT / "data" / "scenarios" / f"{DEFAULT_SCENARIO}.yaml").read_text())
    rows, _ = pages.gallery(resolve_inputs(str(path)))
    assert len(rows) == len(SCENARIOS) + 1 and rows.index[-1] == f"{path} (this build)"
