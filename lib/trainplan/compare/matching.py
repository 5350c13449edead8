"""Which prediction a measurement is compared with, and one config's row of errors.

Reads the record files, groups a config's launches into series, picks the prediction
recorded before a series' first launch (the no-peeking rule; later ones are refused),
and makes the row: predicted and measured step time and memory, relative errors
(predicted / measured - 1), the dominant term and the terms least surely priced.
"""

from __future__ import annotations

import glob
import statistics
from collections import defaultdict
from datetime import datetime
from itertools import pairwise
from pathlib import Path

from trainplan.cost.memory_runtime import CACHING, allocator_of
from trainplan.errors import RecordError
from trainplan.loader import quote, shown
from trainplan.records import schema as records
from trainplan.specs import DATA_DIR, LAYOUT_FIELDS

DEFAULT_GLOB = str(DATA_DIR / "measurements" / "*.jsonl")
MIN_LAUNCHES = 3
TARGETS = {"median": 0.05, "max": 0.10}  # the planner's accuracy bar, on |relative error|
LAYOUT_KEYS = LAYOUT_FIELDS
EXTRA_KEYS = ("dp_shard", "pp_schedule", "pp_virtual")  # compared where both records hold them
PLAN_KEYS = LAYOUT_KEYS + EXTRA_KEYS
HEADLINE_RULE = ("The headline figures are those of the proxy on the largest host measured "
                 "(headline_host); every other host's are under hosts, and all hosts pooled "
                 "under all_hosts. Layer slices of a larger model (NAME:N-layers) are the "
                 "width check, under width_check, and in no other figure. Launches that "
                 "ended without a measurement are under failed, with their predictions; one "
                 "that ran out of memory on the headline host where its config was predicted "
                 "to fit means the targets are not met.")


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
    """Records of every file by kind; each keeps `_where` (file:line). A bad file raises
    RecordError, and so do files that are all empty (an empty one beside others is skipped:
    a run that failed before its first record leaves one)."""
    kinds, empty = defaultdict(list), []
    for path in paths:
        recs = records.load(path)
        if not recs:
            empty.append(path)
        for line, rec in enumerate(recs, start=1):
            kinds[rec["kind"]].append(plain_keys({**rec, "_where": f"{path}:{line}"}))
    if empty and not kinds:
        raise RecordError(f"{shown(empty[0])}: the file is empty, no record to compare; give "
                          "record files of one JSON record a line")
    return kinds


PLAIN = (str, int, float, bool, type(None))  # a JSON value that is neither a list nor a mapping


def plain_keys(rec: dict) -> dict:
    """`rec` if the fields that tell configs apart are plain: every layout field (and a
    prediction's `config.full_layout` field) a string, number, true/false or null, the suite
    tag, implementation and allocator mode strings or null, and the sequence length a whole
    number from 1 to 1e9; else RecordError naming the record (file:line) and the field."""
    pred, where = rec["kind"] == "prediction", rec["_where"]
    cfg, at = (rec.get("config"), "config.") if pred else (rec, "")
    full = (cfg or {}).get("full_layout") if isinstance(cfg, dict) else None
    for name, value in (("config", cfg), ("config.full_layout", full)):
        if not isinstance(value, (dict, type(None))):
            raise RecordError(f"{where}: field {quote(name)} = {quote(value)} is not a mapping")
    cfg = cfg or {}
    text = ((str, type(None)), "a string or null")
    fields = [(f"{at}{k}", cfg.get(k), text) for k in ("tag", "impl", "allocator")]
    fields += [(f"{part}.{k}", v, (PLAIN, "a string, number, true/false or null"))
               for part, lay in (("layout", rec.get("layout")), ("config.full_layout", full))
               for k, v in (lay or {}).items()]
    for name, value, (types, valid) in fields:
        if not isinstance(value, types):
            raise RecordError(f"{where}: field {quote(name)} = {quote(value)} is not valid; use "
                              f"{valid}")
    seq = cfg.get("seq_len")
    if seq is not None and not (type(seq) is int and 1 <= seq <= 10**9):
        raise RecordError(f"{where}: field '{at}seq_len' = {quote(seq)} is not valid; use a "
                          "whole number from 1 to 1e9 (tokens)")
    return rec


