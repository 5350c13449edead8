"""Tables and figures of page 5: checkpointing and failure recovery."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from trainplan.records import schema as records
from trainplan.resilience.checkpoint import digits

CASE_COLOURS = {"conservative": "#c44e52", "nominal": "#4c72b0"}


def checkpoint_table(plans: dict) -> pd.DataFrame:
    """The terms of each `checkpoint.CheckpointPlan`, one column per MTBF case (page 5).

    Numbers keep their digits (`checkpoint.digits`): a positive one never shows as 0,
    as intervals of seconds do on tens of thousands of GPUs."""
    rows = {  # attribute -> (label, decimals; "%": a percentage, None: text)
        "job_mtbf_hours": ("job MTBF (hours)", 0),
        "checkpoint_gb": ("checkpoint, all nodes (GB)", 1),
        "per_node_gb": ("written per node (GB)", 1),
        "stall_s": ("training stalled per save (s)", 2),
        "persist_s": ("save durable after (s)", 1),
        "young_min": ("Young interval (min)", 1),
        "daly_min": ("Daly interval (min)", 1),
        "interval_min": ("chosen interval (min)", 1),
        "limited_by": ("interval set by", None),
        "expected_lost_min": ("expected lost per failure (min)", 1),
        "worst_lost_min": ("worst-case lost per failure (min)", 2),
        "max_lost_min": ("limit (min)", 0),
        "ettr": ("effective training time ratio", "%"),
        "retention_gb": ("retained checkpoints (GB)", 0),
        "peak_storage_gb": ("storage while a save is in flight (GB)", 0),
    }

    def cell(value, places) -> str:
        if places is None:
            return str(value)
        return f"{digits(100.0 * value, 2)}%" if places == "%" else digits(value, places)

    return pd.DataFrame({case: [cell(getattr(p, k), places) for k, (_, places) in rows.items()]
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
ASYNC_STALL_TARGET_S = 1.0  # checkpoint target: asynchronous stall at most 1 s
PERSIST_TARGET = 0.8  # checkpoint target: persist at least 80% of the disk's raw write bandwidth


def checkpoint_records(paths) -> list[dict]:
    """`checkpoint` records (trainplan.bench.series.ckpt_bench) of the files that exist, validated;
    a malformed file raises RecordError naming it."""
    from pathlib import Path

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return [r for p in paths if Path(p).is_file() for r in records.load(p)
            if r["kind"] == "checkpoint"]


def _gpu(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("device") == "cuda"]


def _launch_label(r: dict) -> str:
    card = r["card"].replace("NVIDIA ", "").split(" ")[0]
    return f"{r['model']}\n{r['ranks']} x {card}, ZeRO-{r['layout']['zero']}"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def latest_gpu_checkpoint(recs: list[dict]) -> dict | None:
    """The newest GPU launch among `recs` (by `recorded_at`), or None."""
    gpu = _gpu(recs)
    return max(gpu, key=lambda r: r["recorded_at"]) if gpu else None


def checkpoint_card(r: dict) -> str:
    """'NVIDIA H200 x 2': the card and how many ranks ran the launch."""
    return f"{r['card']} x {r['ranks']}"


def checkpoint_cards(recs: list[dict]) -> str:
    """The cards of the GPU launches, in the figure's order, for its caption."""
    cards = list(dict.fromkeys(checkpoint_card(r) for r in _gpu(recs)))
    return ", ".join(cards) if cards else "no GPU launch recorded yet"


@dataclass(frozen=True)
class TargetCheck:
    """One checkpoint target against one launch's measured figure."""

    what: str  # the measured quantity
    target: str  # the target, in words
    measured: str  # the figure, formatted
    met: bool | None  # None: not measured


