"""Where a scenario's runbook lands (`trainplan.runbook.site`) and how its six printed sheets
are cut from the built pages (`trainplan.runbook.pdf`). Fast: no Sphinx, no browser; the
real build and print are tests/book/test_browser.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainplan.runbook import pdf, site

PARAMETERS = 'scenario: str = "llama-13b-32xh100"  # data/scenarios/NAME.yaml\ngpus: int = 0  # n'


def _notebook(folder: Path, *cells: tuple[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "01_strategy.ipynb"
    path.write_text(json.dumps({"cells": [
        {"cell_type": "code", "metadata": {"tags": [tag]}, "source": src, "outputs": []}
        for tag, src in cells]}))
    return path


def test_each_scenario_has_its_own_folder_and_pdf_name(tmp_path):
    assert site.html_dir("llama-70b-256xh100", tmp_path) == \
        tmp_path / "llama-70b-256xh100" / "html"
    assert site.pdf_path("llama-70b-256xh100", tmp_path) == \
        tmp_path / "llama-70b-256xh100" / "pdf" / "trainplan-runbook-llama-70b-256xh100.pdf"
    assert site.folder_name("elsewhere/mine.yaml") == "mine"
    assert site.html_dir("x") != site.html_dir("y")


@pytest.mark.parametrize("bad", ["two words", "../up", "", "a/b"])
def test_a_name_that_is_no_folder_is_refused(bad):
    with pytest.raises(site.SiteError, match="folder name"):
        site.folder_name(bad)


def test_the_generated_notebooks_name_their_scenario(tmp_path):
    assert site.generated_scenario(tmp_path) is None
    _notebook(tmp_path, ("parameters", PARAMETERS))
    assert site.generated_scenario(tmp_path) == "llama-13b-32xh100"
    _notebook(tmp_path, ("parameters", PARAMETERS),
              ("injected-parameters", 'scenario = "mixtral-8x7b-64xh100"\ngpus = 64\n'))
    assert site.generated_scenario(tmp_path) == "mixtral-8x7b-64xh100"


def test_the_html_of_another_scenario_or_of_nothing_is_refused(tmp_path):
    generated = tmp_path / "generated"
    with pytest.raises(site.SiteError, match="no executed notebooks"):
        site.build_html(build=tmp_path / "build", generated=generated)
    _notebook(generated, ("parameters", PARAMETERS),
              ("injected-parameters", 'scenario = "llama-70b-256xh100"\n'))
    with pytest.raises(site.SiteError, match="llama-70b-256xh100, not llama-13b-32xh100"):
        site.build_html("llama-13b-32xh100", build=tmp_path / "build", generated=generated)
    assert not (tmp_path / "build").exists(), "nothing written"


# ---------------------------------------------------------------- the printed sheets


def _page(title: str, exhibit: str) -> str:
    return (f'<html><h1>nav</h1><article class="bd-article" role="main"><section id="t">'
            f'<h1><span class="section-number">1. </span>{title}<a class="headerlink" '
            f'href="#t">#</a></h1><div class="tip admonition"><p class="admonition-title">In '
            f'plain words</p><div><p>Decide <a href="02_memory.html#x">this</a>.</p></div>'
            f"</div><p>Overview, not printed.</p>{exhibit}</section></article></html>")


FIGURE = '<figure id="fig-a"><img src="a.png"><figcaption><p>Fig. 1</p></figcaption></figure>'
SECTION = ('<section id="sec-b"><h2>1.2. The plan<a class="headerlink" href="#sec-b">#</a></h2>'
           '<p>Prose.</p><div class="cell"><div class="cell_input">code</div>'
           '<div class="cell_output"><table><tr><td>42</td></tr></table></div></div></section>')


def test_element_takes_the_whole_nested_element():
    text = '<p>x</p><div id="a"><div><div>in</div></div>tail</div><div>next</div>'
    assert pdf.element(text, text.index("<div")) == \
        '<div id="a"><div><div>in</div></div>tail</div>'


def test_a_sheet_shows_title_box_and_exhibit_only(tmp_path):
    page = tmp_path / "p.html"
    page.write_text(_page("Strategy", FIGURE))
    parts = pdf.page_parts(page, "fig-a")
    assert "Strategy" in parts["title"] and parts["title"].startswith("<h1><span")
    assert "Decide" in parts["box"] and "Overview" not in "".join(parts.values())
    assert parts["exhibit"] == FIGURE
    page.write_text(_page("Plan", SECTION))
    shown = pdf.page_parts(page, "sec-b")["exhibit"]
    assert "1.2. The plan" in shown and "<td>42</td>" in shown
    assert "Prose" not in shown and "code" not in shown and "#" not in shown.split("</div>")[0]
    assert pdf.page_parts(page, ("sec-gone", "sec-b"))["exhibit"] == shown  # the first there
    with pytest.raises(pdf.PdfError, match='id="fig-gone"'):
        pdf.page_parts(page, "fig-gone")


def test_the_print_page_has_six_sheets_named_by_scenario(tmp_path):
    folder = tmp_path / "book" / "_generated"
    folder.mkdir(parents=True)
    for p in pdf.PAGES:
        shown = pdf.EXHIBITS[p] if isinstance(pdf.EXHIBITS[p], str) else pdf.EXHIBITS[p][-1]
        (folder / f"{p}.html").write_text(_page(p, FIGURE.replace("fig-a", shown)
                                                if shown.startswith("fig")
                                                else SECTION.replace("sec-b", shown)))
    text = pdf.print_page(tmp_path, "llama-70b-256xh100").read_text()
    assert text.count('<section class="tp-page"') == 6
    assert "Llama-style 70B" in text.split("</title>")[0]
    assert "scenario llama-70b-256xh100" in text.split("</title>")[0]
    assert "page 6 of 6" in text and 'href="#02_memory"' in text
    (folder / "03_throughput.html").unlink()
    with pytest.raises(pdf.PdfError, match="make book"):
        pdf.print_page(tmp_path, "llama-70b-256xh100")
