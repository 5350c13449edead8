"""Trust per layout family: how far each family's runs landed from their predictions, by
card class, and the band a plan of that family carries (`validation` in `plan --json`).

A family is a layout without its degrees (`specs.layouts.strategy_family`: "FSDP",
"TP + FSDP", "PP + ZeRO-2", ...). Its band is measured over predicted tokens per second,
1 + step-time error (tokens a step are fixed), over every compared config of the family:
the proxy's and the layer slices', on every host of the card class, each series superseded
by a later one of its config left out (`compare.accuracy`). A card class pools cards the
planner prices alike and calibrates per card (Hopper: H100 and H200); the band names the
cards it came from.

The bands a plan carries come from the generalisation suite's runs (`SUITE_RECORDS`,
data/measurements/general/, one file per run and host: every family, on shapes the planner
was not tuned on, predicted by the planner of the day before the launches); the latest
series of each config counts. The project's older proxy runs, predicted by planners that
were refitted since, stay in `trainplan compare` and on page 4, in no band. A family is
validated on a class when at least `MIN_CONFIGS` of its configs were compared there; a
plan of another family says `validated: false`: the planner prices it from the same
terms, but nothing has checked how they combine. A config's span also carries how far its
launches on one host spread (`launch_medians`, `factor_span`): a host-bound config's launches
differ by up to tens of percent (the host's issue rate varies from machine to machine and
launch to launch), a GPU-bound one's by a few. The same runs give each family's memory
band: the largest measured peak (reserved) over its prediction (`memory_band`), which
decides whether a plan fits with margin (`memory_margin`).
"""

from __future__ import annotations

import copy
import functools
import glob
import os
import statistics
from collections import defaultdict

from trainplan.compare.accuracy import compare
from trainplan.compare.matching import TARGETS, error_summary
from trainplan.cost.compute import matmul_ceiling_tokens_per_s
from trainplan.cost.memory import NON_ALLOCATOR_GIB
from trainplan.specs import DATA_DIR
from trainplan.specs.layouts import strategy_family

SUITE_RECORDS = str(DATA_DIR / "measurements" / "general" / "*.jsonl")

MIN_CONFIGS = 2  # one config is an anecdote: its error may be its shape's, not its family's
CARD_CLASSES = {"h100": "Hopper", "h200": "Hopper", "a100": "Ampere"}  # in a card or preset name


def card_class(card: str) -> str:
    """The class of a card name (nvidia-smi's "NVIDIA H200") or GPU preset ("h100-sxm");
    the name itself where no class is known."""
    return next((c for key, c in CARD_CLASSES.items() if key in card.lower()), card)


def family_of(layout: dict) -> str:
    """The strategy family of a record's or a plan's layout (degrees and ZeRO stage); an fp8
    layout (`precision: fp8`) is a family of its own per recipe, "FSDP fp8" (tensorwise) or
    "FSDP fp8 rowwise", as the planner names it (`cost.step_time.evaluate`)."""
    family = strategy_family(layout["tp"], layout["pp"], layout["cp"], layout["ep"],
                             layout["zero"], layout["dp"],
                             layout.get("dp_shard") or (layout["dp"] if layout["zero"] else 1))
    if layout.get("precision") != "fp8":
        return family
    return family + (" fp8 rowwise" if layout.get("fp8_recipe") == "rowwise" else " fp8")


def family_bands(out: dict) -> list[dict]:
    """One band per (card class, family) compared in `out` (`compare.accuracy.compare`),
    the best-measured first: factors low / median / high of measured over predicted
    throughput (low and high over every config's measurement interval and launches,
    `factor_span`; `launch_spread`: the largest max / min - 1 of one config's launch
    medians on one host, and whose, None where no config ran twice),
    the |error| summaries of step time and memory, the largest measured over predicted peak
    memory (`memory_high` over `memory_configs`; None where none), what it pools, and whether it
    is validated (`MIN_CONFIGS`) and within the planner's targets (`TARGETS` max)."""
    groups = defaultdict(list)
    for r in out["rows"]:
        if r["step_time_error"] is None or "superseded_by" in r:
            continue
        groups[(card_class(r["card"]), family_of(r["layout"]))].append(r)
    medians = launch_medians(out["rows"])
    bands = []
    for (cls, family), rows in groups.items():
        f = sorted(1.0 + r["step_time_error"] for r in rows)
        own = [medians.get((r["config"], r["host"]), ()) for r in rows]
        spans = [factor_span(r, m) for r, m in zip(rows, own, strict=True)]
        spread = max(((max(m) / min(m) - 1.0, r["config"]) for r, m in zip(rows, own, strict=True)
                      if len(m) > 1), default=(None, None))
        step = error_summary(r["step_time_error"] for r in rows)
        mem = error_summary(r["memory_error"] for r in rows if r["memory_error"] is not None)
        peaks = [1.0 / (1.0 + r["memory_error"]) for r in rows if r["memory_error"] is not None]
        bands.append({
            "family": family, "card_class": cls, "configs": len(rows),
            "low": min(lo for lo, _ in spans), "median": statistics.median(f),
            "high": max(hi for _, hi in spans),
            "step_time_error": step, "memory_error": mem,
            "validated": len(rows) >= MIN_CONFIGS,
            "within_targets": step["max"] <= TARGETS["max"]
            and (mem["max"] is None or mem["max"] <= TARGETS["max"]),
            "cards": sorted({r["card"] for r in rows}),
            "hosts": sorted({r["host"] for r in rows}),
            "models": sorted({r["model"] for r in rows}),
            "configs_compared": sorted(r["config"] for r in rows),
            "launch_spread": spread[0], "launch_spread_config": spread[1],
            "memory_high": max(peaks, default=None), "memory_configs": len(peaks)})
    return sorted(bands, key=lambda b: (b["card_class"], -b["configs"], b["family"]))


