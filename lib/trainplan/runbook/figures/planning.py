"""Tables and figures of pages 1-3: strategy, memory, batch and throughput."""

from __future__ import annotations

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

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


def alternatives(table: pd.DataFrame, chosen: pd.Series | None = None) -> pd.DataFrame:
    """`chosen` (page 1's decision, a row of `table`; the first row where none is given), then
    the best layout answering each usual question.

    The questions: with (or, if the plan uses it, without) tensor parallelism;
    with (or without) pipeline parallelism; plain FSDP over every GPU; plain
    data parallelism (DDP). Each answer is the best fitting layout, or, when
    none fits, the smallest one (`fits` False). Column `question` names it.
    """
    chosen = table.iloc[0] if chosen is None else chosen
    questions = {
        "chosen plan": table.index == chosen.name,
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


def unnamed(df: pd.DataFrame) -> pd.DataFrame:
    """Drop the index's name, so the HTML table has one header row, not two."""
    df.index.name = None
    return df


def _fmt(df: pd.DataFrame, formats: dict) -> pd.DataFrame:
    out = pd.DataFrame(index=df.index)
    for col, (label, fmt) in formats.items():
        out[label] = [fmt.format(v) if not isinstance(v, str) else v for v in df[col]]
    return out


TOP_FAMILIES = 8  # families page 1's side-by-side table shows open; the rest are folded


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
    return unnamed(out.set_index("layout"))


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
    return unnamed(_fmt(rows, cols).set_index("layout"))


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


def candidates_tokens_per_s(table: pd.DataFrame, chosen: pd.Series | None = None
                            ) -> plt.Figure:
    """Predicted tokens/s of every fitting layout, one row per strategy family (page 1).

    Families are ordered by their best layout; small dots are all fitting
    candidates, the large marker each family's best, the red one `chosen` (page 1's
    decision; the fastest fitting layout where none is given).
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
    chosen = fitting.iloc[0] if chosen is None else chosen
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
