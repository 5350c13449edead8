"""The knob study's second stage: each knob varied one at a time around a base config, every
variant run paired with a base run back to back, until each effect is known to +-3%.

    trainplan tune --suite S --storage P --gpu-hours H --effects-share 0.5 [--base best|plan|N]
        [--effects-halfwidth 3] [--effects-knobs a,b] [--effects-max-pairs 20]
        [--effects-pairing sweep|sweep-nccl|launches]

Why: the search (TPE) concentrates its trials on good configs and varies many knobs at once,
so a joint fit over them leaves rarely varied knobs with intervals of +-40%. A pair's two
runs share the GPUs and a seeded, recorded order, so slow drifts cancel in their ratio. An
effect is the mean paired log-ratio of tokens/s/GPU (variant over base) with its Student-t
95% interval (`records.stats.paired_log_ratio`), in percent: 100 (exp(x) - 1).

Design (`design`): for each knob of `EFFECT_KNOBS` that can act on the run (`knobs.active`),
each other value of a categorical knob, the neighbours of an integer knob's base value on
`LADDER` (about a halving and a doubling), and no loader workers: at most 15 variants, less
those the skip rules refuse (with the reason). The base: the search's best, a given trial, or
the planner's fastest config of the space (`plan_base`).

Round-robin: the next pair goes to the open variant with the fewest pairs; a variant closes
at >= `MIN_PAIRS` pairs with a half-width <= the bound, at `max_pairs`, or after
`MAX_FAILURES` failed runs. How pairs run (`trainplan.tune.pairs`): "sweep" (the default)
puts one pair of every open non-NCCL variant (at most `ROUND_PAIRS`) in one launch and an
NCCL pair in two; "sweep-nccl" NCCL's too, each run making its process groups under its own
NCCL_* (where `bench.micro.nccl_env` shows NCCL honours it; tensor parallel too, as
`bench.series.sweep.settle` empties DTensor's caches); "launches" two launches a pair.
Budget: the study's GPU-hours, search and effects together; nothing starts that the medians
of this study's launches and runs say would overrun it (`_prices`). Records:
`STEM-effects.jsonl` beside the storage, a `design` record then the pairs'; the same --base
resumes, after `recover` has counted what a killed call spent.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from trainplan.specs.layouts import strategy_family
from trainplan.tune import knobs
from trainplan.tune import study as tn
from trainplan.tune import trial as tl
from trainplan.tune.effect_stats import paths, read_records, tally, variant_rows
from trainplan.tune.knobs import EFFECT_KNOBS, NCCL_KNOBS
from trainplan.tune.pairs import append, recover, run_pair, run_round

LADDER = {"num_workers": (0, 1, 2, 4, 8), "prefetch_factor": (1, 2, 4, 8),
          "grad_accum": (1, 2, 4, 8), "micro_batch": (1, 2, 4, 8, 16)}
MIN_PAIRS = 3  # with 2 pairs t(0.975; 1) = 12.7: a narrow interval there is luck, not evidence
MAX_FAILURES = 2  # failed launches of one variant (or of the base) before it is given up
HALFWIDTH_PCT = 3.0
MAX_PAIRS = 20
ROUND_PAIRS = 8  # pairs in one sweep launch at most: what a crash in it can cost
PAIRINGS = ("sweep", "sweep-nccl", "launches")


# ---------------------------------------------------------------- the design


def family(suite: dict, cfg: dict) -> str:
    """The planner's layout family of the suite's layout with the config's ZeRO stage."""
    lay = suite["layout"]
    dp = lay.get("dp", 1)
    zero = cfg["zero"] if dp > 1 else 0
    return strategy_family(lay.get("tp", 1), lay.get("pp", 1), 1, 1, zero, dp,
                           dp if zero else 1)


def alternatives(name: str, value, knob: knobs.Knob) -> list:
    """The values a knob is varied to from the base's `value` (see the module docstring)."""
    if knob.choices:
        return [v for v in knob.choices if v != value]
    inside = [v for v in LADDER[name] if knob.low <= v <= knob.high]
    lower, higher = [v for v in inside if v < value], [v for v in inside if v > value]
    out = lower[-1:] + higher[:1]
    if name == "num_workers" and value and 0 in inside and 0 not in out:
        out.insert(0, 0)
    return out


