"""Figures and display tables of the runbook pages.

Selection, labelling and drawing only: every number drawn here comes from
the search table (`trainplan.search`) or the specs, never from a formula in
this module. Figures carry no titles: the book captions them through
`{glue:figure}`. Each function returns a matplotlib Figure (or a DataFrame)
and leaves showing it to the notebook (`trainplan.pages.glue_figure`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

# the memory and time terms, in stacking order, with the colour each keeps on every page
MEMORY_PARTS = {
    "params_gib": ("weights", "#4c72b0"),
    "grads_gib": ("gradients", "#55a868"),
    "optimizer_gib": ("optimizer state", "#c44e52"),
    "activations_gib": ("activations", "#dd8452"),
    "other_gib": ("buffers and margin", "#8c8c8c"),
}
TIME_PARTS = {
    "compute_s": ("compute", "#4c72b0"),
    "exposed_comm_s": ("exposed communication", "#c44e52"),
    "bubble_s": ("pipeline bubble", "#dd8452"),
    "optimizer_s": ("optimizer step", "#8c8c8c"),
}
RECOMPUTE_STYLE = {"none": ("#4c72b0", "o"), "selective": ("#55a868", "s"),
                   "full": ("#c44e52", "^")}
HIGHLIGHT = "#c44e52"

plt.rcParams.update({
    "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 100,
})


# ---------------------------------------------------------------- selection


def layout_name(row: pd.Series) -> str:
    """A row's strategy with its batch shape, e.g. 'TP2 x HSDP16, mb 2, selective'."""
    extra = [f"mb {int(row['micro_batch'])}"]
    if row["recompute"] != "none":
        extra.append(f"{row['recompute']} recompute")
    if row["pp"] > 1:
        extra.append(row["pp_schedule"] + (f" v{int(row['pp_virtual'])}"
                                           if row["pp_virtual"] > 1 else ""))
    return f"{row['strategy']}, " + ", ".join(extra)


def representatives(table: pd.DataFrame, families: list[str]) -> pd.DataFrame:
    """For each named family in `table`: its best fitting layout, else its smallest one.

    Families the search did not produce (an MoE family for a dense model, say)
    are skipped. The rows keep the table's columns, `fits` telling which is which.
    """
    rows = []
    for family in families:
        of = table[table["family"] == family]
        if of.empty:
            continue
        fitting = of[of["fits"]]
        rows.append(fitting.iloc[0] if len(fitting) else of.loc[of["total_gib"].idxmin()])
    return pd.DataFrame(rows).reset_index(drop=True)


def alternatives(table: pd.DataFrame) -> pd.DataFrame:
    """The chosen plan (first row) and the best layout answering each usual question.

    The questions: with (or, if the plan uses it, without) tensor parallelism;
    with (or without) pipeline parallelism; plain FSDP over every GPU; plain
    data parallelism (DDP). Each answer is the best fitting layout, or, when
    none fits, the smallest one (`fits` False). Column `question` names it.
    """
    chosen = table.iloc[0]
    questions = {
        "chosen plan": table.index == table.index[0],
        ("without" if chosen["tp"] > 1 else "with") + " tensor parallel":
            (table["tp"] > 1) != (chosen["tp"] > 1),
        ("without" if chosen["pp"] > 1 else "with") + " pipeline parallel":
            (table["pp"] > 1) != (chosen["pp"] > 1),
        "plain FSDP": table["family"] == "FSDP",
        "plain data parallel (DDP)": table["family"] == "DDP",
    }
    rows, seen = [], set()
    for question, mask in questions.items():
        of = table[mask]
        if of.empty:
            continue
        fitting = of[of["fits"]]
        row = fitting.iloc[0] if len(fitting) else of.loc[of["total_gib"].idxmin()]
        if row.name in seen:
            continue
        seen.add(row.name)
        rows.append(row.copy())
        rows[-1]["question"] = question
    return pd.DataFrame(rows).reset_index(drop=True)


def same_mesh(table: pd.DataFrame, row: pd.Series) -> pd.DataFrame:
    """Layouts sharing `row`'s GPU grid and sharding: they differ in batch shape or recompute."""
    keys = ["dp", "tp", "pp", "cp", "ep", "zero", "dp_shard", "pp_schedule", "pp_virtual"]
    mask = np.logical_and.reduce([table[k] == row[k] for k in keys])
    order = {mode: i for i, mode in enumerate(RECOMPUTE_STYLE)}  # none, selective, full
    out = table[mask].assign(_order=lambda d: d["recompute"].map(order))
    return out.sort_values(["_order", "micro_batch"]).drop(columns="_order").reset_index(drop=True)


