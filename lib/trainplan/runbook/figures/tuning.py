"""Tables and figures of page 7: the knob study and `suggest`."""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from trainplan.runbook.figures.planning import HIGHLIGHT
from trainplan.tune import effect_stats
from trainplan.tune.suggest import effects_words

VERDICT_STYLE = {"run": ("#55a868", "o"), "skip: memory": ("#c44e52", "x"),
                 "skip: time": ("#dd8452", "s")}


def suggest_table(out: dict) -> pd.DataFrame:
    """`trainplan suggest`'s answer as one row per setting: value and reason (page 7)."""
    c, e, r = out["config"], out["estimate"], out["reasons"]
    par = c["parallel"]
    layout = f"{c['strategy']} (dp {par['dp']}, tp {par['tp']}, pp {par['pp']}, " \
             f"zero {par['zero']}, recompute {par['recompute']})"
    nccl = ", ".join(f"{k}={v}" for k, v in c["nccl"].items() if v) or "unset (NCCL chooses)"
    loader = ", ".join(f"{k} {v}" for k, v in c["data_loader"].items())
    rows = [("model", out["model"]["name"], r["model"]), ("layout", layout, r["parallel"]),
            ("micro-batch", str(c["micro_batch"]), r["micro_batch"]),
            ("gradient accumulation", str(c["grad_accum"]), r["grad_accum"]),
            ("global batch", f"{c['global_batch_tokens']:,} tokens", r["global_batch"]),
            ("NCCL", nccl, r["nccl"]), ("data loader", loader, r["data_loader"]),
            ("knob effects", effects_words(out["effects"]["knobs"], "; "), r["knob_effects"]),
            ("time to train", f"{e['days']:.1f} days, {e['gpu_hours']:,.0f} GPU-hours",
             r["time_to_train"])]
    return pd.DataFrame([(v, why) for _, v, why in rows], columns=["value", "reason"],
                        index=[k for k, _, _ in rows])


