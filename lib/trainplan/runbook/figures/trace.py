"""Page 4's profiler trace: one config's predicted split beside its traced split.

Both splits come from `trainplan.compare.trace_split.paired` (the prediction recorded before the
runs, and the profile JSON of `bench/profile.py` mapped onto the same terms); nothing is
computed here.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from trainplan.compare.trace_split import TERMS
from trainplan.runbook.figures.planning import TIME_PARTS, unnamed

# The wall's terms in trace_split.TERMS order: the planner's colours, its bubble standing for
# the traced idle time (the bubble is the planner's only idle-GPU term).
TRACE_PARTS = {
    "compute": TIME_PARTS["compute_s"],
    "exposed_comm": TIME_PARTS["exposed_comm_s"],
    "idle": ("idle GPU (predicted: pipeline bubble)", TIME_PARTS["bubble_s"][1]),
    "optimizer": TIME_PARTS["optimizer_s"],
}
ROWS = ("predicted", "traced", "hidden")  # bar rows, top to bottom
LABELS = {"predicted": "predicted", "traced": "traced", "hidden": "hidden collectives"}
MEASURED = "#2f2f2f"  # the measured step, as in validation_split
HEIGHT = {"predicted": 0.6, "traced": 0.6, "hidden": 0.3}


def _stack(ax, y: float, parts: dict, labelled: bool) -> None:
    """One stacked bar of `parts` (seconds by term) at height `y`."""
    left = 0.0
    for term in TERMS:
        label, colour = TRACE_PARTS[term]
        ax.barh(y, parts[term], left=left, color=colour, height=HEIGHT["traced"],
                label=label if labelled else None)
        left += parts[term]


def traced_split(pp: dict) -> plt.Figure:
    """Predicted and traced seconds per step of one config, stacked term by term, the
    collectives the trace saw hidden under other kernels as a hatched bar, and the step the
    records measured (line, its 95% interval shaded)."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    y = dict(zip(ROWS, (2.0, 1.0, 0.25), strict=True))
    _stack(ax, y["predicted"], pp["predicted"], labelled=True)
    t = pp["traced"]
    if t is None:
        ax.text(0.01, y["traced"], "no profiler trace committed yet", va="center",
                transform=ax.get_yaxis_transform(), fontsize=8, style="italic")
    else:
        _stack(ax, y["traced"], {k: getattr(t, f"{k}_s") for k in TERMS}, labelled=False)
        ax.barh(y["hidden"], t.overlapped_comm_s, height=HEIGHT["hidden"], color="white",
                edgecolor=TIME_PARTS["exposed_comm_s"][1], hatch="///",
                label="collectives under other kernels (traced, not on the wall)")
    lo, hi = pp["measured_step_ci"]
    ax.axvspan(lo, hi, color=MEASURED, alpha=0.15, lw=0)
    ax.axvline(pp["measured_step_s"], color=MEASURED, lw=1.2, ls="--",
               label="measured step (records, 95% interval)")
    shown = ROWS if t is not None else ROWS[:2]
    ax.set_yticks([y[r] for r in shown], [LABELS[r] for r in shown])
    ax.set_ylim(-0.2, 2.5)
    upper = t is not None and t.exposed_bound == "upper"
    ax.set_xlabel("seconds per optimizer step" + (
        " (traced exposed communication: an upper bound)" if upper else ""))
    ax.grid(axis="y", alpha=0)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("measured"))
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center",
               ncol=2, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    return fig


def traced_split_table(pp: dict) -> pd.DataFrame:
    """Seconds per step by term, predicted and traced, and the traced minus the predicted."""
    t = pp["traced"]
    traced = {k: (getattr(t, f"{k}_s") if t is not None else np.nan) for k in TERMS}
    out = pd.DataFrame(index=[TRACE_PARTS[k][0] for k in TERMS])
    out["predicted s"] = [f"{pp['predicted'][k]:.3f}" for k in TERMS]
    out["traced s"] = [f"{traced[k]:.3f}" if t is not None else "" for k in TERMS]
    out["traced - predicted s"] = [f"{traced[k] - pp['predicted'][k]:+.3f}" if t is not None
                                   else "" for k in TERMS]
    return unnamed(out)
