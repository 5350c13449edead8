"""Predicted against measured: the committed records, config by config (issue 4).

A measurement is compared only with a prediction of the same config (model,
layout with compile, GPUs, card, sequence length) recorded before the first
launch of that config: the no-peeking rule of DESIGN.md ("Honest
measurement"). A prediction of the config stamped at or after that launch is
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

import glob
import re
import statistics
from collections import defaultdict
from datetime import datetime
from itertools import pairwise
from pathlib import Path

from trainplan.errors import RecordError
from trainplan.records import schema as records
from trainplan.runbook import validation_text
from trainplan.specs import DATA_DIR

DEFAULT_GLOB = str(DATA_DIR / "measurements" / "*.jsonl")
MIN_LAUNCHES = 3
TARGETS = {"median": 0.05, "max": 0.10}  # issue 4's accuracy bar, on |relative error|
LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "recompute")
EXTRA_KEYS = ("dp_shard", "pp_schedule", "pp_virtual")  # compared where both records hold them
PLAN_KEYS = LAYOUT_KEYS + EXTRA_KEYS
CLUSTER = "dgx-h100"  # the suites' interconnect preset (data/suites/*.yaml)
HEADLINE_RULE = ("The headline figures are those of the proxy on the largest host measured "
                 "(headline_host); every other host's are under hosts, and all hosts pooled "
                 "under all_hosts. Layer slices of a larger model (NAME:N-layers) are the "
                 "width check, under width_check, and in no other figure. Launches that "
                 "ended without a measurement are under failed, with their predictions; one "
                 "that ran out of memory on the headline host where its config was predicted "
                 "to fit means the targets are not met.")
SLICE = re.compile(r".+:\d+-layers")  # a model cut to its first N blocks (specs.load_model)


# ---------------------------------------------------------------- reading


def record_paths(paths=None) -> list[Path]:
    """The record files: `paths` as given, or the committed ones (DEFAULT_GLOB)."""
    if paths:
        return [Path(p) for p in paths]
    found = sorted(glob.glob(DEFAULT_GLOB))
    if not found:
        raise RecordError(f"no record files match {DEFAULT_GLOB}; pass --records FILE")
    return [Path(p) for p in found]


def read(paths) -> dict[str, list[dict]]:
    """Records of every file by kind; each keeps `_where` (file:line). Bad files raise."""
    kinds = defaultdict(list)
    for path in paths:
        for line, rec in enumerate(records.load(path), start=1):
            kinds[rec["kind"]].append({**rec, "_where": f"{path}:{line}"})
    return kinds


def stamp(rec: dict) -> datetime:
    """`recorded_at` as a time; a record without a readable one is refused (RecordError)."""
    try:
        return datetime.fromisoformat(rec["recorded_at"])
    except ValueError:
        raise RecordError(f"{rec['_where']}: recorded_at = {rec['recorded_at']!r} is not an "
                          "ISO 8601 time") from None


# ---------------------------------------------------------------- matching


def _extras(rec: dict) -> dict:
    """Layout fields beyond the schema's, and the sequence length, where the record has them."""
    if rec["kind"] == "prediction":
        cfg = rec.get("config") or {}
        src, seq = cfg.get("full_layout") or {}, cfg.get("seq_len")
    else:
        src, seq = rec["layout"], rec.get("seq_len")
    out = {k: src[k] for k in EXTRA_KEYS if k in src}
    if seq is not None:
        out["seq_len"] = seq
    return out


def config_key(rec: dict) -> tuple:
    """What makes two records the same config, compile and extras aside."""
    return (rec["model"], rec["gpus"], rec["card"], tuple(rec["layout"][k] for k in LAYOUT_KEYS))


def same_config(pred: dict, meas: dict) -> bool:
    """Same model, GPUs, card, implementation and layout; compile equal (a prediction without
    it matches any); the extra layout fields, sequence length and suite tag equal where both
    records carry them. A prediction that names no implementation is for the harness
    (`trainplan`)."""
    if config_key(pred) != config_key(meas):
        return False
    if ((pred.get("config") or {}).get("impl") or "trainplan") != meas["impl"]:
        return False
    if "compile" in pred["layout"] and pred["layout"]["compile"] != meas["layout"]["compile"]:
        return False
    pe, me = _extras(pred), _extras(meas)
    tags = ((pred.get("config") or {}).get("tag"), meas.get("tag"))
    return all(pe[k] == me[k] for k in pe.keys() & me.keys()) and (None in tags
                                                                     or tags[0] == tags[1])


def host(rec: dict) -> str:
    """The kind of machine a measurement ran on: its GPU count and card ("4 x NVIDIA H200").
    A 2-GPU config run on a 4-GPU host is another machine than on a 2-GPU host; figures are
    compared within one."""
    n = (rec.get("provenance") or {}).get("gpu_count")
    return f"{n} x {rec['card']}" if n else rec["card"]


