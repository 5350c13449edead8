"""The build's `-p` parameters are range-checked before any notebook runs, and `--only`
rebuilds one page while keeping the others (`python -m trainplan.runbook.build`).

Fast but for the one marked slow, which executes page 1 for real in a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainplan.errors import PresetNotFound
from trainplan.runbook import build as book
from trainplan.runbook.pages import DEFAULT_SCENARIO, ParameterError, resolve_inputs
from trainplan.runbook.site import SiteError, injected_parameters

ROOT = Path(__file__).resolve().parents[2]
PAGES = [p.name for p in book.notebook_paths()]


def _no_execution(monkeypatch):
    """Fail the test if the build gets as far as executing a notebook."""
    def refuse(*args, **kw):
        raise AssertionError("a notebook would run")
    monkeypatch.setattr(book, "execute_all", refuse)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- -p ranges


@pytest.mark.parametrize("item,needles", [
    ("token_budget=nan", ["token_budget=nan", "1 to 1e+18"]),
    ("token_budget=inf", ["token_budget=inf", "1 to 1e+18"]),
    ("token_budget=1e308", ["token_budget=1e+308", "1 to 1e+18"]),
    ("token_budget=1e19", ["token_budget=1e+19", "1 to 1e+18"]),
    ("token_budget=0.5", ["token_budget=0.5", "1 to 1e+18"]),
    ("token_budget=" + "9" * 400, ["token_budget=inf", "1 to 1e+18"]),
    ("gpus=2097152", ["gpus=2097152", "1 to 1,048,576"]),
    ("gpus_per_node=100000", ["gpus_per_node=100000", "1 to 4,096"]),
    ("seq_len=100000000", ["seq_len=100000000", "1 to 16,777,216"]),
    ("global_batch_tokens=10000000000000", ["global_batch_tokens=10000000000000",
                                            "1 to 1,099,511,627,776"]),
    ("gpus=" + "9" * 4000, ["gpus=<a 13288-bit integer>", "1 to 1,048,576"]),
])
def test_an_out_of_range_parameter_is_refused_before_any_notebook_runs(item, needles, monkeypatch,
                                                                      capsys):
    _no_execution(monkeypatch)
    assert book.main(["-p", item]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == "" and len(line) < 300, line
    for needle in needles:
        assert needle in line


@pytest.mark.parametrize("item,needle", [
    ("gpus=" + "9" * 5000, "gpus='999"),  # too many digits for int(): the text, cut short
    ("gpu=" + "x" * 5000, "'xxx"),  # a name the OS refuses to look up
])
def test_a_huge_parameter_is_one_short_line(item, needle, monkeypatch, capsys):
    _no_execution(monkeypatch)
    assert book.main(["-p", item]) == 2
    line = _one_line(capsys.readouterr().err)
    assert needle in line and "..." in line and len(line) < 300, line


# the command as a process, with notebook execution replaced by an exit 99: a regression
# fails the test instead of building the shared book/_generated/
PROCESS = ("import sys; from trainplan.runbook import build; "
           "build.execute_all = lambda *a, **kw: sys.exit(99); "
           "sys.exit(build.main(sys.argv[1:]))")


@pytest.mark.parametrize("value", ["nan", "1e308"])
def test_the_command_refuses_a_token_budget_in_one_line_exit_2(value):
    proc = subprocess.run([sys.executable, "-c", PROCESS, "-p", f"token_budget={value}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("trainplan.runbook.build: bad parameter token_budget=")
    assert str(float(value)) in line and "1 to 1e+18" in line


@pytest.mark.parametrize("kw,needle", [
    ({"token_budget": float("nan")}, "token_budget=nan"),
    ({"token_budget": 10**400}, "token_budget=<a 1329-bit integer>"),  # float() would overflow
    ({"gpus": 2**21}, "gpus=2097152"),
    ({"gpus_per_node": 2**13}, "gpus_per_node=8192"),
])
def test_resolve_inputs_refuses_what_a_notebook_is_given_out_of_range(kw, needle):
    """The notebooks call resolve_inputs with papermill's values: the same checks apply."""
    with pytest.raises(ParameterError) as err:
        resolve_inputs(DEFAULT_SCENARIO, **kw)
    assert needle in str(err.value)


def test_a_name_the_os_will_not_look_up_is_one_line():
    with pytest.raises(PresetNotFound, match="file name too long"):
        resolve_inputs(DEFAULT_SCENARIO, model="m" * 5000)


def test_values_in_range_still_resolve():
    inputs = resolve_inputs(DEFAULT_SCENARIO, token_budget=1e18, gpus=1024, seq_len=2048)
    assert (inputs.token_budget, inputs.gpus, inputs.seq_len) == (1e18, 1024, 2048)


# ---------------------------------------------------------------- --only keeps the others