def checkpoint_targets(r: dict) -> list[TargetCheck]:
    """The checkpoint targets for one launch: the asynchronous stall against its 1 s target, then
    the asynchronous and the synchronous persist throughput against 80% of the raw write
    bandwidth of the same disk, measured in the same launch."""
    s = r["summary"]
    stall = s["async_stall_s"]
    out = [TargetCheck("stall of an asynchronous save", f"at most {ASYNC_STALL_TARGET_S:g} s",
                       f"{_fmt(stall, '.2f')} s",
                       None if stall is None else stall <= ASYNC_STALL_TARGET_S)]
    for mode, word in (("async", "asynchronous"), ("sync", "synchronous")):
        share, gbps = s[f"persist_vs_raw_{mode}"], s[f"persist_gbps_{mode}"]
        out.append(TargetCheck(
            f"persist, {word} save", f"at least {PERSIST_TARGET:.0%} of raw write",
            f"{_fmt(share, '.0%')} ({_fmt(gbps, '.2f')} of {_fmt(s['raw_write_gbps'], '.2f')} "
            "GB/s)", None if share is None else share >= PERSIST_TARGET))
    return out


_RESULT = {True: "met", False: "not met", None: "not measured"}


def checkpoint_targets_table(recs: list[dict]) -> pd.DataFrame:
    """The targets of the newest GPU launch: target, measured, result (empty without one)."""
    r = latest_gpu_checkpoint(recs)
    rows = checkpoint_targets(r) if r else []
    return pd.DataFrame({"target": [c.target for c in rows],
                         "measured": [c.measured for c in rows],
                         "result": [_RESULT[c.met] for c in rows]},
                        index=[c.what for c in rows], dtype=object)


def _why_persist_falls_short(r: dict) -> str:
    """Why persist falls short, from the phases of the last committed asynchronous save
    ('' where they were not timed)."""
    last = [s for s in r["saves"] if s["mode"] == "async" and s.get("committed", True)]
    ph = (last[-1].get("phases") or {}) if last else {}
    write, hashing = ph.get("write_s"), ph.get("hash_s")
    if not (write and hashing and last[-1].get("persist_s")):
        return ""
    return (f" Why: the manifest's checksums are computed only after every shard is written, "
            f"by reading each file back. In the last asynchronous save, writing took "
            f"{write:.2f} s and hashing then took {hashing:.2f} s more "
            f"({hashing / last[-1]['persist_s']:.0%} of its persist time), while the disk "
            f"wrote nothing. Hashing each file while the others are still being written "
            f"removes that serial step.")


def checkpoint_verdict(recs: list[dict]) -> str:
    """The page's sentences on the newest GPU launch (MyST): which target is met, which is
    not and why, and the restart; or that no GPU launch has been recorded yet."""
    r = latest_gpu_checkpoint(recs)
    if r is None:
        return ("No GPU checkpoint benchmark has been recorded yet: run "
                "`torchrun ... -m trainplan.bench.series.ckpt_bench` on 2 GPUs and commit its "
                "ckpt-records.jsonl under data/measurements/.")
    s = r["summary"]
    stall, p_async, p_sync = checkpoint_targets(r)
    text = (f"On {checkpoint_card(r)} ({r['model']}, ZeRO-{r['layout']['zero']}, "
            f"{_fmt((s['checkpoint_bytes'] or 0) / 1e9, '.1f')} GB a save), the stall target "
            f"is **{_RESULT[stall.met]}**: an asynchronous save blocks training for "
            f"{stall.measured}, a synchronous one for {_fmt(s['sync_stall_s'], '.1f')} s.")
    if s.get("async_first_stall_s") is not None:
        text += (f" Only the run's first asynchronous save, which also allocates the pinned "
                 f"host copy that later saves reuse, blocks longer: "
                 f"{s['async_first_stall_s']:.1f} s, once.")
    n = {m: sum(s["mode"] == m and s.get("committed", True) for s in r["saves"])
         for m in ("sync", "async")}
    text += (f" The persist target ({p_async.target}) is **{_RESULT[p_async.met]}**: a save is "
             f"durable at {p_async.measured} asynchronously and {p_sync.measured} "
             f"synchronously (medians of {n['async']} and {n['sync']} saves; the persist "
             f"time runs from the start of a save to its manifest's rename, so the first "
             f"asynchronous save's allocation counts).")
    if p_async.met is False:
        text += _why_persist_falls_short(r)
    return text + (f" A restart in the same process (model and optimizer rebuilt, checkpoint "
                   f"loaded) reaches its first step after "
                   f"{_fmt(s['restart_to_first_step_s'], '.1f')} s.")


