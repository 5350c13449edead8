"""Records: what was predicted, measured and microbenchmarked, as JSON lines.

The rules they follow are in docs/measurement.md ("Records", "Predictions first").

One JSON object per line, appended (append mode, one line, flush, fsync),
never rewritten. Kinds: `prediction`, `measurement`, `microbenchmark`,
`checkpoint` (one `trainplan.bench.series.ckpt_bench` launch), `failed_launch` (a launch of a
suite's config that ended without a measurement, with the reason).
Every record carries `recorded_at` (UTC, ISO 8601) and `provenance` (git
commit, hashed hostname, GPU, driver, torch / CUDA / NCCL versions and the
environment knobs that were set: `provenance.env_knobs`). A prediction that a
measurement is compared with must carry the earlier `recorded_at`.

`append` validates before writing, so nothing half-valid lands in a file;
`load` and `to_frame` refuse a malformed file with one `RecordError` line
naming the file, the line number and the problem.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

from trainplan.errors import RecordError
from trainplan.loader import MAX_LOG_BYTES, parse_json, quote, read_text, shown
from trainplan.records.provenance import env_knobs, provenance, utc_now  # noqa: F401 (re-exported)
from trainplan.records.stats import median_ci, rate_ci

KINDS = ("prediction", "measurement", "microbenchmark", "checkpoint", "failed_launch")
IMPLS = ("trainplan", "hf-baseline", "hf-trainer")  # bench.flags.harness_entry runs each
RECOMPUTE = ("none", "selective", "full")
MICROBENCHES = ("matmul", "attention", "all_reduce", "reduce_scatter", "all_gather",
                "hbm", "head", "block", "optimizer", "overlap", "ring", "matmul-fp8",
                "fp8-linear", "block-fp8")

_NUM, _INT, _STR, _BOOL, _DICT, _LIST = "number", "int", "str", "bool", "dict", "list"
_COMMON = {"kind": _STR, "recorded_at": _STR, "provenance": _DICT}
SCHEMA: dict[str, dict[str, str | tuple[str, ...]]] = {
    "measurement": {
        **_COMMON, "model": _STR, "impl": _STR, "layout": _DICT, "gpus": _INT, "card": _STR,
        "run_id": _STR, "step_time_s": _NUM, "tokens_per_s_per_gpu": _NUM,
        "tokens_per_s_per_gpu_ci": _LIST, "mfu": _NUM,
        "peak_mem_reserved_gib": (_NUM, "null"), "peak_mem_allocated_gib": (_NUM, "null"),
        "step_times_s": _LIST, "warmup_steps_dropped": _INT, "tokens_per_step": _INT,
    },
    "prediction": {
        **_COMMON, "model": _STR, "layout": _DICT, "gpus": _INT, "card": _STR,
        "predicted": _DICT,
    },
    "microbenchmark": {
        **_COMMON, "bench": _STR, "config": _DICT, "results": _DICT, "gpus": _INT, "card": _STR,
    },
    "failed_launch": {  # a launch that ended without a measurement (`bench.suite`)
        **_COMMON, "model": _STR, "layout": _DICT, "gpus": _INT, "card": _STR, "run_id": _STR,
        "tag": _STR, "launch": _INT, "reason": _STR,
    },
    "checkpoint": {
        **_COMMON, "model": _STR, "layout": _DICT, "ranks": _INT, "card": _STR, "run_id": _STR,
        "raw_write": _DICT, "saves": _LIST, "restart": _DICT, "summary": _DICT,
    },
}
CKPT_SUMMARY = ("raw_write_gbps", "checkpoint_bytes", "sync_stall_s", "async_stall_s",
                "persist_gbps_sync", "persist_gbps_async", "persist_vs_raw_sync",
                "persist_vs_raw_async", "restart_to_first_step_s")
CKPT_SAVE = {"mode": _STR, "step": _INT, "stall_s": _NUM, "persist_s": (_NUM, "null"),
             "bytes": (_INT, "null")}
LAYOUT = {"dp": _INT, "tp": _INT, "pp": _INT, "cp": _INT, "ep": _INT, "zero": _INT,
          "micro_batch": _INT, "grad_accum": _INT, "recompute": _STR, "compile": _BOOL}
RESULTS = {"matmul": ("time_s", "tflops"), "attention": ("time_s", "tflops"),
           **{op: ("time_s", "algbw_gbps", "busbw_gbps") for op in MICROBENCHES[2:5]},
           "hbm": ("time_s", "tbps"), "head": ("time_s", "tokens_per_s"),
           "block": ("time_s", "tokens_per_s", "activation_bytes"),
           "optimizer": ("time_s", "params_per_s"), "overlap": ("exposed_fraction",),
           "ring": ("time_s", "plain_s", "ring_extra_s"), "matmul-fp8": ("time_s", "tflops"),
           "fp8-linear": ("time_s", "tflops"),
           "block-fp8": ("time_s", "tokens_per_s", "activation_bytes")}

# Physical ranges (low, high, unit) of the figures compare divides by or sets errors against:
# finite, above a floor where a zero would divide, below a generous ceiling.
SECONDS = (1e-9, 1e6, " s")  # a step, or a term of a predicted step
GIB = (1e-6, 1e6, " GiB")  # one GPU's peak memory, about 1 KiB to 1 PiB
RATE = (1e-6, 1e9, " tokens/s")  # per GPU
MAX_COUNT = 10**12  # GPUs, tokens a step, a layout's degrees
MEASURED = {"step_time_s": SECONDS, "tokens_per_s_per_gpu": RATE, "mfu": (0.0, 10.0, ""),
            "peak_mem_reserved_gib": GIB, "peak_mem_allocated_gib": GIB,
            "tokens_per_step": (1, MAX_COUNT, " tokens")}


# ---------------------------------------------------------------- validation


def _type_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT
    if isinstance(value, float):
        return _NUM
    return {str: _STR, dict: _DICT, list: _LIST}.get(type(value), type(value).__name__)


def _short(value, limit: int = 60) -> str:
    """repr of a value for a one-line message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_type(where: str, value, expected: str | tuple[str, ...]) -> None:
    allowed = expected if isinstance(expected, tuple) else (expected,)
    actual = _type_of(value)
    ok = actual in allowed or (actual == _INT and _NUM in allowed)
    if not ok:
        raise RecordError(
            f"field {quote(where)} = {_short(value)} is {actual}; expected {' or '.join(allowed)}"
        )
    if actual in (_NUM, _INT) and not math.isfinite(value):
        raise RecordError(f"field {quote(where)} = {quote(value)} is not a finite number")


