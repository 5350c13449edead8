"""Views of a comparison (`compare.compare`) that the runbook's pages draw: pairs of configs
that differ in one setting (which term misses), the band of measured over predicted
throughput that page 3 carries over to the target's plan, how far peak memory ran over its
prediction at the target's width (pages 1 and 2), the cost of one of the target's layers
from slices of two depths, and the rows page 4 and its appendix draw (`split_rows`)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from trainplan.compare.matching import LAYOUT_KEYS
from trainplan.specs import SLICE


def one_knob_pairs(rows: list[dict]) -> list[dict]:
    """Pairs of compared configs whose layouts (with compile) differ in one field only.

    For each, the measured and the predicted change in step time from the first
    to the second: where the planner predicts no change and the run shows one,
    that field is a term the cost model misses.
    """
    keys = LAYOUT_KEYS + ("compile",)
    rows = [r for r in rows if r["predicted_step_time_s"] is not None]
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if (a["model"], a["gpus"], a["card"]) != (b["model"], b["gpus"], b["card"]):
                continue
            diff = [k for k in keys if a["layout"][k] != b["layout"][k]]
            if len(diff) != 1:
                continue
            out.append({"field": diff[0], "from": a["config"], "to": b["config"],
                        "values": [a["layout"][diff[0]], b["layout"][diff[0]]],
                        "measured_change_s": b["measured_step_time_s"] - a["measured_step_time_s"],
                        "predicted_change_s": b["predicted_step_time_s"]
                        - a["predicted_step_time_s"]})
    return out


def throughput_band(out: dict) -> dict:
    """Measured / predicted tokens per second over the configs of every host, pooled (not the
    headline host alone; a series superseded by a later one of its config left out, as in
    the headline): low, median, high.

    Tokens per step are fixed, so measured / predicted throughput = predicted / measured
    step time = 1 + step-time error. A predicted rate times these factors is the range
    the measured errors imply, carried over, not measured at the target.
    """
    rows = [r for r in out["rows"]
            if r["step_time_error"] is not None and "superseded_by" not in r]
    f = sorted(1.0 + r["step_time_error"] for r in rows)
    if not f:
        return {"low": None, "median": None, "high": None, "n": 0}
    cards, models = sorted({r["card"] for r in rows}), sorted({r["model"] for r in rows})
    return {"low": f[0], "median": statistics.median(f), "high": f[-1], "n": len(f),
            "basis": f"{len(f)} configs of {' and '.join(models)} on up to "
                     f"{max(r['gpus'] for r in rows)} GPUs of {' and '.join(cards)}, "
                     "predictions recorded before the measurements"}


def memory_band(out: dict) -> dict:
    """How far peak memory ran above its prediction on the width check (the target model's
    layers at their real width, `compare.SLICE`): {"factor": the largest measured over
    predicted, never below 1; "config": whose; "n": configs}, factor None where none is
    compared.

    memory_error = predicted / measured - 1, so measured / predicted = 1 / (1 + error). A
    predicted peak times the factor is what a run of the target may hold, carried over from
    one machine's layer slices, not measured on the target's cluster.
    """
    rows = [r for r in out["rows"] if "superseded_by" not in r
            and r["memory_error"] is not None and SLICE.fullmatch(r["model"])]
    if not rows:
        return {"factor": None, "config": None, "n": 0}
    worst = min(rows, key=lambda r: r["memory_error"])
    return {"factor": max(1.0, 1.0 / (1.0 + worst["memory_error"])), "config": worst["config"],
            "n": len(rows)}


def split_rows(out: dict) -> dict:
    """The rows of a comparison the validation pages draw, each config's latest series only:
    {"current": the proxy's, "rows": those of them with a prediction, "sliced": the width
    check's (the target's layer slices, `SLICE`, drawn in no proxy figure), "head": the
    headline host, "head_rows": its rows with a prediction}."""
    latest = [r for r in out["rows"] if "superseded_by" not in r]
    current = [r for r in latest if not SLICE.fullmatch(r["model"])]
    rows = [r for r in current if r["predicted_step_time_s"] is not None]
    head = out["headline_host"]
    return {"current": current, "rows": rows, "head": head,
            "sliced": [r for r in latest if SLICE.fullmatch(r["model"])
                       and r["predicted_step_time_s"] is not None],
            "head_rows": [r for r in rows if r["host"] == head]}


def per_layer(rows: list[dict]) -> list[dict]:
    """Per-layer time and memory of the target's layers at their real width (the width check):
    for each pair of width-check configs alike in all but depth (same base model, host, GPUs
    and layout, compile and sequence parallelism included), the difference of the deeper
    and the shallower divided by the layers between them, measured and predicted.

    A whole-slice step also holds the embeddings, the output layer and the loss, the
    optimizer's constant part and the host's once-a-step work; the difference cancels what
    does not grow with depth, so what is left is the layers' own cost, the part the 13B
    plan multiplies by forty. The measured difference's interval is the widest the two
    medians' 95% intervals allow (deeper high less shallower low, and the reverse), an
    honest bound rather than a fitted one. Errors are predicted / measured - 1 per layer;
    `measured_reserve_gib` is the peak reserved less the peak allocated, per layer;
    `repredicted_step_error` where both rows were re-predicted with today's planner.
    """
    alike = defaultdict(list)
    for r in rows:
        m = SLICE.fullmatch(r["model"])
        if m is None or "superseded_by" in r or r["predicted_step_time_s"] is None:
            continue
        key = (m["base"], r["host"], r["gpus"], tuple(sorted(r["layout"].items())))
        alike[key].append((int(m["layers"]), r))
    out = []
    for group in alike.values():
        group.sort(key=lambda lr: lr[0], reverse=True)
        for (deep_n, deep), (flat_n, flat) in zip(group, group[1:], strict=False):
            if deep_n == flat_n:
                continue
            out.append(_layer_difference(deep, flat, deep_n - flat_n))
    return out


def _layer_difference(deep: dict, flat: dict, n: int) -> dict:
    """One `per_layer` row: deeper minus shallower over `n` layers."""
    def per(key):
        a, b = deep[key], flat[key]
        return None if a is None or b is None else (a - b) / n

    def err(pred, meas):
        return None if pred is None or not meas else pred / meas - 1.0

    step, mem = per("measured_step_time_s"), per("measured_memory_gib")
    alloc = per("measured_allocated_gib")
    pred_step, pred_mem = per("predicted_step_time_s"), per("predicted_memory_gib")
    (dlo, dhi), (flo, fhi) = deep["measured_step_time_ci"], flat["measured_step_time_ci"]
    row = {"from": flat["config"], "to": deep["config"], "host": deep["host"], "layers": n,
           "measured_step_s": step, "measured_step_ci": [(dlo - fhi) / n, (dhi - flo) / n],
           "predicted_step_s": pred_step, "step_time_error": err(pred_step, step),
           "measured_memory_gib": mem, "predicted_memory_gib": pred_mem,
           "memory_error": err(pred_mem, mem),
           # what the allocator keeps reserved beyond its peak allocation, per layer
           "measured_reserve_gib": None if alloc is None or mem is None else mem - alloc}
    now = [r.get("repredicted", {}).get("calibrated", {}).get("step_time_s") for r in (deep, flat)]
    if None not in now:
        row["repredicted_step_error"] = err((now[0] - now[1]) / n, step)
    return row
