"""Tables and figures of page 5: checkpointing and failure recovery."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

CASE_COLOURS = {"conservative": "#c44e52", "nominal": "#4c72b0"}


def checkpoint_table(plans: dict) -> pd.DataFrame:
    """The terms of each `checkpoint.CheckpointPlan`, one column per MTBF case (page 5)."""
    rows = {  # attribute -> (label, format)
        "job_mtbf_hours": ("job MTBF (hours)", "{:,.0f}"),
        "checkpoint_gb": ("checkpoint, all nodes (GB)", "{:,.1f}"),
        "per_node_gb": ("written per node (GB)", "{:,.1f}"),
        "stall_s": ("training stalled per save (s)", "{:,.2f}"),
        "persist_s": ("save durable after (s)", "{:,.1f}"),
        "young_min": ("Young interval (min)", "{:,.1f}"),
        "daly_min": ("Daly interval (min)", "{:,.1f}"),
        "interval_min": ("chosen interval (min)", "{:,.1f}"),
        "limited_by": ("interval set by", "{}"),
        "expected_lost_min": ("expected lost per failure (min)", "{:,.1f}"),
        "worst_lost_min": ("worst-case lost per failure (min)", "{:,.2f}"),
        "max_lost_min": ("limit (min)", "{:,.0f}"),
        "ettr": ("effective training time ratio", "{:.2%}"),
        "retention_gb": ("retained checkpoints (GB)", "{:,.0f}"),
        "peak_storage_gb": ("storage while a save is in flight (GB)", "{:,.0f}"),
    }
    return pd.DataFrame({case: [fmt.format(getattr(p, k)) for k, (_, fmt) in rows.items()]
                         for case, p in plans.items()}, index=[v[0] for v in rows.values()])


def simulation_table(sims: dict, plans: dict) -> pd.DataFrame:
    """Simulated runs against the closed forms, one column per MTBF case (page 5)."""
    out = {}
    for case, sim in sims.items():
        s, p = sim.summary(), plans[case]
        out[case] = [f"{s['runs']:,d}", f"{s['failures_mean']:.2f}",
                     f"{s['lost_per_failure_min_mean']:.1f} ({p.expected_lost_min:.1f})",
                     f"{s['lost_per_failure_min_max']:.2f} ({p.worst_lost_min:.2f})",
                     f"{s['lost_hours_mean']:.2f} / {s['lost_hours_p95']:.2f} / "
                     f"{s['lost_hours_p99']:.2f}",
                     f"{s['train_days']:.2f}",
                     f"{s['wall_days_mean']:.2f} / {s['wall_days_p95']:.2f} / "
                     f"{s['wall_days_p99']:.2f}",
                     f"{s['ettr_mean']:.2%} ({p.ettr:.2%})"]
    index = ["simulated runs", "failures per run (mean)",
             "lost per failure, mean (closed form), min", "lost per failure, max (worst case), min",
             "lost per run, mean / p95 / p99, hours", "training without failures, days",
             "wall time, mean / p95 / p99, days", "ETTR, simulated (closed form)"]
    return pd.DataFrame(out, index=index)


def lost_work_distribution(sims: dict, plans: dict) -> plt.Figure:
    """Simulated lost work per failure, and the share of runs delayed by more than x hours."""
    fig, (ax_f, ax_w) = plt.subplots(1, 2, figsize=(8, 3.2))
    for case, sim in sims.items():
        colour, p = CASE_COLOURS.get(case, "#55a868"), plans[case]
        ax_f.hist(sim.lost_per_failure_min, bins=40, density=True, histtype="step", lw=1.5,
                  color=colour)
        ax_f.axvline(p.expected_lost_min, color=colour, ls="--", lw=1)
        extra = np.sort(sim.wall_hours - sim.train_hours)
        share = 1.0 - np.arange(1, extra.size + 1) / extra.size
        ax_w.step(extra, share, where="post", color=colour, label=case)
    limit = next(iter(plans.values())).max_lost_min
    ax_f.axvline(limit, color="black", lw=1.2)
    ax_f.text(limit, 0.98, " limit", transform=ax_f.get_xaxis_transform(), va="top", fontsize=8)
    ax_f.set(xlabel="wall time lost per failure, restart included (min)", ylabel="density")
    ax_w.set(xlabel="x: wall time beyond the training time (hours)",
             ylabel="share of runs longer by more than x", yscale="log")
    ax_f.set_ylim(0, ax_f.get_ylim()[1] * 1.15)
    ax_w.legend(title="node MTBF", frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