def factor_span(row: dict, launches=()) -> tuple[float, float]:
    """Measured over predicted throughput of one compared config, as the interval its
    measurement allows: predicted step time over the 95% interval's ends of the measured
    median step time (`compare.accuracy` rows), or the point ratio where there is none;
    widened to `launches` (seconds, the config's launch medians on its host,
    `launch_medians`): the point ratio times the row's measured median over each."""
    point = 1.0 + row["step_time_error"]
    ci, pred = row.get("measured_step_time_ci"), row.get("predicted_step_time_s")
    lo, hi = point, point
    if ci and pred and None not in ci and min(ci) > 0:
        lo, hi = min(point, pred / max(ci)), max(point, pred / min(ci))
    measured = row.get("measured_step_time_s")
    ratios = [point * measured / t for t in launches if t and t > 0] if measured else []
    return min([lo, *ratios]), max([hi, *ratios])


def launch_medians(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """{(config, host): the median step time (s) of each of its launches} over every row of
    `compare.accuracy` (`launch_step_time_s`), superseded series too: how far one config's
    launches spread on one kind of host is the hardware's, whatever predicted them, so a
    later series' band carries the earlier launches' spread (measured times only, never
    an earlier prediction)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        out[(r["config"], r["host"])] += list(r.get("launch_step_time_s") or ())
    return dict(out)


def band_for(bands: list[dict], family: str, gpu: str) -> dict:
    """What a plan of `family` on card or preset `gpu` carries: its family's band on the
    card class with `validated`, or `validated: false` with why (never measured there, or
    fewer than `MIN_CONFIGS` configs)."""
    cls = card_class(gpu)
    band = next((b for b in bands if b["family"] == family and b["card_class"] == cls), None)
    if band is None:
        return {"family": family, "card_class": cls, "validated": False, "configs": 0,
                "why": f"no {family} layout has been measured on {cls} GPUs"}
    out = {k: band[k] for k in ("family", "card_class", "validated", "configs", "low",
                                "median", "high", "step_time_error", "memory_error",
                                "within_targets", "cards", "launch_spread")}
    if not band["validated"]:
        out["why"] = (f"{band['configs']} {family} config measured on {cls} GPUs; "
                      f"a band needs {MIN_CONFIGS}")
    return out


def capped(tokens_per_s: float, factor: float, ceiling: float) -> float:
    """`tokens_per_s` times a band's factor, never above the physical `ceiling` (tokens/s
    at the card's measured dense-matmul rate, `cost.compute.matmul_ceiling_tokens_per_s`)."""
    return min(tokens_per_s * factor, ceiling)


def suite_bands(paths=None) -> list[dict]:
    """`family_bands` of the generalisation suite's committed runs (or of `paths`); [] where
    there are none. Worked out once per set of files as they are on disk (`_stat`): a plan,
    its launch and its pages ask for the same bands."""
    files = list(paths) if paths else sorted(glob.glob(SUITE_RECORDS))
    if not files:
        return []
    return copy.deepcopy(_bands_of(tuple((str(f), os.path.abspath(f), *_stat(f))
                                         for f in files)))


def _stat(path) -> tuple:
    """(inode, size, modification and change times in ns) of `path`, or Nones where it cannot
    be read (`compare` then names it): any write changes the change time, even one that
    keeps the size and sets the modification time back. With the name as given and made
    absolute, the key of `_bands_of`."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None, None, None, None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@functools.lru_cache(maxsize=8)
def _bands_of(files: tuple) -> list[dict]:
    return family_bands(compare([f[0] for f in files], repredictions=False))


def memory_band(bands: list[dict], family: str, gpu: str) -> dict:
    """The upper end of measured over predicted peak memory that a plan of `family` on card or
    preset `gpu` carries: its family's on the card class where `MIN_CONFIGS` of its configs
    compared memory, else the largest of every family measured on that class (`source: "pooled"`, as
    `plan_band` pools throughput); never below 1 (a plan must fit as predicted in any case).
    {"factor", "source": "family" | "pooled" | "none", "configs", "card_class"}; factor None
    where no memory was compared on the class."""
    cls = card_class(gpu)
    own = next((b for b in bands if b["family"] == family and b["card_class"] == cls), None)
    if own and own["memory_configs"] >= MIN_CONFIGS:
        return {"factor": max(1.0, own["memory_high"]), "source": "family",
                "configs": own["memory_configs"], "card_class": cls}
    same = [b for b in bands if b["card_class"] == cls and b["memory_configs"]]
    if not same:
        return {"factor": None, "source": "none", "configs": 0, "card_class": cls}
    return {"factor": max(1.0, max(b["memory_high"] for b in same)), "source": "pooled",
            "configs": sum(b["memory_configs"] for b in same), "card_class": cls}


def memory_margin(band: dict, total_gib: float, card_gib: float) -> dict:
    """Whether a plan of predicted peak `total_gib` fits with its `memory_band`: the band's
    upper end (`upper_gib` = total x factor) against what the allocator can use of a
    `card_gib` card (less `NON_ALLOCATOR_GIB`). `fits` None where there is no band."""
    usable = card_gib - NON_ALLOCATOR_GIB
    upper = None if band["factor"] is None else total_gib * band["factor"]
    return {**band, "upper_gib": upper, "usable_gib": usable,
            "fits": None if upper is None else upper <= usable}


def validation(out: dict, m, gpu, paths=None) -> dict:
    """`out` (`plan.planner.plan`'s answer for model `m` on GPUSpec `gpu`) with each plan's
    `validation`: its family's band from the suite's records (`suite_bands`, `band_for`),
    where validated the throughput range it implies, capped at the physical ceiling, and
    its memory margin (`memory_margin`, also as the plan's `memory_fits_band`)."""
    bands = suite_bands(paths)
    ceiling = matmul_ceiling_tokens_per_s(m, gpu, out["seq_len"])
    for p in out["plans"]:
        family = family_of({**p["parallel"], "precision": out.get("precision", "bf16"),
                            "fp8_recipe": out.get("fp8", {}).get("recipe")})
        v = band_for(bands, family, gpu.name)
        if v["validated"]:
            v["tokens_per_s_per_gpu"] = {
                "low": capped(p["tokens_per_s_per_gpu"], v["low"], ceiling),
                "high": capped(p["tokens_per_s_per_gpu"], v["high"], ceiling),
                "ceiling": ceiling}
        v["memory"] = memory_margin(memory_band(bands, family, gpu.name),
                                    p["memory_gib"]["total"], gpu.memory_gib)
        p["validation"] = v
        p["memory_fits_band"] = v["memory"]["fits"]
    return out


def plan_band(bands: list[dict], family: str, gpu, tokens_per_s_per_gpu: float,
              ceiling: float) -> dict:
    """The band a page carries over to one plan: its family's where validated on the card
    class of `gpu` (a GPUSpec or preset name), else every family measured on that class
    pooled (marked `validated: False`, `source: "pooled"`); and the plan's tokens/s/GPU
    times its low and high factors, capped at `ceiling` (`capped`). Factors None and no
    rates where nothing at all was measured on the class."""
    name = getattr(gpu, "name", gpu)
    own = band_for(bands, family, name)
    out = {**own, "source": "family", "ceiling": ceiling}
    if not own["validated"]:
        same = [b for b in bands if b["card_class"] == own["card_class"]]
        out.update(source="pooled", configs_pooled=sum(b["configs"] for b in same),
                   families_pooled=len(same),
                   low=min((b["low"] for b in same), default=None),
                   high=max((b["high"] for b in same), default=None),
                   median=statistics.median([b["median"] for b in same]) if same else None)
    if out.get("low") is None:
        return {**out, "rate_low": None, "rate_high": None, "capped": False}
    high = tokens_per_s_per_gpu * out["high"]
    return {**out, "rate_low": capped(tokens_per_s_per_gpu, out["low"], ceiling),
            "rate_high": capped(tokens_per_s_per_gpu, out["high"], ceiling),
            "capped": high > ceiling}
