"""The compute stream's reserve per layer: the fit over the memory-stack bench's depths, its
clamps and skips, the calibration's hook, the YAML round trip, and the planner (a measured
scale moves only its wrapper's layouts, by layer; nothing measured: bit for bit as before)."""

import dataclasses

import numpy as np
import pytest

from trainplan.calibrate import fit as calibrate
from trainplan.calibrate import memory as calibrate_memory
from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate import store as calibration
from trainplan.calibrate.store import load_gpu
from trainplan.cost import memory
from trainplan.cost import memory_runtime as rt
from trainplan.cost.measured import activation_scale
from trainplan.errors import SpecError
from trainplan.specs import ParallelConfig, load_model
from trainplan.specs.layouts import Layouts

M = load_model("llama-13b")
GiB = 2**30


def _gpu(**kw):
    return dataclasses.replace(load_gpu("h100-sxm", calibrated=False), **kw)


def _config(tp, zero, layers, mb=1, seq=4096):
    wrapper = ("tp+fsdp2" if zero else "tp") if tp > 1 else ("fsdp2" if zero else "plain")
    spec = dataclasses.asdict(dataclasses.replace(M, n_layers=layers))
    return {"model": M.name, "model_spec": spec, "wrapper": wrapper, "tp": tp, "zero": zero,
            "layers": layers, "micro_batch": mb, "seq": seq, "compile": True,
            "precision": "pure" if zero else "autocast-fp32"}


def _rec(tp, zero, layers, reserve, *, side=0, mb=1, seq=4096, allocated=20 * GiB):
    """A made-up memory-stack record whose compute stream holds `reserve` bytes unallocated."""
    return {"purpose": "memory-stack", "bench": "block",
            "config": _config(tp, zero, layers, mb, seq),
            "results": {"peak_reserved_bytes": allocated + reserve + side,
                        "peak_allocated_bytes": allocated, "side_pool_bytes": side}}


def _kept(tp, zero, mb=1, seq=4096, gpu=None):
    return calibrate_memory.kept_bytes(_config(tp, zero, 2, mb, seq), M, gpu or _gpu())


def _spec(record):
    return calibrate_pieces._spec(record)


def test_two_depths_recover_the_scale_and_the_side_pools_come_off():
    gpu = _gpu()
    plain, z2, z3, tp = _kept(1, 0), _kept(1, 2), _kept(1, 3, mb=2), _kept(2, 0, mb=2)
    side = 0.59 * GiB  # the reduce-scatter pool grows a layer too: stream_pool_bytes' share
    recs = [_rec(1, 0, n, 1.5 * GiB + n * 0.55 * plain) for n in (2, 4)] \
        + [_rec(1, 2, n, 2.3 * GiB + n * 0.07 * z2, side=n * side) for n in (2, 4)] \
        + [_rec(1, 3, n, 1.0 * GiB + n * 0.55 * z3, side=n * side, mb=2) for n in (2, 4)] \
        + [_rec(2, 0, n, 0.9 * GiB + n * 0.08 * tp, mb=2) for n in (2, 4)]
    got = calibrate_memory.fragmentation_scales(recs, gpu, _spec)
    assert got["fragmentation_scales"] == [["fsdp2", pytest.approx(0.07, abs=1e-4)],
                                           ["fsdp2:z3", pytest.approx(0.55, abs=1e-4)],
                                           ["plain", pytest.approx(0.55, abs=1e-4)],
                                           ["tp2", pytest.approx(0.08, abs=1e-4)]]
    fit = dict((w, (b, k)) for w, b, k in got["fragmentation_fit"])
    assert fit["plain"] == pytest.approx((0.55 * plain / GiB, plain / GiB), abs=1e-4)
    # the planner's own kept bytes of one 13B block (calibrated h100: 1.26 GiB one GPU mb 1)
    cal = load_gpu("h100-sxm")
    assert _kept(1, 0, gpu=cal) / GiB == pytest.approx(1.26, abs=0.01)
    assert _kept(1, 3, mb=2, gpu=cal) / GiB == pytest.approx(1.26, abs=0.01)
    assert _kept(2, 0, mb=2, gpu=cal) / GiB == pytest.approx(1.03, abs=0.01)
    # three depths: least squares through the medians per depth
    noisy = [_rec(1, 0, n, 1.5 * GiB + n * 0.3 * plain + e)
             for n, e in ((1, 2**20), (2, -2**21), (4, 2**20))]
    slope = np.polyfit([1, 2, 4], [calibrate_memory.reserve_bytes(r) for r in noisy], 1)[0]
    got = calibrate_memory.fragmentation_scales(noisy, gpu, _spec)["fragmentation_scales"]
    assert got == [["plain", pytest.approx(slope / plain, abs=1e-4)]]


