"""The runbook's papermill runner, and the few helpers its notebooks share.

    python -m trainplan.book --scenario NAME [-p NAME=VALUE ...]
        executes every notebook in notebooks/ with papermill (kernel python3)
        into book/_generated/NN_name.ipynb, which Jupyter Book then renders
        (it executes nothing itself: `execute_notebooks: "off"`).
    python -m trainplan.book --in-place
        re-executes the committed notebooks for the default scenario, so
        that the outputs nbval compares against (`make test`) are current.

Each notebook opens with one cell tagged `parameters`, written papermill's
way, `name: type = value  # help`, one per line. `scenario` names a file in
data/scenarios/ that supplies every default; any other parameter left at its
empty default ("" or 0) takes the scenario's value, one given overrides it.
(Plain `str`/`int`/`float` annotations with empty defaults rather than
`int | None = None`: papermill's parameter inspection reads only the former.)

Bad input (unknown scenario or parameter, a value of the wrong type, a spec
the library rejects) gives one line on stderr naming the value and what is
valid, exit code 2, and writes nothing: notebooks are executed into a
temporary folder and moved into place only when all of them succeeded.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.specs import (
    ClusterSpec,
    GPUSpec,
    ModelSpec,
    load_cluster,
    load_gpu,
    load_model,
    load_scenario,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
GENERATED = ROOT / "book" / "_generated"
REPORTS = ROOT / "_build" / "execution-reports"  # failed notebooks, kept for reading
DEFAULT_SCENARIO = "llama-13b-32xh100"
KERNEL = "python3"
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"


class ParameterError(TrainplanError):
    """A notebook parameter that is unknown or of the wrong type."""


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
        raise ParameterError(
            f"bad parameter {param.name}={text!r}: expected {kind} ({param.type}); {param.help}"
        ) from None
    if not value or (base != "str" and value < 0):
        valid = "a non-empty name" if base == "str" else "a number > 0"
        raise ParameterError(f"bad parameter {param.name}={text!r}: expected {valid}; leave "
                             "it out to take the scenario's value")
    return value


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """A scenario with its overrides applied: what pages 1-6 are about."""

    scenario: str
    title: str
    model: ModelSpec
    gpu: GPUSpec
    cluster: ClusterSpec  # gpus_per_node already overridden when asked
    gpus: int
    seq_len: int
    global_batch_tokens: int
    token_budget: float

    @property
    def gpus_per_node(self) -> int:
        return self.cluster.gpus_per_node

    def summary(self):
        """The inputs as a two-column table for the page (pandas DataFrame)."""
        import pandas as pd

        rows = [
            ("scenario", self.scenario),
            ("model", self.model.name),
            ("GPU", self.gpu.name),
            ("cluster", self.cluster.name),
            ("GPUs", f"{self.gpus:,}"),
            ("GPUs per node", f"{self.gpus_per_node:,}"),
            ("sequence length (tokens)", f"{self.seq_len:,}"),
            ("global batch (tokens per step)", f"{self.global_batch_tokens:,}"),
            ("token budget (tokens)", f"{self.token_budget:,.3g}"),
        ]
        return pd.DataFrame({"value": [v for _, v in rows]}, index=[k for k, _ in rows])


def _given(name: str, value, default, kind=int):
    """`value` if given (not "", 0 or None), else the scenario's `default`; checked > 0."""
    if value in ("", 0, None):
        value = default
    types = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, types) or value <= 0:
        raise ParameterError(
            f"bad parameter {name}={value!r}: expected a {'whole ' if kind is int else ''}"
            f"number > 0, or 0 for the scenario's value")
    return value