# ---------------------------------------------------------------- tables


def _unnamed(df: pd.DataFrame) -> pd.DataFrame:
    """Drop the index's name, so the HTML table has one header row, not two."""
    df.index.name = None
    return df


def _fmt(df: pd.DataFrame, formats: dict) -> pd.DataFrame:
    out = pd.DataFrame(index=df.index)
    for col, (label, fmt) in formats.items():
        out[label] = [fmt.format(v) if not isinstance(v, str) else v for v in df[col]]
    return out


def strategy_table(best: pd.DataFrame) -> pd.DataFrame:
    """Best fitting layout of each strategy family, side by side, best first (page 1)."""
    out = _fmt(best, {
        "strategy": ("best layout", "{}"),
        "micro_batch": ("micro-batch", "{:d}"),
        "grad_accum": ("grad accum", "{:d}"),
        "recompute": ("recompute", "{}"),
        "total_gib": ("GiB per GPU", "{:.1f}"),
        "step_time_s": ("step (s)", "{:.2f}"),
        "tokens_per_s": ("tokens/s", "{:,.0f}"),
        "mfu": ("MFU", "{:.1%}"),
    })
    out.index = list(best["family"])
    return out


def memory_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per-GPU memory by term, GiB, one row per layout (page 2)."""
    cols = {k: (label, "{:.1f}") for k, (label, _) in MEMORY_PARTS.items()}
    cols["total_gib"] = ("total", "{:.1f}")
    cols["fits"] = ("fits", "{}")
    out = _fmt(rows, cols)
    out.index = [layout_name(r) for _, r in rows.iterrows()]
    return out


def tradeoff_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Memory and throughput of layouts that differ in micro-batch and recompute (page 2)."""
    out = _fmt(rows, {
        "recompute": ("recompute", "{}"),
        "micro_batch": ("micro-batch", "{:d}"),
        "grad_accum": ("grad accum", "{:d}"),
        "activations_gib": ("activations (GiB)", "{:.1f}"),
        "total_gib": ("total (GiB)", "{:.1f}"),
        "fits": ("fits", "{}"),
        "tokens_per_s": ("tokens/s", "{:,.0f}"),
    })
    return out.set_index(["recompute", "micro-batch"])


def batch_table(rows: pd.DataFrame, seq_len: int) -> pd.DataFrame:
    """Batch shape of each layout: who processes how many sequences (page 3)."""
    out = _fmt(rows, {
        "strategy": ("layout", "{}"),
        "dp": ("data-parallel ranks", "{:d}"),
        "micro_batch": ("micro-batch (sequences)", "{:d}"),
        "grad_accum": ("micro-batches per step", "{:d}"),
        "tokens_per_step": ("tokens per step", "{:,d}"),
    })
    out.insert(4, "sequence length", f"{seq_len:,d}")
    return _unnamed(out.set_index("layout"))


