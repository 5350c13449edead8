"""The runbook's papermill runner (the helpers its notebooks share live in `pages`).

    python -m trainplan.runbook.build --scenario NAME [-p NAME=VALUE ...]
        executes every notebook in notebooks/ with papermill (kernel python3)
        into book/_generated/NN_name.ipynb, which Jupyter Book then renders
        (it executes nothing itself: `execute_notebooks: "off"`).
    python -m trainplan.runbook.build --in-place
        re-executes the committed notebooks for the default scenario, so
        that the outputs nbval compares against (`make test`) are current.

Each notebook opens with one cell tagged `parameters`, written papermill's
way, `name: type = value  # help`, one per line. `scenario` names a file in
data/scenarios/ that supplies every default; any other parameter left at its
empty default ("" or 0) takes the scenario's value, one given overrides it.
(Plain `str`/`int`/`float` annotations with empty defaults rather than
`int | None = None`: papermill's parameter inspection reads only the former.)

A cell tagged `launchable` is written for a scenario whose model the trainer runs,
one tagged `not-launchable` for one it does not (a mixture of experts: page 6 says
why it has no commands, `decision.no_launch`); a scenario's build drops the other
case's cells before executing, `--in-place` keeps both (the committed notebooks).

`--only NN_name` executes that page alone and keeps the others in book/_generated/
as they are; it is refused when they were built with other parameters.

Bad input (unknown scenario or parameter, a value of the wrong type or out of
its range, a spec the library rejects) gives one line on stderr naming the value
and what is valid, exit code 2, and writes nothing: notebooks are executed into a
temporary folder and moved into place only when all of them succeeded.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trainplan.errors as errors
from trainplan.errors import TrainplanError
from trainplan.loader import quote, shown
from trainplan.plan.search import search
from trainplan.runbook.decision import no_launch_reason
from trainplan.runbook.pages import DEFAULT_SCENARIO, Inputs, ParameterError, resolve_inputs
from trainplan.runbook.site import injected_parameters

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = ROOT / "notebooks"
GENERATED = ROOT / "book" / "_generated"
REPORTS = ROOT / "_build" / "execution-reports"  # failed notebooks, kept for reading
KERNEL = "python3"
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
CASE_TAGS = {True: "launchable", False: "not-launchable"}  # cells for one case of page 6


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Parameter:
    """One line of a parameters cell: `name: type = value  # help`."""

    name: str
    type: str  # the annotation as written: "str", "int" or "float"
    default: object
    help: str


def notebook_paths(folder: Path = NOTEBOOKS) -> list[Path]:
    """The runbook's notebooks, in page order (NN_name.ipynb)."""
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb"))


def parameters_cells(nb: dict) -> list[dict]:
    """The cells of a notebook tagged `parameters` (a runbook notebook has exactly one)."""
    return [
        c for c in nb["cells"]
        if PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])
    ]


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def parse_parameters(source: str) -> dict[str, Parameter]:
    """Parse a parameters cell; every statement must be `name: type = literal  # help`."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out: dict[str, Parameter] = {}
    for node in tree.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.value is not None):
            raise ParameterError(
                f"parameters cell line {node.lineno}: expected `name: type = value  # help`"
            )
        line = lines[node.lineno - 1]
        help_text = line.split("#", 1)[1].strip() if "#" in line else ""
        out[node.target.id] = Parameter(
            name=node.target.id,
            type=ast.unparse(node.annotation),
            default=ast.literal_eval(node.value),
            help=help_text,
        )
    return out


def read_parameters(path: Path) -> dict[str, Parameter]:
    """The parameters of one notebook file."""
    nb = json.loads(Path(path).read_text())
    cells = parameters_cells(nb)
    if len(cells) != 1:
        raise ParameterError(f"{path.name}: {len(cells)} cells tagged 'parameters', expected 1")
    return parse_parameters(_source(cells[0]))


def convert(param: Parameter, text: str):
    """Turn `text` from the command line into the parameter's type, or raise ParameterError."""
    base = param.type
    try:
        if base == "int":
            value = int(text)
        elif base == "float":
            value = float(text)
        else:
            value = text
    except ValueError:
        kind = "a whole number" if base == "int" else "a number"
        raise ParameterError(f"bad parameter {param.name}={quote(text)}: expected {kind} "
                             f"({param.type}); {param.help}") from None
    if not value or (base != "str" and value < 0):
        valid = "a non-empty name" if base == "str" else "a number > 0"
        raise ParameterError(f"bad parameter {param.name}={quote(text)}: expected {valid}; leave "
                             "it out to take the scenario's value")
    return value


# ---------------------------------------------------------------- execution


