"""What a job runs with, from one plan: its layout, its length and its checkpoints.

Pages 1, 5 and 6 and `trainplan launch` all take these numbers from here, so the script a
team runs cannot disagree with the page that justifies it:

- the layout, micro-batch, gradient accumulation and recompute: page 1's decision
  (`launch.choice`: the fastest plan the trainer runs that fits with its memory band's
  margin; expert parallel pinned to 1 until the trainer runs it, context parallel too for
  CPU processes, which cannot run it), or the layout a plan file's decision
  (`trainplan plan --json`) or pins name;
- the run's length: the scenario's token budget over the global batch, in whole steps;
- the checkpoint interval and keep count: page 5's plan (`resilience.checkpoint`) at the
  conservative node MTBF, whose interval also meets the 30-minute limit at the nominal
  one, turned into steps at the plan's predicted step time (rounded down, so the work lost
  to a failure stays under the limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from trainplan.cost.memory_runtime import EXPANDABLE, allocator_of
from trainplan.errors import TrainplanError
from trainplan.launch.inputs import MAX_STEPS
from trainplan.loader import load_json, quote, shown
from trainplan.specs import PLAN_FIELDS
from trainplan.specs.layouts import RECOMPUTE, SCHEDULES
from trainplan.train.support import RUNNABLE_PINS, not_runnable

CASE = "conservative"  # the MTBF whose checkpoint plan the job follows (page 5's choice)


@dataclass(frozen=True)
class CheckpointSchedule:
    """Page 5's plan for one layout, in the units a launch needs."""

    plans: dict  # case -> resilience.checkpoint.CheckpointPlan, conservative and nominal
    every_steps: int  # steps between checkpoints
    every_min: float  # minutes between checkpoints at the plan's step time (<= the interval)
    keep: int  # complete checkpoints kept

    @property
    def plan(self):
        """The plan the job follows (`CASE`)."""
        return self.plans[CASE]


def checkpoint_plans(model, gpus: int, gpus_per_node: int, parallel: dict) -> dict:
    """{"conservative": CheckpointPlan, "nominal": ...} of `model` on `gpus`, its state split
    as `parallel` (a plan's layout) splits it, with page 5's assumptions. Where the job would
    fail within a restart plus a save, one line naming the GPU count and the most that plan:
    the node MTBF and restart are page 5's, not flags of `launch` or the runbook."""
    from trainplan.cost.params import total_params
    from trainplan.resilience import checkpoint, failures

    assume = checkpoint.Assumptions()
    shards = checkpoint.state_shards(int(parallel["tp"]), int(parallel["pp"]),
                                     int(parallel["dp_shard"]), int(parallel["zero"]))
    plans = {}
    for case, mtbf in failures.published_node_mtbf_hours().items():
        try:
            plans[case] = checkpoint.plan_checkpoints(
                total_params(model), gpus, mtbf, assume.write_gbps_per_node,
                assume.restart_minutes, assume.max_lost_minutes, gpus_per_node=gpus_per_node,
                mode=assume.mode, keep=assume.keep, host_copy_gbps=assume.host_copy_gbps,
                shard_gpus=shards)
        except checkpoint.JobFailsTooOften as err:
            use = (f"use at most {err.most_gpus:,} GPUs" if err.most_gpus else
                   "no GPU count plans at this node MTBF")
            raise TrainplanError(  # of trainplan.errors: the runbook's build exits 2 on it
                f"gpus {gpus} is too many to checkpoint: at page 5's {case} node MTBF "
                f"({mtbf:,.0f} h) its {err.nodes:,} nodes fail every {err.job_mtbf_s:.3g} s, "
                f"within the assumed {err.restart_min:g}-min restart plus a "
                f"{err.persist_s:.3g} s save; {use} (launch --gpus N, runbook -p gpus=N)"
            ) from None
    return plans


def schedule(model, gpus: int, gpus_per_node: int, plan_row: dict) -> CheckpointSchedule:
    """Page 5's checkpoint plan for `plan_row` (a planner plan), in steps."""
    plans = checkpoint_plans(model, gpus, gpus_per_node, plan_row["parallel"])
    interval = plans[CASE].interval_min
    every = max(1, math.floor(interval * 60.0 / plan_row["step_time_s"]))
    return CheckpointSchedule(plans=plans, every_steps=every, keep=plans[CASE].keep,
                              every_min=every * plan_row["step_time_s"] / 60.0)


