"""The built runbook in a real browser: Debian's headless Chromium, driven over the DevTools
protocol through a pipe (tests/book/cdp.py, stdlib only), with the network off.

One strict build of the default scenario per test session (`built_book`): the notebooks are
executed with papermill only when book/_generated/ holds none of that scenario's, then
`jupyter-book build -n -W` must succeed with no warning, into _build/<scenario>/html
(`trainplan.runbook.site`, as `make book` runs it). Every built page is then opened once
(`visits`): it must log no console error and no uncaught exception, ask for nothing off the
machine, every file it loads must be there, every image must have rendered (naturalWidth >
0), every internal link must reach an existing page and anchor, and its text must hold
nothing that failed to render (a figure's repr, a glue role, LaTeX that MathJax did not
typeset). Page 1 is saved as a screenshot, _build/browser/01_strategy.png. The PDF and the
other scenarios are tests/book/test_print.py's.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from tests.book.built import BOX_JS, FIRST_SCREEN, HTML, ROOT, needs_chromium
from tests.book.cdp import Browser

from trainplan.runbook.build import notebook_paths
from trainplan.runbook.pdf import PRINT_PAGE

SHOTS = ROOT / "_build" / "browser"
SKIP_PAGES = {"genindex.html", "search.html", PRINT_PAGE}  # Sphinx's own, and the PDF's source

pytestmark = needs_chromium


def test_strict_build_succeeds_without_warnings(built_book):
    assert "build succeeded" in built_book
    assert f"runbook: {HTML / 'index.html'}" in built_book, "into _build/<scenario>/html"
    assert not re.search(r"WARNING|ERROR", built_book), built_book[-3000:]


def test_every_page_shows_the_version(built_book):
    from trainplan.runbook.version import version

    pages = [HTML / "book" / f"{n}.html" for n in ("index", "methods", "changelog")]
    pages += [HTML / "book" / "_generated" / f"{p.stem}.html"
              for p in notebook_paths(ROOT / "notebooks")]
    for page in pages:
        assert f"version {version()}" in page.read_text(), page.name


REFRESH = re.compile(r'<meta http-equiv="refresh" content="\d+;\s*url=([^"]+)"', re.I)


def _pages() -> list[Path]:
    """Every built page but Sphinx's own and the redirect at the top (checked apart)."""
    return sorted(p for p in HTML.rglob("*.html") if p.name not in SKIP_PAGES
                  and "_static" not in p.parts and not REFRESH.search(p.read_text()))


def test_the_top_redirect_reaches_the_front_page(built_book):
    found = REFRESH.search((HTML / "index.html").read_text())
    assert found and (HTML / found[1]).resolve().is_file()


IMAGES_JS = """(async () => {
  for (const img of document.images) img.loading = "eager";
  await Promise.all([...document.images].map(i => i.decode().catch(() => null)));
  return [...document.images].filter(i => !i.complete || i.naturalWidth === 0)
                             .map(i => i.getAttribute("src"));
})()"""
LINKS_JS = "[...document.querySelectorAll('a[href]')].map(a => a.href)"
# the page's prose once MathJax has typeset it: code, scripts and typeset maths left out
TEXT_JS = """(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const body = document.body.cloneNode(true);
  body.querySelectorAll("pre, script, style, mjx-container").forEach(e => e.remove());
  return [body.textContent, document.querySelectorAll("mjx-container").length];
})()"""
UNRENDERED = {
    "a figure's repr (display(fig) under Agg)": re.compile(r"<Figure size \d+x\d+"),
    "a MyST role left raw (in glued markdown roles do not run)":
        re.compile(r"\{(?:glue|ref|term|doc|numref)(?::\w+)?\}"),
    "LaTeX MathJax did not typeset": re.compile(r"\\[A-Za-z]+\{|\\[()\[\]]|\$\$"),
}




def unrendered(text: str) -> list[str]:
    """What in a page's prose failed to render: [(what, the text around it)]."""
    return [f"{what}: {text[max(m.start() - 30, 0):m.end() + 30]!r}"
            for what, rx in UNRENDERED.items() for m in rx.finditer(text)]


