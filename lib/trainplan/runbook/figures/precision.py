"""Page 3's bf16 and fp8 side by side: the table and the bars of `runbook.precision`'s rows."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from trainplan.runbook.figures.planning import HIGHLIGHT

BF16 = "#4c72b0"
ROWS = {  # column of `precision.side_by_side`: (the table's row, format)
    "strategy": ("layout", "{}"),
    "micro_batch": ("micro-batch (sequences)", "{:d}"),
    "recompute": ("recompute", "{}"),
    "step_time_s": ("step (s)", "{:.2f}"),
    "tokens_per_s_per_gpu": ("tokens/s per GPU", "{:,.0f}"),
    "mfu": ("MFU (on the bf16 peak)", "{:.1%}"),
    "total_gib": ("memory per GPU (GiB)", "{:.1f}"),
    "days": ("days for the token budget", "{:,.1f}"),
    "gpu_hours": ("GPU-hours for the token budget", "{:,.0f}"),
}


def precision_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The decided plan in bf16 and in fp8, one column each (`precision.side_by_side`)."""
    return pd.DataFrame({name: [fmt.format(row[col]) for col, (_, fmt) in ROWS.items()]
                         for name, row in rows.iterrows()},
                        index=[label for label, _ in ROWS.values()])


def precision_bars(rows: pd.DataFrame, fp8_measured: bool | None,
                   no_fp8: str = "no fp8 on this GPU") -> plt.Figure:
    """Predicted tokens/s per GPU of the decided plan in bf16 and in fp8 (page 3).

    fp8's bar is hatched unless its rate is measured on the card (`fp8_measured`, from
    `plan --json`'s `fp8.validated`); without an fp8 row its place says `no_fp8`.
    """
    fig, ax = plt.subplots(figsize=(8, 1.5))
    names = ["bf16", "fp8"]
    ypos = np.arange(len(names))[::-1]
    values = rows["tokens_per_s_per_gpu"].astype(float)
    ax.barh(ypos[0], values["bf16"], color=BF16, height=0.6)
    if "fp8" in rows.index:
        ax.barh(ypos[1], values["fp8"], height=0.6, color="white" if not fp8_measured
                else HIGHLIGHT, edgecolor=HIGHLIGHT, hatch=None if fp8_measured else "///")
    else:
        ax.text(0, ypos[1], f" {no_fp8}", va="center", fontsize=8, color="#555555")
    for y, name in zip(ypos, names, strict=True):
        if name in rows.index:
            label = f" {values[name]:,.0f}"
            if name == "fp8" and not fp8_measured:
                label += " (not measured yet)"
            ax.text(values[name], y, label, va="center", fontsize=8)
    ax.set_yticks(ypos, names)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set_xlim(0, values.max() * 1.35)
    ax.set_xlabel("predicted tokens/s per GPU, the decided plan")
    ax.grid(axis="y", alpha=0)
    fig.tight_layout()
    return fig


def loss_parity(run: dict, tolerance: float) -> plt.Figure:
    """One parity run (`runbook.parity.runs`): left, the loss the comparison reads (held-out
    loss at each evaluation for a trainer run, the training loss a step with a 10-step mean
    for a harness run), bf16 solid and fp8 dashed, one line per seed; right, fp8's figure
    over bf16's less one for each seed, inside the shaded +-`tolerance`."""
    fig, (ax, side) = plt.subplots(1, 2, figsize=(9, 2.8), width_ratios=[3, 1])
    for name, color, style in (("bf16", BF16, "-"), ("fp8", HIGHLIGHT, "--")):
        if run["evals"] is not None:
            for i, curve in enumerate(run["evals"][name]):
                steps, loss = zip(*curve, strict=True)
                ax.plot(steps, loss, color=color, linestyle=style, marker=".", linewidth=1.2,
                        label=name if i == 0 else None)
            ax.set_ylabel("held-out loss")
            continue
        loss = np.asarray(run["losses"][name][0], dtype=float)
        steps = np.arange(1, len(loss) + 1)
        ax.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
        k = min(10, len(loss))
        ax.plot(steps[k - 1:], np.convolve(loss, np.ones(k) / k, mode="valid"), color=color,
                linestyle=style, linewidth=1.6, label=f"{name}, {k}-step mean")
        ax.set_ylabel("training loss")
    ax.set_xlabel("training step")
    ax.legend(frameon=False, fontsize=8)
    labels = [f"seed {s['seed']}" if s["seed"] is not None else "the run" for s in run["seeds"]]
    changes = [100 * s["change"] for s in run["seeds"]]
    ypos = np.arange(len(changes))
    side.axvspan(-100 * tolerance, 100 * tolerance, color="#dddddd", label="tolerance")
    side.axvline(0, color="black", linewidth=0.6)
    side.plot(changes, ypos, "o", color=HIGHLIGHT)
    side.set_yticks(ypos, labels)
    side.set_ylim(-0.7, len(changes) - 0.3)
    reach = max(1.5 * 100 * tolerance, *(abs(c) * 1.2 for c in changes))
    side.set_xlim(-reach, reach)
    side.set_xlabel("fp8 vs bf16 (%)")
    fig.tight_layout()
    return fig