def test_clamps_skips_and_one_depth_gives_no_row():
    gpu = _gpu()
    shrinking = [_rec(1, 0, n, 3 * GiB - n * 0.1 * GiB) for n in (2, 4)]
    assert calibrate_memory.fragmentation_scales(shrinking, gpu, _spec)[
        "fragmentation_scales"] == [["plain", 0.0]]
    one = [_rec(1, 2, 4, 3 * GiB), _rec(1, 2, 4, 3.1 * GiB)]  # one depth: no slope
    assert calibrate_memory.fragmentation_scales(one, gpu, _spec) == {}
    cpu = [_rec(1, 0, n, 0) for n in (2, 4)]
    for r in cpu:
        r["results"] = {**r["results"], "peak_reserved_bytes": None, "peak_allocated_bytes": None}
    assert calibrate_memory.fragmentation_scales(cpu, gpu, _spec) == {}  # no bytes: skipped
    two = [_rec(1, 0, n, n * 0.5 * _kept(1, 0)) for n in (2, 4)]
    got = calibrate_memory.fragmentation_scales(one + two + cpu, gpu, _spec)
    assert [w for w, _ in got["fragmentation_scales"]] == ["plain"]
    other = [{**r, "purpose": "host-step"} for r in two]  # not this bench's
    assert calibrate_memory.fragmentation_scales(other, gpu, _spec) == {}
    # older records without side pools: reserved - allocated, as the brief's formula
    r = _rec(1, 2, 2, 5 * GiB)
    del r["results"]["side_pool_bytes"]
    assert calibrate_memory.reserve_bytes(r) == 5 * GiB
    assert [calibrate_memory.wrapper_key(_config(t, z, 2)) for t, z in
            ((1, 0), (1, 2), (1, 3), (2, 0), (2, 3))] == \
        ["plain", "fsdp2", "fsdp2:z3", "tp2", "tp2+fsdp2:z3"]


def test_the_calibration_fits_stacks_apart_from_the_block_scales():
    recs = [_rec(1, 0, n, n * 0.5 * _kept(1, 0)) for n in (2, 4)] \
        + [_rec(1, 2, n, n * 0.1 * _kept(1, 2), side=n * GiB) for n in (2, 4)]
    out, checks = calibrate_pieces.fit({"block": recs}, _gpu())
    assert out["fragmentation_scales"] == [["fsdp2", pytest.approx(0.1, abs=1e-4)],
                                           ["plain", pytest.approx(0.5, abs=1e-4)]]
    assert checks == [] and "fsdp_block_scale" not in out  # no block scale from a stack
    gpu = calibrate_pieces.apply(_gpu(), out)
    assert gpu.fragmentation_scales == (("fsdp2", out["fragmentation_scales"][0][1]),
                                        ("plain", out["fragmentation_scales"][1][1]))
    # the activation scale the calibration measured prices the kept bytes
    scaled = dataclasses.replace(_gpu(), activation_scales=((True, "none", 0.5),))
    assert calibrate_memory.kept_bytes(_config(1, 2, 2), M, scaled) == pytest.approx(
        0.5 * _kept(1, 2))
    assert activation_scale(scaled, True, 0) == 0.5


def test_the_field_validates_and_survives_the_calibration_yaml(tmp_path):
    for bad in ((("plain",),), ((1, 0.1),), (("tp2", -0.1),)):
        with pytest.raises(SpecError, match="fragmentation_scales"):
            _gpu(fragmentation_scales=bad)
    assert _gpu().fragmentation_scales == ()  # inert until measured
    pieces = {"fragmentation_scales": [["fsdp2:z3", 0.55], ["plain", 0.55], ["tp2", 0.08]],
              "fragmentation_fit": [["plain", 0.69, 1.26]]}
    cal = {"gpu": "h100-sxm", "card": ["NVIDIA H100 80GB HBM3"], "label": "test",
           "matmul_efficiency": 0.7,
           "attention_efficiency": 0.5, "collectives": {}, "pieces": pieces}
    path = calibrate.write(cal, tmp_path / "cal.yaml")
    gpu = calibration.apply(_gpu(), calibration.load("h100-sxm", path))
    assert gpu.fragmentation_scales == (("fsdp2:z3", 0.55), ("plain", 0.55), ("tp2", 0.08))
    assert calibrate_pieces.apply(_gpu(), {"fragmentation_scales": []}).fragmentation_scales == ()