def resolve_inputs(
    scenario: str = DEFAULT_SCENARIO,
    model: str = "",
    gpu: str = "",
    cluster: str = "",
    gpus: int = 0,
    gpus_per_node: int = 0,
    seq_len: int = 0,
    global_batch_tokens: int = 0,
    token_budget: float = 0.0,
) -> Inputs:
    """Load `scenario` from data/scenarios/ and apply the parameters given ("" and 0: not)."""
    sc = load_scenario(scenario)
    cl = load_cluster(cluster or sc.cluster)
    if gpus_per_node not in (0, None):
        cl = dataclasses.replace(
            cl, gpus_per_node=_given("gpus_per_node", gpus_per_node, cl.gpus_per_node))
    inputs = Inputs(
        scenario=scenario,
        title=sc.title or scenario,
        model=load_model(model or sc.model),
        gpu=load_gpu(gpu or sc.gpu),
        cluster=cl,
        gpus=_given("gpus", gpus, sc.gpus),
        seq_len=_given("seq_len", seq_len, sc.seq_len),
        global_batch_tokens=_given("global_batch_tokens", global_batch_tokens,
                                   sc.global_batch_tokens),
        token_budget=float(_given("token_budget", token_budget, sc.token_budget, float)),
    )
    return inputs  # whether the GPUs make whole nodes is the search's to say


# ---------------------------------------------------------------- glue helpers


SIGNIFICANT = 6  # glued floats keep 6 significant figures (see glue_values)


