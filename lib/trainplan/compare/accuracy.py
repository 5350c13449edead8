"""Predicted against measured: the committed records, config by config.

A measurement is compared only with a prediction of the same config (model,
layout with compile, GPUs, card, sequence length) recorded before the first
launch of that config: the no-peeking rule (docs/measurement.md, "Predictions
first"). A prediction of the config stamped at or after that launch is
refused, and each refusal is reported once. Where several came first, the latest counts.

Errors are relative, predicted / measured - 1 (negative = optimistic); the
headline is the median and the maximum of their absolute values on the
headline host: the proxy on the largest kind of host measured (most GPUs,
then most configs; `by_host`), over every compared config of that host, none
dropped. Figures are compared within one kind of host (`host`): each host's
are under `hosts`, and all hosts pooled under `all_hosts`, so nothing is
hidden. Where a config was measured again on the same kind of host with a
fresh prediction recorded first (one that differs from the earlier series'), the
later series stands in the headline and the earlier one is listed with what
superseded it (`split_at_fresh_predictions`, `superseded_by`). Step time is the median
over the pooled kept steps of all launches with its rank-based 95% interval
(`records.combine_launches`); memory is the peak reserved memory, the largest
over launches. Configs with fewer than `MIN_LAUNCHES` launches are shown and
counted, but flagged.

Two further comparisons are reported apart from the headline, because they
are made after the measurements, both on the headline host's configs:
re-predictions with today's planner (datasheet and calibrated), and a
one-factor fit to the end-to-end runs with its leave-one-out error.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from trainplan.compare.after import leave_one_out_scale, repredicted
from trainplan.compare.failed import failed_rows
from trainplan.compare.matching import (
    HEADLINE_RULE,
    TARGETS,
    config_key,
    error_summary,
    group_measurements,
    label,
    make_row,
    pick_prediction,
    precedes_own_run,
    read,
    record_paths,
    same_config,
    split_at_fresh_predictions,
    stamp,
    superseded_by,
)
from trainplan.compare.views import per_layer
from trainplan.specs import SLICE

# ---------------------------------------------------------------- the comparison


def compare(paths=None, repredictions: bool = True) -> dict:
    """The `trainplan compare` answer from the record files (default: the committed ones)."""
    files = record_paths(paths)
    kinds = read(files)
    rows, refused, used, chosen, eligible, series = [], [], set(), set(), set(), []
    own = defaultdict(list)  # predictions by config_key: only these can be the same config
    for p in kinds["prediction"]:
        own[config_key(p)].append(p)
    groups = [part for g in group_measurements(kinds["measurement"])  # one config_key a group
              for part in split_at_fresh_predictions(g, own[config_key(g[0])])]
    for launches in groups:
        preds = own[config_key(launches[0])]
        pred, ref = pick_prediction(launches, preds)
        chosen.add(pred["_where"] if pred else None)
        eligible.update(p["_where"] for p in preds  # came before this series
                        if same_config(p, launches[0]) and (stamp(p) < stamp(launches[0])
                                                            or precedes_own_run(p, launches)))
        refused += [{"config": label(launches, pred), **r} for r in ref]
        row = make_row(launches, pred)
        if pred is None:
            row["note"] = "no prediction of this config recorded before it was measured"
        rows.append(row)
        series.append((launches, pred))
        used.update(p["_where"] for p in preds if same_config(p, launches[0]))
    for i, j in superseded_by(series).items():
        rows[i]["superseded_by"] = {"config": rows[j]["config"],
                                    "first_measured_at": rows[j]["first_measured_at"]}
    compared = [r for r in rows
                if r["predicted_step_time_s"] is not None and "superseded_by" not in r]
    by_run = defaultdict(list)  # measurements by run id (a string: the schema's)
    for m in kinds["measurement"]:
        by_run[m.get("run_id")].append(m)
    kept = chosen | eligible | {p["_where"] for p in kinds["prediction"] if p.get("run_id")
                                and not any(same_config(p, m) for m in (
                                    by_run[p["run_id"]] if isinstance(p["run_id"], str) else ()))}
    slices = [r for r in compared if SLICE.fullmatch(r["model"])]
    compared = [r for r in compared if r not in slices]
    hosts = by_host(compared)
    head = next(iter(hosts), None)
    head_rows = [r for r in compared if r["host"] == head]
    out = {
        # the headline: the compared configs of the headline host, none dropped
        "headline_host": head, "headline_rule": HEADLINE_RULE,
        "configs": len(head_rows),
        "step_time_error": error_summary(r["step_time_error"] for r in head_rows),
        "memory_error": error_summary(r["memory_error"] for r in head_rows),
        "signed_step_time_error_median": statistics.median(
            [r["step_time_error"] for r in head_rows]) if head_rows else None,
        "hosts": hosts,
        "all_hosts": summary(compared), "width_check": summary(slices),
        # not refused: a prediction compared on another host, one recorded before a later
        # series of its config or before its own run's launches that pooled into one (an
        # unchanged prediction recorded again), one whose own run never got to its config
        "rows": rows, "refused": [r for r in refused if r["prediction"] not in kept],
        "measured_configs": len(rows), "flagged_configs": sum(r["flagged"] for r in rows),
        "superseded": sum("superseded_by" in r for r in rows),
        "predicted_not_measured": not_measured(kinds, used),
        "targets": TARGETS, "files": [str(f) for f in files],
    }
    out["failed"] = failed_rows(kinds["failed_launch"], kinds["prediction"])
    out["meets_targets"] = bool(head_rows) and not any(
        f["host"] == head and f["out_of_memory"] and f["predicted_fits"] for f in out["failed"]
    ) and all(
        out[k][q] <= TARGETS[q] for k in ("step_time_error", "memory_error") for q in TARGETS
        if out[k][q] is not None)
    if repredictions and head_rows:
        out["repredicted"] = repredicted(head_rows, kinds["prediction"])
    if repredictions and slices:
        out["width_check"]["repredicted"] = repredicted(slices, kinds["prediction"])
    out["width_check"]["per_layer"] = per_layer(slices)
    out["end_to_end_fit"] = leave_one_out_scale(head_rows)
    return out


def not_measured(kinds: dict, used: set) -> list[str]:
    """"TAG on CARD" of each prediction no measurement was compared with and no launch of its
    run failed on (those are under "failed"): its call's budget ran out first."""
    failed = {(f["tag"], f["card"], f["run_id"]) for f in kinds["failed_launch"]}
    return sorted({f"{(p.get('config') or {}).get('tag') or p['_where']} on {p['card']}"
                   for p in kinds["prediction"] if p["_where"] not in used
                   and ((p.get("config") or {}).get("tag"), p["card"], p.get("run_id"))
                   not in failed})


def summary(rows: list[dict]) -> dict:
    """{"configs", "step_time_error", "memory_error"} of compared rows."""
    return {"configs": len(rows),
            "step_time_error": error_summary(r["step_time_error"] for r in rows),
            "memory_error": error_summary(r["memory_error"] for r in rows)}


def by_host(rows: list[dict]) -> dict:
    """{host: {"configs", "step_time_error", "memory_error"}}, the host with the most GPUs
    first (the runbook's headline: the proxy on the largest machine measured), then by
    configs."""
    groups = defaultdict(list)
    for r in rows:
        groups[r["host"]].append(r)

    def size(h):
        n = h.split(" x ", 1)[0]
        return (int(n) if n.isdigit() else 0, len(groups[h]))
    return {h: summary(groups[h]) for h in sorted(groups, key=size, reverse=True)}
