"""A profiled step set beside the planner's predicted split of the same config.

The profile is the JSON that `python -m trainplan.bench.observe.profile` writes on rank 0
(`bench/profile.py`: `main` and `summarise`): GPU kernel seconds per step in
buckets, `busy_s` (their sum), the top kernels, and `step_time_s`, the mean wall
time of the profiled steps (each the slowest rank's, `bench/train.py`). Kernel
times are rank 0's only.

The buckets map onto the planner's terms (`plan`'s `time_breakdown_s`):

    compute        = matmul + attention + elementwise_fused + copies + other
    optimizer      = optimizer
    collectives  K = collectives, split into exposed + overlapped
    idle           = step - compute - optimizer - exposed   (host, launch gaps, bubble)

Collectives overlap compute, so the trace's sum of kernel times is not the GPU's busy
time. Where the profile records `busy_union_s` (the time any kernel ran, from the
trace's intervals) the exposed part is union - compute - optimizer ("union"). The
profile.py of today records only the sum; then the exposed part is bounded by what
the wall leaves, exposed <= min(K, step - compute - optimizer), and reported as an
upper bound ("upper"); the overlapped part and the idle time are then lower bounds.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from trainplan.compare.matching import EXTRA_KEYS, LAYOUT_KEYS
from trainplan.errors import RecordError
from trainplan.loader import MAX_LOG_BYTES, load_json, quote
from trainplan.specs import DATA_DIR

# profiler labels that key_averages() lists beside the kernels (`is_annotation`'s fallback):
# the step (ProfilerStep#3, or ProfilerStep* averaged), the c10d ranges (nccl:all_reduce), FSDP's
# ranges (FSDP::all_gather) and the optimizer hooks' Class.method labels (Optimizer.step#AdamW.step)
ANNOTATION = re.compile(r"^(ProfilerStep[#*]|nccl:|FSDP::|[\w.]+#[\w.]+$)")


def is_annotation(event) -> bool:
    """True where a `key_averages()` entry is a user annotation, not a kernel or an operator.

    On GPU, torch (2.11-2.13, kineto) lists each `record_function` range that encloses kernels
    as a device event of its own (a "gpu_user_annotation": the whole step, `nccl:all_reduce`
    around its ncclDevKernel, `Optimizer.step#AdamW.step` around the fused AdamW kernels), so
    counting it counts its kernels twice. `event` is a FunctionEvent / FunctionEventAvg or a
    name: its `is_user_annotation` where torch sets it, else (older torch, a name from a
    written JSON) the names in ANNOTATION. Kernel names (ncclDevKernel_*, multi_tensor_apply
    ..., cutlass::...) never match."""
    if not isinstance(event, str):
        if getattr(event, "is_user_annotation", None):
            return True
        event = event.key
    return bool(ANNOTATION.match(event))


PROFILE_DIR = DATA_DIR / "measurements" / "profiles"
BUCKETS = ("attention", "collectives", "optimizer", "matmul", "elementwise_fused", "copies",
           "other")  # bench/profile.py's BUCKETS names, and its fallback "other"
COMPUTE_BUCKETS = ("matmul", "attention", "elementwise_fused", "copies", "other")
MATCH_KEYS = LAYOUT_KEYS + ("compile",)  # what a profile must share with a compare row
TERMS = ("compute", "exposed_comm", "idle", "optimizer")  # the wall, in the figure's order
REQUIRED = ("impl", "sdpa", "layout", "card", "active_steps", "step_time_s",
            "step_time_s_unprofiled_median", "buckets_s_per_step", "busy_s", "top_kernels")


@dataclass(frozen=True)
class TracedStep:
    """One profiled step in the planner's terms; `total_s` is the visible sum of the four."""

    compute_s: float  # non-collective, non-optimizer kernels (COMPUTE_BUCKETS)
    exposed_comm_s: float  # collective time no other kernel hides (bound: `exposed_bound`)
    idle_s: float  # GPU idle: host overhead, launch gaps, pipeline bubble, profiler
    optimizer_s: float  # the optimizer bucket (fused AdamW, foreach kernels)
    overlapped_comm_s: float  # collective time under other kernels: not on the wall
    step_s: float  # the profiled steps' mean wall time (`step_time_s`)
    exposed_bound: str  # "union" (from busy_union_s) or "upper" (from the wall)

    @property
    def total_s(self) -> float:
        """compute + exposed communication + idle + optimizer (= step_s unless the
        non-collective kernels alone overrun the wall, i.e. ran on several streams)."""
        return self.compute_s + self.exposed_comm_s + self.idle_s + self.optimizer_s


