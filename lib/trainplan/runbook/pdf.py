"""The six runbook pages as one PDF, printed by Debian's headless Chromium.

    python -m trainplan.runbook.pdf [--html _build/html] [--out _build/pdf/trainplan-runbook.pdf]

Run after the HTML build (`make pdf`; `make book` runs both). The article of each
of the six built pages (the page without the site's navigation) is copied into
one print page, `book/_generated/runbook-print.html` beside them, so that the
images and styles resolve as they do on the site; a print stylesheet hides
the code (the outputs, tables and figures stay), starts each runbook page on a
new sheet and puts the version on top. Chromium then prints it
(`--print-to-pdf`); no browser is downloaded: `make system-deps` installs
Debian's `chromium` package when it is missing.

Bad input (no built HTML, no Chromium) gives one line on stderr and exit 2.
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
from trainplan.runbook.version import ROOT, version

HTML = ROOT / "_build" / "html"
OUT = ROOT / "_build" / "pdf" / "trainplan-runbook.pdf"
PAGES = ("01_strategy", "02_memory", "03_throughput", "04_validation", "05_checkpoint",
         "06_launch")
PRINT_PAGE = "runbook-print.html"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 180

PRINT_CSS = """
@page { size: A4; margin: 11mm 12mm; }
html { font-size: 10px; }
body { margin: 0; background: white; }
.tp-cover { border-bottom: 1px solid #888; margin-bottom: 0.8rem; padding-bottom: 0.4rem; }
.tp-cover h1 { font-size: 1.9rem; margin: 0; }
section.tp-page + section.tp-page { break-before: page; }
.cell_input, .tag_parameters, .tag_injected-parameters, .headerlink,
#injected-parameters-intro, .prev-next-area, .toggle-details { display: none !important; }
.tp-brief .cell, .tp-brief .tp-page > section > section ~ section,
.tp-brief p:has(+ div.cell) { display: none !important; }  /* code and its introductions */
.tp-more { font-style: italic; color: #555; }
.cell_output pre, .highlight pre { white-space: pre-wrap; font-size: 0.85rem; max-height: none; }
.output.text_html table, .cell_output table { font-size: 0.9rem; }
img { max-width: 100% !important; break-inside: avoid; }
.tp-brief figure img { max-height: 7.5cm; width: auto; }
figure { break-inside: avoid; }
h1, h2 { break-after: avoid; }
"""


class PdfError(TrainplanError):
    """The PDF cannot be made: no built HTML, or no Chromium."""


def chromium() -> str:
    """The path of a Chromium binary, or PdfError saying how to install one."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise PdfError("no chromium on PATH (looked for " + ", ".join(BROWSERS) + "); install "
                   "Debian's package: make system-deps (apt-get install chromium)")


def chromium_flags() -> list[str]:
    """Flags every headless run here needs: as root no sandbox, no GPU, no first-run noise."""
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
            "--disable-extensions", "--disable-background-networking"]


_ARTICLE = re.compile(r'<article class="bd-article"[^>]*>(.*?)</article>', re.S)
_STYLES = re.compile(r'<link[^>]+rel="stylesheet"[^>]*>|<link[^>]+href="[^"]+\.css[^"]*"'
                     r'[^>]*rel="stylesheet"[^>]*>')
_TITLE = re.compile(r"<h1>(.*?)<a", re.S)


def _article(page: Path) -> str:
    text = page.read_text(encoding="utf-8")
    found = _ARTICLE.search(text)
    if not found:
        raise PdfError(f"{page}: no <article class=\"bd-article\"> in it; rebuild with make book")
    body = found[1]
    # links between the printed pages point inside the PDF; others to their built page
    for other in PAGES:
        body = re.sub(rf'href="{other}\.html(#[^"]*)?"', f'href="#{other}"', body)
    return body


_FIGURE = re.compile(r"<figure\b.*?</figure>", re.S)


def _brief_tail(page: Path) -> str:
    """What a brief print adds after a page's overview: its first figure, where to read on."""
    found = _FIGURE.search(_article(page))
    rel = page.relative_to(page.parents[2]).as_posix()
    return (found[0] if found else "") + (
        f'<p class="tp-more">The rest of this page, with its tables and figures: {rel} in the '
        "HTML build.</p>")


def print_page(html_dir: Path = HTML, pages=PAGES, brief: bool = True) -> Path:
    """Write the single print page of `pages` beside them and return its path.

    `brief` (the default) prints of each page its title, plain-words box, overview and
    first figure: about one printed sheet per runbook page. The full version prints every
    section with the cells' outputs (tables, generated files), four times as long.
    """
    folder = Path(html_dir) / "book" / "_generated"
    missing = [p for p in pages if not (folder / f"{p}.html").is_file()]
    if missing:
        raise PdfError(f"no built page {folder / (missing[0] + '.html')}; run make book first")
    first = (folder / f"{pages[0]}.html").read_text(encoding="utf-8")
    styles = "\n".join(dict.fromkeys(_STYLES.findall(first)))
    title = _TITLE.search(_article(folder / f"{pages[0]}.html"))
    sections = "\n".join(f'<section class="tp-page" id="{p}">{_article(folder / f"{p}.html")}'
                         f"{_brief_tail(folder / f'{p}.html') if brief else ''}</section>"
                         for p in pages)
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>trainplan runbook {html.escape(version())}</title>
{styles}
<style>{PRINT_CSS}</style>
</head><body class="{'tp-brief' if brief else 'tp-full'}">
<main class="bd-main"><div class="bd-content"><div class="bd-article-container">
<div class="tp-cover"><h1>trainplan runbook</h1>
<p>Version {html.escape(version())}. The six runbook pages, from
{html.escape(re.sub('<[^>]+>', '', title[1]).strip()) if title else 'the strategy'} to launch,
{'without the tables and generated files, which the HTML build shows' if brief else 'in full'};
the appendices, with the records behind these numbers, are in the HTML build.</p></div>
{sections}
</div></div></main></body></html>
"""
    out = folder / PRINT_PAGE
    tmp = out.with_name(f".{PRINT_PAGE}.{os.getpid()}")
    tmp.write_text(doc, encoding="utf-8")
    os.replace(tmp, out)  # whole or not at all: a browser may be reading the last one
    return out


def pdf_pages(path: Path) -> int:
    """Printed pages in a PDF (Chromium's PDFs list each page as a `/Type /Page` object)."""
    return len(re.findall(rb"/Type\s*/Page(?![s\w])", Path(path).read_bytes()))


def print_pdf(source: Path, out: Path = OUT, timeout: float = TIMEOUT_S) -> Path:
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
    p.add_argument("--html", type=Path, default=HTML, help=f"the built HTML (default {HTML})")
    p.add_argument("--out", type=Path, default=OUT, help=f"the PDF to write (default {OUT})")
    p.add_argument("--full", action="store_true",
                   help="print the cells' outputs too (tables, generated files): much longer")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = print_pdf(print_page(args.html, brief=not args.full), args.out)
    except TrainplanError as err:
        print(f"trainplan.runbook.pdf: {err}", file=sys.stderr)
        return 2
    print(f"pdf: {out} ({pdf_pages(out)} pages, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