def checkpoint_verdict_short(recs: list[dict]) -> str:
    """One sentence for the page's plain-words box (MyST)."""
    r = latest_gpu_checkpoint(recs)
    if r is None:
        return "The GPU measurements of the save path are not yet recorded."
    stall, persist, _ = checkpoint_targets(r)
    verb = {True: "meets", False: "misses", None: "has not measured"}
    return (f"On {checkpoint_card(r)}, the harness's asynchronous save {verb[stall.met]} the "
            f"stall target ({stall.measured}) and {verb[persist.met]} the persist target "
            f"({persist.measured.split(' (')[0]} of the raw write bandwidth, "
            f"{persist.target.split(' of ')[0]} wanted).")


def checkpoint_bench_table(recs: list[dict]) -> pd.DataFrame:
    """One column per GPU launch: size, raw bandwidth, stalls, persist, restart."""
    f = _fmt
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


def _no_gpu_figure() -> plt.Figure:
    """A placeholder that says there is no GPU launch yet (the page builds without one)."""
    fig, ax = plt.subplots(figsize=(8, 1.2))
    ax.text(0.5, 0.5, "no GPU checkpoint benchmark recorded yet", ha="center", va="center")
    ax.set_axis_off()
    return fig


def checkpoint_bench_figure(recs: list[dict]) -> plt.Figure:
    """Left: stall per save, synchronous vs asynchronous (bars: median, dots: each save).
    Right: persist throughput of each mode against the raw write bandwidth of the same
    disk, labelled with its share of raw, and the 80% target (dashed). A placeholder that
    says so where there is no GPU record yet."""
    gpu = _gpu(recs)
    if not gpu:
        return _no_gpu_figure()
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
    ax_s.text(x[0] - 0.45, ASYNC_STALL_TARGET_S, f" {ASYNC_STALL_TARGET_S:g} s target",
              va="bottom", ha="left", fontsize=8)
    ax_s.set(ylabel="training blocked per save (s, log)", yscale="log", xticks=x,
             xlim=(x[0] - 0.5, x[-1] + 0.5), xticklabels=[_launch_label(r) for r in gpu])
    ax_s.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_s.legend(frameon=False, fontsize=8, loc="upper right")
    for k, (key, label) in enumerate((("raw_write_gbps", "raw write"),
                                      ("persist_gbps_sync", "persist, synchronous"),
                                      ("persist_gbps_async", "persist, asynchronous"))):
        colour = MODE_COLOURS[("raw", "sync", "async")[k]]
        bars = ax_p.bar(x + (k - 1) * width, [r["summary"][key] or 0 for r in gpu], width,
                        color=colour, label=label)
        if k:  # each persist bar's share of the raw write bandwidth
            share = [r["summary"][key.replace("persist_gbps", "persist_vs_raw")] for r in gpu]
            ax_p.bar_label(bars, labels=[_fmt(v, ".0%") for v in share], fontsize=7)
    for i, r in enumerate(gpu):
        target = PERSIST_TARGET * r["summary"]["raw_write_gbps"]
        ax_p.plot([x[i] - 1.5 * width, x[i] + 1.5 * width], [target, target], color="black",
                  lw=1, ls="--")
    top = max(r["summary"]["raw_write_gbps"] or 0 for r in gpu)
    ax_p.set(ylabel="GB/s (fsynced)", xticks=x, xticklabels=[_launch_label(r) for r in gpu],
             ylim=(0, top * 1.5 or 1))  # headroom for the legend above the bars
    ax_p.legend(frameon=False, fontsize=8, title=f"dashed: {PERSIST_TARGET:.0%} of raw",
                title_fontsize=8, loc="upper center", ncol=2)
    for ax in (ax_s, ax_p):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- fault matrix


def fault_matrix_table(matrix) -> pd.DataFrame:
    """The fault matrix (`python -m trainplan.resilience.fault_matrix`) as the page's evidence
    table:
    scenario, guarantee, result, test. `matrix` is its JSON as a dict, or a path to it."""
    from pathlib import Path

    from trainplan.loader import MAX_LOG_BYTES, load_json

    if isinstance(matrix, (str, Path)):
        matrix = load_json(matrix, max_bytes=MAX_LOG_BYTES)
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