def series_key(m: dict) -> tuple:
    """What makes launches the same config on the same kind of host, the tag aside."""
    extras = tuple(sorted(_extras(m).items()))
    return (config_key(m), m["layout"]["compile"], m["impl"], extras, host(m))


def group_measurements(measurements: list[dict]) -> list[list[dict]]:
    """Launches of one config (and implementation) on one kind of host together, in order of
    first launch. A record that names its suite tag (harness records from session 4 on)
    is grouped by it too: configs of one layout can differ in loader or NCCL settings."""
    groups = defaultdict(list)
    for m in measurements:
        groups[(series_key(m), m.get("tag"))].append(m)
    out = [sorted(g, key=stamp) for g in groups.values()]
    return sorted(out, key=lambda g: stamp(g[0]))


def split_at_fresh_predictions(launches: list[dict], predictions: list[dict]) -> list[list[dict]]:
    """One group's launches cut into series where a fresh prediction came between them.

    A launch starts a new series when a prediction of its config was recorded between the
    previous launch and this one, and it differs from the prediction the series so far is
    compared with: the planner changed and predicted again before measuring again.
    An unchanged prediction recorded again (a rerun) keeps the launches pooled."""
    out = [[launches[0]]]
    for prev, m in pairwise(launches):
        fresh = [p for p in predictions
                 if same_config(p, m) and stamp(prev) < stamp(p) < stamp(m)]
        current, _ = pick_prediction(out[-1], predictions)
        if fresh and _differs(max(fresh, key=stamp), current):
            out.append([m])
        else:
            out[-1].append(m)
    return out


def _differs(pred: dict, other: dict | None) -> bool:
    """Whether two predictions give another step time or peak memory."""
    def figures(p):
        q = p.get("predicted") or {}
        return q.get("step_time_s"), (q.get("memory_gib") or {}).get("total")
    return other is None or figures(pred) != figures(other)


def superseded_by(series: list[tuple[list[dict], dict]]) -> dict[int, int]:
    """{index of a series: index of the later series that replaces it in the headline}.

    A series of launches whose prediction was recorded after an earlier series of the same
    config on the same kind of host (untagged, or with the same tag) had ended, and before
    its own first launch, replaces that series: the headline judges today's planner by its
    latest predictions, and the earlier series stays listed with what replaced it. A later
    series compared with the same old prediction replaces nothing: both count."""
    out = {}
    for i, (a, _) in enumerate(series):
        later = [j for j, (b, pred) in enumerate(series)
                 if j > i and pred is not None and series_key(b[0]) == series_key(a[0])
                 and a[0].get("tag") in (None, b[0].get("tag")) and stamp(pred) > stamp(a[-1])]
        if later:
            out[i] = later[-1]
    return out


def pick_prediction(launches: list[dict], predictions: list[dict]):
    """(the latest prediction recorded before the first launch or None, refused predictions).

    A later prediction is not refused when it precedes every launch of its own run: the
    config was measured again, the launches pooled, and the earlier prediction stands."""
    first = stamp(launches[0])
    same = [p for p in predictions if same_config(p, launches[0])]
    before = [p for p in same if stamp(p) < first]
    refused = [{"prediction": p["_where"], "predicted_at": p["recorded_at"],
                "first_measured_at": launches[0]["recorded_at"],
                "reason": "recorded at or after the first measurement of its config"}
               for p in same if stamp(p) >= first and not _precedes_own_run(p, launches)]
    return (max(before, key=stamp) if before else None), refused


def _precedes_own_run(pred: dict, launches: list[dict]) -> bool:
    """Whether the prediction was recorded before every launch of its own run."""
    own = [stamp(m) for m in launches if pred.get("run_id") and m.get("run_id") == pred["run_id"]]
    return bool(own) and stamp(pred) < min(own)


# ---------------------------------------------------------------- rows


def label(launches: list[dict], pred: dict | None) -> str:
    """The suite's tag where the prediction or the record names one, else a label built from
    the layout."""
    tag = ((pred or {}).get("config") or {}).get("tag") or launches[0].get("tag")
    if tag:
        return tag
    lay = launches[0]["layout"]
    parts = [f"{k}{lay[k]}" for k in ("dp", "tp", "pp") if lay[k] > 1] or ["1gpu"]
    parts += [f"z{lay['zero']}", f"mb{lay['micro_batch']}x{lay['grad_accum']}", lay["recompute"]]
    return "-".join(parts) + ("-c" if lay["compile"] else "")


