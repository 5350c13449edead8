"""The checkpoint planner and its closed forms (`cycle`): each term by hand, Daly's vectors,
properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainplan.cost.params import total_params
from trainplan.resilience import checkpoint as ck
from trainplan.resilience import cycle
from trainplan.resilience.checkpoint import CheckpointPlanError, plan_checkpoints
from trainplan.specs import load_model

N13 = 13_015_864_320  # Llama 2 13B (data/models/llama-13b.yaml)

# ---------------------------------------------------------------- each term by hand


def test_checkpoint_bytes_is_12_or_14_per_param():
    assert cycle.checkpoint_bytes(1_000) == 12_000
    assert cycle.checkpoint_bytes(1_000, bf16_weights=True) == 14_000


def test_13b_checkpoint_matches_facts():
    """Mixed-precision Adam (Rajbhandari et al. 2020):
    13B is 156-182 GB, about 40-46 GB per node on 4 nodes."""
    n = total_params(load_model("llama-13b"))
    assert n == N13
    assert cycle.checkpoint_bytes(n) / cycle.GB == pytest.approx(156.2, abs=0.1)
    assert cycle.checkpoint_bytes(n, True) / cycle.GB == pytest.approx(182.2, abs=0.1)
    assert cycle.checkpoint_bytes(n) / 4 / cycle.GB == pytest.approx(39.0, abs=0.1)


def test_nodes_and_job_mtbf():
    assert ck.nodes_of(32, 8) == 4
    assert ck.nodes_of(2, 8) == 1  # a job smaller than a node
    with pytest.raises(CheckpointPlanError, match="--gpus 12"):
        ck.nodes_of(12, 8)
    assert cycle.job_mtbf(2000.0, 4) == 500.0


def test_state_shards():
    assert ck.state_shards(tp=1, pp=1, dp_shard=8, zero=3) == 8  # HSDP over a node
    assert ck.state_shards(tp=2, pp=4, dp_shard=4, zero=1) == 32
    assert ck.state_shards(tp=2, pp=1, dp_shard=1, zero=0) == 2  # DDP: replicas, no sharding


def test_write_staging_stall_persist_by_hand():
    write = cycle.write_seconds(3e9, 1.5)  # 3 GB at 1.5 GB/s
    stage = cycle.staging_seconds(0.375e9, 25.0)  # 0.375 GB at 25 GB/s
    assert write == pytest.approx(2.0)
    assert stage == pytest.approx(0.015)
    assert cycle.stall_seconds("sync", write, stage) == write
    assert cycle.stall_seconds("async", write, stage) == stage
    assert cycle.persist_seconds("sync", write, stage) == write
    assert cycle.persist_seconds("async", write, stage) == pytest.approx(2.015)


def test_young_by_hand():
    assert cycle.young_interval(5.0, 1440.0) == pytest.approx(120.0)  # sqrt(2 * 5 * 1440)


@pytest.mark.parametrize(("mtbf_min", "published_min", "tol"), [
    (24 * 60, 117, 0.5), (6 * 60, 57, 0.5), (15, 9.1, 0.05)])
def test_daly_eq37_published_vectors(mtbf_min, published_min, tol):
    """Daly 2006 (R = 10 min, delta = 5 min)."""
    assert cycle.daly_interval(5.0, mtbf_min) == pytest.approx(published_min, abs=tol)


def test_daly_beyond_its_range_is_the_mtbf():
    assert cycle.daly_interval(10.0, 4.0) == 4.0  # delta >= 2M


def test_lost_work_and_limit_by_hand():
    assert cycle.expected_lost(20.0, 1.0, 10.0) == 21.0  # I/2 + T_p + R
    assert cycle.worst_lost(20.0, 1.0, 10.0) == 31.0  # I + T_p + R
    assert cycle.max_interval(30.0, 1.0, 10.0) == 19.0


def test_ettr_by_hand():
    # (1 - 1/100) (960 - 50 - 10 + 1) / (960 + 40) = 0.99 * 0.901
    assert cycle.ettr(100.0, 1.0, 10.0, 40.0, 960.0) == pytest.approx(0.89199)


# ---------------------------------------------------------------- the plan

DONE_WHEN = dict(n_params=N13, gpus=32, node_mtbf_hours=2000.0, write_gbps_per_node=2.0,
                 restart_minutes=10.0, max_lost_minutes=30.0)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_done_when_plan_meets_the_requirement(mode):
    p = plan_checkpoints(**DONE_WHEN, mode=mode)
    assert p.meets_requirement and p.worst_lost_min < 30.0
    assert p.nodes == 4 and p.job_mtbf_hours == 500.0
    assert p.checkpoint_gb == pytest.approx(156.19, abs=0.01)
    assert p.interval_min == pytest.approx(p.train_min_between_saves + p.stall_s / 60.0)
    assert p.retention_gb == pytest.approx(2 * p.checkpoint_gb)
    assert p.peak_storage_gb == pytest.approx(3 * p.checkpoint_gb)


def test_async_takes_dalys_optimum_sync_is_shortened():
    a = plan_checkpoints(**DONE_WHEN, mode="async")
    assert a.limited_by == "daly"
    assert a.interval_min == pytest.approx(a.daly_min + a.stall_s / 60.0)
    assert a.stall_s == pytest.approx(N13 * 12 / 32 / 25e9)  # 4.9 GB per GPU at 25 GB/s
    s = plan_checkpoints(**DONE_WHEN, mode="sync")
    assert s.limited_by == "max_lost" and s.interval_min < s.daly_min
    assert s.stall_s == pytest.approx(N13 * 12 / 4 / 2e9)  # 39 GB per node at 2 GB/s


def test_slow_storage_bounds_the_interval_from_below():
    p = plan_checkpoints(**{**DONE_WHEN, "node_mtbf_hours": 20.0, "write_gbps_per_node": 0.2,
                            "max_lost_minutes": 60.0})
    assert p.limited_by == "persist"
    assert p.interval_min == pytest.approx(p.persist_s / 60.0)


def test_shard_gpus_sets_the_staged_share():
    hsdp = plan_checkpoints(**DONE_WHEN, shard_gpus=8)
    assert hsdp.per_gpu_gb == pytest.approx(hsdp.checkpoint_gb / 8)
    assert hsdp.stall_s == pytest.approx(4 * plan_checkpoints(**DONE_WHEN).stall_s)


@pytest.mark.parametrize(("change", "needle"), [
    ({"node_mtbf_hours": 0.0}, "--node-mtbf-hours 0.0"),
    ({"node_mtbf_hours": -5.0}, "--node-mtbf-hours -5.0"),
    ({"node_mtbf_hours": math.inf}, "--node-mtbf-hours inf"),
    ({"node_mtbf_hours": 1e300}, "at most"),
    ({"write_gbps_per_node": 0.0}, "--write-gbps-per-node"),
    ({"restart_minutes": -1.0}, "--restart-minutes"),
    ({"max_lost_minutes": 10.0}, "the restart alone"),
    ({"max_lost_minutes": 10.5}, "write faster than"),
    ({"keep": 1}, "--keep 1"),
    ({"mode": "lazy"}, "'lazy'"),
    ({"gpus": 12}, "--gpus 12"),
    ({"shard_gpus": 64}, "--shard-gpus 64"),
    ({"shard_gpus": 3}, "divisor of 32"),
    ({"host_copy_gbps": 1e-9}, "--host-copy-gbps"),
    ({"node_mtbf_hours": 0.01}, "too short"),
])
def test_bad_inputs_are_refused_naming_the_value(change, needle):
    with pytest.raises(CheckpointPlanError, match=None) as err:
        plan_checkpoints(**{**DONE_WHEN, **change})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_infeasible_message_says_what_would_work():
    with pytest.raises(CheckpointPlanError) as err:
        plan_checkpoints(**{**DONE_WHEN, "max_lost_minutes": 10.5})
    need = float(str(err.value).split("faster than ")[1].split()[0])
    ok = plan_checkpoints(**{**DONE_WHEN, "max_lost_minutes": 10.5,
                             "write_gbps_per_node": need * 1.01})
    assert ok.meets_requirement and ok.worst_lost_min <= 10.5


# ---------------------------------------------------------------- properties

mtbfs = st.floats(min_value=50.0, max_value=1e6)
bandwidths = st.floats(min_value=0.5, max_value=100.0)


@settings(max_examples=150, deadline=None)
@given(m=mtbfs, w=bandwidths, mode=st.sampled_from(["async", "sync"]))
def test_plan_invariants(m, w, mode):
    p = plan_checkpoints(N13, 32, m, w, 10.0, 60.0, mode=mode)
    assert p.worst_lost_min >= p.expected_lost_min > 0
    assert p.worst_lost_min <= p.max_lost_min and p.meets_requirement
    assert 0.0 < p.ettr < 1.0
    assert p.persist_s >= p.stall_s > 0
    assert p.interval_min * 60.0 >= p.persist_s - 1e-9


@settings(max_examples=100, deadline=None)
@given(m=mtbfs, factor=st.floats(min_value=1.01, max_value=100.0), w=bandwidths)
def test_interval_grows_with_mtbf(m, factor, w):
    kw = dict(n_params=N13, gpus=32, write_gbps_per_node=w, restart_minutes=10.0,
              max_lost_minutes=1e6)  # a loose limit: the optimum itself is compared
    short, long = (plan_checkpoints(node_mtbf_hours=x, **kw) for x in (m, m * factor))
    assert long.daly_min > short.daly_min and long.young_min > short.young_min
    assert long.interval_min >= short.interval_min


@settings(max_examples=100, deadline=None)
@given(m=st.floats(min_value=1.0, max_value=1e7), d=st.floats(min_value=1e-3, max_value=1e3))
def test_daly_is_close_to_young_when_saves_are_cheap(m, d):
    if d < 0.01 * m:
        assert cycle.daly_interval(d, m) == pytest.approx(cycle.young_interval(d, m), rel=0.1)
    assert 0.0 < cycle.daly_interval(d, m) <= max(m, cycle.young_interval(d, m) * 1.5)
