"""Page 1's decision and what it passed over, in the words pages 1, 2 and 6 share.

The rule is `launch.choice`'s (the fastest plan the trainer runs that fits with its memory
band's margin), so page 6 and `trainplan launch` run what page 1 recommends. Where a faster
plan was passed over, the page names it and why: the trainer cannot run it (expert
parallel), or its band says it may not fit, with what the safe choice costs. Where no plan
fits with margin, or nothing of the model runs (a mixture of experts), the page says so;
page 6 then has no commands and says why (`no_launch`), by the rule that makes
`trainplan launch` refuse the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainplan.launch.choice import Decision, choose
from trainplan.plan.search import search
from trainplan.specs import Scenario, load_model, load_scenario, preset_names
from trainplan.train.support import RUNNABLE_PINS, not_runnable


def decided(inputs):
    """(the search's result, its table best first with the memory margins; page 1's
    `launch.choice.Decision`) for `inputs` (`pages.Inputs`)."""
    result = search(inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus,
                    seq_len=inputs.seq_len, global_batch_tokens=inputs.global_batch_tokens)
    d = choose(result.table, inputs.model, inputs.gpu)
    return dataclasses.replace(result, table=d.table), d


def decide(inputs):
    """(the search's result; the chosen row; the fastest row; why the trainer cannot run the
    fastest, or None): page 1's decision for `inputs` (`decided`)."""
    result, d = decided(inputs)
    return result, d.chosen, d.fastest, d.not_runnable


def _recompute(row) -> str:
    return "no recompute" if row["recompute"] == "none" else f"{row['recompute']} recompute"


def headline(d: Decision) -> str:
    """Page 1's decision in one line for its box (markdown); the page says it in plain words
    below (`pages.describe_layout`)."""
    c = d.chosen
    mb = int(c["micro_batch"])
    return (f"Train with **{c['strategy']}**, micro-batches of {mb} sequence"
            f"{'s' if mb > 1 else ''} and {_recompute(c)} (in plain words below).")


def _overrun(row) -> str:
    """The runs behind a row's memory band and how far their peak memory ran over."""
    runs = "its family's" if row["memory_source"] == "family" else "every family's"
    return (f"{runs} measured memory band on {row['memory_card_class']} GPUs (+"
            f"{row['memory_factor'] - 1:.0%})")


def passed_over(d: Decision) -> str:
    """Page 1's sentences on what the decision passed over and whether it fits with margin
    (markdown; empty when the fastest plan is the decision and fits with margin)."""
    chosen, fastest, why = d.chosen, d.fastest, d.not_runnable
    parts = []
    if not d.launchable:
        parts.append(f"**Not launchable yet** (page 6): {why}.")
    elif why is not None:
        gain = fastest["tokens_per_s"] / chosen["tokens_per_s"] - 1.0
        parts.append(f"**Passed over.** {fastest['strategy']} would be {gain:.0%} faster, but "
                     f"{why}; the decision is a plan the trainer runs, so that page 6 launches "
                     "what this page recommends.")
    if d.passed_over is not None:
        q = d.passed_over
        slower = 1.0 - chosen["tokens_per_s"] / q["tokens_per_s"]
        parts.append(
            f"**Passed over for memory.** {q['strategy']} is faster, but with {_overrun(q)} it "
            f"may need {q['memory_upper_gib']:.1f} GiB of the {q['usable_gib']:.1f} GiB usable; "
            f"this plan costs {slower:.1%} of its throughput.")
    if d.fits_band is False:
        parts.append(
            f"**No plan fits with margin.** With its band every plan may need more than the "
            f"{chosen['usable_gib']:.1f} GiB the allocator can use; this one keeps the most "
            f"headroom (up to {chosen['memory_upper_gib']:.1f} GiB). Check peak memory in a "
            "short trial run before the full job.")
    return " ".join(parts)