def _rel(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else pred / meas - 1.0


def make_row(launches: list[dict], pred: dict | None) -> dict:
    """One config: predicted and measured step time and memory, errors, dominant term."""
    comb = records.combine_launches(launches)
    mems = [m["peak_mem_reserved_gib"] for m in launches if m["peak_mem_reserved_gib"] is not None]
    meas_mem = max(mems) if mems else None
    alloc = [m["peak_mem_allocated_gib"] for m in launches
             if m["peak_mem_allocated_gib"] is not None]
    first = launches[0]
    p = (pred or {}).get("predicted") or {}
    split = p.get("time_breakdown_s") or {}
    p_step = p.get("step_time_s")
    p_mem = (p.get("memory_gib") or {}).get("total")
    return {
        "config": label(launches, pred), "model": first["model"], "impl": first["impl"],
        "gpus": first["gpus"], "card": first["card"], "host": host(first),
        "layout": first["layout"],
        "launches": comb["launches"], "steps": comb["steps"],
        "flagged": comb["launches"] < MIN_LAUNCHES,
        "predicted_step_time_s": p_step, "measured_step_time_s": comb["step_time_s"],
        "measured_step_time_ci": comb["step_time_s_ci"],
        "step_time_error": _rel(p_step, comb["step_time_s"]),
        "predicted_memory_gib": p_mem, "measured_memory_gib": meas_mem,
        "measured_allocated_gib": max(alloc) if alloc else None,
        "memory_error": _rel(p_mem, meas_mem),
        "measured_tokens_per_s_per_gpu": comb["tokens_per_s_per_gpu"],
        "measured_tokens_per_s_per_gpu_ci": comb["tokens_per_s_per_gpu_ci"],
        "predicted_split_s": split,
        "dominant_term": max(split, key=split.get) if split else None,
        "unexplained_s": None if p_step is None else comb["step_time_s"] - p_step,
        "suspects": validation_text.suspects(first["layout"], first["gpus"]),
        "prediction": pred["_where"] if pred else None,
        "predicted_at": pred["recorded_at"] if pred else None,
        "first_measured_at": first["recorded_at"],
        "measurements": [m["_where"] for m in launches],
    }


def error_summary(errors) -> dict:
    """Median and maximum |relative error|, and how many values; None where there are none."""
    vals = [abs(e) for e in errors if e is not None]
    if not vals:
        return {"median": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "max": max(vals), "n": len(vals)}


# ---------------------------------------------------------------- the comparison


def compare(paths=None, repredictions: bool = True) -> dict:
    """The `trainplan compare` answer from the record files (default: the committed ones)."""
    files = record_paths(paths)
    kinds = read(files)
    rows, refused, used, chosen, eligible, series = [], [], set(), set(), set(), []
    groups = [part for g in group_measurements(kinds["measurement"])
              for part in split_at_fresh_predictions(g, kinds["prediction"])]
    for launches in groups:
        pred, ref = pick_prediction(launches, kinds["prediction"])
        chosen.add(pred["_where"] if pred else None)
        eligible.update(p["_where"] for p in kinds["prediction"]  # came before this series
                        if same_config(p, launches[0]) and stamp(p) < stamp(launches[0]))
        refused += [{"config": label(launches, pred), **r} for r in ref]
        row = make_row(launches, pred)
        if pred is None:
            row["note"] = "no prediction of this config recorded before it was measured"
        rows.append(row)
        series.append((launches, pred))
        used.update(p["_where"] for p in kinds["prediction"] if same_config(p, launches[0]))
    for i, j in superseded_by(series).items():
        rows[i]["superseded_by"] = {"config": rows[j]["config"],
                                    "first_measured_at": rows[j]["first_measured_at"]}
    compared = [r for r in rows
                if r["predicted_step_time_s"] is not None and "superseded_by" not in r]
    kept = chosen | eligible | {p["_where"] for p in kinds["prediction"] if p.get("run_id")
                                and not any(m.get("run_id") == p["run_id"] and same_config(p, m)
                                            for m in kinds["measurement"])}
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
        # series of its config, one whose own run never got to its config (budget)
        "rows": rows, "refused": [r for r in refused if r["prediction"] not in kept],
        "measured_configs": len(rows), "flagged_configs": sum(r["flagged"] for r in rows),
        "superseded": sum("superseded_by" in r for r in rows),
        "predicted_not_measured": not_measured(kinds, used),
        "targets": TARGETS, "files": [str(f) for f in files],
    }
    from trainplan.compare.failed import failed_rows
    out["failed"] = failed_rows(kinds["failed_launch"], kinds["prediction"])
    out["meets_targets"] = bool(head_rows) and not any(
        f["host"] == head and f["out_of_memory"] and f["predicted_fits"] for f in out["failed"]
    ) and all(
        out[k][q] <= TARGETS[q] for k in ("step_time_error", "memory_error") for q in TARGETS
        if out[k][q] is not None)
    from trainplan.compare.after import leave_one_out_scale, repredicted
    if repredictions and head_rows:
        out["repredicted"] = repredicted(head_rows, kinds["prediction"])
    if repredictions and slices:
        out["width_check"]["repredicted"] = repredicted(slices, kinds["prediction"])
    from trainplan.compare.views import per_layer
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
