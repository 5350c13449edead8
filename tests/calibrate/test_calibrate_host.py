"""Host time per block: its fit from made-up records, its isolation from the other scales, and
the planner's host floor (max of device and host time per micro-batch)."""

import dataclasses

import numpy as np
import pytest

from trainplan.calibrate import host as calibrate_host
from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate.store import load_gpu
from trainplan.cost import measured as overheads
from trainplan.cost.step_time import evaluate
from trainplan.errors import SpecError
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import Layouts

M = load_model("llama-1.3b")  # 24 layers
P_BLOCK = 12 * M.hidden**2  # about one block's parameters; only the copies' price reads it


def _gpu(**kw):
    return dataclasses.replace(load_gpu("h100-sxm", calibrated=False), **kw)


def _rec(seconds, *, wrapper=None, tp=1, host=True, mb=2, seq=2048, **config):
    r = {"config": {"model": M.name, "model_spec": dataclasses.asdict(M), "tokens": mb * seq,
                    "seq": seq, "micro_batch": mb, "compile": True, "recompute": "none",
                    "precision": "pure", "wrapper": wrapper, "tp": tp, **config},
         "results": {"time_s": seconds, "activation_bytes": 0}}
    if host:
        r["purpose"] = "host"
    return r


def _fsdp(seconds, **kw):
    r = _rec(seconds, wrapper="fsdp2", zero=2, world=2, params=P_BLOCK, **kw)
    r["results"].update({"allgather_s": 0.001, "reduce_scatter_s": 0.001, "alone_s": 0.02})
    return r


def test_host_scales_are_the_median_per_wrapper_named_from_the_config():
    recs = [_rec(0.001), _rec(0.003), _rec(0.002), _fsdp(0.006), _fsdp(0.008),
            _rec(0.010, wrapper="tp", tp=2), _rec(0.020, wrapper="tp", tp=4),
            _rec(0.012, wrapper="tp+fsdp2", tp=2, zero=3),
            _rec(0.5, wrapper="ddp")]  # no host term for DDP: left out
    got = calibrate_host.host_scales(recs)
    assert got == {"host_block_s": [["fsdp2", 0.007], ["plain", 0.002], ["tp2", 0.01],
                                    ["tp2+fsdp2", 0.012], ["tp4", 0.02]]}
    assert calibrate_host.host_scales([]) == {}
    assert calibrate_host.is_host(recs[0]) and not calibrate_host.is_host(_rec(1, host=False))


def test_fit_keeps_host_records_away_from_every_other_scale():
    gpu = _gpu()
    t = calibrate_pieces.block_terms(M, gpu, tokens=4096, seq=2048, recompute="none")
    plain = _rec(t["matmul"] + t["attention"] + 1.7 * t["elementwise"], host=False)
    fsdp = _fsdp(0.03, host=False)
    tiny = [_rec(0.004, mb=1, seq=64), _fsdp(0.009, mb=1, seq=64),
            _rec(0.011, wrapper="tp", tp=2, mb=1, seq=64)]
    alone, checks = calibrate_pieces.fit({"block": [plain, fsdp]}, gpu)
    both, checks2 = calibrate_pieces.fit({"block": [plain, fsdp] + tiny}, gpu)
    assert both.pop("host_block_s") == [["fsdp2", 0.009], ["plain", 0.004], ["tp2", 0.011]]
    assert both == alone and checks2 == checks
    # the sweep: the plain block at micro-batch 1, its time the host's and GPU's interleaved
    now = calibrate_pieces.apply(gpu, alone)
    sweep = _sweep(1, 0.0)
    device = calibrate_pieces.block_predicted_s(sweep, now)
    sweep["results"]["time_s"] = float(overheads.interleaved(device, 0.004, 3.0))
    swept, checks3 = calibrate_pieces.fit({"block": [plain, fsdp] + tiny + [sweep]}, gpu)
    assert swept.pop("host_overlap_k") == pytest.approx(3.0, abs=0.15)
    assert swept.pop("host_block_s") and swept == alone and checks3 == checks
    assert alone["elementwise_scale"] == pytest.approx(1.7, rel=1e-3)
    # the same tiny records read as ordinary blocks would move the scales: the filter matters
    for r in tiny:
        del r["purpose"]
    leaked, _ = calibrate_pieces.fit({"block": [plain, fsdp] + tiny}, gpu)
    assert leaked["elementwise_scale"] != alone["elementwise_scale"]
    assert leaked["fsdp_block_scale"] != alone["fsdp_block_scale"]