def throughput_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Step time by term, throughput and MFU of each layout (page 3)."""
    cols = {"strategy": ("layout", "{}")}
    cols.update({k: (f"{label} (s)", "{:.2f}") for k, (label, _) in TIME_PARTS.items()})
    cols.update({
        "step_time_s": ("step (s)", "{:.2f}"),
        "tokens_per_s": ("tokens/s", "{:,.0f}"),
        "tokens_per_s_per_gpu": ("tokens/s per GPU", "{:,.0f}"),
        "mfu": ("MFU", "{:.1%}"),
    })
    return _unnamed(_fmt(rows, cols).set_index("layout"))


def comm_table(row: pd.Series) -> pd.DataFrame:
    """Exposed communication of one layout by parallel dimension, seconds per step."""
    names = {"tp_comm_s": "tensor parallel", "dp_comm_s": "data parallel",
             "pp_comm_s": "pipeline sends", "cp_comm_s": "context parallel",
             "ep_comm_s": "expert all-to-all"}
    return pd.DataFrame({"exposed per step (s)": [f"{row[k]:.3f}" for k in names]},
                        index=list(names.values()))


def time_to_train_table(train: dict) -> pd.DataFrame:
    """Wall time and GPU-hours for the token budget (page 3), from `perf.time_to_train`."""
    return pd.DataFrame({"value": [f"{train['days']:.1f}", f"{train['seconds'] / 3600:,.0f}",
                                   f"{train['gpu_hours']:,.0f}"]},
                        index=["days", "hours", "GPU-hours"])


def layout_table(row: pd.Series) -> pd.DataFrame:
    """One layout's settings, as a launch script would need them (page 6)."""
    names = {
        "dp": "data parallel (dp)", "tp": "tensor parallel (tp)", "pp": "pipeline stages (pp)",
        "cp": "context parallel (cp)", "ep": "expert parallel (ep)", "zero": "ZeRO stage",
        "dp_shard": "ranks per ZeRO shard", "micro_batch": "micro-batch (sequences)",
        "grad_accum": "micro-batches per step", "recompute": "activation recompute",
        "sequence_parallel": "sequence parallel", "pp_schedule": "pipeline schedule",
        "pp_virtual": "virtual stages per rank",
    }
    return pd.DataFrame({"value": [str(row[k]) for k in names]},
                        index=list(names.values()))


# ---------------------------------------------------------------- figures


def candidates_tokens_per_s(table: pd.DataFrame) -> plt.Figure:
    """Predicted tokens/s of every fitting layout, one row per strategy family (page 1).

    Families are ordered by their best layout; small dots are all fitting
    candidates, the large marker each family's best, the red one the chosen plan.
    """
    fitting = table[table["fits"]]
    order = list(fitting["family"].drop_duplicates())[::-1]  # the search's ranking, best on top
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.2 * len(order)))
    y = {f: i for i, f in enumerate(order)}
    ax.scatter(fitting["tokens_per_s"] / 1e3, fitting["family"].map(y), s=6, color="#4c72b0",
               alpha=0.25, linewidths=0, label="fitting layout")
    best = fitting.groupby("family", sort=False).head(1)
    ax.scatter(best["tokens_per_s"] / 1e3, best["family"].map(y), s=28, color="#4c72b0",
               label="best of its family")
    chosen = fitting.iloc[0]
    ax.scatter([chosen["tokens_per_s"] / 1e3], [y[chosen["family"]]], s=70, color=HIGHLIGHT,
               zorder=3, label=f"chosen: {chosen['strategy']}")
    ax.set_yticks(range(len(order)), order)
    ax.set_ylim(-0.7, len(order) - 0.3)
    ax.set_xlabel("predicted throughput (thousand tokens/s, whole job)")
    ax.grid(axis="y", alpha=0)
    ax.legend(loc="lower center", bbox_to_anchor=(0.4, 1.0), ncol=3, frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def memory_breakdown(rows: pd.DataFrame, card_gib: float, reserved_gib: float) -> plt.Figure:
    """Stacked per-GPU memory of each layout against the card (page 2).

    `reserved_gib` is what lives outside PyTorch's allocator (CUDA context,
    NCCL and cuBLAS workspaces); it is drawn as a band below the card's line.
    """
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.42 * len(rows)))
    names = [layout_name(r) + ("" if r["fits"] else "  (does not fit)")
             for _, r in rows.iterrows()]
    ypos = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for col, (label, colour) in MEMORY_PARTS.items():
        ax.barh(ypos, rows[col], left=left, color=colour, label=label, height=0.6)
        left += rows[col].to_numpy()
    ax.axvspan(card_gib - reserved_gib, card_gib, color="#8c8c8c", alpha=0.35, lw=0,
               label="outside the allocator")
    ax.axvline(card_gib, color="black", lw=1.2, label=f"GPU memory ({card_gib:g} GiB)")
    ax.set_yticks(ypos, names)
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_xlim(0, max(card_gib, float(left.max())) * 1.05)
    ax.grid(axis="y", alpha=0)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.9 + 0.42 * len(rows)) - 0.12),
              ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def recompute_microbatch(rows: pd.DataFrame, card_gib: float,
                        chosen: pd.Series | None = None) -> plt.Figure:
    """Memory and throughput against micro-batch, one line per recompute mode (page 2).

    `rows` are layouts of one GPU grid (`same_mesh`); hollow markers do not fit;
    a red ring marks `chosen`. Memory is on a log scale: it spans orders of magnitude.
    """
    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(8, 3.2))
    for mode, (colour, marker) in RECOMPUTE_STYLE.items():
        r = rows[rows["recompute"] == mode].sort_values("micro_batch")
        if r.empty:
            continue
        for ax, col, scale in ((ax_mem, "total_gib", 1.0), (ax_tps, "tokens_per_s", 1e3)):
            ax.plot(r["micro_batch"], r[col] / scale, color=colour, lw=1, label=mode)
            ax.scatter(r["micro_batch"], r[col] / scale, marker=marker, s=30,
                       facecolors=np.where(r["fits"], colour, "white"), edgecolors=colour,
                       zorder=3)
    if chosen is not None:
        for ax, col, scale in ((ax_mem, "total_gib", 1.0), (ax_tps, "tokens_per_s", 1e3)):
            ax.scatter([chosen["micro_batch"]], [chosen[col] / scale], s=140, zorder=4,
                       facecolors="none", edgecolors=HIGHLIGHT, linewidths=1.5,
                       label="chosen plan" if ax is ax_tps else None)
    ax_mem.axhline(card_gib, color="black", lw=1.2)
    ax_mem.text(0.02, card_gib, " GPU memory", transform=ax_mem.get_yaxis_transform(),
                va="bottom", fontsize=8)
    ax_mem.set_yscale("log")
    ax_mem.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax_mem.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_mem.set_ylabel("memory per GPU (GiB, log scale)")
    ax_tps.set_ylabel("predicted thousand tokens/s")
    micro = sorted(rows["micro_batch"].unique())
    for ax in (ax_mem, ax_tps):
        ax.set_xscale("log", base=2)
        ax.set_xticks(micro, [str(m) for m in micro])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("micro-batch (sequences)")
    ax_tps.legend(title="recompute", frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def step_time_split(rows: pd.DataFrame) -> plt.Figure:
    """Where one optimizer step's time goes, for each layout (page 3)."""
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.42 * len(rows)))
    ypos = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for col, (label, colour) in TIME_PARTS.items():
        ax.barh(ypos, rows[col], left=left, color=colour, label=label, height=0.6)
        left += rows[col].to_numpy()
    ax.set_yticks(ypos, [layout_name(r) for _, r in rows.iterrows()])
    ax.set_xlabel("seconds per optimizer step")
    ax.grid(axis="y", alpha=0)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.9 + 0.42 * len(rows)) - 0.12),
              ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- validation (page 4)