def memory_check(d: Decision) -> str:
    """The decision's memory risk in plain sentences, the same on pages 1 and 2: its predicted
    peak times its band's upper end (`launch.choice`), against what the allocator can use."""
    c = d.chosen
    if c["memory_factor"] is None:
        return (f"No run on {c['memory_card_class']} GPUs has measured peak memory yet, so "
                f"the predicted {c['total_gib']:.1f} GiB is unchecked: check it in a short "
                "trial run.")
    text = (f"With {_overrun(c)} this plan needs up to {c['memory_upper_gib']:.1f} ")
    if c["fits_band"]:
        return text + f"of the {c['usable_gib']:.1f} GiB usable."
    return text + (f"GiB, more than the {c['usable_gib']:.1f} GiB usable, and no plan does "
                   "better: check peak memory in a short trial run.")


def launch_note(d: Decision) -> str:
    """Page 6's box: whether the decision can be launched (markdown; empty when it can)."""
    if d.launchable:
        return ""
    return f"**Not launchable yet.** The trainer cannot run this model: {d.not_runnable}."


def short_note(d: Decision) -> str:
    """What page 1 passed over, in a sentence or two for pages 2 and 6 (markdown; empty when
    the fastest plan is the decision and fits with margin)."""
    parts = [launch_note(d)] if not d.launchable else []
    if d.launchable and d.not_runnable is not None:
        parts.append(f"{d.fastest['strategy']} would be faster, but {d.not_runnable}.")
    if d.passed_over is not None:
        q = d.passed_over
        parts.append(f"Page 1 passed over the faster {q['strategy']}: with its "
                     f"memory band it may need {q['memory_upper_gib']:.1f} GiB, more than the "
                     f"{q['usable_gib']:.1f} GiB the allocator can use.")
    if d.fits_band is False:
        parts.append("No plan fits with its memory band's margin; this one keeps the most "
                     "headroom.")
    return " ".join(parts)


def memory_decision(d: Decision, card_gib: float) -> str:
    """Page 2's decision: the chosen plan's batch shape and memory (markdown)."""
    c = d.chosen
    text = (f"Run **{c['strategy']}** with micro-batches of {int(c['micro_batch'])} "
            f"sequence{'s' if c['micro_batch'] > 1 else ''} and recompute *{c['recompute']}*: "
            f"it needs {c['total_gib']:.1f} GiB on each GPU, of the {card_gib:g} GiB the card "
            "has.")
    note = short_note(d)
    return f"{text} {note}" if note else text


def no_launch_reason(model) -> str | None:
    """Why `trainplan launch` writes no scripts for `model` (a ModelSpec): the reason the
    trainer runs none of its layouts with expert parallel pinned off, as the launch pins it
    (`launch.job.best_runnable`); None where a layout runs."""
    return not_runnable(RUNNABLE_PINS, model)


def launch_scenarios() -> list[str]:
    """The scenario presets (data/scenarios/) whose model the trainer runs: the runbooks
    whose page 6 has commands."""
    return [name for name in preset_names(Scenario)
            if no_launch_reason(load_model(load_scenario(name).model)) is None]


@dataclass(frozen=True)
class NoLaunch:
    """Page 6's words for a model the trainer does not run: `values` for `{glue:text}`,
    `markdown` for `{glue:md}`."""

    values: dict = field(default_factory=dict)
    markdown: dict = field(default_factory=dict)


def no_launch(inputs, chosen) -> NoLaunch | None:
    """What page 6 says in place of commands where the trainer runs no layout of the model
    (a mixture of experts): the model, its experts per layer and per token, the expert-parallel
    degree and predicted tokens/s per GPU of `chosen` (page 1's plan), why there is no launch,
    and the scenarios that have one. None where the model launches."""
    why = no_launch_reason(inputs.model)
    if why is None:
        return None
    m = inputs.model
    names = [f"`{n}`" for n in launch_scenarios()]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)
    return NoLaunch(
        values={"experts_model": m.name, "n_experts": m.n_experts, "experts_top_k": m.top_k,
                "experts_ep": int(chosen["ep"]),
                "planned_tokens_per_s_per_gpu": float(chosen["tokens_per_s_per_gpu"])},
        markdown={"no_launch_why": why, "launch_scenarios": listed or "none yet"})