# ---------------------------------------------------------------- reading


def _bad(path, field: str, value, want: str) -> RecordError:
    return RecordError(f"{path}: {field} = {quote(value)} {want}; re-record it with "
                       "`python -m trainplan.bench.observe.profile` "
                       "(data/measurements/README-profiles.md)")


def _seconds(path, field: str, value, positive: bool = False) -> float:
    """A finite number of seconds, >= 0 (> 0 where `positive`), or RecordError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(path, field, value, "is not a number of seconds")
    if value < 0 or (positive and value == 0):
        raise _bad(path, field, value, "must be > 0" if positive else "must be >= 0")
    return float(value)


def _check_layout(path, layout) -> None:
    """The layout dict of bench/train.py's summary, with the keys pairing needs."""
    if not isinstance(layout, dict):
        raise _bad(path, "layout", layout, "is not a layout object")
    missing = [k for k in MATCH_KEYS if k not in layout]
    if missing:
        raise _bad(path, f"layout.{missing[0]}", None, "is missing")


def _check_buckets(path, buckets: dict, busy) -> None:
    """Known bucket names, seconds each, and busy_s equal to their sum (profile.summarise)."""
    if not isinstance(buckets, dict):
        raise _bad(path, "buckets_s_per_step", buckets, "is not an object of seconds by bucket")
    for name, s in buckets.items():
        if name not in BUCKETS:
            raise _bad(path, f"buckets_s_per_step.{name}", s, f"is not a bucket of {BUCKETS}")
        _seconds(path, f"buckets_s_per_step.{name}", s)
    if not math.isclose(_seconds(path, "busy_s", busy), sum(buckets.values()),
                        rel_tol=1e-6, abs_tol=1e-9):
        raise _bad(path, "busy_s", busy, f"is not the buckets' sum {sum(buckets.values())!r}")


def _check_kernels(path, kernels) -> None:
    """`top_kernels`: a list of {kernel, bucket, s_per_step, calls_per_step}."""
    if not isinstance(kernels, list):
        raise _bad(path, "top_kernels", kernels, "is not a list")
    for i, k in enumerate(kernels):
        if not isinstance(k, dict) or not isinstance(k.get("kernel"), str):
            raise _bad(path, f"top_kernels[{i}].kernel", k, "is not a kernel name")
        _seconds(path, f"top_kernels[{i}].s_per_step", k.get("s_per_step"))


def drop_annotations(prof: dict) -> dict:
    """The profile without the user annotations that profile.py before `is_annotation`
    counted as kernels (`ProfilerStep*`, `nccl:...`, `Optimizer.step#AdamW.step`: ranges whose
    kernels are counted already): each such `top_kernels` entry leaves `top_kernels`, and
    its seconds leave its bucket and `busy_s`. Marked `"annotations_removed": true`, with the
    removed entries in `annotations_removed_s_per_step`; a marked profile is returned as is.

    Only the 15 listed kernels can be corrected: an annotation below the 15th stays in its
    bucket (each at most the 15th entry's seconds)."""
    if prof.get("annotations_removed"):
        return dict(prof)
    out = {**prof, "buckets_s_per_step": dict(prof["buckets_s_per_step"])}
    buckets, removed, kept = out["buckets_s_per_step"], {}, []
    for k in prof["top_kernels"]:
        if not is_annotation(k["kernel"]):
            kept.append(k)
            continue
        removed[k["kernel"]] = k["s_per_step"]
        if k.get("bucket") in buckets:
            buckets[k["bucket"]] = max(0.0, buckets[k["bucket"]] - k["s_per_step"])
    out.update(top_kernels=kept, busy_s=sum(buckets.values()), annotations_removed=True,
               annotations_removed_s_per_step=removed)
    return out


