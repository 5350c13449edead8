"""What the runbook's notebooks share: the scenario they are about, glue, plain words.

`resolve_inputs` applies a notebook's parameters to its scenario; the glue
helpers put numbers, sentences and figures where the MyST text refers to them
(no number is typed into a page); the plain-words helpers turn a priced
layout into the sentences a non-systems reader sees first on each page.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass

from trainplan.calibrate.store import card_preset, load_gpu
from trainplan.cost.step_time import time_to_train
from trainplan.errors import TrainplanError
from trainplan.loader import quote
from trainplan.runbook import decision
from trainplan.specs import (
    ClusterSpec,
    GPUSpec,
    ModelSpec,
    Scenario,
    load_cluster,
    load_model,
    load_scenario,
    preset_names,
)
from trainplan.specs.bounds import field_range
from trainplan.specs.layouts import RECOMPUTE  # none < selective < full

DEFAULT_SCENARIO = "llama-13b-32xh100"


class ParameterError(TrainplanError):
    """A notebook parameter that is unknown or of the wrong type."""


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


# numeric parameter -> (the spec field whose range it takes, `specs.bounds`; its unit)
RANGES = {"gpus": ("Scenario", "GPUs in the job"),
          "gpus_per_node": ("ClusterSpec", "GPUs a node"),
          "seq_len": ("Scenario", "tokens a sequence"),
          "global_batch_tokens": ("Scenario", "tokens an optimizer step"),
          "token_budget": ("Scenario", "tokens to train on")}


def _given(name: str, value, default, kind=int):
    """`value` if given (not "", 0 or None), else the scenario's `default`; checked to be a
    number (a whole one for `int`) in the range a spec file may give it (`RANGES`)."""
    if value in ("", 0, None):
        value = default
    spec, unit = RANGES[name]
    low, high = field_range(spec, name)
    types = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, types) or not low <= value <= high:
        span = f"{low:g} to {high:g}" if kind is float else f"{low:,} to {high:,}"
        raise ParameterError(
            f"bad parameter {name}={quote(value)}: expected a {'whole ' if kind is int else ''}"
            f"number from {span} ({unit}), or 0 for the scenario's value")
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


def display_whole_tables() -> None:
    """Let the page's tables show every row and each cell's whole text: pandas cuts a cell
    at 50 characters and a table at 60 rows unless told, and a page reader cannot widen it."""
    import pandas as pd

    pd.set_option("display.max_colwidth", None)
    pd.set_option("display.max_rows", None)


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


def show_figure(fig, dpi: int = 144):
    """Show a matplotlib figure in the cell's output as a PNG image, rendered as
    `glue_figure` renders it, whatever the kernel's backend (under Agg, `display(fig)`
    would print only the figure's repr)."""
    import matplotlib.pyplot as plt
    from IPython.display import Image, display

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    display(Image(data=buf.getvalue(), format="png"))


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
             f"{ga} such micro-batch{'es' if ga > 1 else ''} before each optimizer step, "
             f"and {recompute}.")
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
    """Why `alt` is not the decision: it does not fit, it is faster but its memory band may
    not fit (`launch.choice` columns), or the time term that costs it most."""
    name = f"**{alt['strategy']}**"
    if not alt["fits"]:
        return (f"{name} does not fit: even its smallest layout needs "
                f"{alt['total_gib']:,.0f} GiB per GPU, against {card_gib:g} GiB on the card.")
    if alt["tokens_per_s"] > chosen["tokens_per_s"] and alt.get("fits_band") is False:
        return (f"{name}: {alt['tokens_per_s']:,.0f} tokens/s, faster, but with its memory "
                f"band it may need {alt['memory_upper_gib']:.1f} GiB per GPU, more than the "
                f"{alt['usable_gib']:.1f} GiB the allocator can use, so it was passed over.")
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


# ---------------------------------------------------------------- across scenarios


def gallery(current: Inputs):
    """Page 1's decision for every scenario in data/scenarios/ (the gallery appendix).

    The row of `current` (this build's scenario, added if it is a file elsewhere) uses
    its parameters as given, overrides included. Returns (one row per scenario: raw numbers, pandas
    DataFrame; a markdown list of the decisions in plain words).
    """
    import pandas as pd

    rows, lines = [], []
    names = preset_names(Scenario)
    for name in names + ([] if current.scenario in names else [current.scenario]):
        inputs = current if name == current.scenario else resolve_inputs(name)
        _, chosen, _, _ = decision.decide(inputs)
        train = time_to_train(inputs.token_budget, chosen["tokens_per_s"], inputs.gpus)
        mark = " (this build)" if inputs is current else ""
        rows.append({"scenario": f"{name}{mark}", "gpus": inputs.gpus, "gpu": inputs.gpu.name,
                     "card_gib": inputs.gpu.memory_gib, "strategy": chosen["strategy"],
                     "total_gib": chosen["total_gib"],
                     "tokens_per_s_per_gpu": chosen["tokens_per_s_per_gpu"],
                     "mfu": chosen["mfu"], "days": train["days"],
                     "token_budget": inputs.token_budget})
        lines.append(f"- *{inputs.title}*{mark}: {describe_layout(chosen, inputs)}")
    return pd.DataFrame(rows).set_index("scenario"), "\n".join(lines)


def gallery_sentence(rows) -> str:
    """The gallery's decision in plain words (markdown): which strategies the scenarios get."""
    strategies = sorted(set(rows["strategy"]))
    return (f"The planner picks {len(strategies)} different strategies for the {len(rows)} "
            "scenarios: " + ", ".join(f"**{s}**" for s in strategies)
            + ". The table says which scenario gets which, and the list below it why, in "
            "plain words.")


def gallery_table(rows):
    """The gallery's rows formatted for the page (pandas DataFrame of strings)."""
    import pandas as pd

    return pd.DataFrame({
        "GPUs": [f"{n:,} x {g}" for n, g in zip(rows["gpus"], rows["gpu"], strict=True)],
        "strategy": rows["strategy"],
        "GiB per GPU": [f"{t:.1f} of {c:g}" for t, c in
                        zip(rows["total_gib"], rows["card_gib"], strict=True)],
        "tokens/s per GPU": [f"{v:,.0f}" for v in rows["tokens_per_s_per_gpu"]],
        "MFU": [f"{v:.0%}" for v in rows["mfu"]],
        "days to train": [f"{v:,.1f}" for v in rows["days"]],
        "token budget": [f"{v:.3g}" for v in rows["token_budget"]],
    }, index=rows.index)


def records_note(inputs: Inputs, record_cards: list[str], record_gpus: int) -> str:
    """Page 4 in plain words: how far the proxy records speak for this scenario (markdown)."""
    cards = ", ".join(sorted(set(record_cards))) or "no card"
    if inputs.gpu.name not in {card_preset(c) for c in record_cards}:
        return (f"The proxy records were measured on {cards}, not on this scenario's "
                f"{inputs.gpu.name}: there are no proxy records for this card yet. They test the "
                "planner's cost model, not this card's constants, which stay the datasheet's "
                "assumptions until the card is measured.")
    return (f"The proxy records were measured on {cards}, the card of this scenario, on "
            f"{record_gpus} GPUs against the scenario's {inputs.gpus:,}.")
