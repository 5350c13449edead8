"""Tables and figures of page 4: predicted versus measured."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from trainplan.runbook.figures.planning import HIGHLIGHT, TIME_PARTS, unnamed
from trainplan.specs.layouts import strategy_label


def _validation_frame(rows) -> pd.DataFrame:
    """`trainplan.compare.accuracy` rows (dicts) that have a prediction, as a DataFrame."""
    df = pd.DataFrame([r for r in rows if r["predicted_step_time_s"] is not None])
    return df.reset_index(drop=True)


def layout_words(row: dict) -> str:
    """A config's model, GPUs and layout in words ("llama-13b, 4 of its layers; 4 GPUs: TP4,
    micro-batch 2, selective recompute, compiled") from a `compare` row, for readers who do
    not read config tags."""
    lay = row["layout"]
    model = row["model"].replace(".yaml", "").rsplit("/", 1)[-1]
    name, _, cut = model.partition(":")
    where = f"{name}, {cut.split('-')[0]} of its layers" if cut else name
    split = strategy_label(lay.get("tp", 1), lay.get("pp", 1), lay.get("cp", 1),
                           lay.get("ep", 1), lay.get("zero", 0), lay.get("dp", 1),
                           lay.get("dp_shard", lay.get("dp", 1)))
    batch = f"micro-batch {lay.get('micro_batch', 1)}"
    if lay.get("grad_accum", 1) > 1:
        batch += f" x {lay['grad_accum']} accumulated"
    extra = [f"{lay['recompute']} recompute"] if lay.get("recompute", "none") != "none" else []
    extra += ["compiled"] if lay.get("compile") else []
    parts = ([] if split == "single GPU" else [split]) + [batch, *extra]
    return f"{where}; {row['gpus']} GPU{'s' if row['gpus'] > 1 else ''}: " + ", ".join(parts)


def validation_table(rows) -> pd.DataFrame:
    """Predicted against measured step time and peak reserved memory, one row a config: its
    tag, what it ran in words, and the host it ran on."""
    df = _validation_frame(rows)
    out = pd.DataFrame(index=[c + (" *" if f else "") for c, f in zip(df["config"],
                                                                       df["flagged"], strict=True)])
    out["what ran"] = [layout_words(r) for r in df.to_dict("records")]
    out["host"] = df["host"].to_numpy()
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
    return unnamed(out)


def per_layer_table(pairs) -> pd.DataFrame:
    """One of the target's layers, predicted against measured: a slice less its shallower
    twin, per layer (`compare_views.per_layer`), one row a pair."""
    def pct(v):
        return "-" if v is None else f"{v:+.1%}"

    out = pd.DataFrame(index=[f"{p['to']} less {p['from']}" for p in pairs])
    out["predicted ms"] = [f"{1e3 * p['predicted_step_s']:.1f}" for p in pairs]
    out["measured ms (95% bound)"] = [
        f"{1e3 * p['measured_step_s']:.1f} ({1e3 * p['measured_step_ci'][0]:.1f}-"
        f"{1e3 * p['measured_step_ci'][1]:.1f})" for p in pairs]
    out["step error"] = [pct(p["step_time_error"]) for p in pairs]
    out["re-predicted step error"] = [pct(p.get("repredicted_step_error")) for p in pairs]
    out["predicted GiB"] = [f"{p['predicted_memory_gib']:.2f}" for p in pairs]
    out["measured GiB"] = [f"{p['measured_memory_gib']:.2f}" for p in pairs]
    out["memory error"] = [pct(p["memory_error"]) for p in pairs]
    out["reserved beyond allocated GiB"] = [
        "-" if p["measured_reserve_gib"] is None else f"{p['measured_reserve_gib']:.2f}"
        for p in pairs]
    return unnamed(out)


def predicted_vs_measured(rows) -> plt.Figure:
    """Predicted against measured step time, the measurement's 95% interval as a bar.

    Points are numbered in the order of `rows`; the key beside the plot names them with their
    host. Both axes are logarithmic: step times span an order of magnitude, and the band
    within 10% keeps one width all along the diagonal.
    """
    df = _validation_frame(rows)
    fig, (ax, key) = plt.subplots(1, 2, figsize=(8.6, 5.2), width_ratios=(3, 1.6))
    meas, pred = df["measured_step_time_s"].to_numpy(), df["predicted_step_time_s"].to_numpy()
    ci = np.array(df["measured_step_time_ci"].tolist())
    lo, hi = min(meas.min(), pred.min()) / 1.3, max(meas.max(), pred.max()) * 1.3
    line = np.array([lo, hi])
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
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured step time, s (95% interval)", ylabel="predicted step time, s")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.2, not 2 x 10^-1
    some = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}".strip("0.")[:1] in "235" else "")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(some)  # 0.2, 0.3, 0.5 between the decades
    ax.legend(loc="upper left", frameon=False, fontsize=8)
    key.axis("off")
    names = [f"{i:>2}  {c} ({short_host(h)})"
             for i, (c, h) in enumerate(zip(df["config"], df["host"], strict=True), 1)]
    key.text(0, 1, "\n".join(names), va="top", family="monospace",
             fontsize=min(8.0, 300 / max(len(names), 1)), transform=key.transAxes)
    fig.tight_layout()
    return fig


def short_host(host: str) -> str:
    """'4 x NVIDIA H100 80GB HBM3' -> '4xH100': a host as a figure's key names it."""
    m = re.match(r"(\d+) x (?:NVIDIA )?(\S+)", str(host))
    return f"{m[1]}x{m[2]}" if m else str(host)


def validation_split(rows) -> plt.Figure:
    """Each config's predicted step split into its terms, with the measured step beside it
    (0.36 in a config: the caller picks the rows, e.g. one host's)."""
    df = _validation_frame(rows)
    n = len(df)
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.36 * n))
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
    fig.tight_layout(rect=(0, 0.55 / (0.9 + 0.36 * n), 1, 1))
    return fig


def weak_scaling_figure(scaling: dict) -> plt.Figure:
    """Weak-scaling efficiency against GPU count, one line a layout (`trainplan.compare.scaling`).

    Each point carries its 95% interval; the dashed line is the target.
    """
    fig, ax = plt.subplots(figsize=(6, 3.8))
    gpus = sorted({p["gpus"] for s in scaling["series"] for p in s["points"]}) or [1]
    for s in scaling["series"]:
        x = np.array([p["gpus"] for p in s["points"]], dtype=float)
        y = np.array([p["efficiency"] for p in s["points"]])
        ci = np.array([p["efficiency_ci"] for p in s["points"]])
        ax.errorbar(x, y * 100, yerr=[(y - ci[:, 0]) * 100, (ci[:, 1] - y) * 100], marker="o",
                    capsize=3, label=f"{s['name']}, {s['model']} ({s.get('host', s['card'])})")
    ax.axhline(scaling["target"] * 100, color=HIGHLIGHT, ls="--", lw=1,
               label=f"target {scaling['target']:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.set(xlabel="GPUs (same micro-batch per GPU)", ylabel="weak-scaling efficiency, %",
           ylim=(min(80.0, ax.get_ylim()[0]), 105.0))
    ax.legend(loc="lower left", frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