def steps_for(token_budget: float, tokens_per_step: int, warmup: int = 0) -> int:
    """Optimizer steps that train on the whole token budget (the last step may run over);
    one line where they are not more than `warmup`, the steps the harness leaves untimed,
    or more than `MAX_STEPS`."""
    steps = max(1, math.ceil(token_budget / tokens_per_step))
    if steps > MAX_STEPS:
        raise TrainplanError(
            f"the scenario's token_budget {token_budget:g} is {steps:,} steps of "
            f"{tokens_per_step:,} tokens, more than launch's {MAX_STEPS:,}; give --steps N "
            f"(at most {MAX_STEPS:,}), or a scenario with a smaller token_budget")
    if steps <= warmup:
        raise TrainplanError(
            f"the scenario's token_budget {token_budget:g} is {steps} step(s) of "
            f"{tokens_per_step:,} tokens, not more than the harness's {warmup} warm-up step(s) "
            f"(--warmup); give a token_budget of at least {warmup * tokens_per_step + 1:,} "
            f"({warmup + 1} steps), or --steps N > {warmup}")
    return steps


_PLAN_VALUES = {"recompute": RECOMPUTE, "pp_schedule": SCHEDULES, "zero": (0, 1, 2, 3)}
_PLAN_TYPES = {"recompute": str, "pp_schedule": str, "sequence_parallel": bool, "model": str,
               "gpu": str, "cluster": str}  # the rest: whole numbers >= 1
PLAN_SPECS = ("model", "gpu", "cluster")  # the specs a plan file names (model always)
PLAN_SIZES = ("gpus", "seq_len", "global_batch_tokens")
LAUNCHED = {"precision": "bf16", "loss": "standard"}  # a plan made for others is refused
_MISSING = object()


def _refuse(path: Path, field: str, value=_MISSING, want: str = "") -> NoReturn:
    """The one line for a plan file whose `field` is missing (no `value`) or not `want`."""
    text = ("null" if value is None else str(value).lower() if isinstance(value, bool)
            else quote(value))
    got = "is missing" if value is _MISSING else f"= {text} is not valid"
    raise TrainplanError(f"--plan '{shown(path)}': {field} {got}; use {want} (as "
                         "`trainplan plan --json` writes it)")


def _part(obj: dict, key: str, field: str, path: Path, want: type, what: str):
    """obj[key] where it is a `want` (a bool is no whole number); else `_refuse`."""
    value = obj.get(key, _MISSING)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        _refuse(path, field, value, what)
    return value


def _value(obj: dict, key: str, field: str, path: Path):
    """A layout size or choice, a size of the run, or a spec's name, checked for its kind
    and range (sizes >= 1; zero, recompute and schedule one of their own)."""
    want = _PLAN_TYPES.get(key, int)
    valid = _PLAN_VALUES.get(key, range(1, 2**63) if want is int else None)
    what = (f"one of {list(valid)}" if isinstance(valid, tuple) else
            {int: "a whole number >= 1", bool: "true or false", str: "a name"}[want])
    value = _part(obj, key, field, path, want, what)
    if (valid is not None and value not in valid) or value == "":
        _refuse(path, field, value, what)
    return value


def plan_file_pins(path: str | Path) -> tuple[dict, dict]:
    """(layout pins, {gpus, seq_len, global_batch_tokens, model; gpu, cluster where named})
    of a `trainplan plan --json` file's decision (of its first plan where it has none); one
    line naming the field (`_refuse`) where one is missing or not of its kind or range."""
    path = Path(path)
    out = load_json(path, error=TrainplanError, what="plan file (`trainplan plan --json`)")
    if not isinstance(out, dict):
        _refuse(path, "the top-level value", out, "an object with a decision")
    if "decision" in out or "plans" not in out:
        decision = _part(out, "decision", "decision", path, dict, "an object with a plan")
        where = "decision.plan"
        chosen = _part(decision, "plan", where, path, dict, "an object with a parallel layout")
    else:  # older files: the first of the plans
        plans = _part(out, "plans", "plans", path, list, "a list of plans")
        where = "plans[0]"
        chosen = _part(dict(enumerate(plans)), 0, where, path, dict,
                       "an object with a parallel layout")
    parallel = _part(chosen, "parallel", f"{where}.parallel", path, dict,
                     "an object of the layout's sizes (dp, tp, pp, ...)")
    pins = {k: _value(parallel, k, f"{where}.parallel.{k}", path)
            for k in PLAN_FIELDS if k in parallel or k == "dp"}
    facts = {k: _value(out, k, k, path) for k in (*PLAN_SPECS, *PLAN_SIZES)
             if k in out or k not in ("gpu", "cluster")}  # older files name neither
    for key, runs in LAUNCHED.items():  # what launch prices and writes into the job
        if out.get(key, runs) != runs:
            raise TrainplanError(
                f"--plan '{shown(path)}' was made for {key} {quote(out[key])}; launch "
                f"prices and runs {key} {runs!r} only: plan again without --{key}, or run "
                f"`trainplan train --{key} {out[key]}` with the plan's layout yourself")
    return pins, facts