def skip_grid(table: pd.DataFrame, card_gib: float) -> plt.Figure:
    """Predicted memory of each micro-batch x ZeRO x recompute, marked run or skipped (page 7)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    zeros = sorted(table["zero"].unique())
    styles = dict(zip(zeros, ("-", "--", ":"), strict=False))
    for (zero, rc), group in table.groupby(["zero", "recompute"], sort=False):
        ax.plot(group["micro_batch"], group["memory_gib"], color="#8c8c8c", lw=0.8,
                ls=styles[zero], zorder=1)
        for verdict, (colour, marker) in VERDICT_STYLE.items():
            part = group[group["verdict"] == verdict]
            ax.scatter(part["micro_batch"], part["memory_gib"], color=colour, marker=marker,
                       s=18, zorder=2)
        if zero == zeros[-1]:
            last = group.iloc[-1]
            ax.annotate(f"recompute {rc}", (last["micro_batch"], last["memory_gib"]),
                        xytext=(6, -2), textcoords="offset points", fontsize=7, va="top")
    ax.axhline(card_gib, color="black", lw=1)
    for verdict, (colour, marker) in VERDICT_STYLE.items():
        if (table["verdict"] == verdict).any():
            ax.scatter([], [], color=colour, marker=marker, label=verdict)
    for zero in zeros:
        ax.plot([], [], color="#8c8c8c", ls=styles[zero], label=f"zero {zero}")
    ax.set(xlabel="micro-batch (sequences per GPU)", ylabel="predicted memory per GPU (GiB)")
    ax.set_xlim(right=table["micro_batch"].max() * 1.25)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.legend(frameon=False, fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def tune_effects(report: dict) -> plt.Figure:
    """Each knob level's effect on tokens/s/GPU against the knob's default, with 95% CIs."""
    rows = [(f"{k['knob']}: {e['level']} vs {e['vs']}", e["effect_pct"], *e["ci_pct"])
            for k in report["knobs"] for e in k["effects"]]
    fig, ax = plt.subplots(figsize=(6, 0.3 * len(rows) + 1))
    y = np.arange(len(rows))[::-1]
    for yi, (_, eff, lo, hi) in zip(y, rows, strict=True):
        colour = HIGHLIGHT if lo > 0 or hi < 0 else "#8c8c8c"
        ax.errorbar(eff, yi, xerr=[[eff - lo], [hi - eff]], fmt="o", color=colour, ms=4)
    ax.axvline(0, color="black", lw=1)
    ax.set_yticks(y, [r[0] for r in rows], fontsize=7)
    ax.set(xlabel="effect on tokens/s/GPU (%), 95% interval")
    fig.tight_layout()
    return fig


def tune_importance(report: dict) -> plt.Figure:
    """PED-ANOVA importance of each knob, largest first."""
    items = [(k["knob"], k["importance"]) for k in report["knobs"] if k["importance"] is not None]
    items.sort(key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(5, 0.3 * len(items) + 1))
    ax.barh([k for k, _ in items], [v for _, v in items], color="#4c72b0")
    ax.set(xlabel="importance (PED-ANOVA)")
    fig.tight_layout()
    return fig


def tune_history(trials: pd.DataFrame) -> plt.Figure:
    """Tokens/s/GPU of each measured trial with its 95% interval, and the best so far."""
    fig, ax = plt.subplots(figsize=(6, 3))
    t = trials.sort_values("trial")
    ax.errorbar(t["trial"], t["tokens_per_s_per_gpu"],
                yerr=[t["tokens_per_s_per_gpu"] - t["ci_low"],
                      t["ci_high"] - t["tokens_per_s_per_gpu"]],
                fmt="o", ms=3, color="#4c72b0", lw=0.8, label="trial (95% interval)")
    ax.step(t["trial"], t["tokens_per_s_per_gpu"].cummax(), where="post", color=HIGHLIGHT,
            label="best so far")
    ax.set(xlabel="trial", ylabel="tokens/s per GPU")
    ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def paired_effects(eff: dict) -> plt.Figure:
    """Each variant's paired effect on tokens/s/GPU with its 95% interval, one panel per
    layout family (`trainplan.tune.effect_stats.summary`); variants without an interval yet
    are left out, intervals that exclude 0 highlighted."""
    fams = list(eff["families"].items())
    rows = {f: [(f"{v['knob']} {v['base_value']} -> {v['value']} (n={v['pairs']})",
                 v["effect_pct"], *v["ci_pct"]) for k in d["knobs"] for v in k["variants"]
                if v["ci_pct"] is not None] for f, d in fams}
    fig, axes = plt.subplots(len(fams), 1, squeeze=False, figsize=(
        6, 1 + 0.3 * sum(max(len(r), 1) for r in rows.values()) + 0.5 * len(fams)))
    for ax, (fam, d) in zip(axes[:, 0], fams, strict=True):
        y = np.arange(len(rows[fam]))[::-1]
        for yi, (_, eff_, lo, hi) in zip(y, rows[fam], strict=True):
            colour = HIGHLIGHT if lo > 0 or hi < 0 else "#8c8c8c"
            ax.errorbar(eff_, yi, xerr=[[eff_ - lo], [hi - eff_]], fmt="o", color=colour, ms=4)
        ax.axvline(0, color="black", lw=1)
        for bound in (-d["halfwidth_pct"], d["halfwidth_pct"]):
            ax.axvline(bound, color="#8c8c8c", lw=0.6, ls=":")
        ax.set_yticks(y, [r[0] for r in rows[fam]], fontsize=7)
        on = f", {effect_stats.where(d)}" if effect_stats.where(d) else ""
        ax.text(0.0, 1.02, f"{fam}: {d['pairs']} pairs{on}", transform=ax.transAxes, fontsize=8)
    axes[-1, 0].set(xlabel="effect on tokens/s/GPU against the base (%), 95% interval")
    fig.tight_layout()
    return fig