@pytest.fixture(scope="module")
def visits(built_book):
    """Open every built page once: {relative path: what went wrong}; and the screenshot."""
    out = {}
    t0 = time.monotonic()
    with Browser() as browser:
        for page in _pages():
            report = browser.open(page.as_uri())
            report["images"] = browser.evaluate(IMAGES_JS, await_promise=True)
            report["links"] = browser.evaluate(LINKS_JS)
            report["text"], report["maths"] = browser.evaluate(TEXT_JS, await_promise=True)
            report["box_bottom"] = browser.evaluate(BOX_JS)
            out[str(page.relative_to(HTML))] = report
            if page.stem == "01_strategy":
                SHOTS.mkdir(parents=True, exist_ok=True)
                browser.evaluate("window.scrollTo(0, 0)")
                (SHOTS / "01_strategy.png").write_bytes(browser.screenshot())
    out["_elapsed_s"] = time.monotonic() - t0
    return out


def _reports(visits):
    return {k: v for k, v in visits.items() if not k.startswith("_")}


def test_every_page_of_the_toc_was_built_and_opened(visits):
    opened = set(_reports(visits))
    for path in notebook_paths(ROOT / "notebooks"):
        assert f"book/_generated/{path.stem}.html" in opened
    for name in ("index", "methods", "changelog"):
        assert f"book/{name}.html" in opened


def test_each_box_fits_the_first_screen(visits):
    """The plain-words box is the page for a hurried reader: at 1280 x 800 it ends on the
    first screen (the browser's window is that wide)."""
    assert Browser().width == FIRST_SCREEN[0]
    long = {page: r["box_bottom"] for page, r in _reports(visits).items()
            if r["box_bottom"] is not None and r["box_bottom"] > FIRST_SCREEN[1]}
    assert not long


def test_no_console_errors(visits):
    errors = {page: r["console"] for page, r in _reports(visits).items()}
    assert not {k: v for k, v in errors.items() if v}


def test_no_page_asks_for_anything_off_the_machine(visits):
    """The book reads offline (CI, a cluster's login node): no CDN, no remote font."""
    remote = {page: [u for u in r["requested"] if not u.startswith(("file:", "data:", "about:"))]
              for page, r in _reports(visits).items()}
    assert not {k: v for k, v in remote.items() if v}


def test_every_file_a_page_loads_is_there(visits):
    failed = {page: r["failed"] for page, r in _reports(visits).items()}
    assert not {k: v for k, v in failed.items() if v}


def test_nothing_on_a_page_failed_to_render(visits):
    problems = {page: unrendered(r["text"]) for page, r in _reports(visits).items()}
    assert not {k: v for k, v in problems.items() if v}


GLOSSARY_JS = """[...document.querySelectorAll("dl.glossary dt")]
                   .map(dt => [dt.id, dt.firstChild.textContent.trim()])"""
# each page: its text outside code blocks and links (tables included; a link's text is
# another page's title or an entry already linked), the glossary entries it links, and its
# inline code spans
WORDS_JS = """(() => {
  const body = document.body.cloneNode(true);
  body.querySelectorAll("pre, script, style, mjx-container, nav, .bd-sidebar, footer, a")
      .forEach(e => e.remove());
  const spans = [...body.querySelectorAll("code")].map(c => c.textContent);
  body.querySelectorAll("code").forEach(e => e.remove());
  const links = [...document.querySelectorAll('a[href*="glossary.html#"]')]
      .map(a => decodeURIComponent(a.hash.slice(1)));
  return [body.textContent, links, spans];
})()"""


def missing_glossary_links(text: str, links: list[str], spans: list[str],
                           ids: dict[str, str]) -> list[str]:
    """The glossary entries a page uses (a word of `glossary.TERMS` in its text, a config tag
    among its code spans) but does not link; `ids` maps each entry to its anchor."""
    from trainplan.runbook import glossary

    used = [e for e, rx in glossary.PATTERNS.items() if rx.search(text)]
    if "config tag" not in used and any(glossary.TAG.fullmatch(s) for s in spans):
        used.append("config tag")
    return [e for e in used if ids.get(e.lower()) not in set(links)]


@pytest.fixture(scope="module")
def words(built_book):
    """{page: (text, glossary links, code spans)} and the glossary's {entry: anchor}."""
    out = {}
    with Browser() as browser:
        browser.open((HTML / "book" / "glossary.html").as_uri())
        ids = {term.lower(): anchor for anchor, term in browser.evaluate(GLOSSARY_JS)}
        for page in _pages():
            if page.name not in ("glossary.html", PRINT_PAGE):  # the PDF's source, not a page
                browser.open(page.as_uri())
                out[str(page.relative_to(HTML))] = browser.evaluate(WORDS_JS)
    return out, ids


def test_every_page_links_the_glossary_words_it_uses(words):
    pages, ids = words
    from trainplan.runbook import glossary

    assert {t.lower() for t in glossary.TERMS} <= set(ids), "an entry is missing"
    missing = {p: missing_glossary_links(*w, ids) for p, w in pages.items()}
    assert not {p: m for p, m in missing.items() if m}


