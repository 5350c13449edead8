"""The runbook on paper, for every scenario: six printed pages, one a runbook page, titled and
named by scenario (`trainplan.runbook.pdf`), and each page's plain-words box on the first
screen at 1280 x 800.

The default scenario is this session's build (`built_book`); another scenario is checked
where `make book-all` built it at this version, and skipped, saying so, where it did not:
one scenario's build takes about a minute on two cores, four more would not fit `make test`
(`make test-scenarios` builds them all, then runs these). Whatever a page holds, it prints
on one sheet: a sheet that would run over is scaled to fit, checked with a box made six
times as long.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from tests.book.built import BOX_JS, FIRST_SCREEN, HTML, ROOT, needs_chromium, run
from tests.book.cdp import Browser

from trainplan.runbook import site
from trainplan.runbook.build import notebook_paths
from trainplan.runbook.pages import DEFAULT_SCENARIO
from trainplan.runbook.pdf import PAGES, PRINT_PAGE
from trainplan.specs import Scenario, preset_names

pytestmark = needs_chromium

SCENARIOS = preset_names(Scenario)


def _built(scenario: str) -> Path:
    """A scenario's built site: the default's is this session's; another's must have been
    built at this version (`make book-all`), else the test is skipped, saying so."""
    from trainplan.runbook.version import version

    html = site.html_dir(scenario)
    first = html / "book" / "_generated" / f"{PAGES[0]}.html"
    if scenario != DEFAULT_SCENARIO and not (first.is_file()
                                             and f"version {version()}" in first.read_text()):
        pytest.skip(f"{scenario} is not built at version {version()}: make book-all")
    return html


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_prints_six_pages_named_by_it(scenario, built_book, tmp_path):
    """One sheet per runbook page, the scenario in the PDF's title and file name."""
    from trainplan.runbook.pdf import pdf_pages, scenario_title
    from trainplan.runbook.version import version

    html = _built(scenario)
    out = tmp_path / site.pdf_path(scenario).name
    proc = run([sys.executable, "-m", "trainplan.runbook.pdf", "--scenario", scenario,
                 "--html", str(html), "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert pdf_pages(out) == len(PAGES) == 6
    assert out.name == f"trainplan-runbook-{scenario}.pdf"
    title = f"trainplan runbook {version()}: {scenario_title(scenario)}, scenario {scenario}"
    assert f"<title>{title}</title>" in (html / "book" / "_generated" / PRINT_PAGE).read_text()
    assert f"trainplan runbook {version()}".encode() in out.read_bytes()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_s_boxes_fit_the_first_screen(scenario, built_book):
    """At 1280 x 800, each notebook page's plain-words box ends on the first screen."""
    html = _built(scenario)
    bottoms = {}
    with Browser() as browser:
        for path in notebook_paths(ROOT / "notebooks"):
            browser.open((html / "book" / "_generated" / f"{path.stem}.html").as_uri())
            bottoms[path.stem] = browser.evaluate(BOX_JS)
    assert None not in bottoms.values(), bottoms
    assert not {p: b for p, b in bottoms.items() if b > FIRST_SCREEN[1]}


def test_a_sheet_that_runs_over_is_scaled_to_fit(built_book, tmp_path):
    """Six pages whatever a scenario's pages hold: page 1 with its box six times over still
    prints on one sheet, and would not without the fit (so the check can fail)."""
    from trainplan.runbook.pdf import FIT_JS, element, pdf_pages, print_page, print_pdf

    text = print_page(HTML, DEFAULT_SCENARIO).read_text()
    box = element(text, re.search(r'<div class="[^"]*\badmonition\b', text).start())
    long = HTML / "book" / "_generated" / f".long-print-{os.getpid()}.html"
    try:
        long.write_text(text.replace(box, box * 6, 1))
        assert pdf_pages(print_pdf(long, tmp_path / "long.pdf")) == len(PAGES)
        long.write_text(text.replace(box, box * 6, 1).replace(FIT_JS, ""))
        assert pdf_pages(print_pdf(long, tmp_path / "unfitted.pdf")) > len(PAGES)
    finally:
        long.unlink(missing_ok=True)