CONFIGS = [ParallelConfig(micro_batch=1), ParallelConfig(dp=2, zero=2, micro_batch=1),
           ParallelConfig(dp=2, zero=3, micro_batch=2), ParallelConfig(tp=2, micro_batch=2),
           ParallelConfig(tp=4, dp=2, zero=3, micro_batch=1), ParallelConfig(dp=4, micro_batch=2),
           ParallelConfig(pp=2, dp=2, zero=1, micro_batch=1, grad_accum=4)]


def _memory(gpu, model=M, cfgs=CONFIGS):
    """`memory.breakdown` over `cfgs` as `perf.evaluate` calls it, with the card `gpu`, under
    the caching allocator (the mode whose reserve `fragmentation_scales` price)."""
    L = Layouts.from_configs(list(cfgs))
    cal = load_gpu("h100-sxm")
    return memory.breakdown(
        model, L, seq_len=4096, activation_scale=activation_scale(cal, True, L.recompute),
        rebuilt_scale=activation_scale(cal, True, 0), logits_scale=cal.logits_scale,
        compiled_loss=True, gpu=gpu, allocator=rt.CACHING)


def test_nothing_measured_leaves_the_planner_bit_for_bit_as_before():
    before = _memory(None)
    for gpu in (_gpu(), load_gpu("h100-sxm")):  # no fragmentation_scales on either
        after = _memory(gpu)
        assert all(np.array_equal(before[k], after[k]) for k in before)
    L = Layouts.from_configs(CONFIGS)
    path = rt.harness_path(L.dp, L.tp, L.pp, L.zero)
    kw = dict(tp=L.tp, pp=L.pp, ep=L.ep, zero=L.zero, dp_shard=L.dp_shard, cp=L.cp)
    buffers = memory.buffer_bytes(M, dp=L.dp, **kw)
    buffers = np.where(path == rt.FSDP, buffers, np.where(path == rt.DDP, buffers, 0.0))
    head = rt.head_block_bytes(M, seq_len=4096, micro_batch=L.micro_batch, cp=L.cp,
                               compiled_loss=True)
    old = buffers + (rt.stream_pool_bytes(M, path=path, **kw)
                     + rt.root_reduce_bytes(M, path=path, head_block=head, **kw)
                     + rt.FRAGMENTATION * np.asarray(before["activations"]))
    assert np.array_equal(before["other"], old)  # the assumption, as it was written


def test_a_measured_scale_moves_only_its_wrappers_layouts_and_grows_with_depth():
    base = _memory(None)
    L = Layouts.from_configs(CONFIGS)
    tp_layouts = L.tp > 1
    got = _memory(_gpu(fragmentation_scales=(("tp2", 0.5),)))  # tp4 takes tp2's, tp+fsdp2 too
    extra = got["other"] - base["other"]
    assert np.array_equal(extra[~tp_layouts], np.zeros((~tp_layouts).sum()))
    assert extra[tp_layouts] == pytest.approx((0.5 - rt.FRAGMENTATION)
                                              * base["activations"][tp_layouts])
    # ZeRO-2 and ZeRO-3 apart; plain not measured stays the assumption
    stages = _gpu(fragmentation_scales=(("fsdp2", 0.07), ("fsdp2:z3", 0.55)))
    scale = rt.fragmentation_scale(stages, tp=L.tp, fsdp=rt.harness_path(L.dp, L.tp, L.pp,
                                                                          L.zero) == rt.FSDP,
                                   zero=L.zero)
    assert scale.tolist() == pytest.approx([0.08, 0.07, 0.55, 0.08, 0.55, 0.08, 0.07])
    one_stage = _gpu(fragmentation_scales=(("fsdp2:z3", 0.55),))  # ZeRO-2 takes ZeRO-3's
    assert rt.fragmentation_scale(one_stage, tp=1, fsdp=True, zero=2) == pytest.approx(0.55)
    # by layer: the 13B model's first 2, 4 and 8 blocks, one GPU (its bf16 stream), plain at 0.55
    plain = _gpu(fragmentation_scales=(("plain", 0.55),))
    one = [ParallelConfig(micro_batch=1)]
    extras = [float((_memory(plain, m, one)["other"] - _memory(None, m, one)["other"])[0])
              for m in (dataclasses.replace(M, n_layers=n) for n in (2, 4, 8))]
    per_layer = (0.55 - rt.FRAGMENTATION) * float(memory.layer_kept_bytes(
        M, seq_len=4096, micro_batch=1, tp=1, cp=1, recompute=0, sequence_parallel=False,
        scale=activation_scale(load_gpu("h100-sxm"), True, 0), path=rt.SINGLE))
    assert extras[1] - extras[0] == pytest.approx(2 * per_layer)
    assert extras[2] - extras[1] == pytest.approx(4 * per_layer)