def _check_numbers(where: str, values: list, length: int | None = None, bounds=None) -> None:
    if length is not None and len(values) != length:
        raise RecordError(f"field {quote(where)} has {len(values)} items; expected {length}")
    for i, v in enumerate(values):
        _check_type(f"{where}[{i}]", v, _NUM)
        if bounds:
            _check_in(f"{where}[{i}]", v, bounds)


def _check_in(where: str, value, bounds: tuple) -> None:
    """`value`, a finite number (or None: not given), within `bounds` = (low, high, unit)."""
    low, high, unit = bounds
    if value is not None and not low <= value <= high:
        raise RecordError(f"field {quote(where)} = {quote(value)} is out of range; valid: "
                          f"{low:g} to {high:g}{unit}")


def plain(value):
    """numpy scalars (np.float64, np.int64, ...) as Python numbers, inside dicts and lists too."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def validate(record) -> dict:
    """Return `record` if it follows the schema of its kind, else raise RecordError (one line)."""
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a JSON object, got {_type_of(record)}")
    kind = record.get("kind")
    if kind not in KINDS:
        raise RecordError(f"unknown kind {_short(kind)}; valid kinds: {list(KINDS)}")
    for name, expected in SCHEMA[kind].items():
        if name not in record:
            raise RecordError(f"{kind} record is missing field {quote(name)}")
        _check_type(name, record[name], expected)
    if "layout" in SCHEMA[kind]:
        for name, expected in LAYOUT.items():
            if name == "compile" and kind == "prediction" and name not in record["layout"]:
                continue  # the cost model has no compile knob; a prediction may leave it out
            if name not in record["layout"]:
                raise RecordError(f"field 'layout' is missing {quote(name)} (needs {list(LAYOUT)})")
            _check_type(f"layout.{name}", record["layout"][name], expected)
            if expected == _INT:
                _check_in(f"layout.{name}", record["layout"][name],
                          (0, 3, "") if name == "zero" else (1, MAX_COUNT, ""))
        recompute = record["layout"]["recompute"]
        if recompute not in RECOMPUTE:
            raise RecordError(f"field 'layout.recompute' = {_short(recompute)}; "
                              f"use one of {list(RECOMPUTE)}")
    if "gpus" in record:
        _check_in("gpus", record["gpus"], (1, MAX_COUNT, " GPUs"))
    if kind == "measurement":
        if record["impl"] not in IMPLS:
            raise RecordError(f"field 'impl' = {_short(record['impl'])}; use one of {list(IMPLS)}")
        for name, bounds in MEASURED.items():
            _check_in(name, record[name], bounds)
        _check_numbers("tokens_per_s_per_gpu_ci", record["tokens_per_s_per_gpu_ci"], 2, RATE)
        if not record["step_times_s"]:
            raise RecordError("field 'step_times_s' is empty; a measurement keeps at least one "
                              "step time")
        _check_numbers("step_times_s", record["step_times_s"], bounds=SECONDS)
        if "harness_revision" in record:  # absent in records before it: revision 1
            _check_type("harness_revision", record["harness_revision"], _INT)
            _check_in("harness_revision", record["harness_revision"], (1, MAX_COUNT, ""))
        low, high = record["tokens_per_s_per_gpu_ci"]
        if not low <= record["tokens_per_s_per_gpu"] <= high:
            raise RecordError(f"field 'tokens_per_s_per_gpu_ci' = {[low, high]} does not contain "
                              f"tokens_per_s_per_gpu = {record['tokens_per_s_per_gpu']}")
    if kind == "microbenchmark":
        if record["bench"] not in MICROBENCHES:
            raise RecordError(f"field 'bench' = {_short(record['bench'])}; use one of "
                              f"{list(MICROBENCHES)}")
        for name in RESULTS[record["bench"]]:
            if name not in record["results"]:
                raise RecordError(f"{record['bench']} results are missing {quote(name)}")
            _check_type(f"results.{name}", record["results"][name], _NUM)
    if kind == "prediction":
        _check_predicted(record["predicted"])
    if kind == "checkpoint":
        _check_checkpoint(record)
    return record


def _check_predicted(predicted: dict) -> None:
    """A prediction's step time (s), peak memory (GiB) and step-time terms (s), where given:
    the figures compare sets the measured ones against."""
    for name in ("memory_gib", "time_breakdown_s"):
        _check_type(f"predicted.{name}", predicted.get(name), (_DICT, "null"))
    fields = [("step_time_s", predicted.get("step_time_s"), (_NUM, "null"), SECONDS),
              ("memory_gib.total", (predicted.get("memory_gib") or {}).get("total"),
               (_NUM, "null"), GIB)]
    fields += [(f"time_breakdown_s.{k}", v, _NUM, (0.0, SECONDS[1], " s"))
               for k, v in (predicted.get("time_breakdown_s") or {}).items()]
    for name, value, expected, bounds in fields:
        _check_type(f"predicted.{name}", value, expected)
        _check_in(f"predicted.{name}", value, bounds)


def _check_checkpoint(record: dict) -> None:
    """The nested fields of a checkpoint record that figures read."""
    fields = [("summary", record["summary"], name, (_NUM, "null")) for name in CKPT_SUMMARY]
    fields += [(f"saves[{i}]", s if isinstance(s, dict) else {}, name, want)
               for i, s in enumerate(record["saves"]) for name, want in CKPT_SAVE.items()]
    for where, part, name, want in fields:
        if name not in part:
            raise RecordError(f"field {quote(where)} is missing {quote(name)}")
        _check_type(f"{where}.{name}", part[name], want)
        if name == "mode" and part[name] not in ("sync", "async"):
            raise RecordError(f"field '{where}.mode' = {_short(part[name])}; use sync or async")


# ---------------------------------------------------------------- builders


def measurement_record(*, model: str, impl: str, layout: dict, gpus: int, card: str,
                       run_id: str, step_times_s: list[float], tokens_per_step: int,
                       flops_per_token: float, peak_tflops: float, peak_mem_reserved_gib,
                       peak_mem_allocated_gib, warmup_steps_dropped: int,
                       extra: dict | None = None) -> dict:
    """One launch of one config, with its figures derived from the kept step times.

    `step_times_s`: whole synchronised optimizer steps after the warm-up,
    `tokens_per_step`: tokens of one step over all GPUs (global batch),
    `flops_per_token`: training FLOPs per token by the PaLM convention (6 N + 12 l h s;
    Chowdhery et al. 2022, app. B), `peak_tflops`: the dense bf16 peak MFU is quoted against.

    - step_time_s: median step time, with `step_time_s_ci` (rank interval);
    - tokens_per_s_per_gpu: tokens_per_step * steps / sum(step times) / gpus
      (total tokens over total time), with a bootstrap interval over steps;
    - mfu = tokens_per_s_per_gpu * flops_per_token / (peak_tflops * 1e12).
    """
    for name, value in (("gpus", gpus), ("tokens_per_step", tokens_per_step),
                        ("flops_per_token", flops_per_token), ("peak_tflops", peak_tflops)):
        if _type_of(plain(value)) not in (_INT, _NUM) or not value > 0:
            raise RecordError(f"{name} = {quote(value)} is not valid; use a number > 0")
    times = plain(list(step_times_s)) if isinstance(step_times_s, (list, tuple)) else None
    if not times or any(_type_of(t) not in (_INT, _NUM) or not t > 0 for t in times):
        raise RecordError(f"step_times_s = {_short(step_times_s)} must be a list of times > 0")
    times = [float(t) for t in times]
    step = median_ci(times)
    rate = rate_ci([tokens_per_step / gpus] * len(times), times)
    record = {
        "kind": "measurement", "recorded_at": utc_now(), "model": model, "impl": impl,
        "layout": dict(layout), "gpus": gpus, "card": card, "run_id": run_id,
        "step_time_s": step.estimate, "step_time_s_ci": step.as_list(),
        "tokens_per_s_per_gpu": rate.estimate, "tokens_per_s_per_gpu_ci": rate.as_list(),
        "ci_enough_samples": step.enough and rate.enough,
        "mfu": rate.estimate * flops_per_token / (peak_tflops * 1e12),
        "peak_mem_reserved_gib": peak_mem_reserved_gib,
        "peak_mem_allocated_gib": peak_mem_allocated_gib,
        "step_times_s": times, "warmup_steps_dropped": warmup_steps_dropped,
        "tokens_per_step": tokens_per_step, "flops_per_token": flops_per_token,
        "peak_tflops": peak_tflops, **(extra or {}), "provenance": provenance(),
    }
    return validate(plain(record))


def prediction_record(*, model: str, layout: dict, gpus: int, card: str, predicted: dict,
                      config: dict | None = None, run_id: str | None = None,
                      extra: dict | None = None) -> dict:
    """What the planner predicts for a config, stamped before the measurement runs."""
    record = {"kind": "prediction", "recorded_at": utc_now(), "model": model,
              "layout": dict(layout), "gpus": gpus, "card": card, "run_id": run_id,
              "predicted": dict(predicted), "config": dict(config or {}), **(extra or {}),
              "provenance": provenance()}
    return validate(plain(record))


def microbenchmark_record(*, bench: str, config: dict, results: dict, gpus: int, card: str,
                          run_id: str | None = None, extra: dict | None = None) -> dict:
    """One microbenchmark point (one GEMM shape, attention shape, or collective size)."""
    record = {"kind": "microbenchmark", "recorded_at": utc_now(), "bench": bench,
              "config": dict(config), "results": dict(results), "gpus": gpus, "card": card,
              "run_id": run_id, **(extra or {}), "provenance": provenance()}
    return validate(plain(record))


def combine_launches(records: list[dict]) -> dict:
    """Figures of one config over several launches (measurement records of it).

    Rates are total tokens over total time across all kept steps of all
    launches (docs/measurement.md, "Timing"), with a bootstrap interval over the pooled steps;
    `launch_range` gives the slowest and fastest launch, since steps of one
    launch share its placement and are not independent of each other. A refused launch is
    named by its `_where` (file:line, as `compare` keeps it), else by its place in `records`.
    """
    if not records:
        raise RecordError("combine_launches needs at least one measurement record")
    first = records[0]
    for i, r in enumerate(records):
        where = r.get("_where") or f"launch {i + 1} of {len(records)}"  # compare: file:line
        try:
            validate(r)
        except RecordError as err:
            raise RecordError(f"{where}: {err}") from None
        for key in ("kind", "model", "impl", "layout", "gpus", "card", "tokens_per_step"):
            if r[key] != first[key]:
                raise RecordError(f"{where}: launches of one config differ in {quote(key)}: "
                                  f"{quote(r[key])} here, {quote(first[key])} at "
                                  f"{first.get('_where') or 'launch 1'}")
    times = [t for r in records for t in r["step_times_s"]]
    per_gpu = first["tokens_per_step"] / first["gpus"]
    step, rate = median_ci(times), rate_ci([per_gpu] * len(times), times)
    launch_rates = [r["tokens_per_s_per_gpu"] for r in records]
    mfus = [r["mfu"] / r["tokens_per_s_per_gpu"] for r in records]  # flops_per_token / peak
    return {
        "launches": len(records), "steps": len(times),
        "step_time_s": step.estimate, "step_time_s_ci": step.as_list(),
        "tokens_per_s_per_gpu": rate.estimate, "tokens_per_s_per_gpu_ci": rate.as_list(),
        "mfu": rate.estimate * mfus[0], "launch_range": [min(launch_rates), max(launch_rates)],
        "ci_enough_samples": step.enough and rate.enough,
    }


# ---------------------------------------------------------------- files


def append(path: str | Path, record: dict) -> None:
    """Validate, then append one line (flush + fsync). A bad record writes nothing."""
    try:
        validate(record)
        line = json.dumps(record, allow_nan=False, sort_keys=False)
    except (RecordError, ValueError, TypeError) as err:
        raise RecordError(f"{path}: record not written: {err}") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def load(path: str | Path) -> list[dict]:
    """All records of one file, each validated; the first problem raises RecordError."""
    text = read_text(path, max_bytes=MAX_LOG_BYTES, error=RecordError, what="record file")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last record
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise RecordError(f"{path}:{number}: empty line (records are one JSON object a line)")
        record = parse_json(line, f"{shown(path)}:{number}", error=RecordError)
        try:
            records.append(validate(record))
        except RecordError as err:
            raise RecordError(f"{path}:{number}: {err}") from None
    return records


def to_frame(paths: str | Path | Iterable[str | Path]):
    """Records of one or more files as a pandas DataFrame, one row a record.

    Nested mappings are flattened one level (`layout.tp`, `provenance.git_commit`,
    `results.busbw_gbps`); `source` and `line` say where each row came from.
    """
    import pandas as pd

    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows = []
    for path in paths:
        for number, record in enumerate(load(path), start=1):
            rows.append({**record, "source": str(path), "line": number})
    return pd.json_normalize(rows, max_level=1) if rows else pd.DataFrame()
