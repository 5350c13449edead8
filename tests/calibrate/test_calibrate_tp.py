"""TP block scales: the residual over what the planner prices, and how the planner uses it."""

import dataclasses

import numpy as np
import pytest

from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate import tp as calibrate_tp
from trainplan.calibrate.store import load_gpu
from trainplan.cost import measured as overheads
from trainplan.cost.step_time import evaluate
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import Layouts

M = load_model("llama-1.3b")
P_LAYER = 4 * 2048 * 2048 + 3 * 2048 * 5504 + 2 * 2048


def _gpu():
    gpu = load_gpu("h100-sxm", calibrated=False)
    return dataclasses.replace(gpu, collectives=(("all_gather", 10.0, 300.0),
                                                 ("reduce_scatter", 12.0, 280.0)))


def _tp_record(gpu, scale, *, tp, fsdp=False, mb=8):
    c = {"model": M.name, "model_spec": dataclasses.asdict(M), "tp": tp, "micro_batch": mb,
         "seq": 2048, "tokens": mb * 2048, "compile": True, "recompute": "none",
         "wrapper": "tp+fsdp2" if fsdp else "tp", "precision": "pure" if fsdp else "autocast-fp32",
         "params": P_LAYER, "dp": 2 if fsdp else 1, "zero": 3 if fsdp else 0, "world": 4}
    t_compute, rest = calibrate_tp.priced(M, gpu, c)
    return {"bench": "block", "config": c,
            "results": {"time_s": scale * t_compute + rest, "activation_bytes": 0}}


def test_tp_scale_is_the_block_less_what_the_planner_prices_over_its_compute():
    gpu = _gpu()
    recs = [_tp_record(gpu, 1.1, tp=2), _tp_record(gpu, 1.7, tp=4),
            _tp_record(gpu, 1.4, tp=2, fsdp=True)]
    scales, _ = calibrate_pieces.fit({"block": recs}, gpu)
    assert scales["tp_block_scales"] == [[2, 0, pytest.approx(1.1)], [2, 1, pytest.approx(1.4)],
                                         [4, 0, pytest.approx(1.7)]]
    got = calibrate_pieces.apply(gpu, scales)
    assert [row[:2] for row in got.tp_block_scales] == [(2, 0), (2, 1), (4, 0)]
    # the comm the planner prices is taken off first: a block that is exactly its priced
    # compute and comm has scale 1, however slow the links
    slow = dataclasses.replace(gpu, collectives=(("all_gather", 50.0, 30.0),
                                                 ("reduce_scatter", 50.0, 30.0)))
    same = calibrate_tp.tp_scales([_tp_record(slow, 1.0, tp=4)], slow, lambda r: M)
    assert same["tp_block_scales"] == [[4, 0, pytest.approx(1.0)]]
    assert not calibrate_tp.tp_scales([{"config": {"wrapper": "fsdp2"}}], gpu, lambda r: M)


def test_tp_block_scale_interpolates_and_holds_beyond_the_largest_degree():
    gpu = dataclasses.replace(_gpu(), tp_block_scales=((2, 0, 1.2), (4, 0, 1.6), (2, 1, 1.5)))
    got = overheads.tp_block_scale(gpu, [1, 2, 4, 8, 2, 4, 8], [0, 0, 0, 0, 1, 1, 1])
    assert got.tolist() == pytest.approx([1.0, 1.2, 1.6, 1.6, 1.5, 1.5, 1.5])
    only_plain = dataclasses.replace(gpu, tp_block_scales=((4, 0, 1.6),))
    got = overheads.tp_block_scale(only_plain, [2, 4], [1, 1])
    assert got.tolist() == pytest.approx([1.3, 1.6])
    assert overheads.tp_block_scale(_gpu(), [2, 8], [0, 1]).tolist() == [1.0, 1.0]


def test_the_planner_slows_tp_layouts_by_their_scale_and_no_other():
    gpu = _gpu()
    scaled = dataclasses.replace(gpu, tp_block_scales=((4, 0, 1.5),))
    cfgs = [ParallelConfig(tp=4, micro_batch=8), ParallelConfig(dp=4, zero=3, micro_batch=8)]
    L = Layouts.from_configs(cfgs)
    base, slow = (evaluate(M, g, load_cluster("dgx-h100"), L, 2048) for g in (gpu, scaled))
    assert slow["compute_s"][0] > 1.3 * base["compute_s"][0]
    assert slow["step_time_s"][1] == base["step_time_s"][1]
    assert np.all(slow["tp_comm_s"] == base["tp_comm_s"])


