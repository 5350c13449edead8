"""The step's host work outside the blocks split into a constant and a part per layer: the line
through the host-step bench's depths, its clamps, the one-depth rule, the YAML round trip, and
the planner (a stage pays its own layers' part; nothing measured: bit for bit as before)."""

import dataclasses

import numpy as np
import pytest

from trainplan.calibrate import fit as calibrate
from trainplan.calibrate import host as calibrate_host
from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate import store as calibration
from trainplan.calibrate.store import load_gpu
from trainplan.cost import measured as overheads
from trainplan.cost.step_time import evaluate
from trainplan.errors import SpecError
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import Layouts

from .test_calibrate_host import assert_wait_as_before

M = load_model("llama-1.3b")  # 24 layers


def _gpu(**kw):
    return dataclasses.replace(load_gpu("h100-sxm", calibrated=False), **kw)


def _config(wrapper, tp, **more):
    return {"model": M.name, "wrapper": wrapper, "tp": tp, "micro_batch": 1, "seq": 64, **more}


def _block(seconds, wrapper=None, tp=1):
    return {"purpose": "host", "config": _config(wrapper, tp), "results": {"time_s": seconds}}


def _step(seconds, layers, wrapper="plain", tp=1):
    return {"purpose": "host-step", "config": _config(wrapper, tp, layers=layers),
            "results": {"time_s": seconds}}


def _line(a, b, wrapper="plain", tp=1, depths=(24, 4), spread=(0.0, -0.004, 0.006)):
    """Step records on the line a + L b, three per depth; the median sits on the line."""
    return [_step(a + n * b + e, n, wrapper, tp) for n in depths for e in spread]


def _eval(gpu, *cfgs, model=M):
    return evaluate(model, gpu, load_cluster("dgx-h100"), Layouts.from_configs(list(cfgs)), 2048)


def test_two_depths_recover_the_constant_and_the_part_per_layer():
    blocks = [_block(0.003), _block(0.005, "fsdp2"), _block(0.004, "tp", 2)]
    steps = _line(0.010, 0.004) + _line(0.020, 0.007, "fsdp2") \
        + _line(0.015, 0.0065, "tp", 2, depths=(24, 8, 4))  # three depths: least squares
    got = calibrate_host.host_scales(blocks + steps)
    assert got["host_step_s"] == [["fsdp2", pytest.approx(0.020)],
                                  ["plain", pytest.approx(0.010)], ["tp2", pytest.approx(0.015)]]
    assert got["host_step_layer_s"] == [["fsdp2", pytest.approx(0.002)],
                                        ["plain", pytest.approx(0.001)],
                                        ["tp2", pytest.approx(0.0025)]]
    assert calibrate_host.step_line({24: [0.2, 0.1, 0.3], 4: [0.1]}) == pytest.approx((0.08, 0.005))
    noisy = {n: [0.01 + 0.004 * n + e] for n, e in ((4, 1e-4), (12, -2e-4), (24, 1e-4))}
    a, b = calibrate_host.step_line(noisy)
    assert (a, b) == pytest.approx(tuple(np.polyfit([4, 12, 24], [v[0] for v in
                                                                   noisy.values()], 1)[::-1]))


def test_one_depth_keeps_everything_once_a_step_as_before():
    blocks = [_block(0.00284), _block(0.00531, "fsdp2"), _block(0.00473, "tp", 2)]
    steps = [_step(0.0526, 24), _step(0.124, 24, "fsdp2"), _step(0.1784, 24, "tp", 2),
             _step(0.1790, 24, "tp", 2), _step(0.1770, 24, "tp", 2)]
    got = calibrate_host.host_scales(blocks + steps)
    old = {w: round(max(0.0, float(np.median([s["results"]["time_s"] - 24 * b for s in steps
                                              if calibrate_host.wrapper_name(s["config"]) == w
                                              ]))), 7)
           for w, b in (("plain", 0.00284), ("fsdp2", 0.00531), ("tp2", 0.00473))}
    assert got["host_step_s"] == [[w, old[w]] for w in sorted(old)]
    assert got["host_step_s"][2][1] == pytest.approx(0.0649, abs=1e-4)  # 2 x H100's tp2
    assert "host_step_layer_s" not in got