def _validation_frame(rows) -> pd.DataFrame:
    """`trainplan.compare` rows (dicts) that have a prediction, as a DataFrame."""
    df = pd.DataFrame([r for r in rows if r["predicted_step_time_s"] is not None])
    return df.reset_index(drop=True)


def validation_table(rows) -> pd.DataFrame:
    """Predicted against measured step time and peak reserved memory, one row a config."""
    df = _validation_frame(rows)
    out = pd.DataFrame(index=[c + (" *" if f else "") for c, f in zip(df["config"],
                                                                       df["flagged"], strict=True)])
    out["launches"] = df["launches"].to_numpy()
    out["predicted s"] = [f"{v:.3f}" for v in df["predicted_step_time_s"]]
    out["measured s (95% interval)"] = [
        f"{m:.3f} ({lo:.3f}-{hi:.3f})" for m, (lo, hi) in
        zip(df["measured_step_time_s"], df["measured_step_time_ci"], strict=True)]
    out["step error"] = [f"{v:+.1%}" for v in df["step_time_error"]]
    out["predicted GiB"] = [f"{v:.1f}" for v in df["predicted_memory_gib"]]
    out["measured GiB"] = [f"{v:.1f}" for v in df["measured_memory_gib"]]
    out["memory error"] = [f"{v:+.1%}" for v in df["memory_error"]]
    out["largest predicted term"] = [TIME_PARTS[f"{t}_s"][0] for t in df["dominant_term"]]
    return _unnamed(out)