def _world(suite: dict) -> dict:
    return {"world": suite["gpus"], "dp": suite["layout"].get("dp", 1),
            "data": knobs.data_source(suite)}


def design(base: dict, suite: dict, sp: dict, gpu, names=EFFECT_KNOBS) -> tuple[list, list]:
    """(variants [{id, knob, value, config}], left out [{knob, value?, why}]) around `base`."""
    candidates, left_out = [], []
    for name in names:
        if not knobs.active(name, **_world(suite)):
            left_out.append({"knob": name, "why": knobs.inactive_why(name)})
            continue
        if name == "prefetch_factor" and not base["num_workers"]:
            left_out.append({"knob": name, "why": "the base has no loader workers"})
            continue
        for value in alternatives(name, base[name], sp[name]):
            cfg = {**base, name: value}
            if name == "num_workers":
                cfg["prefetch_factor"] = None if value == 0 else (
                    base["prefetch_factor"] or sp["prefetch_factor"].default)
            candidates.append({"id": f"{name}={value}", "knob": name, "value": value,
                               "config": cfg})
    verdicts = knobs.verdicts([c["config"] for c in candidates], suite, gpu) if candidates else []
    variants = []
    for c, (_, reason) in zip(candidates, verdicts, strict=True):
        if reason:
            left_out.append({"knob": c["knob"], "value": c["value"], "why": reason})
        else:
            variants.append(c)
    return variants, left_out


def plan_base(suite: dict, sp: dict, gpu) -> dict:
    """The planner's fastest runnable config in the suite's space: ZeRO stage, recompute and
    micro-batch by its step-time model (tokens per step over step time), the rest at defaults."""
    base = knobs.defaults(sp, **_world(suite))
    zeros = sp["zero"].values if suite["layout"].get("dp", 1) > 1 else (0,)
    grid = [{**base, "zero": z, "recompute": r, "micro_batch": mb} for z in zeros
            for r in sp["recompute"].values for mb in sp["micro_batch"].values]
    runnable = [(c["micro_batch"] * c["grad_accum"] / p["step_time_s"], -i)  # ties: first
                for i, (c, (p, why)) in enumerate(zip(grid, knobs.verdicts(grid, suite, gpu),
                                                      strict=True)) if why is None]
    if not runnable:
        raise tn.StudyError("--base plan: the skip rules refuse every config of the suite's "
                            "space at default knobs; widen the space or pass --base N")
    return grid[-max(runnable)[1]]


def choose_base(spec: str, study, suite: dict, sp: dict, gpu) -> tuple[str, dict, str]:
    """(design name, base config, where it comes from) of --base best | plan | N."""
    if spec == "plan":
        return "plan", plan_base(suite, sp, gpu), "the planner's fastest config of the space"
    done = tn.measured(study) if study is not None else []  # None: no study stored yet
    if spec == "best":
        if not done:
            raise tn.StudyError("--base best: the search has measured no configuration yet; "
                                "run it first (--effects-share below 1) or pass --base plan")
        t = max(done, key=lambda t: t.value)
        return "best", _settled(t.user_attrs["config"], suite, sp), \
            f"the search's best, trial {t.number}"
    t = next((t for t in done if t.number == int(spec)), None)
    if t is None:
        raise tn.StudyError(f"--base {spec}: trial {spec} has no measurement; measured trials: "
                            f"{sorted(t.number for t in done)[:20]}")
    return f"trial-{t.number}", _settled(t.user_attrs["config"], suite, sp), \
        f"trial {t.number} of the search"


def _settled(cfg: dict, suite: dict, sp: dict) -> dict:
    return knobs.settled(cfg, sp, **_world(suite))


# ---------------------------------------------------------------- the stage


