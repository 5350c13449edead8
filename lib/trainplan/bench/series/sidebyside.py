"""Side by side: trainplan's layouts against the Hugging Face baseline from one suite run.

The speed-up is a ratio measured in the same run, not against figures from
another day. From the per-launch summaries of a suite run (`suite.run_suite`'s
rows) this pools each config's launches (total tokens over total time of all
kept steps, docs/measurement.md "Timing", with a bootstrap 95% interval over
the steps, `stats.rate_ci`) and reports, at the GPU count of the baseline
configs:

- the best trainplan config against the best baseline config of either kind (bar:
  >= 1.05, goal 1.15), and whether their intervals overlap (then neither is better);
  and against the best of each kind: transformers' model in our loop (`hf-baseline`,
  the control: the same loop and layout code, so it tells model code apart) and
  transformers' own Trainer (`hf-trainer`, what a team would run instead);
- the best trainplan config against the naive default (the config marked
  `naive: true` in the suite; bar >= 1.4).

Which config is "best" is decided by the measured rate, after the fact, and
said so: the ratio is the best of those tried, not a planner's pick.
"""

from __future__ import annotations

from trainplan.records.stats import Interval, overlap, rate_ci

BASELINES = ("hf-baseline", "hf-trainer")  # transformers' model in our loop; its Trainer
IMPL_NAMES = {"hf-baseline": "transformers model in trainplan's loop",
              "hf-trainer": "transformers Trainer"}


def pooled(summaries: list[dict]) -> dict | None:
    """One config's launches as one rate (tokens/s/GPU with interval) and MFU; None if none ran."""
    amounts, seconds = [], []
    for s in summaries:
        per_gpu = s["tokens_per_step"] / max(s["ranks"], 1)
        amounts += [per_gpu] * len(s["step_times_s"])
        seconds += list(s["step_times_s"])
    if not seconds:
        return None
    rate = rate_ci(amounts, seconds)
    first = summaries[0]
    peak = first.get("peak_tflops")
    mem = [s.get("peak_mem_reserved_gib") for s in summaries if s.get("peak_mem_reserved_gib")]
    return {"launches": len(summaries), "steps": len(seconds),
            "tokens_per_s_per_gpu": rate.estimate, "tokens_per_s_per_gpu_ci": rate.as_list(),
            "mfu": rate.estimate * first["flops_per_token"] / (peak * 1e12) if peak else None,
            "peak_mem_reserved_gib": max(mem) if mem else None}


def _interval(row: dict) -> Interval:
    low, high = row["tokens_per_s_per_gpu_ci"]
    return Interval(row["tokens_per_s_per_gpu"], low, high, 0.95, "bootstrap-percentile",
                    row["steps"], True)


def _ratio(ours: dict, theirs: dict) -> tuple[float, bool]:
    """Our rate over theirs, and whether the two 95% intervals overlap."""
    return (ours["tokens_per_s_per_gpu"] / theirs["tokens_per_s_per_gpu"],
            overlap(_interval(ours), _interval(theirs)))


def compare(configs: list[dict], rows: list) -> dict:
    """Pooled figures per config, the ratios against the best baseline (of each kind too) and
    the naive default; `rows` are (tag, predicted, summaries)."""
    by_tag = {c["tag"]: c for c in configs}
    table = []
    for tag, predicted, done in rows:
        cfg = by_tag.get(tag, {})
        row = {"tag": tag, "impl": cfg.get("impl", "trainplan"), "gpus": cfg.get("gpus"),
               "naive": bool(cfg.get("naive", False)),
               "predicted_step_time_s": (predicted or {}).get("step_time_s")}
        row.update(pooled(done) or {"launches": 0})
        table.append(row)
    measured = [r for r in table if r["launches"]]
    base_gpus = max((r["gpus"] for r in measured if r["impl"] in BASELINES), default=None)
    at = [r for r in measured if r["gpus"] == base_gpus]

    def best(*impls):
        rows_ = [r for r in at if r["impl"] in impls]
        return max(rows_, key=lambda r: r["tokens_per_s_per_gpu"]) if rows_ else None

    ours, theirs = best("trainplan"), best(*BASELINES)
    naive = next((r for r in at if r["naive"]), None)
    out = {"configs": table, "gpus": base_gpus,
           "best_trainplan": ours and ours["tag"], "best_baseline": theirs and theirs["tag"],
           "best_baseline_impl": theirs and theirs["impl"],
           "naive": naive and naive["tag"], "speedup_vs_best_baseline": None,
           "intervals_overlap": None, "speedup_vs_naive": None,
           "best_mfu": ours and ours["mfu"], "by_baseline": {}}
    if ours and theirs:
        out["speedup_vs_best_baseline"], out["intervals_overlap"] = _ratio(ours, theirs)
        for impl in BASELINES:
            if row := best(impl):
                speedup, overlaps = _ratio(ours, row)
                out["by_baseline"][impl] = {"best": row["tag"], "speedup": speedup,
                                            "intervals_overlap": overlaps}
    if ours and naive:
        out["speedup_vs_naive"] = ours["tokens_per_s_per_gpu"] / naive["tokens_per_s_per_gpu"]
    return out


def format_comparison(out: dict) -> str:
    """Two lines: the side-by-side ratios against their bars, or why one is missing."""
    if out["speedup_vs_best_baseline"] is None:
        return "side by side: no trainplan and baseline configs measured at the same GPU count"
    lines = [f"on {out['gpus']} GPUs: best trainplan {out['best_trainplan']} / best baseline "
             f"{out['best_baseline']} ({out['best_baseline_impl']}) = "
             f"{out['speedup_vs_best_baseline']:.3f}x (bar 1.05, goal 1.15; intervals "
             f"{'overlap' if out['intervals_overlap'] else 'apart'})"]
    if out["best_mfu"] is not None:
        lines[0] += f", MFU {out['best_mfu']:.1%} (bar 55%)"
    by = out.get("by_baseline") or {}
    if len(by) > 1:
        lines += [f"  against the best {IMPL_NAMES[impl]} {b['best']}: {b['speedup']:.3f}x "
                  f"(intervals {'overlap' if b['intervals_overlap'] else 'apart'})"
                  for impl, b in by.items()]
    if out["speedup_vs_naive"] is not None:
        lines.append(f"best trainplan / naive default {out['naive']} = "
                     f"{out['speedup_vs_naive']:.3f}x (bar 1.4)")
    return "\n".join(lines)
