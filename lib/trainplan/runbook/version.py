"""What one build of the runbook is: its version, and the records it read.

`version()` is the one version string of a build: the package's version from
pyproject.toml and the short git commit, `0.1.0+1a2b3c4`. $TRAINPLAN_GIT_COMMIT
overrides the commit (a copy without .git, a tagged rebuild); without either
the commit reads `unknown`.

`setup(app)` makes this module a Sphinx extension (`_config.yml`,
`sphinx.extra_extensions`): it sets the MyST substitution `{{ version }}`,
which every page's opening box shows, in the HTML and in the PDF alike, and
drops script tags that a page would otherwise carry twice (see `_unique_scripts`).

`records_used()` names the committed record files a build reads (the
measurements and microbenchmarks of page 4, the calibration of the card, the
knob study when there is one), and `provenance_table()` says where each came
from: card, dates, software versions and commit, from the records' own
provenance.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from trainplan.loader import load_yaml, parse_json
from trainplan.records import provenance

ROOT = Path(__file__).resolve().parents[3]
MEASUREMENTS = ROOT / "data" / "measurements"
CALIBRATION = ROOT / "data" / "hardware" / "calibration"
SHORT = 7  # hex digits of a short commit


# ---------------------------------------------------------------- version


def package_version(root: Path = ROOT) -> str:
    """The `version` of pyproject.toml (the installed metadata where there is no pyproject)."""
    try:  # the first `version = "..."` line: [project]'s (tomllib is Python 3.11+)
        text = (root / "pyproject.toml").read_text()
    except OSError:
        text = ""
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if found:
        return found[1]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainplan")
    except PackageNotFoundError:
        return "unknown"


def git_commit(root: Path = ROOT, environ=None) -> str:
    """The short commit of a build (`provenance.git_commit` cut to SHORT hex digits), or
    'unknown' without one."""
    full = provenance.git_commit(root, environ)
    if not full:
        return "unknown"
    return full[:SHORT] if re.fullmatch(r"[0-9a-fA-F]{8,40}", full) else full


def version(root: Path = ROOT, environ=None) -> str:
    """`<package version>+<short commit>`, e.g. `0.1.0+1a2b3c4` (or `0.1.0+unknown`)."""
    return f"{package_version(root)}+{git_commit(root, environ)}"


# ---------------------------------------------------------------- records


def records_used(root: Path = ROOT) -> list[Path]:
    """The committed record files a build reads, in a stable order."""
    meas, cal = root / "data" / "measurements", root / "data" / "hardware" / "calibration"
    files = sorted(meas.glob("*.jsonl")) + sorted(meas.glob("*/*.jsonl"))
    files += sorted(meas.glob("*/*.journal")) + sorted(cal.glob("*.yaml"))
    return files


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = parse_json(line, str(path), error=ValueError)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def _joined(values) -> str:
    """Distinct values, most common first, `None` shown as 'not recorded'."""
    counts = Counter("not recorded" if v in (None, "") else str(v) for v in values)
    return ", ".join(v for v, _ in counts.most_common()) or "not recorded"


def describe_file(path: Path, root: Path = ROOT) -> dict:
    """One row of the provenance table: what a record file holds and where it came from."""
    row = {"file": str(path.relative_to(root))}
    if path.suffix != ".jsonl":  # a calibration (YAML) or a study journal: no record lines
        head = load_yaml(path) if path.suffix == ".yaml" else None
        label = head.get("label", "") if isinstance(head, dict) else ""
        return {**row, "kind": "calibration" if path.suffix == ".yaml" else "knob study",
                "records": "", "card": label, "dates": "", "torch": "", "cuda": "",
                "nccl": "", "driver": "", "commit": ""}
    recs = _records(path)
    prov = [r.get("provenance") or {} for r in recs]
    dates = sorted(str(r.get("recorded_at") or p.get("date") or "")[:10] for r, p in
                   zip(recs, prov, strict=True))
    dates = [d for d in dates if d]
    commits = [(p.get("git_commit") or "")[:SHORT] or None for p in prov]
    return {**row, "kind": _joined(r.get("kind") for r in recs), "records": len(recs),
            "card": _joined(r.get("card") for r in recs),
            "dates": f"{dates[0]} to {dates[-1]}" if dates and dates[0] != dates[-1]
            else (dates[0] if dates else "not recorded"),
            "torch": _joined(p.get("torch") for p in prov),
            "cuda": _joined(p.get("cuda") for p in prov),
            "nccl": _joined(p.get("nccl") for p in prov),
            "driver": _joined(p.get("driver") for p in prov),
            "commit": _joined(commits)}


def provenance_table(paths=None, root: Path = ROOT):
    """Every record file a build reads, one row each (pandas DataFrame indexed by file)."""
    import pandas as pd

    rows = [describe_file(Path(p), root) for p in (paths or records_used(root))]
    return pd.DataFrame(rows).set_index("file")


def provenance_summary(table) -> dict:
    """The provenance appendix's headline: records, cards, the span of dates, files without
    a commit in their records' provenance (from `provenance_table`)."""
    lines = table[table["records"] != ""]
    dates = sorted(d for span in lines["dates"] for d in span.split(" to ")
                   if d != "not recorded")
    span = "on no recorded date" if not dates else (
        f"on {dates[0]}" if dates[0] == dates[-1] else f"between {dates[0]} and {dates[-1]}")
    return {"records": int(lines["records"].sum()),
            "cards": ", ".join(sorted(set(lines["card"]))) or "no card",
            "dates": span,
            "no_commit": [f for f, c in lines["commit"].items() if "not recorded" in c]}


# ---------------------------------------------------------------- Sphinx


def _substitutions(app, config) -> None:
    subs = dict(getattr(config, "myst_substitutions", None) or {})
    subs.setdefault("version", version())
    config.myst_substitutions = subs


def _script_key(js):
    """What makes two script tags the same: the file, or an inline script's first name."""
    if getattr(js, "filename", None):
        return ("file", str(js.filename))
    body = str(getattr(js, "attributes", {}).get("body", ""))
    return ("inline", body.split(";")[0].split("=")[0].strip() or body)


def _unique_scripts(app, pagename, templatename, context, doctree) -> None:
    """Keep the last of repeated <script> tags. sphinx-thebe adds its inline
    `const THEBE_JS_URL = ...` each time the environment reads documents (twice in a
    jupyter-book build, the second with the theme's final settings), and a second
    `const` declaration is a SyntaxError in the browser's console."""
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    last = {_script_key(js): i for i, js in enumerate(scripts)}
    scripts[:] = [js for i, js in enumerate(scripts) if last[_script_key(js)] == i]


def setup(app):
    """Sphinx extension: `{{ version }}` on every page; no script tag twice."""
    app.connect("config-inited", _substitutions)
    app.connect("html-page-context", _unique_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
