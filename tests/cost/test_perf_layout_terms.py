"""The layout-specific step-time terms: TP collectives and copies, fp32 stream, DDP, accumulation.

Tiny model (conftest.py): l = 4 (8 where given), h = 64, V = 100. Easy GPU: 100 TFLOP/s,
1 TB/s HBM at 50 %. Easy cluster: 4 GPUs a node, 100 GB/s x 0.5 inside, 10 us latency.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import easy_cluster, easy_gpu, tiny_model
from trainplan.calibrate import store as calibration
from trainplan.calibrate.store import CalibrationError
from trainplan.cost import comms, compute
from trainplan.cost import measured as overheads
from trainplan.cost.step_time import _exposed, evaluate, fsdp_passes
from trainplan.errors import SpecError
from trainplan.specs import ParallelConfig
from trainplan.specs.layouts import Layouts

SEQ = 32


def _rows(*cfgs, gpu=None, m=None):
    return evaluate(m or tiny_model(n_layers=8), gpu or easy_gpu(), easy_cluster(),
                    Layouts.from_configs(list(cfgs)), SEQ)


# ---------------------------------------------------------------- which layouts autocast


def test_harness_precision_and_wrapper_by_layout():
    # (dp, zero, tp, pp) -> fp32 weights under autocast? DDP-wrapped? (bench/parallelize.py)
    cases = {(1, 0, 1, 1): (True, False), (2, 0, 1, 1): (True, True), (2, 2, 1, 1): (False, False),
             (1, 0, 4, 1): (True, False), (2, 3, 2, 1): (False, False), (1, 0, 1, 4): (True, False),
             (2, 0, 1, 2): (False, False), (2, 0, 2, 1): (False, False)}
    for (dp, zero, tp, pp), (amp, ddp) in cases.items():
        assert bool(compute.autocast_layout(dp, zero, tp, pp)) is amp, (dp, zero, tp, pp)
        assert bool(compute.ddp_layout(dp, zero, tp, pp)) is ddp, (dp, zero, tp, pp)
        assert bool(compute.fsdp_layout(dp, zero, tp, pp)) is not amp, (dp, zero, tp, pp)


# ---------------------------------------------------------------- tensor parallel


def test_tp_blocks_grow_with_tp_with_collectives_and_with_the_fp32_stream():
    cl, act = easy_cluster(), 4e6
    t = {n: comms.tp_microbatch_time(cl, act_bytes=act, tp=n, layers=2, recompute_full=False,
                                     sequence_parallel=True) for n in (1, 2, 4)}
    assert t[1] == 0 and 0 < t[2] < t[4]
    fwd, bwd = comms.tp_sublayer_time(cl, act_bytes=act, tp=4, sequence_parallel=True)
    assert t[4] == pytest.approx(2 * 2 * (fwd + bwd))  # 2 sublayers x 2 blocks, 4 collectives
    full = comms.tp_microbatch_time(cl, act_bytes=act, tp=4, layers=2, recompute_full=True,
                                    sequence_parallel=True)
    assert full == pytest.approx(t[4] + 2 * 2 * fwd)  # recompute replays the forward's two
    fp32 = comms.tp_microbatch_time(cl, act_bytes=act, tp=4, layers=2, recompute_full=False,
                                    sequence_parallel=True, stream_scale=2.0)
    ag = comms.collective_time(cl, "all_gather", act, 4, 4)
    rs = comms.collective_time(cl, "reduce_scatter", act, 4, 4)
    ag2 = comms.collective_time(cl, "all_gather", 2 * act, 4, 4)
    rs2 = comms.collective_time(cl, "reduce_scatter", 2 * act, 4, 4)
    assert fp32 == pytest.approx(4 * (ag2 + rs + rs2 + ag))  # norm output and its grad in fp32


def test_tp_ends_gather_the_logits_on_the_last_stage_only():
    cl = easy_cluster()
    kw = dict(act_bytes=1e6, tp=2, sequence_parallel=True)
    assert comms.tp_ends_time(cl, logits_bytes=1e8, **{**kw, "tp": 1}) == 0
    both = comms.tp_ends_time(cl, logits_bytes=1e8, **kw)
    inner = comms.tp_ends_time(cl, logits_bytes=1e8, first_stage=False, last_stage=False, **kw)
    last = comms.tp_ends_time(cl, logits_bytes=1e8, first_stage=False, **kw)
    assert inner == 0 and 0 < last < both
    assert last - comms.tp_ends_time(cl, logits_bytes=1e6, first_stage=False, **kw) == \
        pytest.approx(comms.collective_time(cl, "all_gather", 1e8, 2, 2)
                      - comms.collective_time(cl, "all_gather", 1e6, 2, 2))


def test_tp_layout_copies_read_and_write_each_gathered_tensor():
    gpu = easy_gpu()
    kw = dict(act_elems=1e6, stream_bytes=4, layers=2, recompute_full=False)
    t = compute.tp_layout_copy_time(gpu, tp=4, sequence_parallel=True, micro_batch=8, **kw)
    # per sublayer 2 x (4 + 2) B forward and backward, 2 sublayers, 2 blocks, at 0.5 TB/s
    assert t == pytest.approx(2 * 2 * 2 * 2 * 6 * 1e6 / 5e11)
    view = compute.tp_layout_copy_time(gpu, tp=4, sequence_parallel=True, micro_batch=1, **kw)
    assert view == pytest.approx(2 * 2 * 2 * 6 * 1e6 / 5e11)  # B = 1: the gathers are views
    assert compute.tp_layout_copy_time(gpu, tp=1, sequence_parallel=True, micro_batch=8, **kw) == 0
    assert compute.tp_layout_copy_time(gpu, tp=4, sequence_parallel=False, micro_batch=8,
                                       **kw) == 0


def test_tp_step_term_grows_with_tp_and_prices_the_whole_loss_on_every_rank():
    r2, r4 = _rows(ParallelConfig(tp=2, micro_batch=2), ParallelConfig(tp=4, micro_batch=2)) \
        .itertuples()
    assert 0 < r2.tp_comm_s < r4.tp_comm_s
    m, gpu = tiny_model(), easy_gpu()
    one = compute.head_analytic_per_token(m, gpu, tokens=64, tp=1)
    two = compute.head_analytic_per_token(m, gpu, tokens=64, tp=2)
    gemm = 3 * 2 * m.vocab * m.hidden / 5e13
    assert one - two == pytest.approx(gemm / 2)  # the GEMM splits, the loss (20 V B) does not


# ---------------------------------------------------------------- scales and DDP


def test_measured_scales_pick_by_precision_and_wrapper():
    m = tiny_model()
    kw = dict(seq_len=SEQ, micro_batch=2, tp=1, cp=1, pp=1, recompute=0,
              sequence_parallel=False, last_stage=False)
    base = easy_gpu()
    amp = dataclasses.replace(base, autocast_elementwise_scale=3.0, ddp_block_scale=1.5)
    t = compute.microbatch_compute_time(m, base, **kw)
    assert compute.microbatch_compute_time(m, amp, **kw) == pytest.approx(t)  # bf16: unchanged
    assert compute.microbatch_compute_time(m, base, autocast=True, **kw) == pytest.approx(t)
    slower = compute.microbatch_compute_time(m, amp, autocast=True, **kw)
    assert slower > t
    ddp = compute.microbatch_compute_time(m, amp, autocast=True, ddp=True, **kw)
    assert ddp == pytest.approx(1.5 * slower)
    head = {g: compute.head_time_per_token(m, g, tokens=64, tp=1, compiled=True)
            for g in (base, dataclasses.replace(base, compiled_head_scale=0.5))}
    assert list(head.values())[1] == pytest.approx(0.5 * list(head.values())[0])


def test_ddp_block_scale_reaches_the_step():
    m = tiny_model(n_layers=8)
    cfg = ParallelConfig(dp=2, micro_batch=2)
    plain = _rows(cfg, m=m).iloc[0]
    scaled = _rows(cfg, m=m, gpu=easy_gpu(ddp_block_scale=1.25)).iloc[0]
    blocks = compute.microbatch_compute_time(m, easy_gpu(), seq_len=SEQ, micro_batch=2, tp=1, cp=1,
                                             pp=1, recompute=0, sequence_parallel=False,
                                             last_stage=False)
    assert scaled.compute_s - plain.compute_s == pytest.approx(0.25 * blocks)


def test_fsdp_block_scale_reaches_fsdp2_layouts_only_and_only_their_blocks():
    m = tiny_model(n_layers=8)
    cfgs = {"1 GPU": ParallelConfig(micro_batch=2), "DDP": ParallelConfig(dp=2, micro_batch=2),
            "TP": ParallelConfig(tp=2, micro_batch=2), "PP": ParallelConfig(pp=2, grad_accum=4),
            "ZeRO-2": ParallelConfig(dp=2, zero=2, micro_batch=2),
            "ZeRO-3": ParallelConfig(dp=4, zero=3, micro_batch=2, grad_accum=2),
            "FSDP2 + TP": ParallelConfig(dp=2, tp=2, micro_batch=2)}
    plain = _rows(*cfgs.values(), m=m)
    scaled = _rows(*cfgs.values(), m=m, gpu=easy_gpu(fsdp_block_scale=1.25))
    for i, (name, cfg) in enumerate(cfgs.items()):
        p, s = plain.iloc[i], scaled.iloc[i]
        if not compute.fsdp_layout(cfg.dp, cfg.zero, cfg.tp, cfg.pp) or cfg.tp > 1:
            # TP blocks under FSDP2 take the TP x FSDP2 block's own scale (tp_block_scales)
            assert s.step_time_s == p.step_time_s, name  # bit for bit
            continue
        blocks = compute.microbatch_compute_time(
            m, easy_gpu(), seq_len=SEQ, micro_batch=cfg.micro_batch, tp=cfg.tp, cp=1, pp=cfg.pp,
            recompute=0, sequence_parallel=cfg.tp > 1, last_stage=False)
        assert s.compute_s - p.compute_s == pytest.approx(0.25 * cfg.grad_accum * blocks), name
        # the copies and collectives stay priced once, as traffic: the same terms (their
        # exposure may only shrink, under the longer compute they hide under)
        assert s.dp_comm_s <= p.dp_comm_s and s.tp_comm_s == p.tp_comm_s, name
        assert s.step_time_s >= p.step_time_s * (1 - 1e-12), name  # tiny model: comm-bound
    one = dict(seq_len=SEQ, micro_batch=2, tp=1, cp=1, pp=1, recompute=0,
               sequence_parallel=False, last_stage=False)
    gpu = easy_gpu(fsdp_block_scale=1.25, ddp_block_scale=1.5)
    base = compute.microbatch_compute_time(m, easy_gpu(), **one)
    assert compute.microbatch_compute_time(m, gpu, fsdp=True, **one) == pytest.approx(1.25 * base)
    assert compute.microbatch_compute_time(m, gpu, ddp=True, **one) == pytest.approx(1.5 * base)
    assert compute.microbatch_compute_time(m, gpu, **one) == base


# ---------------------------------------------------------------- accumulation and pipeline


def test_gradient_accumulation_bytes_by_layout():
    acc = compute.grad_accum_bytes_per_param
    assert acc(1, zero=0, shard_ranks=1, fsdp=False) == 0
    assert acc(1, zero=2, shard_ranks=4, fsdp=True) == 0
    assert acc(8, zero=0, shard_ranks=1, fsdp=False) == 7 * 12  # fp32 AccumulateGrad adds
    assert acc(8, zero=2, shard_ranks=4, fsdp=True) == 7 * 10 + 6  # FSDP2 upcast, then adds
    assert acc(8, zero=3, shard_ranks=4, fsdp=True) == pytest.approx(7 * 12 / 4)  # shards
    np.testing.assert_allclose(acc(np.array([1, 2, 4]), zero=0, shard_ranks=1, fsdp=False),
                               [0, 12, 36])


def test_fsdp_traffic_runs_when_the_harness_and_torch_pipelining_run_it():
    """ZeRO-3 moves a stage every micro-batch; ZeRO-2 gathers and reduces once a step, with
    accumulation as without; under a pipeline ZeRO-2's reduce-scatter waits for the last
    backward and nothing hides it."""
    runs = {k: float(v) for k, v in fsdp_passes(2, 2).items()}
    assert runs == {"gathers_mb": 0.0, "reduces_mb": 0.0, "gathers_once": 1.0,
                    "reduces_once": 0.0, "reduces_tail": 1.0}
    assert float(fsdp_passes(3, 1)["gathers_mb"]) == 2.0 and float(fsdp_passes(2, 1)[
        "reduces_once"]) == 1.0 and float(fsdp_passes(1, 2)["reduces_tail"]) == 0.0

    def dp(zero, ga, pp=1):
        return float(_rows(ParallelConfig(dp=2, zero=zero, micro_batch=2, grad_accum=ga, pp=pp),
                           m=tiny_model(n_layers=8, hidden=512, ffn=1024))["dp_comm_s"].iloc[0])
    # once a step (a longer window with accumulation's adds hides a little more of it)
    assert 0 < dp(2, 4) <= dp(2, 1)
    assert dp(3, 4) > 3 * dp(3, 1)  # every micro-batch
    ag, rs = comms.fsdp_collectives(easy_cluster(), stage_params=1e8, dp_shard=2, cp=1, tp=1)
    assert comms.dp_microbatch_time(easy_cluster(), stage_params=1e8, zero=3, dp_shard=2, cp=1,
                                    tp=1) == pytest.approx(2 * ag + rs)
    assert dp(2, 4, pp=2) > dp(2, 4) / 2  # the tail reduce of half the weights, all exposed


def test_fsdp_traffic_beside_tensor_parallel_is_priced_whole():
    """FSDP2 beside TP costs its whole traffic, as `calibrate.tp` reads the TP x FSDP2 block
    microbenchmark; alone or beside context parallel only `overlap_exposed` of what compute
    hides shows."""
    gpu = easy_gpu(overlap_exposed=0.1)
    assert overheads.fsdp_leak(gpu, [1, 2, 2, 1], [True, True, False, False]).tolist() == [
        0.1, 1.0, 0.1, 0.1]
    m = tiny_model(n_layers=8, hidden=512, ffn=1024)

    def dp_comm(leak, **layout):
        cfg = ParallelConfig(zero=3, micro_batch=8, **layout)
        return float(_rows(cfg, gpu=easy_gpu(overlap_exposed=leak), m=m)["dp_comm_s"].iloc[0])
    # beside TP the share measured for a GEMM beside a collective no longer matters: all shows
    assert dp_comm(0.1, dp=2, tp=2) == pytest.approx(dp_comm(1.0, dp=2, tp=2))
    assert dp_comm(0.1, dp=2, tp=2) > 0
    for alone in ({"dp": 4}, {"dp": 2, "cp": 2}):  # hidden under compute, a share leaking
        assert dp_comm(0.1, **alone) < dp_comm(1.0, **alone)
    # what shows: the window's excess or the floor, plus the leak's share of the rest; at a
    # leak of 1 exactly the traffic, the floor not counted twice
    comm, window = np.array([4.0, 4.0, 4.0]), np.array([1.0, 10.0, 10.0])
    assert _exposed(comm, window, np.array([1.0, 1.0, 0.0]), 0.5).tolist() == [3.5, 2.5, 2.0]
    assert _exposed(comm, window, comm * 0.5, 1.0).tolist() == comm.tolist()


def test_pipeline_sends_carry_the_fp32_stream_under_autocast():
    autocast, fsdp = _rows(ParallelConfig(pp=2, grad_accum=4, micro_batch=2),
                           ParallelConfig(dp=2, zero=2, pp=2, grad_accum=4, micro_batch=2)) \
        .itertuples()
    assert autocast.pp_comm_s > fsdp.pp_comm_s > 0


# ---------------------------------------------------------------- bad calibrations


@pytest.mark.parametrize("curve", [((1.0, 0.5),), ((4096, 1e6, 1.5),), ((4096, -1, 0.5),),
                                   ((16384, 1e6, 0.7), (4096, 1e6, 0.6)),
                                   ((4096, 1e6, 0.6), (4096, 1e6, 0.7)), ((4096, 1e6, True),)])
def test_bad_matmul_curves_are_rejected_by_name(curve):
    with pytest.raises(SpecError, match=r"GPUSpec\.matmul_curve\[\d\].*tokens > 0, width > 0"):
        easy_gpu(matmul_curve=curve)


def test_bad_layout_scales_are_rejected():
    with pytest.raises(SpecError, match="ddp_block_scale"):
        easy_gpu(ddp_block_scale=0.0)
    for bad in (0.0, -1.0):
        with pytest.raises(SpecError, match=rf"GPUSpec\.fsdp_block_scale = {bad} is not valid; "
                                            "it must be > 0"):
            easy_gpu(fsdp_block_scale=bad)
    with pytest.raises(SpecError, match="fsdp_block_scale = 'x' is not valid; use a finite"):
        easy_gpu(fsdp_block_scale="x")
    with pytest.raises(SpecError, match="autocast_elementwise_scale"):
        easy_gpu(autocast_elementwise_scale=-1.0)
    cal = {"label": "bad", "matmul_efficiency": 0.8, "attention_efficiency": 0.5,
           "collectives": {}, "pieces": {"matmul_curve": [[4096, 1e6, 2.0]]}}
    with pytest.raises(CalibrationError, match="matmul_curve"):
        calibration.apply(easy_gpu(), cal)