def test_a_host_bound_tp_block_sets_no_scale_and_its_wrapper_takes_the_others():
    gpu = _gpu()
    recs = [_tp_record(gpu, 1.1, tp=2), _tp_record(gpu, 2.7, tp=2, fsdp=True)]
    t_hybrid = recs[1]["results"]["time_s"]
    host = [["tp2", 1e-4], ["tp2+fsdp2", t_hybrid / 1.1]]  # measured within 1.25 x the host
    got = calibrate_tp.tp_scales(recs, gpu, lambda r: M, host)
    assert got["tp_block_scales"] == [[2, 0, pytest.approx(1.1, rel=1e-3)]]
    # well above its host time (and k = 0, the plain maximum) the record is in, unchanged
    host[1][1] = t_hybrid / 2.0
    got = calibrate_tp.tp_scales(recs, gpu, lambda r: M, host)
    assert got["tp_block_scales"][1] == [2, 1, pytest.approx(2.7, rel=1e-3)]
    # fit() measures the host first and hands it on: the same exclusion end to end
    scales, _ = calibrate_pieces.fit({"block": recs + [_host_record(t_hybrid / 1.1)]}, gpu)
    assert [row[:2] for row in scales["tp_block_scales"]] == [[2, 0]]
    spec = calibrate_pieces.apply(gpu, scales)
    assert overheads.tp_block_scale(spec, 2, True) == pytest.approx(1.1, rel=1e-3)


def test_the_host_share_is_taken_out_as_the_planner_puts_it_in():
    """A block whose GPU time d and host time h combine as the planner combines them
    (the smooth maximum of exponent k) gives back the scale of d, not of the sum."""
    gpu = _gpu()
    rec = _tp_record(gpu, 1.3, tp=2)
    d = rec["results"]["time_s"]
    for k, h in ((3.5, 0.6 * d), (2.0, 0.3 * d), (0.0, 0.7 * d)):
        rec["results"]["time_s"] = float(overheads.interleaved(d, h, k))
        got = calibrate_tp.tp_scales([rec], gpu, lambda r: M, [["tp2", h]], k)
        assert got["tp_block_scales"] == [[2, 0, pytest.approx(1.3, rel=1e-6)]]
    assert calibrate_tp.device_part(1.0, 0.9, 3.5) is None  # host-bound: no GPU time to read
    assert calibrate_tp.device_part(1.0, 0.0, 3.5) == 1.0  # no host time measured


def test_tp_scale_is_fitted_at_the_element_wise_scale_the_planner_prices_with():
    """The plain blocks' element-wise scale is fitted first and the TP block is priced with
    it, as `compute.microbatch_compute_time` prices it: the scale comes back unchanged."""
    gpu = _gpu()
    t = calibrate_pieces.block_terms(M, gpu, tokens=4096, seq=2048, recompute="none")
    amp = {"config": {"model": M.name, "model_spec": dataclasses.asdict(M), "tokens": 4096,
                      "seq": 2048, "micro_batch": 2, "compile": True, "recompute": "none",
                      "precision": "autocast-fp32"},
           "results": {"time_s": t["matmul"] + t["attention"] + 3.0 * t["elementwise"],
                       "activation_bytes": 0}}
    priced_at = dataclasses.replace(gpu, autocast_elementwise_scale=3.0)
    scales, _ = calibrate_pieces.fit({"block": [amp, _tp_record(priced_at, 1.2, tp=2)]}, gpu)
    assert scales["autocast_elementwise_scale"] == pytest.approx(3.0, rel=1e-3)
    assert scales["tp_block_scales"] == [[2, 0, pytest.approx(1.2, rel=1e-3)]]


def _host_record(seconds):
    c = {"model": M.name, "model_spec": dataclasses.asdict(M), "tp": 2, "micro_batch": 1,
         "seq": 64, "tokens": 64, "compile": True, "recompute": "none", "wrapper": "tp+fsdp2",
         "precision": "pure", "params": P_LAYER, "dp": 2, "zero": 3, "world": 4}
    return {"bench": "block", "purpose": "host", "config": c,
            "results": {"time_s": seconds, "activation_bytes": 0}}