def _strip_volatile(nb: dict) -> dict:
    """Drop papermill's and nbclient's timing metadata so re-runs give stable diffs."""
    nb["metadata"].pop("papermill", None)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("papermill", None)
        cell.get("metadata", {}).pop("execution", None)
    return nb


def _introduce_injected(nb: dict) -> dict:
    """Put a sentence before papermill's injected cell (every code cell has one)."""
    for i, cell in enumerate(nb["cells"]):
        if INJECTED_TAG in cell.get("metadata", {}).get("tags", []):
            nb["cells"].insert(i, {
                "cell_type": "markdown",
                "id": "injected-parameters-intro",
                "metadata": {},
                "source": "For this build, papermill set these parameters, "
                          "which override the defaults above:",
            })
            break
    return nb


HIDDEN_INPUT_TAG = "hide-input"  # Jupyter Book 1.x: the code folds under a toggle


def _hide_inputs(nb: dict) -> dict:
    """Fold every code cell's source on the page: readers see prose, tables and figures
    first, the code stays one click away (the committed notebooks keep theirs open)."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            if HIDDEN_INPUT_TAG not in tags:
                tags.append(HIDDEN_INPUT_TAG)
    return nb


def other_case_tags(inputs: Inputs) -> tuple[str, ...]:
    """The tags of the cells a build for `inputs` drops: those written for the other case
    of whether the trainer runs the scenario's model."""
    return (CASE_TAGS[no_launch_reason(inputs.model) is not None],)


def drop_cells(nb: dict, tags: tuple[str, ...]) -> dict:
    """`nb` without its cells tagged with any of `tags`."""
    nb["cells"] = [c for c in nb["cells"]
                   if not set(tags) & set(c.get("metadata", {}).get("tags", []))]
    return nb


def _rewrite(path: Path, *steps) -> None:
    nb = json.loads(path.read_text())
    for step in steps:
        nb = step(nb)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


class NotebookFailed(Exception):
    def __init__(self, name: str, ename: str, evalue: str, report: Path | None):
        super().__init__(f"{name}: {ename}: {evalue}")
        self.name, self.ename, self.evalue, self.report = name, ename, evalue, report


def _error_names() -> set[str]:
    return {n for n, v in vars(errors).items()
            if isinstance(v, type) and issubclass(v, TrainplanError)} | {"ParameterError"}


def execute_all(paths: list[Path], dest: Path, parameters: dict, in_place: bool = False,
                log=print, scratch: Path = ROOT / "book", drop_tags: tuple[str, ...] = ()
                ) -> list[Path]:
    """Execute `paths` with papermill into a temp folder, then move them all to `dest`.

    `in_place` replaces the files one by one inside `dest` (the committed
    notebooks); otherwise `dest` as a whole is swapped for the new folder, which keeps
    unchanged the pages of `dest` not executed this time (`swap_in`).
    The temporary folder is made in `scratch` (hidden, and excluded from the book).
    Cells tagged with any of `drop_tags` are left out before execution.
    """
    import papermill as pm

    tmp = Path(tempfile.mkdtemp(prefix=".trainplan-book-", dir=scratch))
    try:
        outputs = []
        for i, src in enumerate(paths, 1):
            out = tmp / src.name
            t0 = time.perf_counter()
            source = src
            if drop_tags:
                source = tmp / f".source-{src.name}"
                nb = drop_cells(json.loads(src.read_text()), drop_tags)
                source.write_text(json.dumps(nb, indent=1, ensure_ascii=False))
            try:
                pm.execute_notebook(
                    str(source), str(out), parameters=parameters or None, kernel_name=KERNEL,
                    cwd=str(src.parent), progress_bar=False, log_output=False,
                    request_save_on_cell_execute=False,
                    # the kernel's own log (TCP without encryption, the interrupt that
                    # jupyter_client sends at shutdown) is noise here; cell errors still raise
                    extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
                )
            except pm.PapermillExecutionError as err:
                report = None
                if out.exists():
                    REPORTS.mkdir(parents=True, exist_ok=True)
                    report = REPORTS / src.name
                    shutil.copy(out, report)
                raise NotebookFailed(src.stem, err.ename, err.evalue, report) from None
            finally:
                if source != src:
                    source.unlink(missing_ok=True)
            steps = [_strip_volatile] + ([_introduce_injected] if parameters else []) \
                + ([] if in_place else [_hide_inputs])
            _rewrite(out, *steps)
            log(f"[{i}/{len(paths)}] {src.stem:<16} {time.perf_counter() - t0:5.1f} s")
            outputs.append(out)
        if in_place:
            for out in outputs:
                os.replace(out, dest / out.name)
        else:
            swap_in(tmp, dest, kept_pages(paths))
        return [dest / out.name for out in outputs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def kept_pages(paths: list[Path]) -> set[str]:
    """The file names of the pages a build of `paths` leaves as they are: those of the other
    notebooks in their folder (none for a build of every page)."""
    return {p.name for p in notebook_paths(paths[0].parent)} - {p.name for p in paths} \
        if paths else set()


def swap_in(tmp: Path, dest: Path, keep: set[str]) -> None:
    """Make the folder `tmp` (the pages just executed) the folder `dest`, after copying into it
    the files of `dest` named in `keep`, unchanged; `dest`'s other files go."""
    for name in sorted(keep):
        if (dest / name).is_file() and not (tmp / name).exists():
            shutil.copy2(dest / name, tmp / name)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def check_kept_pages(dest: Path, keep: set[str], parameters: dict) -> None:
    """Refuse (ParameterError) to keep a page of `dest` named in `keep` that was executed with
    other parameters than `parameters`: the book would mix two builds' numbers."""
    for name in sorted(keep):
        built = injected_parameters(dest / name) if (dest / name).is_file() else parameters
        if built != parameters:
            said = [", ".join(f"{k}={quote(v, 40)}" for k, v in d.items()) or "no parameters"
                    for d in (built, parameters)]
            raise ParameterError(
                f"--only: {shown(dest / name)} was built with {said[0]}, this build has "
                f"{said[1]}; give the same --scenario and -p, or drop --only")


# ---------------------------------------------------------------- CLI


def check_searchable(inputs: Inputs) -> None:
    """Run the strategy search once, so that a scenario where no layout reaches the batch
    or nothing fits is refused in one line before any notebook runs."""
    search(inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus, seq_len=inputs.seq_len,
           global_batch_tokens=inputs.global_batch_tokens)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message)
        print(f"trainplan.runbook.build: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainplan.runbook.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default=None,
                   help=f"scenario in data/scenarios/ or a YAML path (default {DEFAULT_SCENARIO})")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="override one notebook parameter (repeatable); see the parameters cell")
    p.add_argument("--in-place", action="store_true",
                   help="re-execute notebooks/ in place for the default scenario (for nbval)")
    p.add_argument("--only", action="append", default=[], metavar="NN_name",
                   help="execute only this notebook (repeatable), e.g. 04_validation")
    return p