def stamp(rec: dict) -> datetime:
    """`recorded_at` as a time with its zone; a record without a readable one is refused
    (RecordError): records are stamped in UTC, and times with and without a zone do not
    compare."""
    try:
        when = datetime.fromisoformat(rec["recorded_at"])
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise RecordError(f"{rec['_where']}: recorded_at = {quote(rec['recorded_at'])} is not an "
                          "ISO 8601 time with its zone (e.g. 2026-11-26T01:00:00+00:00)")
    return when


# ---------------------------------------------------------------- matching


def extras(rec: dict) -> dict:
    """Layout fields beyond the schema's, and the sequence length, where the record has them;
    precision, loss and the allocator mode always (records from before them: bf16, standard,
    caching)."""
    if rec["kind"] == "prediction":
        cfg = rec.get("config") or {}
        src, seq = cfg.get("full_layout") or {}, cfg.get("seq_len")
    else:
        src, seq = rec["layout"], rec.get("seq_len")
    out = {k: src[k] for k in EXTRA_KEYS if k in src}
    out["allocator"] = allocator(rec)
    out.update(precision_of(rec))
    out["loss"] = rec["layout"].get("loss") or "standard"  # fused or not: never one series
    if seq is not None:
        out["seq_len"] = seq
    return out


def allocator(rec: dict) -> str:
    """The CUDA caching allocator's mode a record is for: a prediction's `config.allocator`
    (predictions before the planner priced the mode: caching, whatever their process ran), a
    measurement's from its process's environment (`provenance.env`,
    `memory_runtime.allocator_of`; none recorded: the caching default)."""
    if rec["kind"] == "prediction":
        return (rec.get("config") or {}).get("allocator") or CACHING
    return allocator_of((rec.get("provenance") or {}).get("env"))


def precision_of(rec: dict) -> dict:
    """{"precision": ...} of a record's layout, bf16 where it names none (records from before
    fp8), with its `fp8_recipe` for fp8: always compared, so bf16 and fp8 never match."""
    lay = rec["layout"]
    precision = lay.get("precision") or "bf16"
    return {"precision": precision,
            **({"fp8_recipe": lay.get("fp8_recipe")} if precision == "fp8" else {})}


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
    pe, me = extras(pred), extras(meas)
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
    fields = tuple(sorted(extras(m).items()))
    return (config_key(m), m["layout"]["compile"], m["impl"], fields, host(m))


def group_measurements(measurements: list[dict]) -> list[list[dict]]:
    """Launches of one config (and implementation) on one kind of host together, in order of
    first launch. A record that names its suite tag (`tag`; older harness records have none)
    is grouped by it too: configs of one layout can differ in loader or NCCL settings."""
    groups = defaultdict(list)
    for m in measurements:
        groups[(series_key(m), m.get("tag"))].append(m)
    out = [sorted(g, key=stamp) for g in groups.values()]
    return sorted(out, key=lambda g: stamp(g[0]))


def harness_revision(m: dict) -> int:
    """The harness revision a measurement was taken under (`bench.harness.step`; 1 where the
    record predates the field)."""
    return m.get("harness_revision", 1)


def split_at_fresh_predictions(launches: list[dict], predictions: list[dict]) -> list[list[dict]]:
    """One group's launches cut into series where a fresh prediction came between them.

    A launch starts a new series when a prediction of its config was recorded between the
    previous launch and this one, and it differs from the prediction the series so far is
    compared with (the planner changed and predicted again before measuring again), or when
    it ran under another harness revision (the harness changed what it measures).
    An unchanged prediction recorded again (a rerun) keeps the launches pooled."""
    out = [[launches[0]]]
    for prev, m in pairwise(launches):
        fresh = [p for p in predictions
                 if same_config(p, m) and stamp(prev) < stamp(p) < stamp(m)]
        current, _ = pick_prediction(out[-1], predictions)
        if harness_revision(m) != harness_revision(prev) or \
                (fresh and _differs(max(fresh, key=stamp), current)):
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