def run_effects(suite: dict, *, storage: str, name: str, gpu_hours: float, base: str = "best",
                halfwidth: float = HALFWIDTH_PCT, knob_names=EFFECT_KNOBS,
                max_pairs: int = MAX_PAIRS, cpu: bool = False, records_path: str | None = None,
                stop_after_s: float | None = None, progress: bool = True,
                pairing: str = "sweep") -> dict:
    """Run (or resume) the effects stage of study `name` under the study's `gpu_hours`;
    `pairing` as in the module docstring."""
    from tqdm import tqdm

    card = tl.card_name(cpu)
    gpu = tl.gpu_for(card, suite)
    devices = tl.device_groups(1, suite["gpus"], cpu)[0]
    _check_base(storage, name, base, suite, gpu)  # before the storage is made or written
    store, path = tn.open_storage(storage, must_exist=False)
    rec, live = paths(path)
    with tn.exclusive(path):
        study = tn.load_study(store, name, suite, create=True)
        if study.user_attrs.get("card") is None:
            study.set_user_attr("card", card)
        recovered = recover(rec, live)
        records = read_records(rec)
        head = _design_head(records, rec, name, base, study, suite, gpu, knob_names, halfwidth,
                            card)
        run = {"suite": suite, "cpu": cpu, "devices": devices, "rec": rec, "live": live,
               "name": name, "head": head, "start": time.monotonic(), "stop_after_s":
               stop_after_s, "budget_s": gpu_hours * 3600.0, "search_s": tn.gpu_seconds(study),
               "search_costs": [c for t in study.get_trials(deepcopy=False)
                                for c in t.user_attrs.get("launch_gpu_seconds", [])],
               "rec_path": Path(records_path) if records_path else path.with_name(
                   path.stem + "-measurements.jsonl"), "pairing": pairing, "card": card}
        first = tally(records, name, head["design"])["pairs"]
        bar = tqdm(desc=f"effects {name}/{head['design']}", unit="pair", initial=first,
                   file=sys.stderr, disable=not progress)
        while True:
            records = read_records(rec)
            state = tally(records, name, head["design"])
            stopped, how, batch = _next(run, records, state, set(knob_names), halfwidth,
                                        max_pairs)
            if stopped:
                break
            outcomes = [run_pair(run, batch[0], state["attempts"], records)] if how == "pair" \
                else run_round(run, batch, state["attempts"], records)
            bar.update(outcomes.count("ok"))
            stopped = next((o for o in outcomes if o in ("budget", "time")), None)
            if stopped:
                break
        bar.close()
        records = read_records(rec)
    state = tally(records, name, head["design"])
    spent = sum(float(r.get("gpu_seconds", 0.0)) for r in records if r.get("study") == name)
    return {"design": head["design"], "base": head["base"], "base_from": head["base_from"],
            "family": head["family"], "stopped": stopped, "message": _message(
                stopped, state["pairs"], halfwidth, run, spent, stop_after_s),
            "pairs": state["pairs"], "new_pairs": state["pairs"] - first,
            "recovered": recovered, "gpu_hours": spent / 3600.0,
            "budget_gpu_hours": gpu_hours, "halfwidth_pct": halfwidth,
            "variants": variant_rows(records, head), "left_out": head["left_out"],
            "pairing": pairing}


def _check_base(storage: str, name: str, spec: str, suite: dict, gpu) -> None:
    """Refuse (one StudyError line) a --base that cannot be had, reading only: a stored design
    of it resumes; else `choose_base` on the study as stored (none: no measured trial)."""
    path = tn.storage_path(storage)[1]
    wanted = {"best": "best", "plan": "plan"}.get(spec, f"trial-{spec}")
    if any(r["record"] == "design" and r["study"] == name and r["design"] == wanted
           for r in read_records(paths(path)[0])):
        return
    study = None
    if spec != "plan" and path.is_file():
        store, _ = tn.open_storage(storage, must_exist=True)
        if name in [s.study_name for s in store.get_all_studies()]:
            study = tn.load_study(store, name, None, create=False)
    choose_base(spec, study, suite, knobs.space(suite["space"]), gpu)


def _design_head(records, rec, name, spec, study, suite, gpu, knob_names, halfwidth,
                 card) -> dict:
    """The design record of this --base: the stored one (resume), else a new one appended."""
    sp = knobs.space(suite["space"])
    wanted = {"best": "best", "plan": "plan"}.get(spec, f"trial-{spec}")
    for r in records:
        if r["record"] == "design" and r["study"] == name and r["design"] == wanted:
            return r
    design_name, cfg, source = choose_base(spec, study, suite, sp, gpu)
    variants, left_out = design(cfg, suite, sp, gpu, EFFECT_KNOBS)
    head = {"record": "design", "study": name, "design": design_name, "card": card, "base": cfg,
            "base_from": source, "family": family(suite, cfg), "variants": variants,
            "left_out": left_out, "seed": int(suite.get("seed", 0)), "halfwidth_pct": halfwidth,
            "min_pairs": MIN_PAIRS, "knobs_asked": list(knob_names)}
    append(rec, head)
    return head


