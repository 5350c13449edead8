"""The six runbook pages as a six-page PDF, printed by Debian's headless Chromium.

    python -m trainplan.runbook.pdf [--scenario NAME] [--html DIR] [--out FILE]

Run after the HTML build (`make pdf`; `make book` runs both). One printed sheet per runbook
page, for a reader who takes the plan to a meeting or a cluster's change review: the page's
title, its plain-words box (the decision, the number that matters, the risk) and its one key
figure or table (`EXHIBITS`), with the scenario and version on top of every sheet; the rest
of each page is in the HTML build, which every sheet names. These parts of the six built
pages are copied into one print page, `book/_generated/runbook-print.html` beside them (so
images and links resolve as on the site), styled by its own sheet rather than the site's
theme; a sheet whose content would run over is scaled down to fit it, so the PDF has six
pages whatever the scenario. Its title and file name carry the scenario
(`_build/<scenario>/pdf/trainplan-runbook-<scenario>.pdf`, `trainplan.runbook.site`).
No browser is downloaded: `make browser` installs Debian's `chromium` when it is missing.

Bad input (no built HTML, a page without its box or exhibit, no Chromium) gives one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.runbook import site
from trainplan.runbook.version import version

PAGES = ("01_strategy", "02_memory", "03_throughput", "04_validation", "05_checkpoint",
         "06_launch")
# each page's key exhibit: a figure's id, or a section's id (its first cell output is printed);
# the first id of a tuple that the page has (page 6 of a model the trainer does not run has
# no commands, and shows its plan's layout)
EXHIBITS = {"01_strategy": "fig-candidates", "02_memory": "fig-memory",
            "03_throughput": "fig-step", "04_validation": "per-layout-family",
            "05_checkpoint": "the-checkpoint-plan",
            "06_launch": ("three-commands", "the-plan-s-layout")}
PRINT_PAGE = "runbook-print.html"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 180
SHEET_MM = (186, 275)  # A4 less the margins below: what one sheet holds

PRINT_CSS = f"""
@page {{ size: A4; margin: 11mm 12mm; }}
html {{ font: 10.5px/1.45 "DejaVu Sans", Arial, sans-serif; color: #222; }}
body {{ margin: 0; width: {SHEET_MM[0]}mm; }}
section.tp-page {{ break-after: page; }}
section.tp-page:last-child {{ break-after: auto; }}
.tp-running {{ font-size: 0.85rem; color: #555; border-bottom: 1px solid #999;
               padding-bottom: 0.2rem; margin: 0 0 0.6rem; }}
h1 {{ font-size: 2rem; font-weight: 500; margin: 0 0 0.8rem; }}
.admonition {{ border-left: 4px solid #2e7d32; background: #f4faf4; padding: 0.1rem 1rem;
               margin-bottom: 1rem; }}
.admonition-title {{ font-weight: bold; margin: 0.5rem 0; }}
.tp-exhibit-title {{ font-weight: bold; margin: 0.6rem 0 0.3rem; }}
figure {{ margin: 0; }}
figure img {{ max-width: 100%; max-height: 150mm; }}
figcaption {{ font-size: 0.9rem; color: #444; }}
table {{ border-collapse: collapse; font-size: 0.9rem; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.15rem 0.5rem; text-align: right; }}
pre {{ white-space: pre-wrap; font-size: 0.9rem; background: #f6f6f6; padding: 0.5rem; }}
a {{ color: inherit; text-decoration: none; }}
.headerlink, style {{ display: none; }}
.tp-more {{ font-style: italic; color: #555; margin-top: 0.8rem; }}
"""

# a sheet whose content runs over is zoomed down until it fits (sizes are known once the
# images have loaded; Chromium prints after the load event's handlers have run)
FIT_JS = """
window.addEventListener("load", () => {
  const sheet = document.createElement("div");
  sheet.style.cssText = "position:absolute;height:SHEET_HEIGHT;width:1px";
  document.body.appendChild(sheet);
  const room = 0.98 * sheet.getBoundingClientRect().height;
  sheet.remove();
  for (const page of document.querySelectorAll("section.tp-page")) {
    let zoom = 1;
    for (let i = 0; i < 8 && page.getBoundingClientRect().height > room; i++) {
      zoom *= Math.max(0.5, room / page.getBoundingClientRect().height);
      page.style.zoom = zoom.toFixed(3);
    }
  }
});
""".replace("SHEET_HEIGHT", f"{SHEET_MM[1]}mm")


class PdfError(TrainplanError):
    """The PDF cannot be made: no built HTML, a page without its parts, or no Chromium."""


def chromium() -> str:
    """The path of a Chromium binary, or PdfError saying how to install one."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise PdfError("no chromium on PATH (looked for " + ", ".join(BROWSERS) + "); install "
                   "Debian's package: make browser (apt-get install chromium)")


def chromium_flags() -> list[str]:
    """Flags every headless run here needs: as root no sandbox, no GPU, no first-run noise."""
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
            "--disable-extensions", "--disable-background-networking"]


def element(text: str, start: int) -> str:
    """The whole element whose start tag begins at `start` (Sphinx writes well-formed HTML)."""
    tag = re.match(r"<(\w+)", text[start:])[1]
    pattern = re.compile(rf"<{tag}\b|</{tag}\s*>")
    depth = 0
    for m in pattern.finditer(text, start):
        depth += -1 if m[0].startswith("</") else 1
        if depth == 0:
            return text[start:m.end()]
    raise PdfError(f"<{tag}> at {start} is never closed")


def _find(text: str, pattern: str, what: str, page: Path) -> str:
    found = re.search(pattern, text)
    if not found:
        raise PdfError(f"{page}: no {what} in it; rebuild with make book")
    return element(text, found.start())


def page_parts(page: Path, exhibit: str | tuple[str, ...]) -> dict[str, str]:
    """The parts of one built page that its printed sheet shows: {"title", "box", "exhibit"}
    (`exhibit` names a figure, or a section whose first cell output is shown, headed; of a
    tuple, the first the page has)."""
    text = _find(page.read_text(encoding="utf-8"), r'<article class="bd-article"',
                 '<article class="bd-article">', page)
    title = _find(text, r"<h1\b", "<h1> title", page)
    box = _find(text, r'<div class="(?=[^"]*\badmonition\b)(?=[^"]*\btip\b)', "plain-words box",
                page)
    ids = (exhibit,) if isinstance(exhibit, str) else exhibit
    exhibit = next((i for i in ids if f'id="{i}"' in text), ids[0])
    shown = _find(text, rf'<\w+\b[^>]*\bid="{re.escape(exhibit)}"', f'id="{exhibit}"', page)
    if not shown.startswith("<figure"):
        heading = _find(shown, r"<h[2-4]\b", "heading", page)
        output = _find(shown, r'<div class="cell_output\b', f"cell output in #{exhibit}", page)
        shown = f'<div class="tp-exhibit-title">{_text(heading)}</div>{output}'
    return {"title": title, "box": box, "exhibit": shown}


def _text(fragment: str) -> str:
    """An element's text, tags and the headerlink's '#' left out."""
    fragment = re.sub(r'<a class="headerlink".*?</a>', "", fragment, flags=re.S)
    return html.escape(html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip())


def scenario_title(scenario: str) -> str:
    """The scenario's title in words (its file's `title`), or its name where it has none."""
    from trainplan.specs import load_scenario

    try:
        return load_scenario(scenario).title or scenario
    except TrainplanError:
        return scenario


def print_page(html_dir: Path, scenario: str, pages=PAGES) -> Path:
    """Write the single print page of `pages` (one sheet each) beside them; return its path."""
    folder = Path(html_dir) / "book" / "_generated"
    missing = [p for p in pages if not (folder / f"{p}.html").is_file()]
    if missing:
        raise PdfError(f"no built page {folder / (missing[0] + '.html')}; run make book first")
    head = (f"trainplan runbook {version()}: {scenario_title(scenario)}, scenario "
            f"{site.folder_name(scenario)}")
    sheets = []
    for n, p in enumerate(pages, 1):
        parts = page_parts(folder / f"{p}.html", EXHIBITS[p])
        body = parts["title"] + parts["box"] + parts["exhibit"]
        for other in pages:  # links between the printed pages stay inside the PDF
            body = re.sub(rf'href="{other}\.html(#[^"]*)?"', f'href="#{other}"', body)
        sheets.append(
            f'<section class="tp-page" id="{p}"><p class="tp-running">{html.escape(head)}'
            f" &middot; page {n} of {len(pages)}</p>{body}<p class=\"tp-more\">The whole page, "
            f"with its other tables and figures: book/_generated/{p}.html in the HTML build "
            f"(_build/{html.escape(site.folder_name(scenario))}/html).</p></section>")
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
           f"<title>{html.escape(head)}</title>\n<style>{PRINT_CSS}</style>\n"
           f"<script>{FIT_JS}</script>\n</head><body>\n" + "\n".join(sheets)
           + "\n</body></html>\n")
    out = folder / PRINT_PAGE
    tmp = out.with_name(f".{PRINT_PAGE}.{os.getpid()}")
    tmp.write_text(doc, encoding="utf-8")
    os.replace(tmp, out)  # whole or not at all: a browser may be reading the last one
    return out


def pdf_pages(path: Path) -> int:
    """Printed pages in a PDF (Chromium's PDFs list each page as a `/Type /Page` object)."""
    return len(re.findall(rb"/Type\s*/Page(?![s\w])", Path(path).read_bytes()))


def print_pdf(source: Path, out: Path, timeout: float = TIMEOUT_S) -> Path:
    """Print `source` (an HTML file) to `out` with headless Chromium."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.pdf")
    tmp.unlink(missing_ok=True)
    cmd = [chromium(), *chromium_flags(), "--no-pdf-header-footer",
           f"--print-to-pdf={tmp}", Path(source).resolve().as_uri()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PdfError(f"chromium did not finish printing {source} in {timeout:.0f} s") from None
    if not tmp.is_file() or tmp.stat().st_size == 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PdfError(f"chromium printed no PDF (exit {proc.returncode}): {last}")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainplan.runbook.pdf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default=None,
                   help="whose build to print (default: the scenario of book/_generated/)")
    p.add_argument("--html", type=Path, default=None,
                   help="the built HTML (default _build/<scenario>/html)")
    p.add_argument("--out", type=Path, default=None,
                   help="the PDF (default _build/<scenario>/pdf/trainplan-runbook-<scenario>.pdf)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        from trainplan.runbook.pages import DEFAULT_SCENARIO

        scenario = args.scenario or site.generated_scenario() or DEFAULT_SCENARIO
        source = print_page(args.html or site.html_dir(scenario), scenario)
        out = print_pdf(source, args.out or site.pdf_path(scenario))
    except TrainplanError as err:
        print(f"trainplan.runbook.pdf: {err}", file=sys.stderr)
        return 2
    print(f"pdf: {out} ({pdf_pages(out)} pages, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
