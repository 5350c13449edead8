"""Page 1's decision: the fastest plan that fits and that the trainer runs, and what was
passed over for it.

The search ranks every layout (`plan.search`); the runbook recommends the first one the
trainer can run (`train.support.not_runnable`), because page 6 launches what page 1
recommends. Where a faster plan needs what the trainer lacks (expert parallel),
the page names it, its rate and why it was passed over; where nothing of the model runs
(a mixture of experts), the fastest plan stays the decision and the page says it cannot
be launched yet.
"""

from __future__ import annotations

from trainplan.plan.search import search
from trainplan.train.support import not_runnable


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