def test_apply_passes_the_table_on_and_the_spec_refuses_bad_rows():
    gpu = calibrate_pieces.apply(_gpu(), {"host_block_s": [["fsdp2", 0.006], ["plain", 0.001]]})
    assert gpu.host_block_s == (("fsdp2", 0.006), ("plain", 0.001))
    for bad in ((("fsdp2",),), ((2, 0.1),), (("plain", -1.0),)):
        with pytest.raises(SpecError, match="host_block_s"):
            _gpu(host_block_s=bad)


def test_host_time_picks_the_wrapper_and_the_nearest_tp_degree():
    gpu = _gpu(host_block_s=(("plain", 0.001), ("fsdp2", 0.006), ("tp2", 0.01), ("tp4", 0.02),
                             ("tp2+fsdp2", 0.03)))
    tp = np.array([1, 1, 2, 4, 8, 2, 8])
    fsdp = np.array([0, 1, 0, 0, 0, 1, 1], dtype=bool)
    got = overheads.host_time_per_microbatch(gpu, 10.0, tp, fsdp)
    assert got.tolist() == pytest.approx([0.01, 0.06, 0.1, 0.2, 0.2, 0.3, 0.3])
    only_tp4 = _gpu(host_block_s=(("tp4", 0.02),))  # the other TP wrapper's, no plain floor
    assert overheads.host_time_per_microbatch(only_tp4, 10.0, tp, fsdp).tolist() == \
        pytest.approx([0, 0, 0.2, 0.2, 0.2, 0.2, 0.2])
    assert not overheads.host_time_per_microbatch(_gpu(), 10.0, tp, fsdp).any()


def _eval(gpu, *cfgs):
    return evaluate(M, gpu, load_cluster("dgx-h100"), Layouts.from_configs(list(cfgs)), 2048)


def test_a_host_bound_micro_batch_takes_the_host_time_and_a_device_bound_one_does_not():
    small = ParallelConfig(dp=2, zero=3, micro_batch=1, grad_accum=2)  # hooks every micro-batch
    big = ParallelConfig(dp=2, zero=3, micro_batch=16)
    before = _eval(_gpu(), small, big)
    after = _eval(_gpu(host_block_s=(("fsdp2", 0.006),)), small, big)
    b, a = before.iloc[0], after.iloc[0]
    floor = 24 * 0.006
    assert b["step_time_s"] < 2 * floor  # device-bound, the planner would say 2 x < 0.144 s
    assert a["step_time_s"] >= 2 * floor + a["optimizer_s"]
    assert a["host_wait_s"] > 0
    assert a["step_time_s"] - b["step_time_s"] == pytest.approx(a["host_wait_s"])
    assert a["compute_s"] - b["compute_s"] == pytest.approx(a["host_wait_s"])
    assert a["step_time_s"] == pytest.approx(sum(a[k] for k in ("compute_s", "exposed_comm_s",
                                                                "bubble_s", "optimizer_s")))
    assert a["tokens_per_s"] < b["tokens_per_s"]
    assert before.iloc[1]["compute_s"] > floor  # the mb 16 layout's GPU time exceeds it
    pd_equal(after.iloc[[1]], before.iloc[[1]])


def test_host_wait_sums_each_micro_batch_s_shortfall():
    gpu = _gpu(host_block_s=(("plain", 0.002), ("fsdp2", 0.006)))
    t_dev = np.array([0.03, 0.03, 0.03, 0.2])
    wait = overheads.host_wait_per_step(gpu, t_dev, layers=24.0, tp=1,
                                        fsdp=np.array([True, True, False, True]),
                                        zero=np.array([2, 3, 0, 2]), grad_accum=4)
    full, light = 24 * 0.006 - 0.03, 24 * 0.002 - 0.03
    # ZeRO-2: one micro-batch gathers and reduce-scatters, three run as plain blocks; ZeRO-3:
    # all four; no FSDP2: four plain ones; device-bound: no wait
    assert wait.tolist() == pytest.approx([full + 3 * light, 4 * full, 4 * light, 0.0])