def _prices(run, records) -> tuple[float, float, float]:
    """(a launch, a sweep launch's start, a run inside a sweep) in GPU-seconds: the medians of
    this study's effects launches (the search's launches before any), of its rounds' starts
    (0 before any) and of its runs inside rounds (a launch's before any)."""
    mine = [r for r in records if r.get("study") == run["name"]]
    launches = [c for r in mine for c in r.get("launch_gpu_seconds", [])] or run["search_costs"]
    launch = float(np.median(launches)) if launches else 0.0
    inside = [c for r in mine for c in r.get("run_gpu_seconds", []) if c > 0]
    starts = [r["round"]["start_gpu_seconds"] for r in mine
              if r.get("round") and r.get("attempt") == r["round"]["first_attempt"]]
    if not inside:
        return launch, 0.0, launch
    return launch, float(np.median(starts)) if starts else 0.0, float(np.median(inside))


def _next(run, records, state, names, halfwidth, max_pairs) -> tuple[str | None, str, list]:
    """(why the stage stops, "", []) or (None, "pair" or "round", the variants to pair next:
    the open variant with the fewest pairs, with the other open variants of a round)."""
    if state["failures"].get("base", 0) >= MAX_FAILURES:
        return "base-failed", "", []
    open_ = []
    for i, v in enumerate(run["head"]["variants"]):
        n, hw = len(state["rates"][v["id"]]), state["halfwidth"].get(v["id"])
        finished = (n >= MIN_PAIRS and hw is not None and hw <= halfwidth) or n >= max_pairs \
            or state["failures"].get(v["id"], 0) >= MAX_FAILURES
        if v["knob"] in names and not finished:
            open_.append((n, i, v))
    if not open_:
        return "done", "", []
    ranked = [v for _, _, v in sorted(open_, key=lambda x: x[:2])]
    launch, start, inside = _prices(run, records)
    in_round = (lambda v: True) if run["pairing"] == "sweep-nccl" else \
        (lambda v: v["knob"] not in NCCL_KNOBS)
    if run["pairing"] == "launches" or not in_round(ranked[0]):
        how, batch, cost = "pair", ranked[:1], lambda k: 2 * launch
    else:
        how = "round"
        batch = [v for v in ranked if in_round(v)][:ROUND_PAIRS]
        cost = lambda k: start + 2 * k * inside  # noqa: E731
    spent = run["search_s"] + sum(float(r.get("gpu_seconds", 0.0)) for r in records
                                  if r.get("study") == run["name"])
    stop = run["stop_after_s"]
    elapsed = time.monotonic() - run["start"]

    def why(k: int) -> str | None:
        if spent + cost(k) > run["budget_s"]:
            return "budget"
        return "time" if stop and elapsed + cost(k) / run["suite"]["gpus"] > stop else None
    if why(1):
        return why(1), "", []
    while len(batch) > 1 and why(len(batch)):
        batch = batch[:-1]
    return None, how, batch


def _message(stopped: str, pairs: int, halfwidth: float, run, spent: float, stop_after_s) -> str:
    return {
        "done": f"done: {pairs} pairs; each effect asked for has its 95% interval within "
                f"+-{halfwidth:g}% (or reached --effects-max-pairs, or its launches failed)",
        "budget": f"stopped: GPU-hour budget spent ({(run['search_s'] + spent) / 3600:.3f} of "
                  f"{run['budget_s'] / 3600:g} GPU-hours, search and effects; the next pair "
                  "would overrun it)",
        "time": f"stopped: --stop-after-s {stop_after_s or 0:g} reached after {pairs} pairs; "
                "rerun the same command to resume",
        "base-failed": f"stopped: the base config failed {MAX_FAILURES} launches; see the "
                       "effects records' errors",
    }[stopped]