def predicted_vs_measured(rows) -> plt.Figure:
    """Predicted against measured step time, the measurement's 95% interval as a bar.

    Points are numbered in the order of `rows`; the key beside the plot names them.
    """
    df = _validation_frame(rows)
    fig, (ax, key) = plt.subplots(1, 2, figsize=(8, 4.8), width_ratios=(3, 1.3))
    meas, pred = df["measured_step_time_s"].to_numpy(), df["predicted_step_time_s"].to_numpy()
    ci = np.array(df["measured_step_time_ci"].tolist())
    hi = max(meas.max(), pred.max()) * 1.1
    line = np.array([0, hi])
    ax.fill_between(line, line * 0.9, line * 1.1, color="#8c8c8c", alpha=0.15,
                    label="within 10%")
    ax.plot(line, line, color="#8c8c8c", lw=1, label="predicted = measured")
    flagged = df["flagged"].to_numpy(bool)
    for mask, face, label in ((~flagged, "#4c72b0", "config"),
                              (flagged, "white", "config, fewer than 3 launches")):
        if mask.any():
            ax.errorbar(meas[mask], pred[mask], xerr=[meas[mask] - ci[mask, 0],
                                                      ci[mask, 1] - meas[mask]],
                        fmt="o", color="#4c72b0", mfc=face, ms=5, capsize=3, label=label)
    for i, (x, y) in enumerate(zip(meas, pred, strict=True), 1):
        ax.annotate(str(i), (x, y), xytext=(-3, 5), textcoords="offset points", fontsize=7,
                    ha="right")
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="measured step time, s (95% interval)",
           ylabel="predicted step time, s")
    ax.legend(loc="upper left", frameon=False, fontsize=8)
    key.axis("off")
    key.text(0, 1, "\n".join(f"{i:>2}  {c}" for i, c in enumerate(df["config"], 1)),
             va="top", family="monospace", fontsize=8, transform=key.transAxes)
    fig.tight_layout()
    return fig


def validation_split(rows) -> plt.Figure:
    """Each config's predicted step split into its terms, with the measured step beside it."""
    df = _validation_frame(rows)
    n = len(df)
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.5 * n))
    ypos = np.arange(n)[::-1].astype(float)
    left = np.zeros(n)
    for col, (label, colour) in TIME_PARTS.items():
        part = np.array([s[col[:-2]] for s in df["predicted_split_s"]])
        ax.barh(ypos + 0.17, part, left=left, color=colour, label=f"predicted: {label}",
                height=0.32)
        left += part
    meas = df["measured_step_time_s"].to_numpy()
    ci = np.array(df["measured_step_time_ci"].tolist())
    ax.barh(ypos - 0.17, meas, color="#2f2f2f", height=0.32, label="measured step")
    ax.errorbar(meas, ypos - 0.17, xerr=[meas - ci[:, 0], ci[:, 1] - meas], fmt="none",
                color=HIGHLIGHT, capsize=2)
    ax.set_yticks(ypos, df["config"])
    ax.set_xlabel("seconds per optimizer step")
    ax.grid(axis="y", alpha=0)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False,
               fontsize=8)
    fig.tight_layout(rect=(0, 0.55 / (0.9 + 0.5 * n), 1, 1))
    return fig



# ---------------------------------------------------------------- checkpointing (page 5)

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


# ---------------------------------------------------------------- knob study and suggest (page 7)

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


# ---------------------------------------------------------------- launch and operations (page 6)


def watch_table(w: dict) -> pd.DataFrame:
    """What a healthy run shows and where the alert lines are, from `trainplan.launch.watch`."""
    rows = [
        ("tokens/s per GPU (plan)", f"{w['tokens_per_s_per_gpu']:,.0f}"),
        ("tokens/s, whole job (plan)", f"{w['tokens_per_s']:,.0f}"),
        ("step time (plan, s)", f"{w['step_time_s']:.2f}"),
        ("MFU (plan)", f"{w['mfu']:.1%}"),
        ("memory per GPU (plan, GiB)", f"{w['memory_gib']:.1f}"),
        ("alert: tokens/s per GPU below", f"{w['alert_tokens_per_s_per_gpu']:,.0f}"),
        ("straggler: a rank's step time above (s)", f"{w['straggler_step_time_s']:.2f}"),
        ("checkpoint every (steps)", f"{w['checkpoint_every_steps']:,}"),
        ("checkpoint every (minutes)", f"{w['checkpoint_every_min']:.0f}"),
        ("collective timeout (minutes)", f"{w['collective_timeout_min']:.0f}"),
    ]
    return pd.DataFrame({"value": [v for _, v in rows]}, index=[k for k, _ in rows])
