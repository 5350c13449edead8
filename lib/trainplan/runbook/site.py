"""Where a scenario's runbook lands, and its strict HTML build.

    python -m trainplan.runbook.site [--scenario NAME]

Each scenario builds into a folder of its own, so that building another one does not
overwrite the last: `_build/<scenario>/html/` holds the site and
`_build/<scenario>/pdf/trainplan-runbook-<scenario>.pdf` the six printed pages
(`trainplan.runbook.pdf`). A scenario given as a YAML path takes the file's stem as its name;
a build with `-p` overrides lands in its scenario's folder.

The HTML is built from the executed notebooks in book/_generated/
(`python -m trainplan.runbook.build --scenario NAME` writes them), whose injected parameters
name their scenario: `--scenario` defaults to it, and a different one is refused, since the
pages would be another scenario's. Jupyter Book runs strictly (`-n -W --keep-going`, every
page afresh) into a staging folder, which replaces `html/` only when the build succeeded.

Bad input (no executed notebooks, another scenario's, a name that is no folder name) gives
one line on stderr and exit 2; a failed Sphinx build exits 1 after its own messages.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.loader import MAX_LOG_BYTES, read_text, shown

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "_build"
GENERATED = ROOT / "book" / "_generated"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class SiteError(TrainplanError):
    """The HTML cannot be built: no executed notebooks, or another scenario's."""


def folder_name(scenario: str) -> str:
    """The name of a scenario's build folder: the preset's name, or a YAML file's stem."""
    name = Path(scenario).stem if scenario.endswith((".yaml", ".yml")) else scenario
    if not _NAME.fullmatch(name):
        raise SiteError(f"scenario {scenario!r} makes no folder name; use letters, digits, "
                        "'.', '_' and '-'")
    return name


def html_dir(scenario: str, build: Path = BUILD) -> Path:
    """`_build/<scenario>/html`: the built site of one scenario."""
    return build / folder_name(scenario) / "html"


def pdf_path(scenario: str, build: Path = BUILD) -> Path:
    """`_build/<scenario>/pdf/trainplan-runbook-<scenario>.pdf`: its six printed pages."""
    name = folder_name(scenario)
    return build / name / "pdf" / f"trainplan-runbook-{name}.pdf"


def _assigned(source: str, name: str):
    """The literal a cell's code assigns to `name` (`name = v` or `name: t = v`), else None."""
    for node in ast.parse(source).body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else \
            getattr(node, "targets", [])
        if any(getattr(t, "id", None) == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    return None


def _tags(cell: dict) -> list:
    meta = cell.get("metadata")
    tags = meta.get("tags") if isinstance(meta, dict) else None
    return tags if isinstance(tags, list) else []


def notebook_cells(notebook: Path) -> list[dict]:
    """The cells of the executed notebook file `notebook` (read bounded, as JSON); SiteError
    when it is not a notebook."""
    text = read_text(notebook, max_bytes=MAX_LOG_BYTES, error=SiteError, what="notebook")
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, RecursionError, TypeError, KeyError):
        cells = None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise SiteError(f"{shown(notebook)} is not a notebook (JSON with a list of cells); "
                        "run python -m trainplan.runbook.build without --only")
    return cells


def injected_parameters(notebook: Path) -> dict:
    """{name: value} of the parameters papermill injected into the executed `notebook`
    ({} without an injected cell); SiteError if one is not a plain literal."""
    out = {}
    for cell in notebook_cells(notebook):
        if "injected-parameters" not in _tags(cell):
            continue
        try:
            for node in ast.parse("".join(cell.get("source", ""))).body:
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name)):
                    raise ValueError("not `name = value`")
                out[node.targets[0].id] = ast.literal_eval(node.value)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            raise SiteError(f"{shown(notebook)}: its injected parameters are not `name = value` "
                            "lines; run python -m trainplan.runbook.build without --only"
                            ) from None
    return out


def generated_scenario(folder: Path | None = None) -> str | None:
    """The scenario the executed notebooks in `folder` (default book/_generated/) were run for
    (papermill's injected `scenario = "..."`, else the parameters cell's default), None
    without notebooks."""
    notebooks = sorted((folder or GENERATED).glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        return None
    found = None
    for cell in notebook_cells(notebooks[0]):  # the injected cell comes later
        tags = _tags(cell)
        if "parameters" in tags or "injected-parameters" in tags:
            found = _assigned("".join(cell["source"]), "scenario") or found
    return found


def jupyter_book_command(out: Path) -> list[str]:
    """`jupyter-book build` of the whole book, strict, into `out`/_build/html."""
    return [str(Path(sys.executable).parent / "jupyter-book"), "build", str(ROOT), "--all",
            "--builder", "html", "-n", "-W", "--keep-going", "--path-output", str(out)]


def build_html(scenario: str | None = None, capture: bool = False,
               build: Path | None = None, generated: Path | None = None) -> tuple[Path, str]:
    """Build the site of the executed notebooks (`generated`, default book/_generated/) into
    `html_dir(scenario)` under `build` (default _build/); return that folder and Sphinx's
    output (empty unless `capture`: then it is not printed)."""
    build, generated = build or BUILD, generated or GENERATED
    built = generated_scenario(generated)
    if built is None:
        raise SiteError(f"no executed notebooks in {generated}; run python -m "
                        "trainplan.runbook.build --scenario NAME first")
    scenario = scenario or built
    if folder_name(scenario) != folder_name(built):
        raise SiteError(f"{generated} holds the notebooks of {built}, not {scenario}; run "
                        f"python -m trainplan.runbook.build --scenario {scenario} first")
    dest = html_dir(scenario, build)
    staging = dest.parent / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(jupyter_book_command(staging), cwd=ROOT, env=env, text=True,
                          capture_output=capture)
    log = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise subprocess.CalledProcessError(proc.returncode, "jupyter-book build", log)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging / "_build" / "html", dest)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return dest, log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainplan.runbook.site",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default=None,
                   help="the scenario of book/_generated/ (default: the one it holds)")
    args = p.parse_args(argv)
    try:
        dest, _ = build_html(args.scenario)
    except TrainplanError as err:
        print(f"trainplan.runbook.site: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"trainplan.runbook.site: the strict HTML build failed (exit {err.returncode}); "
              "its messages are above", file=sys.stderr)
        return 1
    print(f"runbook: {dest / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
