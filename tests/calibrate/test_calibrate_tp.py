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
    t_compute, rest = calibrate_tp.priced(M, gpu, recs[1]["config"])
    host = [["tp2", 1e-4], ["tp2+fsdp2", 1.01 * (t_compute + rest)]]
    got = calibrate_tp.tp_scales(recs, gpu, lambda r: M, host)
    assert got["tp_block_scales"] == [[2, 0, pytest.approx(1.1)]]
    # a host time below the block's priced GPU time leaves the record in
    host[1][1] = 0.99 * (t_compute + rest)
    got = calibrate_tp.tp_scales(recs, gpu, lambda r: M, host)
    assert got["tp_block_scales"][1] == [2, 1, pytest.approx(2.7)]
    # fit() measures the host first and hands it on: the same exclusion end to end
    scales, _ = calibrate_pieces.fit({"block": recs + [_host_record(host[1][1] * 1.03)]}, gpu)
    assert [row[:2] for row in scales["tp_block_scales"]] == [[2, 0]]
    spec = calibrate_pieces.apply(gpu, scales)
    assert overheads.tp_block_scale(spec, 2, True) == pytest.approx(1.1)


def _host_record(seconds):
    c = {"model": M.name, "model_spec": dataclasses.asdict(M), "tp": 2, "micro_batch": 1,
         "seq": 64, "tokens": 64, "compile": True, "recompute": "none", "wrapper": "tp+fsdp2",
         "precision": "pure", "params": P_LAYER, "dp": 2, "zero": 3, "world": 4}
    return {"bench": "block", "purpose": "host", "config": c,
            "results": {"time_s": seconds, "activation_bytes": 0}}
