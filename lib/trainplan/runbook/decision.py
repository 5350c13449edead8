"""Page 1's decision: the fastest plan that fits and that the trainer runs, and what was
passed over for it.

The search ranks every layout (`plan.search`); the runbook recommends the first one the
trainer can run (`train.support.not_runnable`), because page 6 launches what page 1
recommends. Where a faster plan needs what the trainer lacks (expert parallel),
the page names it, its rate and why it was passed over; where nothing of the model runs
(a mixture of experts), the fastest plan stays the decision and the page says it cannot
be launched yet; page 6 then has no commands and says why (`no_launch`), by the rule that
makes `trainplan launch` refuse the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainplan.plan.search import search
from trainplan.specs import Scenario, load_model, load_scenario, preset_names
from trainplan.train.support import RUNNABLE_PINS, not_runnable


def _parallel(row) -> dict:
    return {k: row[k] for k in ("cp", "ep")}


def decide(inputs):
    """(the search's result, its table best first; the chosen row; the fastest row; why the
    fastest was passed over, or None): page 1's decision for `inputs` (`pages.Inputs`)."""
    result = search(inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus,
                    seq_len=inputs.seq_len, global_batch_tokens=inputs.global_batch_tokens)
    table = result.table
    fastest = table.iloc[0]
    why = not_runnable(_parallel(fastest), inputs.model)
    if why is None:
        return result, fastest, fastest, None
    for _, row in table.iterrows():
        if not row["fits"]:
            break
        if not_runnable(_parallel(row), inputs.model) is None:
            return result, row, fastest, why
    return result, fastest, fastest, why


def passed_over(chosen, fastest, why: str | None) -> str:
    """Page 1's sentence on what the decision passed over (markdown; empty when nothing)."""
    if why is None:
        return ""
    if chosen.name == fastest.name:
        return (f"**Not launchable yet.** The fastest plan, {fastest['strategy']}, cannot be "
                f"run by the trainer: {why}. Its figures below are the planner's; page 6's "
                "scripts wait for that support.")
    gain = fastest["tokens_per_s"] / chosen["tokens_per_s"] - 1.0
    return (f"**Passed over.** {fastest['strategy']} would be {gain:.0%} faster "
            f"({fastest['tokens_per_s_per_gpu']:,.0f} against "
            f"{chosen['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU), but {why}; the "
            "decision is the fastest plan the trainer runs, so that page 6 launches what this "
            "page recommends.")


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
