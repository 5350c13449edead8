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


# ---------------------------------------------------------------- GPU checkpoint benchmark

MODE_COLOURS = {"sync": "#c44e52", "async": "#4c72b0", "raw": "#8c8c8c"}
ASYNC_STALL_TARGET_S = 1.0  # issue 5: asynchronous stall at most 1 s
PERSIST_TARGET = 0.8  # issue 5: persist at least 80% of the disk's raw write bandwidth


def checkpoint_records(paths) -> list[dict]:
    """`checkpoint` records (trainplan.bench.ckpt_bench) of the files that exist, validated;
    a malformed file raises RecordError naming it."""
    from pathlib import Path

    from trainplan import records

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return [r for p in paths if Path(p).is_file() for r in records.load(p)
            if r["kind"] == "checkpoint"]


def _gpu(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("device") == "cuda"]


def _launch_label(r: dict) -> str:
    card = r["card"].replace("NVIDIA ", "").split(" ")[0]
    return f"{r['model']}\n{r['ranks']} x {card}, ZeRO-{r['layout']['zero']}"


def checkpoint_bench_note(recs: list[dict]) -> str:
    """One sentence for the page: what the GPU records show, or that there are none yet."""
    gpu = _gpu(recs)
    if not gpu:
        return ("No GPU checkpoint benchmark has been recorded yet: run "
                "`torchrun ... -m trainplan.bench.ckpt_bench` on 2 GPUs and commit its "
                "ckpt-records.jsonl under data/measurements/.")
    s = gpu[-1]["summary"]
    return (f"Latest GPU run ({gpu[-1]['card']}, {gpu[-1]['ranks']} GPUs, "
            f"{(s['checkpoint_bytes'] or 0) / 1e9:.1f} GB a checkpoint): asynchronous stall "
            f"{s['async_stall_s']:.2f} s against {s['sync_stall_s']:.1f} s synchronous; "
            f"persist at {s['persist_vs_raw_sync']:.0%} (sync) and "
            f"{s['persist_vs_raw_async']:.0%} (async) of the disk's raw write bandwidth.")


def checkpoint_bench_table(recs: list[dict]) -> pd.DataFrame:
    """One column per GPU launch: size, raw bandwidth, stalls, persist, restart."""
    def f(value, spec):
        return "-" if value is None else format(value, spec)

    out = {}
    for i, r in enumerate(_gpu(recs)):
        s = r["summary"]
        out[f"{i + 1}: {_launch_label(r).replace(chr(10), ', ')}"] = [
            f((s["checkpoint_bytes"] or 0) / 1e9, ".1f"), f(s["raw_write_gbps"], ".2f"),
            f(s["sync_stall_s"], ".2f"), f(s["async_stall_s"], ".2f"),
            f(s.get("async_first_stall_s"), ".2f"),
            f(s["persist_gbps_sync"], ".2f"), f(s["persist_gbps_async"], ".2f"),
            f(s["persist_vs_raw_sync"], ".0%"), f(s["persist_vs_raw_async"], ".0%"),
            f(s["restart_to_first_step_s"], ".1f"), r["provenance"].get("date", "")[:10]]
    index = ["checkpoint (GB)", "raw write, same disk (GB/s)", "stall, synchronous (s)",
             "stall, asynchronous (s)", "stall, first asynchronous save (s)",
             "persist, synchronous (GB/s)", "persist, asynchronous (GB/s)",
             "persist / raw, synchronous", "persist / raw, asynchronous",
             "restart to first step, in-process (s)", "date"]
    return pd.DataFrame(out, index=index)


def checkpoint_bench_figure(recs: list[dict]) -> plt.Figure | None:
    """Left: stall per save, synchronous vs asynchronous (bars: median, dots: each save).
    Right: persist throughput of each mode against the raw write bandwidth of the same
    disk, with the 80% target. None where there is no GPU record yet
    (`checkpoint_bench_note` says so)."""
    gpu = _gpu(recs)
    if not gpu:
        return None
    fig, (ax_s, ax_p) = plt.subplots(1, 2, figsize=(8, 3.2))
    x = np.arange(len(gpu))
    width = 0.27
    for k, mode in enumerate(("sync", "async")):
        col = MODE_COLOURS[mode]
        ax_s.bar(x + (k - 0.5) * width, [r["summary"][f"{mode}_stall_s"] or 0 for r in gpu],
                 width, color=col, label=f"{'synchronous' if k == 0 else 'asynchronous'}")
        for i, r in enumerate(gpu):
            dots = [s["stall_s"] + s.get("commit_in_loop_s", 0) for s in r["saves"]
                    if s["mode"] == mode and s.get("committed", True)]
            ax_s.plot([x[i] + (k - 0.5) * width] * len(dots), dots, "o", ms=3, color="black")
    ax_s.axhline(ASYNC_STALL_TARGET_S, color="black", lw=1, ls="--")
    ax_s.text(x[-1] + 0.45, ASYNC_STALL_TARGET_S, " 1 s target", va="bottom", ha="right",
              fontsize=8)
    ax_s.set(ylabel="training blocked per save (s)", xticks=x,
             xticklabels=[_launch_label(r) for r in gpu])
    ax_s.legend(frameon=False, fontsize=8)
    for k, (key, label) in enumerate((("raw_write_gbps", "raw write"),
                                      ("persist_gbps_sync", "persist, synchronous"),
                                      ("persist_gbps_async", "persist, asynchronous"))):
        colour = MODE_COLOURS[("raw", "sync", "async")[k]]
        ax_p.bar(x + (k - 1) * width, [r["summary"][key] or 0 for r in gpu], width,
                 color=colour, label=label)
    for i, r in enumerate(gpu):
        target = PERSIST_TARGET * r["summary"]["raw_write_gbps"]
        ax_p.plot([x[i] - 1.5 * width, x[i] + 1.5 * width], [target, target], color="black",
                  lw=1, ls="--")
    ax_p.set(ylabel="GB/s (fsynced)", xticks=x, xticklabels=[_launch_label(r) for r in gpu])
    ax_p.legend(frameon=False, fontsize=8, title="dashed: 80% of raw", title_fontsize=8)
    for ax in (ax_s, ax_p):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- fault matrix


def fault_matrix_table(matrix) -> pd.DataFrame:
    """The fault matrix (`python -m trainplan.fault_matrix`) as the page's evidence table:
    scenario, guarantee, result, test. `matrix` is its JSON as a dict, or a path to it."""
    import json
    from pathlib import Path

    if isinstance(matrix, (str, Path)):
        matrix = json.loads(Path(matrix).read_text())
    rows = [{"scenario": r["scenario"], "guarantee": r["guarantee"],
             "result": f"{r['outcome']} ({r['duration_s']:.1f} s)",
             "test": r["test"].split("::", 1)[-1]} for r in matrix["rows"]]
    return pd.DataFrame(rows, columns=["scenario", "guarantee", "result", "test"])


def fault_matrix_caption(matrix: dict) -> str:
    """'N of M fault tests passed on DATE at commit C (torch V)'."""
    c = matrix["counts"]
    total = sum(c.values())
    commit = (matrix.get("commit") or "unknown")[:10]
    return (f"{c['passed']} of {total} fault tests passed on {matrix['date'][:10]} at commit "
            f"{commit} (torch {matrix['torch']}, CPU, gloo, real torchrun)")