def _plain(value):
    """numpy scalars -> Python numbers, so that `{glue:text}` can format them."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float):
        value = float(f"{value:.{SIGNIFICANT}g}")
    return value


def glue_values(**values) -> None:
    """Glue numbers and strings for `{glue:text}` roles, without showing them in the cell.

    Floats are rounded to `SIGNIFICANT` figures: more than any page prints, and
    few enough that a last-bit difference between CPUs (numpy's SIMD paths)
    does not fail nbval, which compares the glued values as text.
    """
    from myst_nb import glue

    for key, value in values.items():
        glue(key, _plain(value), display=False)


def glue_markdown(key: str, text: str) -> None:
    """Glue a sentence (MyST markdown) for a `{glue:md}` role."""
    from IPython.display import Markdown
    from myst_nb import glue

    glue(key, Markdown(text), display=False)


def glue_figure(key: str, fig, dpi: int = 144) -> None:
    """Glue a matplotlib figure for a `{glue:figure}` directive (which carries the caption).

    The figure is rendered here to PNG with no creation-time metadata and
    closed, so the result does not depend on the kernel's matplotlib backend
    and is not shown a second time at the end of the cell.
    """
    import matplotlib.pyplot as plt
    from IPython.display import Image
    from myst_nb import glue

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    glue(key, Image(data=buf.getvalue(), format="png"), display=False)


# ---------------------------------------------------------------- plain words

_TERMS = {"compute_s": "compute", "exposed_comm_s": "communication that compute cannot hide",
          "bubble_s": "the pipeline bubble (stages idle while it fills and drains)",
          "optimizer_s": "the optimizer step"}


def describe_layout(row, inputs: Inputs) -> str:
    """A layout (one row of the search table) in plain words, as MyST markdown."""
    dp, tp, pp, cp, ep = (int(row[k]) for k in ("dp", "tp", "pp", "cp", "ep"))
    zero, shard = int(row["zero"]), int(row["dp_shard"])
    parts = []
    if tp > 1:
        parts.append(f"split every layer's matrices across {tp} GPUs of the same node "
                     "(*tensor parallel*), which exchange partial results over NVLink inside "
                     "every layer")
    if pp > 1:
        parts.append(f"cut the {inputs.model.n_layers} layers into {pp} consecutive stages on "
                     "different GPUs (*pipeline parallel*), which pass activations along")
    if cp > 1:
        parts.append(f"split each sequence into {cp} parts on different GPUs (*context "
                     "parallel*)")
    if ep > 1:
        parts.append(f"spread each layer's experts over {ep} GPUs (*expert parallel*), which "
                     "also serve as data-parallel ranks")
    copies = " of this arrangement" if (tp > 1 or pp > 1 or cp > 1) else ""
    if dp > 1 and zero == 0:
        parts.append(f"run {dp} full copies{copies} on different data and average their "
                     "gradients every step (*data parallel*, DDP)")
    elif dp > 1 and zero in (1, 2):
        what = "optimizer state" if zero == 1 else "optimizer state and gradients"
        parts.append(f"run {dp} copies{copies} on different data, each keeping only its "
                     f"share of the {what} (*ZeRO-{zero}*)")
    elif dp > 1 and shard == dp:
        parts.append(f"shard the weights, gradients and optimizer state over {dp} GPUs, each "
                     "storing its slice and fetching the rest layer by layer just before use "
                     "(*FSDP*)")
    elif dp > 1 and shard == inputs.gpus_per_node:
        parts.append(f"shard the weights, gradients and optimizer state over the {shard} GPUs "
                     f"of each node (*FSDP* inside a node), and run the {dp // shard} nodes on "
                     "different data, averaging gradients across them (*HSDP*)")
    elif dp > 1:
        parts.append(f"shard the weights, gradients and optimizer state over groups of {shard} "
                     f"GPUs (*FSDP* inside a group), and run {dp // shard} such groups on "
                     "different data, averaging gradients across them (*HSDP*)")
    recompute = {
        "none": "keeps every activation for the backward pass (no recompute)",
        "selective": "recomputes part of the activations in the backward pass instead of "
                     "storing them (*selective recompute*)",
        "full": "recomputes each layer's forward pass during the backward pass to save memory "
                "(*full recompute*)",
    }[row["recompute"]]
    mb, ga = int(row["micro_batch"]), int(row["grad_accum"])
    who = "Each GPU" if cp == 1 else f"Each group of {cp} GPUs"
    batch = (f"{who} works on {mb} sequence{'s' if mb > 1 else ''} at a time, adds up "
             f"{ga} such micro-batches before each optimizer step, and {recompute}.")
    how = "; ".join(parts) if parts else "run on a single GPU"
    return f"**{row['strategy']}**: {how}. {batch}"


def summarize_decision(row, inputs: Inputs) -> str:
    """One plain-text line for the book's front page (cross-page glue pastes text only)."""
    return (f"{row['strategy']} on {inputs.gpus} GPUs, predicted at "
            f"{row['tokens_per_s']:,.0f} tokens/s ({row['mfu']:.0%} MFU) with "
            f"{row['total_gib']:.0f} of {inputs.gpu.memory_gib:g} GiB used on each GPU")


def describe_batch(row, inputs: Inputs) -> str:
    """How one optimizer step's global batch is made up, in plain words (markdown)."""
    dp, mb, ga = int(row["dp"]), int(row["micro_batch"]), int(row["grad_accum"])
    return (f"Each optimizer step trains on {int(row['tokens_per_step']):,} tokens: "
            f"{dp} data-parallel rank{'s' if dp > 1 else ''} each run {ga} micro-batch"
            f"{'es' if ga > 1 else ''} of {mb} sequence{'s' if mb > 1 else ''} of "
            f"{inputs.seq_len:,} tokens, and the gradients are added up before the weights "
            "change.")


def compare_sentence(chosen, alt, card_gib: float) -> str:
    """Why `alt` ranks below `chosen`: it does not fit, or the time term that costs it most."""
    from trainplan.layouts import RECOMPUTE  # none < selective < full

    name = f"**{alt['strategy']}**"
    if not alt["fits"]:
        return (f"{name} does not fit: even its smallest layout needs "
                f"{alt['total_gib']:,.0f} GiB per GPU, against {card_gib:g} GiB on the card.")
    extra = {k: float(alt[k] - chosen[k]) for k in _TERMS}
    worst = max(extra, key=extra.get)
    longer = float(alt["step_time_s"] - chosen["step_time_s"])
    why = f"most of it in {_TERMS[worst]} (+{extra[worst]:.2f} s)"
    heavier = RECOMPUTE.index(alt["recompute"]) > RECOMPUTE.index(chosen["recompute"])
    if worst == "compute_s" and heavier:
        why += f", because it needs {alt['recompute']} recompute to fit"
    return (f"{name}: {alt['tokens_per_s']:,.0f} tokens/s; its step takes {longer:.2f} s "
            f"longer, {why}.")


def why_not(alternatives, card_gib: float) -> str:
    """A markdown list: each alternative of `figures.alternatives` against the chosen plan."""
    chosen = alternatives.iloc[0]
    lines = []
    for _, alt in alternatives.iloc[1:].iterrows():
        question = alt["question"][:1].upper() + alt["question"][1:]
        lines.append(f"- *{question}*: {compare_sentence(chosen, alt, card_gib)}")
    return "\n".join(lines)


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
    import trainplan.errors as errors

    return {n for n, v in vars(errors).items()
            if isinstance(v, type) and issubclass(v, TrainplanError)} | {"ParameterError"}


def execute_all(paths: list[Path], dest: Path, parameters: dict, in_place: bool = False,
                log=print, scratch: Path = ROOT / "book") -> list[Path]:
    """Execute `paths` with papermill into a temp folder, then move them all to `dest`.

    `in_place` replaces the files one by one inside `dest` (the committed
    notebooks); otherwise `dest` as a whole is swapped for the new folder.
    The temporary folder is made in `scratch` (hidden, and excluded from the book).
    """
    import papermill as pm

    tmp = Path(tempfile.mkdtemp(prefix=".trainplan-book-", dir=scratch))
    try:
        outputs = []
        for i, src in enumerate(paths, 1):
            out = tmp / src.name
            t0 = time.perf_counter()
            try:
                pm.execute_notebook(
                    str(src), str(out), parameters=parameters or None, kernel_name=KERNEL,
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
            steps = [_strip_volatile] + ([_introduce_injected] if parameters else [])
            _rewrite(out, *steps)
            log(f"[{i}/{len(paths)}] {src.stem:<16} {time.perf_counter() - t0:5.1f} s")
            outputs.append(out)
        if in_place:
            for out in outputs:
                os.replace(out, dest / out.name)
        else:
            old = dest.with_name(dest.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if dest.exists():
                os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        return [dest / out.name for out in outputs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- CLI


def check_searchable(inputs: Inputs) -> None:
    """Run the strategy search once, so that a scenario where no layout reaches the batch
    or nothing fits is refused in one line before any notebook runs."""
    from trainplan.search import search

    search(inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus, seq_len=inputs.seq_len,
           global_batch_tokens=inputs.global_batch_tokens)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message)
        print(f"trainplan.book: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainplan.book", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default=None,
                   help=f"scenario in data/scenarios/ or a YAML path (default {DEFAULT_SCENARIO})")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="override one notebook parameter (repeatable); see the parameters cell")
    p.add_argument("--in-place", action="store_true",
                   help="re-execute notebooks/ in place for the default scenario (for nbval)")
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
        known = read_parameters(paths[0])
        if args.in_place and (args.param or args.scenario not in (None, DEFAULT_SCENARIO)):
            raise ParameterError(
                "--in-place runs the default scenario only "
                f"({DEFAULT_SCENARIO}); drop --scenario/--param"
            )
        overrides = _parse_overrides(args.param, known)
        scenario = args.scenario or DEFAULT_SCENARIO
        inputs = resolve_inputs(scenario, **overrides)  # fail fast, before any kernel starts
        if not args.in_place:
            check_searchable(inputs)
    except TrainplanError as err:
        print(f"trainplan.book: {err}", file=sys.stderr)
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
        execute_all(paths, dest, parameters, in_place=args.in_place)
    except NotebookFailed as err:
        where = f" (executed notebook: {err.report})" if err.report else ""
        print(f"trainplan.book: notebook {err}{where}", file=sys.stderr)
        return 2 if err.ename in _error_names() else 1
    print(f"done: {len(paths)} notebooks in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