def load(path) -> dict:
    """One profile JSON (bench/profile.py's `main`), checked, with `drop_annotations` applied;
    `_where` names its file.

    Anything malformed raises one RecordError naming the file and the field."""
    prof = load_json(path, error=RecordError, max_bytes=MAX_LOG_BYTES, what="profile (JSON)")
    if not isinstance(prof, dict):
        raise _bad(path, "(top level)", type(prof).__name__, "is not a JSON object")
    missing = [k for k in REQUIRED if k not in prof]
    if missing:
        raise _bad(path, missing[0], None, "is missing")
    for key in ("impl", "sdpa", "card"):
        if not isinstance(prof[key], str):
            raise _bad(path, key, prof[key], "is not a string")
    steps = prof["active_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise _bad(path, "active_steps", steps, "is not a step count >= 1")
    _check_layout(path, prof["layout"])
    _seconds(path, "step_time_s", prof["step_time_s"], positive=True)
    if prof["step_time_s_unprofiled_median"] is not None:
        _seconds(path, "step_time_s_unprofiled_median", prof["step_time_s_unprofiled_median"])
    _check_buckets(path, prof["buckets_s_per_step"], prof["busy_s"])
    _check_kernels(path, prof["top_kernels"])
    if prof.get("busy_union_s") is not None:
        _seconds(path, "busy_union_s", prof["busy_union_s"])
    profiled = prof.get("step_times_s_profiled")
    if profiled is not None:
        if not isinstance(profiled, list) or not profiled:
            raise _bad(path, "step_times_s_profiled", profiled, "is not a non-empty list")
        for t in profiled:
            _seconds(path, "step_times_s_profiled", t, positive=True)
        # the wall is their median: the last profiled step also runs the profiler's stop and
        # trace collection (profiles written before bench/profile.py said so took the mean)
        prof = {**prof, "step_time_s": statistics.median(profiled)}
    return {**drop_annotations(prof), "_where": str(path)}


def committed() -> list[Path]:
    """The committed profiles, data/measurements/profiles/*.json, sorted; [] when none."""
    return sorted(PROFILE_DIR.glob("*.json"))


# ---------------------------------------------------------------- the split


def measured_split(profile: dict) -> TracedStep:
    """The profile's step in the planner's terms (module docstring: the mapping and bounds).

    Buckets are `buckets_s_per_step` (bench/profile.py's `summarise`: self device time over
    the active steps); the wall is `step_time_s`."""
    b = profile["buckets_s_per_step"]
    compute = sum(b.get(k, 0.0) for k in COMPUTE_BUCKETS)
    optimizer, comm = b.get("optimizer", 0.0), b.get("collectives", 0.0)
    step = profile["step_time_s"]
    others = compute + optimizer
    union = profile.get("busy_union_s")
    room = (union if union is not None else step) - others  # what collectives alone can fill
    exposed = min(comm, max(0.0, room))
    return TracedStep(compute_s=compute, exposed_comm_s=exposed, optimizer_s=optimizer,
                      idle_s=max(0.0, step - others - exposed), overlapped_comm_s=comm - exposed,
                      step_s=step, exposed_bound="upper" if union is None else "union")


# ---------------------------------------------------------------- pairing


def _same_layout(profile: dict, row: dict) -> bool:
    """MATCH_KEYS equal, and compare's EXTRA_KEYS equal where both carry them."""
    a, b = profile["layout"], row["layout"]
    return all(a[k] == b.get(k) for k in MATCH_KEYS) and all(
        a[k] == b[k] for k in EXTRA_KEYS if k in a and k in b)


def _optional_match(profile: dict, row: dict) -> bool:
    """Fields profile.py writes (older profiles may lack them), equal where the profile has
    them: the suite tag (the row's `config`), model, GPUs, and the host's GPU count
    (`host_gpus`)."""
    fields = {"tag": "config", "model": "model", "gpus": "gpus"}
    same = all(profile[k] == row.get(v) for k, v in fields.items() if profile.get(k) is not None)
    n = profile.get("host_gpus")
    return same and (n is None or row["host"] == f"{n} x {row['card']}")


def pair(profile: dict, rows: list[dict], host: str | None = None) -> dict:
    """The compare row (`trainplan.compare.accuracy.compare()["rows"]`, with a prediction) of the
    profile's config, and both splits: see `paired`.

    Matched on implementation, card and layout with compile (what profile.py records), and on
    tag, model, gpus and host where the profile carries them; `host` ("4 x NVIDIA H200")
    picks among hosts that ran the same layout. None found, a card that differs, or more
    than one row left: RecordError."""
    where = profile.get("_where", "profile")
    rows = [r for r in rows if r.get("predicted_split_s")]
    same = [r for r in rows if r["impl"] == profile["impl"] and _same_layout(profile, r)
            and _optional_match(profile, r) and (host is None or r["host"] == host)]
    if not same:
        raise RecordError(f"{where}: layout = {profile['layout']} ({profile['impl']}) matches no "
                          "compared config; profile a layout that `trainplan compare` lists")
    found = [r for r in same if r["card"] == profile["card"]]
    if not found:
        raise RecordError(f"{where}: card = {quote(profile['card'])}, but its layout was "
                          f"measured only on {sorted({r['card'] for r in same})}; profile it on "
                          "that card")
    if len(found) > 1:  # the same layout measured again: the series that stands
        found = [r for r in found if "superseded_by" not in r] or found
    if len(found) > 1:
        raise RecordError(f"{where}: layout matches {len(found)} compare rows "
                          f"({[(r['config'], r['host']) for r in found]}); pass host=")
    return paired(profile, found[0])


def pair_committed(rows: list[dict], host: str | None = None) -> list[dict]:
    """`pair` of each committed profile that has a compare row of its own card and layout;
    profiles of a card or layout no compare row has (e.g. profiles taken on one card of
    layouts compared only on another) are left out instead of refused."""
    out = []
    for path in committed():
        prof = load(path)
        if any(r.get("predicted_split_s") and r["impl"] == prof["impl"]
               and r["card"] == prof["card"] and _same_layout(prof, r)
               and _optional_match(prof, r) for r in rows):
            out.append(pair(prof, rows, host))
    return out


def paired(profile: dict | None, row: dict) -> dict:
    """Predicted (the row's `predicted_split_s`, the prediction recorded before the runs) and
    traced (`measured_split`) seconds per term; `traced` is None where no profile is given.

    The planner's only idle-GPU term, the bubble, stands beside the traced idle time."""
    t = measured_split(profile) if profile is not None else None
    p = row["predicted_split_s"]
    predicted = {"compute": p["compute"], "exposed_comm": p["exposed_comm"],
                 "idle": p["bubble"], "optimizer": p["optimizer"]}
    return {"config": row["config"], "host": row["host"], "card": row["card"],
            "profile": (profile or {}).get("_where"), "predicted": predicted, "traced": t,
            "predicted_step_s": row["predicted_step_time_s"],
            "measured_step_s": row["measured_step_time_s"],
            "measured_step_ci": row["measured_step_time_ci"],
            "unprofiled_step_s": (profile or {}).get("step_time_s_unprofiled_median")}


def untraced(rows: list[dict], config: str, host: str | None = None) -> dict:
    """`paired(None, row)` for the compared row named `config` (on `host`, default the first):
    the page's figure before a profile of that config is committed."""
    found = [r for r in rows if r["config"] == config and r.get("predicted_split_s")
             and (host is None or r["host"] == host)]
    if not found:
        raise RecordError(f"config = {quote(config)} is not a compared config; "
                          f"pick one of {sorted({r['config'] for r in rows})}")
    return paired(None, found[0])


def values(pp: dict) -> dict:
    """Glue values of a pairing (`paired`): seconds per term predicted and traced, and the
    steps; the traced ones are absent when nothing is traced."""
    out = {f"trace_pred_{k}_s": v for k, v in pp["predicted"].items()}
    out.update(trace_config=pp["config"], trace_host=pp["host"],
               trace_measured_step_s=pp["measured_step_s"])
    t = pp["traced"]
    if t is not None:
        out.update({f"trace_{k}_s": getattr(t, f"{k}_s") for k in TERMS})
        out.update(trace_overlapped_comm_s=t.overlapped_comm_s, trace_step_s=t.step_s,
                   trace_exposed_bound=t.exposed_bound)
    return out


def describe(pp: dict) -> str:
    """One markdown sentence for page 4: what the trace shows, or that none is committed."""
    t = pp["traced"]
    if t is None:
        return (f"No profiler trace of {pp['config']} is committed yet "
                "(`data/measurements/README-profiles.md` says how to record one), so only the "
                "predicted split is drawn.")
    bound = "at most" if t.exposed_bound == "upper" else "from the kernel union,"
    pred = pp["predicted"]
    src = f" (`{Path(pp['profile']).name}`)" if pp["profile"] else ""
    return (f"The trace of {pp['config']} on {pp['host']}{src} spends "
            f"{t.compute_s:.3f} s per step in compute kernels against {pred['compute']:.3f}"
            f" s predicted; exposed communication is {bound} {t.exposed_comm_s:.3f} s against "
            f"{pred['exposed_comm']:.3f} s, with {t.overlapped_comm_s:.3f} s of "
            f"collectives hidden under other kernels, and the GPU is idle for "
            f"{t.idle_s:.3f} s of the {t.step_s:.3f} s profiled step.")