def test_under_a_pipeline_no_zero2_micro_batch_issues_fsdp2_collectives():
    """torch's pipelining skips every backward's reduce-scatter: the last micro-batch of a
    ZeRO-2 stage costs the host what the others do; ZeRO-3 still gathers in each."""
    gpu = _gpu(host_block_s=(("plain", 0.002), ("fsdp2", 0.006)))
    t_dev = np.array([0.03, 0.03, 0.03])
    kw = dict(layers=24.0, tp=1, fsdp=True, zero=np.array([2, 2, 3]), grad_accum=4)
    wait = overheads.host_wait_per_step(gpu, t_dev, pp=np.array([1, 2, 2]), **kw)
    full, light = 24 * 0.006 - 0.03, 24 * 0.002 - 0.03
    assert wait.tolist() == pytest.approx([full + 3 * light, 4 * light, 4 * full])


def test_zero2_accumulation_waits_on_the_host_less_than_zero3():
    gpu = _gpu(host_block_s=(("plain", 0.002), ("fsdp2", 0.006)))
    z2 = ParallelConfig(dp=2, zero=2, micro_batch=1, grad_accum=4)
    z3 = ParallelConfig(dp=2, zero=3, micro_batch=1, grad_accum=4)
    r2, r3 = (row for _, row in _eval(gpu, z2, z3).iterrows())
    assert 0 < r2["host_wait_s"] < r3["host_wait_s"]


def pd_equal(x, y):
    assert list(x.columns) == list(y.columns)
    for c in x.columns:
        assert (x[c].astype(object).to_numpy() == y[c].astype(object).to_numpy()).all(), c


def test_no_host_records_leave_the_planner_unchanged_bit_for_bit():
    cfgs = [ParallelConfig(dp=2, zero=2, micro_batch=1), ParallelConfig(dp=4, micro_batch=2),
            ParallelConfig(tp=2, dp=2, zero=3, micro_batch=1),
            ParallelConfig(tp=4, micro_batch=1), ParallelConfig(pp=2, dp=2, micro_batch=1,
                                                                grad_accum=4)]
    plain = _eval(_gpu(), *cfgs)
    assert (plain["host_wait_s"] == 0).all()
    zeros = _gpu(host_block_s=(("plain", 0.0), ("fsdp2", 0.0), ("tp2", 0.0), ("tp2+fsdp2", 0.0)))
    pd_equal(_eval(zeros, *cfgs), plain)
    floor = _eval(_gpu(host_block_s=(("plain", 0.01), ("fsdp2", 0.01), ("tp2", 0.01))), *cfgs)
    assert (floor["host_wait_s"] > 0).all()  # the same layouts do feel a floor when measured


def test_interleaved_is_the_max_unmeasured_a_smooth_max_measured():
    d, h = np.array([1.0, 2.0, 0.0, 3.0]), np.array([2.0, 2.0, 1.0, 0.0])
    assert overheads.interleaved(d, h, 0.0).tolist() == [2.0, 2.0, 1.0, 3.0]
    assert overheads.interleaved(d, h, 1.0).tolist() == pytest.approx([3.0, 4.0, 1.0, 3.0])
    assert overheads.interleaved(d, h, 2.0)[1] == pytest.approx(2.0 * 2**0.5)
    big = overheads.interleaved(d, h, 60.0)
    assert big == pytest.approx(np.maximum(d, h), rel=0.02) and (big >= np.maximum(d, h)).all()
    assert overheads.interleaved(1e-3, 1e-3, 12.0) > 1e-3  # never below either side


def _sweep(mb, seconds):
    r = _rec(seconds, host=False, mb=mb)
    r["purpose"] = calibrate_host.SWEEP
    return r


def test_overlap_k_recovers_the_exponent_of_made_up_sweep_times():
    h, k = 0.0024, 4.0
    device = {1: 0.0012, 2: 0.0025, 4: 0.005}
    recs = [_sweep(mb, float(overheads.interleaved(d, h, k))) for mb, d in device.items()]
    got = calibrate_host.overlap_k(recs, lambda r: device[r["config"]["micro_batch"]],
                                   (("plain", h),))
    assert got == {"host_overlap_k": pytest.approx(k)}
    assert calibrate_host.overlap_k(recs, lambda r: 0.0, ()) == {}  # no plain host time
    assert calibrate_host.overlap_k([], lambda r: 0.0, (("plain", h),)) == {}
    # sweep records never feed the host floor itself
    assert calibrate_host.host_scales(recs + [_rec(h)]) == {"host_block_s": [["plain", h]]}