ALERT_MARGIN = 0.10  # below the band's low end by this share: day-to-day noise is not an alert
UNVALIDATED_ALERT = 0.8  # share of the prediction where nothing was measured on the card class


def best_runnable(m, gpu, cluster, *, gpus: int, seq_len: int, global_batch_tokens: int,
                  pins: dict | None = None, gpus_per_node: int, env: dict | None = None) -> dict:
    """`plan.planner.plan`'s answer whose one plan is the decision (`launch.choice`, page
    1's rule) among the layouts the trainer runs: expert parallel pinned to 1 unless
    `pins` ask otherwise (then the trainer refuses); a fully pinned layout as it is. Memory
    is priced for the allocator the job's environment `env` sets (`allocator_of`; none set:
    the expandable segments the trainer sets)."""
    from trainplan.launch import choice  # pandas: not loaded at import
    from trainplan.plan.planner import answer, ranked, row_to_plan

    asked = {**RUNNABLE_PINS, **(pins or {})}
    why = not_runnable(asked, m)
    if why:
        bad = ", ".join(f"{k}={asked[k]}" for k in RUNNABLE_PINS if int(asked[k]) > 1)
        fix = f"; pin {' '.join(f'--{k} 1' for k in RUNNABLE_PINS)}" if bad else ""
        raise TrainplanError(f"no launch for {bad or m.name}: {why}{fix}")
    result = ranked(m, gpu, cluster, gpus=gpus, seq_len=seq_len,
                    global_batch_tokens=global_batch_tokens, pins=asked,
                    gpus_per_node=gpus_per_node, allocator=allocator_of(env, unset=EXPANDABLE))
    out = answer(m, gpu, cluster, result, gpus=gpus, seq_len=seq_len,
                 global_batch_tokens=global_batch_tokens, top=1)
    d = choice.choose(result.table, m, gpu)
    margin = choice.margin_of(d.chosen)
    out["plans"] = [{**row_to_plan(d.chosen), "memory_margin": margin,
                     "memory_fits_band": margin["fits"]}]
    return out


def alert(m, gpu, seq_len: int, plan_row: dict, paths=None) -> dict:
    """The tokens/s/GPU below which a run is reported as slow, and why that number.

    The plan's family band on the card class (`compare.trust.plan_band`, page 4's table;
    the class's families pooled where the family is not validated) says how low a healthy
    run measured against its prediction; the alert sits `ALERT_MARGIN` below that low end.
    Where nothing was measured on the class, `UNVALIDATED_ALERT` x the prediction."""
    from trainplan.compare import trust
    from trainplan.cost.compute import matmul_ceiling_tokens_per_s

    rate = float(plan_row["tokens_per_s_per_gpu"])
    band = trust.plan_band(trust.suite_bands(paths), trust.family_of(plan_row["parallel"]), gpu,
                           rate, matmul_ceiling_tokens_per_s(m, gpu, seq_len))
    if band.get("rate_low") is None:
        return {"tokens_per_s_per_gpu": UNVALIDATED_ALERT * rate, "factor": UNVALIDATED_ALERT,
                "source": "none",
                "basis": f"no layout has been measured on {band['card_class']} GPUs: "
                         f"{UNVALIDATED_ALERT:.0%} of the prediction"}
    factor = band["rate_low"] / rate * (1.0 - ALERT_MARGIN)
    slowest = f"{band['low']:.2f} x the prediction"
    basis = (f"{ALERT_MARGIN:.0%} below the slowest that the {band['family']} family's "
             f"measured runs reached against their predictions ({slowest})"
             if band["source"] == "family" else
             f"{ALERT_MARGIN:.0%} below the slowest run of any family on {band['card_class']} "
             f"GPUs against its prediction ({slowest}; {band['family']} is not validated yet)")
    return {"tokens_per_s_per_gpu": factor * rate, "factor": factor, "source": band["source"],
            "basis": basis}