def _page(folder: Path, name: str, injected: str, text: str = "") -> Path:
    cells = [{"cell_type": "code", "metadata": {"tags": ["injected-parameters"]},
              "source": injected, "outputs": [], "execution_count": None},
             {"cell_type": "markdown", "metadata": {}, "source": text}]
    path = folder / name
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def _fake_papermill(monkeypatch):
    import papermill

    def fake_execute(input_path, output_path, parameters=None, **kw):
        injected = "".join(f"{k} = {v!r}\n" for k, v in (parameters or {}).items())
        _page(Path(output_path).parent, Path(output_path).name, injected, "new")

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)


def _snapshot(folder: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_build_of_one_page_keeps_the_other_pages_as_they_were(tmp_path, monkeypatch):
    _fake_papermill(monkeypatch)
    src, dest = tmp_path / "src", tmp_path / "_generated"
    src.mkdir()
    dest.mkdir()
    names = ["01_a.ipynb", "02_b.ipynb", "03_c.ipynb"]
    for name in names:
        _page(src, name, "")
        _page(dest, name, "scenario = 'x'\n", f"old {name}")
    before = _snapshot(dest)
    book.execute_all([src / "02_b.ipynb"], dest, {"scenario": "x"}, log=lambda _: None,
                     scratch=tmp_path)
    after = _snapshot(dest)
    assert sorted(after) == names
    assert after["01_a.ipynb"] == before["01_a.ipynb"]
    assert after["03_c.ipynb"] == before["03_c.ipynb"]
    assert b"new" in after["02_b.ipynb"][0] and b"old" not in after["02_b.ipynb"][0]
    assert not list(tmp_path.glob(".trainplan-book-*")), "temporary folder left behind"


def test_a_build_of_every_page_still_replaces_the_whole_folder(tmp_path, monkeypatch):
    _fake_papermill(monkeypatch)
    src, dest = tmp_path / "src", tmp_path / "_generated"
    src.mkdir()
    dest.mkdir()
    _page(src, "01_a.ipynb", "")
    _page(dest, "00_stale.ipynb", "")
    book.execute_all([src / "01_a.ipynb"], dest, {"scenario": "x"}, log=lambda _: None,
                     scratch=tmp_path)
    assert [p.name for p in dest.iterdir()] == ["01_a.ipynb"]


def test_only_is_refused_when_the_kept_pages_are_another_builds(tmp_path, monkeypatch, capsys):
    _no_execution(monkeypatch)
    for name in PAGES:
        _page(tmp_path, name, f"# Parameters\nscenario = {DEFAULT_SCENARIO!r}\n")
    monkeypatch.setattr(book, "GENERATED", tmp_path)
    before = _snapshot(tmp_path)
    assert book.main(["--only", "01_strategy", "-p", "gpus=64"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--only" in line and PAGES[1] in line and "gpus=64" in line, line
    assert _snapshot(tmp_path) == before


def test_only_with_the_same_parameters_goes_ahead(tmp_path):
    for name in PAGES:
        _page(tmp_path, name, f"# Parameters\nscenario = {DEFAULT_SCENARIO!r}\ngpus = 64\n")
    keep = book.kept_pages([book.NOTEBOOKS / "01_strategy.ipynb"])
    assert keep == set(PAGES[1:])
    book.check_kept_pages(tmp_path, keep, {"scenario": DEFAULT_SCENARIO, "gpus": 64})
    book.check_kept_pages(tmp_path / "none", keep, {"scenario": "other"})  # nothing kept yet


@pytest.mark.parametrize("text", ["{not json", '{"cells": 3}', "[]"])
def test_a_kept_page_that_is_no_notebook_is_one_line(tmp_path, text):
    (tmp_path / "02_b.ipynb").write_text(text)
    with pytest.raises(SiteError, match="02_b.ipynb"):
        injected_parameters(tmp_path / "02_b.ipynb")


def test_injected_parameters_that_are_not_literals_are_refused(tmp_path):
    _page(tmp_path, "02_b.ipynb", "token_budget = float('nan')\n")
    with pytest.raises(SiteError, match="02_b.ipynb"):
        injected_parameters(tmp_path / "02_b.ipynb")


@pytest.mark.slow
def test_page_one_built_for_real_leaves_the_others_byte_for_byte(tmp_path):
    """Executes 01_strategy with papermill (a kernel, some seconds) into a copy of the
    committed notebooks standing in for book/_generated/."""
    dest = tmp_path / "_generated"
    dest.mkdir()
    for path in book.notebook_paths():
        (dest / path.name).write_bytes(path.read_bytes())
        os.utime(dest / path.name, ns=(1, 1))
    before = _snapshot(dest)
    book.execute_all([book.NOTEBOOKS / "01_strategy.ipynb"], dest, {"scenario": DEFAULT_SCENARIO},
                     log=lambda _: None, scratch=tmp_path, drop_tags=("not-launchable",))
    after = _snapshot(dest)
    assert sorted(after) == sorted(before)
    assert after["01_strategy.ipynb"] != before["01_strategy.ipynb"]
    assert injected_parameters(dest / "01_strategy.ipynb") == {"scenario": DEFAULT_SCENARIO}
    assert {k: v for k, v in after.items() if k != "01_strategy.ipynb"} == \
        {k: v for k, v in before.items() if k != "01_strategy.ipynb"}
