"""Checkpoint planner: the interval, lost work, ETTR and retention of one job, or why none.

`plan_checkpoints` checks a request, adds up the closed forms of one checkpoint cycle
(`trainplan.resilience.cycle`: size, stall, persist time, Young's and Daly's intervals,
lost work, ETTR) into a `CheckpointPlan`, whose `as_dict` is the `trainplan checkpoint
--json` contract (README, "Command line"), and refuses in one line a request no interval
meets, naming what would work. Page 5 plans with `Assumptions` and says which bound set
the interval (`describe_interval`). Units as in `cycle`: GB, seconds unless named.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass

from trainplan.errors import TrainplanError
from trainplan.resilience.cycle import (
    BF16_WEIGHT_BYTES,
    FP32_ADAM_BYTES,
    GB,
    HOST_COPY_GBPS,
    Mode,
    checkpoint_bytes,
    daly_interval,
    ettr,
    expected_lost,
    job_mtbf,
    max_interval,
    outlives_restart,
    persist_seconds,
    staging_seconds,
    stall_seconds,
    worst_lost,
    write_seconds,
    young_interval,
)

MIN_KEEP = 2  # torchtitan refuses keep_latest_k = 1: the only checkpoint would be deleted
#               while its successor is still being written
MAX_KEEP = 10_000  # checkpoints retained; beyond this a value is a typo
LIMITS = {  # sanity bounds on inputs: beyond these a value is a typo, and floats overflow
    "node_mtbf_hours": 1e9, "write_gbps_per_node": 1e6, "restart_minutes": 1e6,
    "max_lost_minutes": 1e9, "host_copy_gbps": 1e6,
}


class CheckpointPlanError(TrainplanError):
    """Checkpoint inputs that are out of range, or a requirement no interval can meet."""


class JobFailsTooOften(CheckpointPlanError):
    """A job whose MTBF is within a restart plus a save (`cycle.outlives_restart`), with the
    numbers of the refusal, so that a caller whose inputs are not `trainplan checkpoint`'s
    flags can say it in its own words: `most_gpus` is the largest whole-node GPU count that
    plans (0: none), `job_mtbf_s` the job's MTBF (s), `persist_s` one save's persist time."""

    def __init__(self, text: str, *, nodes: int, most_gpus: int, job_mtbf_s: float,
                 restart_min: float, persist_s: float):
        super().__init__(text)
        self.nodes, self.most_gpus, self.job_mtbf_s = nodes, most_gpus, job_mtbf_s
        self.restart_min, self.persist_s = restart_min, persist_s


# ---------------------------------------------------------------- the job


def nodes_of(gpus: int, gpus_per_node: int) -> int:
    """Nodes the job spans: gpus / gpus_per_node (one node when the job is smaller)."""
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise CheckpointPlanError(
            f"--gpus {gpus} is not a whole number of nodes of --gpus-per-node {gpus_per_node}; "
            f"use a multiple of {gpus_per_node}")
    return max(gpus // gpus_per_node, 1)


def state_shards(tp: int, pp: int, dp_shard: int, zero: int) -> int:
    """GPUs one copy of the optimizer state is split over: tp x pp x (dp_shard when zero >= 1).

    ZeRO-1/2/3 shard the 12 B/param over the data-parallel shard group
    (Rajbhandari et al. 2020, ZeRO); tensor and pipeline parallel split the
    model itself. Each GPU stages this share when it saves asynchronously.
    """
    return tp * pp * (dp_shard if zero >= 1 else 1)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class CheckpointPlan:
    """A checkpoint cadence with every term that led to it (times in s, min, h as named)."""

    mode: str  # "async" or "sync"
    nodes: int
    bytes_per_param: int
    checkpoint_gb: float  # one full checkpoint, all nodes
    per_node_gb: float  # what each node writes
    per_gpu_gb: float  # what each GPU stages (async)
    stall_s: float  # training blocked per save (delta)
    persist_s: float  # save start -> durable (T_p)
    write_s: float  # one node's share at the write bandwidth
    job_mtbf_hours: float
    young_min: float  # Young's compute time between saves
    daly_min: float  # Daly's compute time between saves
    interval_min: float  # chosen: save start to save start (compute + stall)
    train_min_between_saves: float  # interval - stall: what `save every N steps` sets
    limited_by: str  # "daly" (the optimum), "max_lost" (shortened), "persist" (storage bound)
    expected_lost_min: float
    worst_lost_min: float
    max_lost_min: float
    restart_min: float
    ettr: float
    stall_fraction: float  # share of running time spent stalled in saves
    keep: int
    retention_gb: float  # the last `keep` checkpoints
    peak_storage_gb: float  # keep + the one being written
    meets_requirement: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _check_range(name: str, value: float) -> None:
    flag = "--" + name.replace("_", "-")
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise CheckpointPlanError(f"{flag} {value!r} is not valid: it must be a number > 0")
    if value > LIMITS[name]:
        raise CheckpointPlanError(f"{flag} {value:g} is out of range: at most {LIMITS[name]:g}")


def _infeasible(max_lost_min, restart_min, persist_s, bytes_per_node, write_gbps):
    """The one-line refusal when no interval meets the limit, saying what would work."""
    need_min = restart_min + 2.0 * persist_s / 60.0
    head = (f"--max-lost-minutes {max_lost_min:g} cannot be met: restart {restart_min:g} min + "
            f"persist {persist_s / 60:.3g} min leave no interval of at least the persist time; ")
    if restart_min >= max_lost_min:
        return head + (f"the restart alone takes --restart-minutes {restart_min:g}; "
                       f"allow more than {need_min:.3g} min or restart faster")
    room_s = (max_lost_min - restart_min) * 60.0 / 2.0 - (persist_s - bytes_per_node /
                                                          (write_gbps * GB))
    fix = f"allow more than {need_min:.3g} min of lost work"
    if room_s > 0:
        fix += (f", or write faster than {bytes_per_node / room_s / GB:.3g} GB/s per node "
                f"(--write-gbps-per-node {write_gbps:g})")
    else:
        fix += ", or copy to host faster (--host-copy-gbps)"
    return head + fix


def _too_many_nodes(gpus, nodes, gpus_per_node, node_mtbf_hours, restart_min, persist_s, fits,
                    shard=None):
    """The refusal when the job fails within a restart plus a save (`outlives_restart`), one
    line naming the largest whole-node GPU count `fits(nodes)` allows (a multiple of the
    given `shard`, --shard-gpus) and the node MTBF needed."""
    most = bisect.bisect_left(range(1, nodes), True, key=lambda n: not fits(n))  # fits, then not
    while shard and most and (most * gpus_per_node % shard or most * gpus_per_node < shard):
        most -= 1  # fits(n) holds for every n below: the largest count --shard-gpus divides
    mtbf_s = node_mtbf_hours * 3600.0 / nodes
    need_h = nodes * (restart_min * 60.0 + persist_s) / 3600.0
    need = f"{math.ceil(need_h):,}" if need_h >= 10 else f"{math.ceil(need_h * 1e3) / 1e3:g}"
    need = f"a node MTBF above {need} h, " if need_h < LIMITS["node_mtbf_hours"] else ""
    use = f"use at most {most * gpus_per_node:,} GPUs, " if most else ""
    return JobFailsTooOften(
        f"--node-mtbf-hours {node_mtbf_hours:g} is too short for --gpus {gpus} ({nodes:,} "
        f"node{'s' * (nodes > 1)}): the job's MTBF, {mtbf_s:.3g} s, is within a restart "
        f"({restart_min:g} min) plus a save ({persist_s:.3g} s), so no interval bounds the lost "
        f"work; {use}{need}or a faster restart", nodes=nodes, most_gpus=most * gpus_per_node,
        job_mtbf_s=mtbf_s, restart_min=restart_min, persist_s=persist_s)


def plan_checkpoints(n_params: int, gpus: int, node_mtbf_hours: float,
                     write_gbps_per_node: float, restart_minutes: float,
                     max_lost_minutes: float = 30.0, *, gpus_per_node: int = 8,
                     mode: Mode = "async", keep: int = MIN_KEEP,
                     host_copy_gbps: float = HOST_COPY_GBPS, bf16_weights: bool = False,
                     shard_gpus: int | None = None) -> CheckpointPlan:
    """Choose the interval: Daly's optimum, shortened so that I + T_p + R <= max_lost_minutes.

    `shard_gpus` is how many GPUs one copy of the state is split over (default:
    all of them, as FSDP/ZeRO-3; `state_shards` for a layout); it sets what each
    GPU stages in an async save. Raises `CheckpointPlanError` for bad inputs and
    for a limit no interval can meet (naming what would work), `JobFailsTooOften`
    (one of them) for a job that fails within a restart plus a save.
    """
    for name, value in (("node_mtbf_hours", node_mtbf_hours),
                        ("write_gbps_per_node", write_gbps_per_node),
                        ("restart_minutes", restart_minutes),
                        ("max_lost_minutes", max_lost_minutes),
                        ("host_copy_gbps", host_copy_gbps)):
        _check_range(name, value)
    if mode not in ("async", "sync"):
        raise CheckpointPlanError(f"mode {mode!r} is not valid: use 'async' or 'sync'")
    if keep < MIN_KEEP:
        raise CheckpointPlanError(
            f"--keep {keep} is not valid: keep at least {MIN_KEEP} checkpoints, so that one "
            "complete checkpoint survives while the next is written")
    if keep > MAX_KEEP:
        raise CheckpointPlanError(f"--keep {keep} is out of range: at most {MAX_KEEP:,}")
    given_shard, shard_gpus = shard_gpus, shard_gpus or gpus
    if shard_gpus > gpus or gpus % shard_gpus:
        raise CheckpointPlanError(
            f"--shard-gpus {shard_gpus} is not valid for --gpus {gpus}: use a divisor of {gpus}")
    nodes = nodes_of(gpus, gpus_per_node)
    total = checkpoint_bytes(n_params, bf16_weights)
    per_node, per_gpu = total / nodes, total / shard_gpus
    write_s = write_seconds(per_node, write_gbps_per_node)
    staging_s = staging_seconds(per_gpu, host_copy_gbps)
    stall = stall_seconds(mode, write_s, staging_s)
    persist = persist_seconds(mode, write_s, staging_s)
    restart, limit = restart_minutes * 60.0, max_lost_minutes * 60.0
    mtbf = job_mtbf(node_mtbf_hours, nodes) * 3600.0

    longest = max_interval(limit, persist, restart)
    if not longest > persist:
        raise CheckpointPlanError(_infeasible(max_lost_minutes, restart_minutes, persist,
                                              per_node, write_gbps_per_node))
    if not outlives_restart(mtbf, restart, persist):
        def fits(n: int) -> bool:  # the same job on n whole nodes
            t_p = persist_seconds(mode, write_seconds(total / n, write_gbps_per_node),
                                  staging_seconds(total / (given_shard or n * gpus_per_node),
                                                  host_copy_gbps))
            return outlives_restart(job_mtbf(node_mtbf_hours, n) * 3600.0, restart, t_p)
        raise _too_many_nodes(gpus, nodes, gpus_per_node, node_mtbf_hours, restart_minutes,
                              persist, fits, given_shard)
    young, daly = young_interval(stall, mtbf), daly_interval(stall, mtbf)
    optimum = daly + stall  # Daly's tau is compute time; the interval adds the stall
    if math.ceil(longest) - 1 > persist:  # whole seconds, so the worst case stays strictly under
        longest = float(math.ceil(longest) - 1)
    interval = min(max(optimum, persist), longest)
    limited_by = ("max_lost" if interval < optimum else
                  "persist" if interval > optimum else "daly")
    ratio = ettr(interval, stall, persist, restart, mtbf)
    if not 0.0 < ratio < 1.0:
        need_h = nodes * (interval / 2.0 + persist) / 3600.0  # where L reaches M + R
        raise CheckpointPlanError(
            f"--node-mtbf-hours {node_mtbf_hours:g} is too short for {nodes} nodes: the job "
            f"fails every {mtbf / 60:.3g} min, less than the work each failure loses; use a "
            f"node MTBF well above {need_h:.3g} h")
    worst = worst_lost(interval, persist, restart)
    return CheckpointPlan(
        mode=mode, nodes=nodes,
        bytes_per_param=FP32_ADAM_BYTES + (BF16_WEIGHT_BYTES if bf16_weights else 0),
        checkpoint_gb=total / GB, per_node_gb=per_node / GB, per_gpu_gb=per_gpu / GB,
        stall_s=stall, persist_s=persist, write_s=write_s, job_mtbf_hours=mtbf / 3600.0,
        young_min=young / 60.0, daly_min=daly / 60.0, interval_min=interval / 60.0,
        train_min_between_saves=(interval - stall) / 60.0, limited_by=limited_by,
        expected_lost_min=expected_lost(interval, persist, restart) / 60.0,
        worst_lost_min=worst / 60.0, max_lost_min=max_lost_minutes,
        restart_min=restart_minutes, ettr=ratio, stall_fraction=stall / interval, keep=keep,
        retention_gb=keep * total / GB, peak_storage_gb=(keep + 1) * total / GB,
        meets_requirement=worst <= limit,
    )


def digits(x: float, places: int = 1) -> str:
    """`x` with `places` decimals, or 2 significant digits where those would show it as 0."""
    return f"{x:,.{places}f}" if x == 0 or abs(x) >= 10.0**-places else f"{x:.2g}"


def describe_interval(plan: CheckpointPlan) -> str:
    """Which bound set the interval, in plain words (a sentence for page 5)."""
    daly, interval = digits(plan.daly_min), digits(plan.interval_min)
    if plan.limited_by == "max_lost":
        return (f"Daly's optimum ({daly} minutes of training between saves) would "
                f"let the worst case exceed the {plan.max_lost_min:g}-minute limit, so the "
                f"interval is shortened to {interval} minutes; saving more often "
                "costs little, as each save stalls training only briefly.")
    if plan.limited_by == "persist":
        return (f"Daly's optimum ({daly} minutes) is shorter than the time a save "
                f"takes to become durable, so the interval is that time, "
                f"{interval} minutes: storage bandwidth sets the cadence.")
    return (f"The interval is Daly's optimum, {interval} minutes, and its worst "
            f"case stays within the {plan.max_lost_min:g}-minute limit.")


# ---------------------------------------------------------------- the runbook's inputs


@dataclass(frozen=True)
class Assumptions:
    """What page 5 plans with when the scenario does not say: each value with its source.

    Node MTBFs come from `failures.published_node_mtbf_hours`. None of these is
    measured on this project's machines yet.
    """

    write_gbps_per_node: float = 2.0  # middle of the published 1-3 GB/s
    restart_minutes: float = 10.0  # assumption; Daly's worked example uses 10
    max_lost_minutes: float = 30.0  # requirement: at most 30 min of work lost to a failure
    host_copy_gbps: float = HOST_COPY_GBPS  # assumption (see HOST_COPY_GBPS)
    keep: int = MIN_KEEP  # the fewest torchtitan allows
    mode: str = "async"  # PyTorch DCP async_save, as the harness implements

    SOURCES = {  # short: pandas truncates table cells past 50 characters
        "write_gbps_per_node": "published 1-3 GB/s a node (BLOOM, Llama 3)",
        "restart_minutes": "ASSUMPTION (Daly 2006's worked example)",
        "max_lost_minutes": "requirement: lose under 30 minutes",
        "host_copy_gbps": "ASSUMPTION (PCIe Gen5 x16 peaks near 64)",
        "keep": "the fewest torchtitan allows (it refuses 1)",
        "mode": "PyTorch DCP async_save",
    }

    def table(self):
        """The assumptions as a (value, source) table for the page (pandas DataFrame)."""
        import pandas as pd

        names = list(self.SOURCES)
        return pd.DataFrame({"value": [f"{getattr(self, n):g}" if not isinstance(
            getattr(self, n), str) else getattr(self, n) for n in names],
            "source": [self.SOURCES[n] for n in names]}, index=names)