def successor_key(m: dict) -> tuple:
    """`series_key` less the allocator mode: what a later series must share with an earlier
    one to replace it. The harness runs every config under expandable segments since the
    planner priced the mode, so a caching-allocator series is never measured again; its
    config's later series, with today's prediction, is the one the headline judges."""
    key, compiled, impl, fields, where = series_key(m)
    return key, compiled, impl, tuple(f for f in fields if f[0] != "allocator"), where


def superseded_by(series: list[tuple[list[dict], dict]]) -> dict[int, int]:
    """{index of a series: index of the later series that replaces it in the headline}.

    A series of launches whose prediction was recorded after an earlier series of the same
    config on the same kind of host (untagged, or with the same tag; either allocator mode,
    `successor_key`) had ended, and before its own first launch, replaces that series: the
    headline judges today's planner by its latest predictions, and the earlier series stays
    listed with what replaced it. A later series compared with the same old prediction
    replaces nothing: both count."""
    out = {}
    by_key = defaultdict(list)  # series of one config and kind of host, in order
    for j, (b, _) in enumerate(series):
        by_key[successor_key(b[0])].append(j)
    for i, (a, _) in enumerate(series):
        later = [j for j in by_key[successor_key(a[0])] if j > i and series[j][1] is not None
                 and a[0].get("tag") in (None, series[j][0][0].get("tag"))
                 and stamp(series[j][1]) > stamp(a[-1])]
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
               for p in same if stamp(p) >= first and not precedes_own_run(p, launches)]
    return (max(before, key=stamp) if before else None), refused


def precedes_own_run(pred: dict, launches: list[dict]) -> bool:
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
    return "-".join(parts) + ("-c" if lay["compile"] else "") + (
        "-fp8" if lay.get("precision") == "fp8" else "")


def rel(pred: float | None, meas: float | None) -> float | None:
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
        "layout": first["layout"], "allocator": allocator(first),
        "launches": comb["launches"], "steps": comb["steps"],
        "launch_step_time_s": [m["step_time_s"] for m in launches],
        "flagged": comb["launches"] < MIN_LAUNCHES,
        "predicted_step_time_s": p_step, "measured_step_time_s": comb["step_time_s"],
        "measured_step_time_ci": comb["step_time_s_ci"],
        "step_time_error": rel(p_step, comb["step_time_s"]),
        "predicted_memory_gib": p_mem, "measured_memory_gib": meas_mem,
        "measured_allocated_gib": max(alloc) if alloc else None,
        "memory_error": rel(p_mem, meas_mem),
        "measured_tokens_per_s_per_gpu": comb["tokens_per_s_per_gpu"],
        "measured_tokens_per_s_per_gpu_ci": comb["tokens_per_s_per_gpu_ci"],
        "predicted_split_s": split,
        "dominant_term": max(split, key=split.get) if split else None,
        "unexplained_s": None if p_step is None else comb["step_time_s"] - p_step,
        "suspects": suspects(first["layout"], first["gpus"]),
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


def suspects(lay: dict, gpus: int) -> list[str]:
    """What the run does that the cost model prices least surely, from the layout alone.

    These are hypotheses to test with a profiler trace, not measured causes.
    """
    out = []
    if not lay.get("compile", True):
        out.append("eager mode: unfused element-wise kernels, priced by the card's measured "
                   "eager block scale (none without a block microbenchmark)")
    if lay["zero"] == 0 and lay["dp"] > 1:
        out.append("DDP: the block's slowdown is its microbenchmark's; the all-reduce beyond "
                   "it is assumed hidden under backward but for one layer's share")
    if lay["tp"] > 1:
        out.append("TP: at the proxy's width the block is host-bound, priced from a "
                   "microbenchmark whose host time varies from launch to launch")
    if lay["pp"] > 1:
        out.append("PP: the schedule's per-micro-batch work beyond the host floor")
    if lay["zero"] in (2, 3) and gpus > 1:
        out.append("FSDP: gathers and reduce-scatters assumed hidden under compute")
    if lay["micro_batch"] <= 4:
        out.append("small micro-batch: a step takes the larger of host and GPU time per "
                   "micro-batch, a lower bound where the two interleave")
    return out