def test_a_measured_exponent_raises_a_balanced_step_and_leaves_a_host_free_one():
    cfgs = [ParallelConfig(dp=2, zero=2, micro_batch=4), ParallelConfig(dp=2, zero=2,
                                                                        micro_batch=16)]
    floor = (("plain", 0.003), ("fsdp2", 0.006))
    base = _eval(_gpu(host_block_s=floor), *cfgs)
    smooth = _eval(_gpu(host_block_s=floor, host_overlap_k=4.0), *cfgs)
    assert (smooth["step_time_s"] > base["step_time_s"]).all()
    assert (smooth["host_wait_s"] - base["host_wait_s"]).iloc[0] > \
        (smooth["host_wait_s"] - base["host_wait_s"]).iloc[1]  # most where the two are close
    pd_equal(_eval(_gpu(host_overlap_k=4.0), *cfgs), _eval(_gpu(), *cfgs))  # nothing measured


def _step(seconds, *, wrapper="plain", tp=1, layers=24):
    r = _rec(seconds, wrapper=wrapper, tp=tp, host=False, mb=1, seq=64, layers=layers)
    r["purpose"] = calibrate_host.STEP
    return r


def test_host_step_s_is_the_median_step_less_its_blocks_clamped_at_0():
    blocks = [_rec(0.003, mb=1, seq=64), _fsdp(0.005, mb=1, seq=64)]
    steps = [_step(0.09), _step(0.10), _step(0.12),  # plain: 0.018, 0.028, 0.048 over blocks
             _step(0.10, wrapper="fsdp2"),  # below 24 x 0.005 = 0.12: clamped at 0
             _step(0.5, wrapper="tp", tp=2)]  # no tp2 block timed: nothing to subtract
    # one depth each (two: tests/calibrate/test_host_step_depth.py): all of it once a step
    got = calibrate_host.host_scales(blocks + steps)
    assert got["host_block_s"] == [["fsdp2", 0.005], ["plain", 0.003]]
    assert got["host_step_s"] == [["fsdp2", 0.0], ["plain", pytest.approx(0.028)]]
    assert "host_step_layer_s" not in got
    assert "host_step_s" not in calibrate_host.host_scales(blocks)  # no step records
    assert calibrate_host.host_scales(steps) == {}  # no blocks: neither key
    assert all(calibrate_host.is_host(r) for r in steps)
    # fit hands them to calibrate_host and keeps them from every other scale
    gpu = _gpu()
    t = calibrate_pieces.block_terms(M, gpu, tokens=4096, seq=2048, recompute="none")
    plain = _rec(t["matmul"] + t["attention"] + 1.7 * t["elementwise"], host=False)
    alone, checks = calibrate_pieces.fit({"block": [plain] + blocks}, gpu)
    both, checks2 = calibrate_pieces.fit({"block": [plain] + blocks + steps}, gpu)
    assert both.pop("host_step_s") == got["host_step_s"] and both == alone and checks2 == checks
    applied = calibrate_pieces.apply(gpu, {"host_step_s": [["plain", 0.03]]})
    assert applied.host_step_s == (("plain", 0.03),)
    for bad in ((("plain",),), ((1, 0.1),), (("fsdp2", -0.1),)):
        with pytest.raises(SpecError, match="host_step_s"):
            _gpu(host_step_s=bad)


def test_host_step_time_picks_the_wrapper_as_the_block_time_does():
    gpu = _gpu(host_step_s=(("plain", 0.01), ("fsdp2", 0.03), ("tp2", 0.02), ("tp4", 0.04)))
    tp = np.array([1, 1, 2, 4, 8, 2])
    fsdp = np.array([0, 1, 0, 0, 0, 1], dtype=bool)
    got = overheads.host_step_time(gpu, tp, fsdp, 24.0)
    assert got.tolist() == pytest.approx([0.01, 0.03, 0.02, 0.04, 0.04, 0.02])  # tp2+fsdp2: tp2
    assert not overheads.host_step_time(_gpu(), tp, fsdp, 24.0).any()


