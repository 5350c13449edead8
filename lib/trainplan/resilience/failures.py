"""Monte Carlo of node failures over a whole run: the distribution of lost work and wall time.

Checks the closed forms of `trainplan.resilience.cycle` and shows their spread.
Model (the same cycle as `cycle`'s docstring): after each (re)start the
job trains `tau` = interval - stall, then saves (stall delta, durable T_p after
the save starts), and so on until `train_hours` of training are done.
Failures of the job arrive as a Poisson process at rate nodes / node MTBF
while the job runs (not during restarts, a simplification); each one loses the
wall time since the last durable snapshot (or since the restart, whose
checkpoint is durable), then costs the restart R, and training resumes from
that snapshot.

Vectorised over runs with numpy: one loop iteration per failure round, so
10,000 runs of a multi-week job take well under a second. Seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainplan.resilience.checkpoint import CheckpointPlan, CheckpointPlanError
from trainplan.resilience.cycle import job_mtbf, outlives_restart

# Published failure statistics: Dubey et al. 2024 (Llama 3) and Zhang et al. 2022 (OPT).
LLAMA3_NODES = 2048  # 16,384 H100s, 8 a node (Llama 3 paper, 2024, sec. 3.3.4)
LLAMA3_DAYS = 54  # the snapshot of pre-training the paper counts over
LLAMA3_INTERRUPTIONS = 419  # unexpected interruptions in those days (78% hardware)
OPT175B_NODE_DAYS_PER_FAILURE = 64.0  # OPT-175B logbook (Zhang et al. 2022), about
MAX_ROUNDS = 100_000  # failure rounds before the simulation gives up (no progress)


def llama3_node_mtbf_hours() -> float:
    """Node MTBF from Llama 3: 2,048 nodes x 54 days / 419 interruptions = 264 node-days."""
    return LLAMA3_NODES * LLAMA3_DAYS * 24.0 / LLAMA3_INTERRUPTIONS


def opt175b_node_mtbf_hours() -> float:
    """Node MTBF from the OPT-175B logbook: about 64 node-days per failure."""
    return OPT175B_NODE_DAYS_PER_FAILURE * 24.0


MTBF_SOURCES = {
    "conservative": "OPT-175B logbook (Zhang et al. 2022): about 64 node-days per failure",
    "nominal": "Llama 3 (2024, sec. 3.3.4): 419 unexpected interruptions in 54 days on "
               "2,048 nodes of 8 H100s, 264 node-days per failure",
}


def published_node_mtbf_hours() -> dict[str, float]:
    """Conservative (OPT-175B) and nominal (Llama 3) node MTBF, hours: plan with both."""
    return {"conservative": opt175b_node_mtbf_hours(), "nominal": llama3_node_mtbf_hours()}


@dataclass(frozen=True)
class Simulation:
    """Outcomes of `runs` simulated runs (hours unless named otherwise)."""

    train_hours: float  # training time each run needs, failure-free and stall-free
    wall_hours: np.ndarray  # (runs,) wall time to finish
    lost_hours: np.ndarray  # (runs,) wall time lost to failures, restarts included
    failures: np.ndarray  # (runs,) failures each run met
    lost_per_failure_min: np.ndarray  # (all failures,) lost wall time per failure, restart incl.

    @property
    def runs(self) -> int:
        return self.wall_hours.size

    @property
    def ettr(self) -> np.ndarray:
        """Per run: training time / wall time."""
        return self.train_hours / self.wall_hours

    def mean_ettr(self) -> tuple[float, float]:
        """Long-run ETTR, total training over total wall time, and its standard error."""
        mean_wall = self.wall_hours.mean()
        se_wall = self.wall_hours.std(ddof=1) / np.sqrt(self.runs)
        value = self.train_hours / mean_wall
        return float(value), float(value * se_wall / mean_wall)

    def mean_lost_per_failure(self) -> tuple[float, float]:
        """Mean lost minutes per failure and its standard error."""
        x = self.lost_per_failure_min
        if x.size < 2:
            return float("nan"), float("nan")
        return float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size))

    def summary(self) -> dict:
        """Means and percentiles of lost work and wall time, plain floats."""
        pct = (50, 95, 99)
        wall_days = self.wall_hours / 24.0
        out = {"runs": self.runs, "train_days": self.train_hours / 24.0,
               "failures_mean": float(self.failures.mean()),
               "ettr_mean": self.mean_ettr()[0],
               "lost_hours_mean": float(self.lost_hours.mean()),
               "wall_days_mean": float(wall_days.mean()),
               "lost_per_failure_min_mean": self.mean_lost_per_failure()[0],
               "lost_per_failure_min_max": float(self.lost_per_failure_min.max(initial=0.0))}
        for p in pct:
            out[f"lost_hours_p{p}"] = float(np.percentile(self.lost_hours, p))
            out[f"wall_days_p{p}"] = float(np.percentile(wall_days, p))
        return out


def _finish(remaining, tau, stall):
    """Wall time to train `remaining` with no failure: one stall per save before the end."""
    saves = np.maximum(np.ceil(remaining / tau - 1e-9) - 1.0, 0.0)  # 1e-9: float round-off
    return remaining + saves * stall, saves


def _last_durable(fail_at, tau, stall, persist, saves):
    """Saves (after the restart) durable by `fail_at`: save k starts at k tau + (k-1) delta."""
    k = np.floor((fail_at - persist + stall) / (tau + stall))
    return np.clip(k, 0.0, saves)


def simulate(train_hours: float, interval_min: float, stall_s: float, persist_s: float,
             restart_min: float, job_mtbf_hours: float, runs: int = 10_000,
             seed: int = 0) -> Simulation:
    """Simulate `runs` runs of `train_hours` of training under exponential job failures."""
    for name, value in (("train_hours", train_hours), ("interval_min", interval_min),
                        ("stall_s", stall_s), ("job_mtbf_hours", job_mtbf_hours)):
        if not np.isfinite(value) or value <= 0:
            raise CheckpointPlanError(f"{name} = {value!r} is not valid: it must be a number > 0")
    if persist_s < stall_s or restart_min < 0 or runs < 1:
        raise CheckpointPlanError(
            f"persist_s = {persist_s!r} must be >= stall_s, restart_min = {restart_min!r} >= 0, "
            f"runs = {runs!r} >= 1")
    if not outlives_restart(job_mtbf_hours * 3600.0, restart_min * 60.0, persist_s):
        raise CheckpointPlanError(
            f"job_mtbf_hours = {job_mtbf_hours:g} is not above the restart ({restart_min:g} min) "
            f"plus the persist time ({persist_s:g} s): this model, failures only while training, "
            "does not hold there (`cycle.outlives_restart`)")
    interval, stall = interval_min / 60.0, stall_s / 3600.0
    persist, restart = persist_s / 3600.0, restart_min / 60.0
    tau = interval - stall
    if tau <= 0:
        raise CheckpointPlanError(f"interval_min = {interval_min!r} must exceed the stall")
    rng = np.random.default_rng(seed)
    progress, wall = np.zeros(runs), np.zeros(runs)
    lost, failures = np.zeros(runs), np.zeros(runs, dtype=np.int64)
    per_failure = []
    active = np.arange(runs)
    for _ in range(MAX_ROUNDS):
        if active.size == 0:
            break
        finish, saves = _finish(train_hours - progress[active], tau, stall)
        fail_at = rng.exponential(job_mtbf_hours, active.size)
        done = fail_at >= finish
        wall[active[done]] += finish[done]
        active, fail_at, saves = active[~done], fail_at[~done], saves[~done]
        k = _last_durable(fail_at, tau, stall, persist, saves)
        snapshot_at = np.where(k > 0, k * tau + (k - 1.0) * stall, 0.0)
        window = fail_at - snapshot_at + restart
        progress[active] += k * tau
        wall[active] += fail_at + restart
        lost[active] += window
        failures[active] += 1
        per_failure.append(window * 60.0)
    else:
        raise CheckpointPlanError(
            f"job_mtbf_hours = {job_mtbf_hours:g} is too short: runs still unfinished after "
            f"{MAX_ROUNDS:,} failures; the job makes no progress")
    return Simulation(train_hours=float(train_hours), wall_hours=wall, lost_hours=lost,
                      failures=failures,
                      lost_per_failure_min=np.concatenate(per_failure) if per_failure
                      else np.zeros(0))


def simulate_plan(plan: CheckpointPlan, train_hours: float, node_mtbf_hours: float | None = None,
                  runs: int = 10_000, seed: int = 0) -> Simulation:
    """Simulate a plan's cadence; `node_mtbf_hours` overrides the MTBF it was planned for."""
    mtbf = (plan.job_mtbf_hours if node_mtbf_hours is None
            else job_mtbf(node_mtbf_hours, plan.nodes))
    return simulate(train_hours, plan.interval_min, plan.stall_s, plan.persist_s,
                    plan.restart_min, mtbf, runs=runs, seed=seed)
