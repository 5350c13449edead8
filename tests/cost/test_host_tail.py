"""The step's host work outside the blocks (clipping, optimizer, zero_grad): issued after the
last backward, it hides under the GPU's queued backward where the layout runs without FSDP2
(`measured.last_microbatch_time`), and keeps the one-phase coupling under FSDP2.

Made-up host times on the H100 preset (no calibration file read), the 1.3B proxy at 2048
tokens a sequence, the dgx-h100 cluster.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainplan.calibrate.store import load_gpu
from trainplan.cost import measured as overheads
from trainplan.cost.step_time import evaluate
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import Layouts

M = load_model("llama-1.3b")  # 24 layers
K = 3.5  # the exponent the H200 calibration measured (calibrate_host.overlap_k)


def _gpu(**kw):
    return dataclasses.replace(load_gpu("h100-sxm", calibrated=False), **kw)


def _eval(gpu, *cfgs):
    return evaluate(M, gpu, load_cluster("dgx-h100"), Layouts.from_configs(list(cfgs)), 2048)


def test_a_tail_shorter_than_the_gpu_backlog_costs_nothing_without_fsdp2():
    d, h_b, h_s = 0.10, 0.04, 0.03  # the GPU is 0.06 s behind when the blocks are issued
    two = overheads.last_microbatch_time(d, h_b, h_s, K, tail_phase=True)
    assert float(two) == pytest.approx(float(overheads.interleaved(d, h_b, K)))
    one = overheads.last_microbatch_time(d, h_b, h_s, K, tail_phase=False)
    assert float(one) == pytest.approx(float(overheads.interleaved(d, h_b + h_s, K)))
    assert float(one) > float(two) + 1e-3  # the one-phase form charges the tail's coupling


def test_a_tail_longer_than_the_backlog_adds_what_the_host_finishes_after_the_gpu():
    d, h_b, h_s = 0.10, 0.06, 0.08  # host done at 0.14 s, after the GPU's ~0.10 s
    two = overheads.last_microbatch_time(d, h_b, h_s, K, tail_phase=True)
    assert float(two) == pytest.approx(h_b + h_s)
    assert float(two) < float(overheads.interleaved(d, h_b + h_s, K))


def test_the_two_phase_time_lies_between_the_roofline_and_the_one_phase_form():
    rng = np.random.default_rng(1)
    d, h_b, h_s = (rng.uniform(1e-3, 0.3, 256) for _ in range(3))
    h_s[:32] = 0.0
    for k in (0.0, 1.0, K, 8.0):
        two = overheads.last_microbatch_time(d, h_b, h_s, k, tail_phase=True)
        one = overheads.last_microbatch_time(d, h_b, h_s, k, tail_phase=False)
        assert (two >= np.maximum(d, h_b + h_s) - 1e-15).all()
        assert (two <= one + 1e-15).all()
        # no host work outside the blocks: both forms are the blocks' interleave, bit for bit
        assert (two[:32] == one[:32]).all()
        assert (two[:32] == overheads.interleaved(d[:32], h_b[:32], k)).all()


def test_tp_alone_step_hides_the_optimizer_s_host_work_under_a_device_bound_backward():
    # TP 4 at micro-batch 8: 24 x 1 ms of host blocks, far below the GPU's time; a 30 ms tail
    tp4 = ParallelConfig(tp=4, micro_batch=8)
    blocks = (("tp4", 0.001), ("plain", 0.001))
    base = _gpu(host_block_s=blocks, host_overlap_k=K)
    tail = _gpu(host_block_s=blocks, host_overlap_k=K, host_step_s=(("tp4", 0.03),))
    b, a = _eval(base, tp4).iloc[0], _eval(tail, tp4).iloc[0]
    assert b["compute_s"] > 24 * 0.001 + 0.03  # device-bound, with room for the tail
    assert a["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-12)


def test_tp_alone_host_bound_step_pays_the_tail_in_full():
    tp4 = ParallelConfig(tp=4, micro_batch=1)
    blocks = (("tp4", 0.02),)  # 24 x 20 ms: host-bound
    base = _gpu(host_block_s=blocks, host_overlap_k=K)
    tail = _gpu(host_block_s=blocks, host_overlap_k=K, host_step_s=(("tp4", 0.03),))
    b, a = _eval(base, tp4).iloc[0], _eval(tail, tp4).iloc[0]
    t_dev = b["step_time_s"] - b["host_wait_s"] - b["optimizer_s"]
    assert float(overheads.interleaved(t_dev, 24 * 0.02, K)) < 24 * 0.02 + 0.03
    assert a["host_wait_s"] + t_dev == pytest.approx(24 * 0.02 + 0.03)


def test_fsdp2_layouts_keep_the_one_phase_coupling():
    cfg = ParallelConfig(tp=2, dp=2, zero=3, micro_batch=8)
    gpu = _gpu(host_block_s=(("tp2+fsdp2", 0.002),), host_overlap_k=K,
               host_step_s=(("tp2+fsdp2", 0.03),))
    base = _gpu(host_block_s=(("tp2+fsdp2", 0.002),), host_overlap_k=K)
    a, b = _eval(gpu, cfg).iloc[0], _eval(base, cfg).iloc[0]
    t_dev = b["step_time_s"] - b["host_wait_s"] - b["optimizer_s"]
    want = float(overheads.interleaved(t_dev, 24 * 0.002 + 0.03, K)) - t_dev
    assert a["host_wait_s"] == pytest.approx(want, rel=1e-9)
    assert a["host_wait_s"] > b["host_wait_s"]