def test_the_step_s_host_work_joins_the_last_micro_batch_once():
    floor = (("plain", 0.002), ("fsdp2", 0.006))
    gpu = _gpu(host_block_s=floor, host_step_s=(("plain", 0.01), ("fsdp2", 0.03)))
    t_dev = np.array([0.03, 0.03, 0.03, 0.5])
    kw = dict(layers=24.0, tp=1, fsdp=np.array([True, True, False, True]),
              zero=np.array([2, 3, 0, 2]), grad_accum=4)
    base = overheads.host_wait_per_step(_gpu(host_block_s=floor), t_dev, **kw)
    wait = overheads.host_wait_per_step(gpu, t_dev, **kw)
    # host-bound: once a step, whatever the micro-batches; device-bound (0.5 s): nothing
    assert (wait - base).tolist() == pytest.approx([0.03, 0.03, 0.01, 0.0])


def test_host_step_s_raises_a_host_bound_step_and_leaves_a_device_bound_one():
    small = ParallelConfig(dp=2, zero=2, micro_batch=1)  # host-bound: 24 x 5 ms a step
    big = ParallelConfig(dp=2, zero=2, micro_batch=16)
    floor = (("plain", 0.003), ("fsdp2", 0.005))
    before = _eval(_gpu(host_block_s=floor), small, big)
    after = _eval(_gpu(host_block_s=floor, host_step_s=(("fsdp2", 0.035),)), small, big)
    assert before.iloc[0]["host_wait_s"] > 0  # already on the floor: the extra adds whole
    assert after.iloc[0]["step_time_s"] - before.iloc[0]["step_time_s"] == pytest.approx(0.035)
    assert after.iloc[0]["host_wait_s"] - before.iloc[0]["host_wait_s"] == pytest.approx(0.035)
    pd_equal(after.iloc[[1]], before.iloc[[1]])  # its GPU time hides the host's
    zeros = _gpu(host_block_s=floor, host_step_s=(("plain", 0.0), ("fsdp2", 0.0)))
    pd_equal(_eval(zeros, small, big), before)


def test_no_host_step_s_leaves_the_wait_bit_for_bit_as_before():
    """host_wait_per_step with host_step_s = () against its form before host_step_s."""
    gpu = _gpu(host_block_s=(("plain", 0.002), ("fsdp2", 0.006), ("tp2", 0.004),
                             ("tp2+fsdp2", 0.01)), host_overlap_k=6.0)
    assert_wait_as_before(gpu, seed=0, tps=[1, 2, 4, 8], depths=[6.0, 12.0, 24.0])


def assert_wait_as_before(gpu, *, seed, tps, depths, step_extra=lambda tp, fsdp: 0.0):
    """host_wait_per_step over random layouts equals, bit for bit, its form from before a
    new term: the blocks' floor (plus `step_extra` on the last micro-batch: a phase after
    the blocks without FSDP2, coupled with them under it), the lighter floor on the others
    where ZeRO-1/2 skips the sync."""
    rng = np.random.default_rng(seed)
    t_dev = rng.uniform(0.001, 0.3, 64)
    tp = rng.choice(tps, 64)
    fsdp, zero = rng.choice([True, False], 64), rng.choice([0, 2, 3], 64)
    ga, layers = rng.choice([1, 2, 4, 8], 64), rng.choice(depths, 64)
    blocks = overheads.host_time_per_microbatch(gpu, layers, tp, fsdp)
    full = blocks + step_extra(tp, fsdp)
    light = np.where(fsdp & (zero < 3), overheads.host_time_per_microbatch(gpu, layers, tp, False),
                     blocks)
    k = gpu.host_overlap_k
    last = np.where(fsdp, overheads.interleaved(t_dev, full, k),
                    np.maximum(overheads.interleaved(t_dev, blocks, k), full))
    old = (last - t_dev) \
        + (ga - 1.0) * (overheads.interleaved(t_dev, light, k) - t_dev)
    new = overheads.host_wait_per_step(gpu, t_dev, layers=layers, tp=tp, fsdp=fsdp, zero=zero,
                                       grad_accum=ga)
    assert (new == old).all()