def _parse_overrides(items: list[str], known: dict[str, Parameter]) -> dict:
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise ParameterError(f"bad parameter {item!r}: write NAME=VALUE")
        if name not in known or name == "scenario":
            valid = ", ".join(n for n in known if n != "scenario")
            raise ParameterError(f"unknown parameter {name!r}; valid: {valid} (or --scenario)")
        out[name] = convert(known[name], text)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        paths = notebook_paths()
        if not paths:
            raise ParameterError(f"no notebooks NN_name.ipynb in {NOTEBOOKS}")
        unknown = sorted(set(args.only) - {p.stem for p in paths})
        if unknown:
            raise ParameterError(f"--only {unknown[0]}: no such notebook; valid: "
                                 f"{[p.stem for p in paths]}")
        if args.only:
            paths = [p for p in paths if p.stem in args.only]
        known = read_parameters(paths[0])
        if args.in_place and (args.param or args.scenario not in (None, DEFAULT_SCENARIO)):
            raise ParameterError(
                "--in-place runs the default scenario only "
                f"({DEFAULT_SCENARIO}); drop --scenario/--param"
            )
        overrides = _parse_overrides(args.param, known)
        scenario = args.scenario or DEFAULT_SCENARIO
        inputs = resolve_inputs(scenario, **overrides)  # fail fast, before any kernel starts
        drop = () if args.in_place else other_case_tags(inputs)
        if not args.in_place:
            check_searchable(inputs)
            check_kept_pages(GENERATED, kept_pages(paths), {"scenario": scenario, **overrides})
    except TrainplanError as err:
        print(f"trainplan.runbook.build: {err}", file=sys.stderr)
        return 2

    if args.in_place:
        dest, parameters = NOTEBOOKS, {}  # no injected cell: the defaults are the scenario
        print(f"executing {len(paths)} notebooks in place ({DEFAULT_SCENARIO})")
    else:
        dest, parameters = GENERATED, {"scenario": scenario, **overrides}
        print(f"executing {len(paths)} notebooks for {scenario} -> "
              f"{GENERATED.relative_to(ROOT)}/")
    t0 = time.perf_counter()
    try:
        execute_all(paths, dest, parameters, in_place=args.in_place, drop_tags=drop)
    except NotebookFailed as err:
        where = f" (executed notebook: {err.report})" if err.report else ""
        print(f"trainplan.runbook.build: notebook {err}{where}", file=sys.stderr)
        return 2 if err.ename in _error_names() else 1
    print(f"done: {len(paths)} notebooks in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