def test_clamps_and_a_one_depth_wrapper_beside_a_two_depth_one():
    blocks = [_block(0.003), _block(0.005, "fsdp2"), _block(0.004, "tp", 2)]
    steps = _line(-0.01, 0.005) \
        + _line(0.03, 0.004, "fsdp2") \
        + [_step(0.2, 24, "tp", 2)]  # one depth: its constant holds its per-layer work
    got = calibrate_host.host_scales(blocks + steps)
    assert got["host_step_s"] == [["fsdp2", pytest.approx(0.03)], ["plain", 0.0],
                                  ["tp2", pytest.approx(0.2 - 24 * 0.004)]]  # a < 0: 0
    # fsdp2's slope is below its block (0.004 < 0.005): 0; tp2 a 0 row, not plain's part
    assert got["host_step_layer_s"] == [["fsdp2", 0.0], ["plain", pytest.approx(0.002)],
                                        ["tp2", 0.0]]
    assert "host_step_s" not in calibrate_host.host_scales(_line(0.01, 0.004))  # no blocks


def test_the_field_validates_and_survives_the_calibration_yaml(tmp_path):
    for bad in ((("plain",),), ((1, 0.1),), (("tp2", -0.001),)):
        with pytest.raises(SpecError, match="host_step_layer_s"):
            _gpu(host_step_layer_s=bad)
    assert _gpu().host_step_layer_s == ()  # inert until measured
    pieces = {"host_block_s": [["plain", 0.003]], "host_step_s": [["plain", 0.01]],
              "host_step_layer_s": [["plain", 0.001], ["tp2", 0.0025]]}
    cal = {"gpu": "h100-sxm", "card": ["NVIDIA H100 80GB HBM3"], "label": "test",
           "matmul_efficiency": 0.7,
           "attention_efficiency": 0.5, "collectives": {}, "pieces": pieces}
    path = calibrate.write(cal, tmp_path / "cal.yaml")
    gpu = calibration.apply(_gpu(), calibration.load("h100-sxm", path))
    assert gpu.host_step_layer_s == (("plain", 0.001), ("tp2", 0.0025))
    assert gpu.host_step_s == (("plain", 0.01),)
    assert calibrate_pieces.apply(_gpu(), {"host_step_layer_s": []}).host_step_layer_s == ()


def test_no_host_step_layer_s_leaves_the_planner_bit_for_bit_as_before():
    gpu = _gpu(host_block_s=(("plain", 0.002), ("fsdp2", 0.006), ("tp2", 0.004)),
               host_step_s=(("plain", 0.01), ("fsdp2", 0.03), ("tp2", 0.065)),
               host_overlap_k=6.0)
    assert_wait_as_before(gpu, seed=1, tps=[1, 2, 4], depths=[2.0, 6.0, 12.0, 24.0],
                          step_extra=lambda tp, fsdp: overheads.per_wrapper(gpu.host_step_s,
                                                                             tp, fsdp))
    cfgs = [ParallelConfig(dp=2, zero=2, micro_batch=1), ParallelConfig(tp=2, dp=2),
            ParallelConfig(pp=2, dp=2, micro_batch=1, grad_accum=4)]
    zeros = dataclasses.replace(gpu, host_step_layer_s=(("plain", 0.0), ("tp2", 0.0)))
    a, b = _eval(gpu, *cfgs), _eval(zeros, *cfgs)
    for c in a.columns:
        assert (a[c].astype(object).to_numpy() == b[c].astype(object).to_numpy()).all(), c


def test_a_deeper_stage_pays_more_host_time_outside_its_blocks():
    gpu = _gpu(host_step_s=(("tp2", 0.01),), host_step_layer_s=(("tp2", 0.002),))
    got = overheads.host_step_time(gpu, 2, False, np.array([2.0, 4.0, 12.0, 24.0]))
    assert got.tolist() == pytest.approx([0.014, 0.018, 0.034, 0.058])
    assert overheads.host_step_time(_gpu(), 2, False, 24.0) == 0.0  # nothing measured
    # the planner, host-bound (tp 2, micro-batch 1): each layer of the stage adds its part
    floor = (("plain", 0.003), ("tp2", 0.005))
    base = _gpu(host_block_s=floor, host_step_s=(("tp2", 0.01),))
    per = dataclasses.replace(base, host_step_layer_s=(("tp2", 0.002),))
    one = ParallelConfig(tp=2, micro_batch=1)
    for model, n in ((M, 24), (load_model("llama-1.3b:2-layers"), 2),
                     (load_model("llama-1.3b:4-layers"), 4)):
        extra = _eval(per, one, model=model).iloc[0]["host_wait_s"] \
            - _eval(base, one, model=model).iloc[0]["host_wait_s"]
        assert extra == pytest.approx(n * 0.002)
    # a pipeline stage of 12 layers pays 12 layers' part, not the model's 24
    staged = ParallelConfig(tp=2, pp=2, micro_batch=1, grad_accum=4)
    extra = _eval(per, staged).iloc[0]["host_wait_s"] - _eval(base, staged).iloc[0]["host_wait_s"]
    assert extra == pytest.approx(12 * 0.002)
