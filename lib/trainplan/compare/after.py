"""What `trainplan compare` reports apart from its headline, because it is made after the
measurements: re-predictions of every compared config of the headline host with today's
planner (datasheet and calibrated constants), and one scale factor fitted to the end-to-end runs
of that host, judged by its leave-one-out error (docs/measurement.md, "Fits")."""

from __future__ import annotations

import statistics
from pathlib import Path

from trainplan.compare.matching import PLAN_KEYS, error_summary, extras, precision_of, rel
from trainplan.specs import DATA_DIR, SUITE_CLUSTER, load_cluster, load_model


def record_model(name: str):
    """The model a record names: a preset, or a YAML path as written by the run, which ran
    from the repository root (`data/models/x.yaml[:N-layers]`); read from the root when it
    is not there from the working directory (the runbook's notebooks run in notebooks/)."""
    base = name.split(":")[0]
    if base.endswith((".yaml", ".yml")) and not Path(base).is_absolute() \
            and not Path(base).is_file() and (DATA_DIR.parent / base).is_file():
        name = str(DATA_DIR.parent / name)
    return load_model(name)


def repredict(row: dict, pred: dict | None, calibrated: bool) -> dict:
    """Today's planner on the row's config: one fully pinned `plan` (the `trainplan plan` path),
    in the record's precision, fp8 recipe, loss (bf16 and standard where it names none) and
    caching allocator mode (`row["allocator"]`: the measurement's environment, `make_row`)."""
    from trainplan.calibrate.store import card_preset, load_gpu  # pandas: not loaded at import
    from trainplan.plan.planner import plan  # pandas: not loaded at import

    cfg = (pred or {}).get("config") or {}
    lay = dict(cfg.get("full_layout") or {}) or {k: row["layout"][k] for k in PLAN_KEYS
                                                   if k in row["layout"]}
    seq = cfg.get("seq_len") or extras({"kind": "measurement", **row}).get("seq_len") or 2048
    gpu = load_gpu(cfg.get("gpu_preset") or card_preset(row["card"]) or row["card"],
                   calibrated=calibrated)
    tokens = lay["dp"] * lay["micro_batch"] * lay["grad_accum"] * seq
    prec = precision_of(row)
    out = plan(record_model(row["model"]), gpu, load_cluster(SUITE_CLUSTER), gpus=row["gpus"],
               seq_len=seq, global_batch_tokens=tokens,
               pins={k: lay[k] for k in PLAN_KEYS if k in lay},
               compiled=bool(row["layout"].get("compile", True)), precision=prec["precision"],
               fp8_recipe=prec.get("fp8_recipe") or "tensorwise",
               loss=row["layout"].get("loss") or "standard",
               allocator=row["allocator"])
    p = out["plans"][0]
    return {"step_time_s": p["step_time_s"], "memory_gib": p["memory_gib"]["total"],
            "split_s": p["time_breakdown_s"], "calibration": out["calibration"]}


def leave_one_out_scale(rows: list[dict]) -> dict:
    """A single end-to-end factor k = median(measured / predicted) fitted on all rows but one,
    applied to the one left out; the held-out errors' median and max. Reported apart: it is a
    fit to end-to-end runs, which the planner itself never uses (docs/measurement.md, "Fits")."""
    pairs = [(r["predicted_step_time_s"], r["measured_step_time_s"]) for r in rows
             if r["predicted_step_time_s"] is not None]
    if len(pairs) < 3:
        return {"method": "one scale factor, leave-one-out", "median": None, "max": None}
    errs = []
    for i, (p, m) in enumerate(pairs):
        k = statistics.median(mm / pp for j, (pp, mm) in enumerate(pairs) if j != i)
        errs.append(k * p / m - 1.0)
    return {"method": "one scale factor k = median(measured / predicted), leave-one-out",
            "k_all": statistics.median(m / p for p, m in pairs), **error_summary(errs)}


def repredicted(rows: list[dict], predictions: list[dict]) -> dict:
    """Re-predictions made now (after the measurements), datasheet and calibrated; per row too."""
    by_where = {p["_where"]: p for p in predictions}
    res = {"datasheet": [], "calibrated": []}
    for row in rows:
        pred = by_where.get(row["prediction"])
        row["repredicted"] = {}
        for name in res:
            r = repredict(row, pred, calibrated=name == "calibrated")
            row["repredicted"][name] = r
            res[name].append((rel(r["step_time_s"], row["measured_step_time_s"]),
                              rel(r["memory_gib"], row["measured_memory_gib"])))
    calib = rows[0]["repredicted"]["calibrated"]["calibration"]
    return {
        "note": "made now, after the measurements, on the same configs: reported "
                "apart, not in the headline",
        "calibration": calib,
        **{name: {"step_time_error": error_summary(e for e, _ in v),
                  "memory_error": error_summary(m for _, m in v)} for name, v in res.items()},
    }