def test_the_glossary_check_catches_an_unlinked_word():
    ids = {"mfu": "term-MFU", "config tag": "term-config-tag", "hsdp": "term-HSDP"}
    assert missing_glossary_links("at 45% MFU", [], [], ids) == ["MFU"]
    assert missing_glossary_links("at 45% MFU", ["term-MFU"], [], ids) == []
    assert missing_glossary_links("MFUs and HSDPs", [], [], ids) == []
    assert missing_glossary_links("", [], ["p-z2-mb8"], ids) == ["config tag"]
    assert missing_glossary_links("", [], ["make test"], ids) == []
    assert missing_glossary_links("ran 15% over (s13b-1gpu-mb1-l2-c)", [], [], ids) == \
        ["config tag"]


def test_the_methods_maths_is_typeset_offline(visits):
    assert _reports(visits)["book/methods.html"]["maths"] > 0


def test_every_image_rendered(visits):
    broken = {page: r["images"] for page, r in _reports(visits).items() if r["images"]}
    assert not broken
    assert sum(1 for r in _reports(visits).values() if r["images"] == []) == len(_reports(visits))


_IDS = {}


def _ids(path: Path) -> set[str]:
    if path not in _IDS:
        _IDS[path] = set(re.findall(r'\sid="([^"]+)"', path.read_text(encoding="utf-8")))
    return _IDS[path]


def broken_links(page_links: dict[str, list[str]]) -> list[str]:
    """Internal links (file:// into the build) whose file or #anchor does not exist."""
    broken = []
    for page, links in page_links.items():
        for href in links:
            parts = urlsplit(href)
            if parts.scheme != "file":
                continue
            target = Path(unquote(parts.path))
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page}: {href}")
            elif parts.fragment and target.suffix == ".html" \
                    and unquote(parts.fragment) not in _ids(target):
                broken.append(f"{page}: {href} (no such anchor)")
    return broken


def test_no_broken_internal_links(visits):
    assert broken_links({p: r["links"] for p, r in _reports(visits).items()}) == []


def test_screenshot_of_page_one(visits):
    shot = SHOTS / "01_strategy.png"
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000  # a rendered page, not blank
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 900)


def test_the_browser_check_is_quick(visits):
    assert visits["_elapsed_s"] < 120


def test_the_checks_catch_a_broken_page(tmp_path):
    """The same checks on a page made to fail: a console error, a missing image, a dead link."""
    (tmp_path / "ok.html").write_text('<p id="here">ok</p>')
    page = tmp_path / "bad.html"
    page.write_text('<script>console.error("boom")</script><img src="missing.png">'
                    '<a href="ok.html#here">fine</a><a href="ok.html#gone">no anchor</a>'
                    '<a href="nope.html">dead</a><script>undefinedCall()</script>')
    with Browser() as browser:
        report = browser.open(page.as_uri())
        images = browser.evaluate(IMAGES_JS, await_promise=True)
        links = browser.evaluate(LINKS_JS)
    assert any("boom" in c for c in report["console"])
    assert any("undefinedCall" in c for c in report["console"])
    assert images == ["missing.png"]
    assert any("missing.png" in f[0] for f in report["failed"])
    bad = broken_links({"bad.html": links})
    assert len(bad) == 2 and any("no such anchor" in b for b in bad)


def test_the_checks_catch_what_did_not_render(tmp_path):
    """A figure's repr, a raw glue role, raw LaTeX and a remote image, offline."""
    page = tmp_path / "raw.html"
    page.write_text("<p>&lt;Figure size 600x580 with 1 Axes&gt;</p><p>{glue:text}`x`</p>"
                    r"<p>the bound \frac{a}{b} and \(x\)</p><pre>\frac{ok}{in a code block}</pre>"
                    '<img src="https://example.invalid/x.png">')
    with Browser() as browser:
        report = browser.open(page.as_uri())
        text, maths = browser.evaluate(TEXT_JS, await_promise=True)
    found = unrendered(text)
    latex = "LaTeX MathJax did not typeset"
    assert [f.split(":")[0] for f in found] == [
        "a figure's repr (display(fig) under Agg)",
        "a MyST role left raw (in glued markdown roles do not run)", latex, latex, latex]
    assert "code block" not in " ".join(found) and maths == 0
    assert "https://example.invalid/x.png" in report["requested"]
    assert any(u == "https://example.invalid/x.png" for u, _ in report["failed"])
