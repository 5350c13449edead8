"""The failure simulation: published MTBFs, agreement with the closed forms, speed, seeding."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trainplan.resilience import failures
from trainplan.resilience.checkpoint import CheckpointPlanError, plan_checkpoints
from trainplan.resilience.failures import simulate, simulate_plan

N13 = 13_015_864_320
RUN_HOURS = 302.0  # about the default scenario's predicted 12.6 days


def _plan(mode="async", mtbf=2000.0, **kw):
    return plan_checkpoints(N13, 32, mtbf, 2.0, 10.0, 30.0, mode=mode, **kw)


def test_published_node_mtbf():
    """Llama 3 (Dubey et al. 2024) about 264 node-days per failure, OPT-175B (Zhang et al. 2022)
    about 64."""
    assert failures.llama3_node_mtbf_hours() / 24 == pytest.approx(264, abs=0.5)
    assert failures.opt175b_node_mtbf_hours() == 64 * 24
    both = failures.published_node_mtbf_hours()
    assert both["conservative"] < both["nominal"]


def test_no_failures_by_hand():
    """MTBF far beyond the run: wall = training + one stall per save before the end."""
    sim = simulate(10.0, interval_min=61.0, stall_s=60.0, persist_s=60.0, restart_min=5.0,
                   job_mtbf_hours=1e12, runs=5)
    assert np.all(sim.failures == 0) and sim.lost_per_failure_min.size == 0
    assert sim.wall_hours == pytest.approx(10.0 + 9 / 60.0)  # 10 one-hour blocks, 9 saves


def test_seeded_and_reproducible():
    p = _plan(mtbf=500.0)
    a, b = simulate_plan(p, RUN_HOURS, seed=7), simulate_plan(p, RUN_HOURS, seed=7)
    assert np.array_equal(a.wall_hours, b.wall_hours)
    assert not np.array_equal(a.wall_hours, simulate_plan(p, RUN_HOURS, seed=8).wall_hours)


def test_ten_thousand_runs_under_a_second():
    p = _plan(mtbf=failures.opt175b_node_mtbf_hours())
    start = time.perf_counter()
    sim = simulate_plan(p, RUN_HOURS, runs=10_000)
    assert time.perf_counter() - start < 1.0
    assert sim.runs == 10_000


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("mtbf", [200.0, failures.opt175b_node_mtbf_hours(),
                                  failures.llama3_node_mtbf_hours()])
def test_mean_lost_per_failure_matches_closed_form(mode, mtbf):
    p = _plan(mode, mtbf)
    mean, se = simulate_plan(p, RUN_HOURS, runs=20_000, seed=1).mean_lost_per_failure()
    assert abs(mean - p.expected_lost_min) < 4 * se, (mean, se, p.expected_lost_min)


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("mtbf", [200.0, failures.opt175b_node_mtbf_hours()])
def test_ettr_matches_closed_form(mode, mtbf):
    """Within 4 standard errors, plus the end effect: a finite run skips a save or two."""
    p = _plan(mode, mtbf)
    value, se = simulate_plan(p, RUN_HOURS, runs=20_000, seed=2).mean_ettr()
    end_effect = 2 * p.stall_s / 3600.0 / RUN_HOURS  # no save at the end, a partial last one
    assert abs(value - p.ettr) < 4 * se + end_effect, (value, se, p.ettr)


def test_worst_case_bounds_every_simulated_failure():
    p = _plan("sync", 200.0)
    sim = simulate_plan(p, RUN_HOURS, runs=5_000)
    assert sim.lost_per_failure_min.max() <= p.worst_lost_min + 1e-9
    assert sim.lost_per_failure_min.min() >= p.restart_min


def test_summary_is_consistent():
    s = simulate_plan(_plan(mtbf=500.0), RUN_HOURS, runs=2_000).summary()
    assert s["runs"] == 2_000
    assert s["lost_hours_p50"] <= s["lost_hours_p95"] <= s["lost_hours_p99"]
    assert s["wall_days_p50"] <= s["wall_days_p95"] <= s["wall_days_p99"]
    assert s["wall_days_mean"] >= s["train_days"]
    assert 0.0 < s["ettr_mean"] < 1.0


def test_override_mtbf_changes_failure_count():
    p = _plan(mtbf=2000.0)
    few = simulate_plan(p, RUN_HOURS, runs=2_000).failures.mean()
    many = simulate_plan(p, RUN_HOURS, node_mtbf_hours=200.0, runs=2_000).failures.mean()
    assert many > 5 * few


@pytest.mark.parametrize("kw", [{"train_hours": 0.0}, {"job_mtbf_hours": -1.0},
                                {"interval_min": 0.5}, {"persist_s": 1.0}])
def test_bad_simulation_inputs(kw):
    args = dict(train_hours=10.0, interval_min=30.0, stall_s=60.0, persist_s=60.0,
                restart_min=5.0, job_mtbf_hours=100.0, runs=10)
    with pytest.raises(CheckpointPlanError):
        simulate(**{**args, **kw})
