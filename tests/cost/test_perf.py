"""Step time, bubble, throughput and MFU from `perf.evaluate`."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import easy_cluster, easy_gpu, free_cluster, layouts, tiny_model
from trainplan.calibrate.store import load_gpu
from trainplan.cost import comms, compute, memory, params
from trainplan.cost.step_time import evaluate
from trainplan.specs import ParallelConfig, load_cluster, load_model
from trainplan.specs.layouts import Layouts

SEQ = 32


def _row(cfg: ParallelConfig, m=None, gpu=None, cluster=None, seq=SEQ):
    m = m or tiny_model(n_layers=8)
    return evaluate(m, gpu or easy_gpu(), cluster or easy_cluster(), Layouts.from_configs([cfg]),
                    seq).iloc[0]


LAYOUTS = [
    ParallelConfig(dp=8),
    ParallelConfig(dp=4, zero=1, micro_batch=2, grad_accum=4),
    ParallelConfig(dp=4, zero=2, grad_accum=8),
    ParallelConfig(dp=8, zero=3, dp_shard=4, grad_accum=2),
    ParallelConfig(dp=2, tp=2, pp=2, grad_accum=8),
    ParallelConfig(dp=1, tp=2, pp=4, grad_accum=8, pp_schedule="interleaved", pp_virtual=2),
    ParallelConfig(dp=2, tp=2, cp=2, zero=3, recompute="full", micro_batch=2),
    ParallelConfig(dp=2, pp=4, grad_accum=2, pp_schedule="gpipe", recompute="selective"),
]


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: f"dp{c.dp}tp{c.tp}pp{c.pp}cp{c.cp}z{c.zero}")
def test_step_time_is_the_sum_of_its_terms(cfg):
    r = _row(cfg)
    total = r["compute_s"] + r["exposed_comm_s"] + r["bubble_s"] + r["optimizer_s"]
    assert r["step_time_s"] == pytest.approx(total, rel=1e-12)
    assert min(r["compute_s"], r["exposed_comm_s"], r["bubble_s"], r["optimizer_s"]) >= 0
    comm_parts = sum(r[k] for k in ("tp_comm_s", "dp_comm_s", "pp_comm_s", "cp_comm_s",
                                    "ep_comm_s"))
    assert comm_parts == pytest.approx(r["exposed_comm_s"], rel=1e-12)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: f"dp{c.dp}tp{c.tp}pp{c.pp}cp{c.cp}z{c.zero}")
def test_throughput_and_mfu_formulas(cfg):
    m, gpu = tiny_model(n_layers=8), easy_gpu()
    r = _row(cfg, m=m, gpu=gpu)
    tokens = cfg.dp * cfg.micro_batch * cfg.grad_accum * SEQ
    assert r["tokens_per_step"] == tokens
    assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-12)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / cfg.world, rel=1e-12)
    # MFU = tokens/s x (6 N + 12 l h s) / (gpus x peak); recompute not counted
    flops = 6 * params.flop_params(m) + 12 * m.n_layers * m.hidden * SEQ
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (cfg.world * 100e12), rel=1e-12)


def test_compute_term_is_grad_accum_micro_batches_of_the_last_stage():
    cfg = ParallelConfig(dp=2, tp=2, pp=2, grad_accum=8)
    m, gpu = tiny_model(n_layers=8), easy_gpu()
    t_mb = compute.microbatch_compute_time(m, gpu, seq_len=SEQ, micro_batch=1, tp=2, cp=1, pp=2,
                                           recompute=0, sequence_parallel=True)
    # dp 2 beside tp and pp runs FSDP2 (shard group of one): its fp32 gradient accumulation
    stage = params.stage_params_per_rank(m, 2, 2, 1)
    adds = compute.grad_accum_time(gpu, stage, 8, zero=0, shard_ranks=1, fsdp=True)
    assert adds > 0
    assert _row(cfg, m=m, gpu=gpu)["compute_s"] == pytest.approx(8 * t_mb + adds, rel=1e-12)


def test_optimizer_term_uses_the_parameters_this_rank_updates():
    m, gpu = tiny_model(n_layers=8), easy_gpu()
    stage = params.stage_params_per_rank(m, 1, 1, 1)
    r0 = _row(ParallelConfig(dp=4, grad_accum=2), m=m, gpu=gpu)
    r1 = _row(ParallelConfig(dp=4, zero=1, grad_accum=2), m=m, gpu=gpu)
    assert r0["optimizer_s"] == pytest.approx(32 * stage / 5e11)
    assert r1["optimizer_s"] == pytest.approx(32 * stage / 4 / 5e11)


def test_no_communication_for_one_gpu():
    r = _row(ParallelConfig(grad_accum=4))
    assert r["exposed_comm_s"] == 0 and r["bubble_s"] == 0
    assert r["step_time_s"] == pytest.approx(r["compute_s"] + r["optimizer_s"])


@pytest.mark.parametrize(("p", "m_", "v", "schedule"), [
    (2, 4, 1, "1f1b"), (4, 8, 1, "1f1b"), (4, 4, 1, "1f1b"), (8, 16, 1, "1f1b"),
    (4, 8, 2, "interleaved"), (2, 8, 4, "interleaved"), (4, 2, 1, "gpipe"),
])
def test_bubble_fraction_when_communication_is_free(p, m_, v, schedule):
    """Stages of equal time (a model whose output layer is a vanishing share of the last
    stage): the textbook bubble fraction (p - 1) / (v m + p - 1)."""
    cfg = ParallelConfig(dp=1, pp=p, grad_accum=m_, pp_schedule=schedule, pp_virtual=v)
    r = _row(cfg, m=tiny_model(n_layers=16, vocab=1), cluster=free_cluster())
    assert r["exposed_comm_s"] == pytest.approx(0, abs=1e-12)
    busy = r["step_time_s"] - r["optimizer_s"]  # compute + bubble
    assert r["bubble_s"] / busy == pytest.approx((p - 1) / (v * m_ + p - 1), rel=1e-3)


def test_the_bubble_is_of_stages_without_the_output_layer():
    """The last stage alone runs the output layer and loss: it sets the pace of the m steady
    slots, and the p - 1 slots of fill and drain are the other stages' micro-batches."""
    m, gpu, p, m_ = tiny_model(n_layers=8, vocab=5000), easy_gpu(), 4, 8
    r = _row(ParallelConfig(pp=p, grad_accum=m_), m=m, gpu=gpu, cluster=free_cluster())
    stage = dict(m=m, gpu=gpu, seq_len=SEQ, micro_batch=1, tp=1, cp=1, pp=p, recompute=0,
                 sequence_parallel=True, autocast=True)
    last = float(compute.microbatch_compute_time(**stage))
    inner = float(compute.microbatch_compute_time(**stage, last_stage=False))
    assert last > 1.5 * inner  # a head worth pricing apart
    t_mb = r["compute_s"] / m_  # a micro-batch of the last stage (no communication here)
    assert t_mb >= last
    assert r["bubble_s"] == pytest.approx((p - 1) * (t_mb - (last - inner)), rel=1e-6)


def test_bubble_is_zero_without_pipeline():
    assert _row(ParallelConfig(dp=8, grad_accum=4), cluster=free_cluster())["bubble_s"] == 0


def test_tp_comm_term_matches_comms_model():
    cfg = ParallelConfig(dp=1, tp=4, grad_accum=3)
    m, cl = tiny_model(n_layers=8), easy_cluster()
    r = _row(cfg, m=m, cluster=cl)
    act = 2 * SEQ * m.hidden  # bf16 b s h, micro-batch 1
    # one data-parallel rank: fp32 weights under autocast, an fp32 residual stream (x 2)
    blocks = comms.tp_microbatch_time(cl, act_bytes=act, tp=4, layers=8, recompute_full=False,
                                      sequence_parallel=True, stream_scale=2.0)
    ends = comms.tp_ends_time(cl, act_bytes=act, logits_bytes=2 * SEQ * m.vocab, tp=4,
                              sequence_parallel=True, stream_scale=2.0)
    copies = compute.tp_layout_copy_time(easy_gpu(), act_elems=SEQ * m.hidden, stream_bytes=4,
                                         tp=4, layers=8, recompute_full=False,
                                         sequence_parallel=True, micro_batch=1)
    assert r["tp_comm_s"] == pytest.approx(3 * (blocks + ends + copies), rel=1e-12)
    bf16 = comms.tp_microbatch_time(cl, act_bytes=act, tp=4, layers=8, recompute_full=False,
                                    sequence_parallel=True)
    assert blocks > bf16  # the fp32 stream's gathers move twice the bytes


def test_ddp_gradient_all_reduce_hides_under_backward():
    # DDP over 8 ranks on two nodes: exposed = max(ar - 2/3 t_mb, ar / layers)
    m, gpu, cl = tiny_model(n_layers=8), easy_gpu(), easy_cluster()
    r = _row(ParallelConfig(dp=8, grad_accum=2), m=m, gpu=gpu, cluster=cl)
    stage = params.stage_params_per_rank(m, 1, 1, 1)
    ar = comms.collective_time(cl, "all_reduce", 4 * stage, 8, 8)
    t_mb = compute.microbatch_compute_time(m, gpu, seq_len=SEQ, micro_batch=1, tp=1, cp=1, pp=1,
                                           recompute=0, sequence_parallel=False, autocast=True,
                                           ddp=True)
    t_mb += compute.grad_accum_time(gpu, stage, 2, zero=0, shard_ranks=1, fsdp=False) / 2
    _, copies = compute.dp_copy_time(gpu, stage, zero=0, shard_ranks=1, dp_ranks=8)  # buckets
    assert r["dp_comm_s"] == pytest.approx(max(ar - 2 / 3 * t_mb, ar / 8) + copies, rel=1e-12)


def test_memory_columns_match_memory_model():
    cfg = ParallelConfig(dp=4, tp=2, zero=3, micro_batch=2, grad_accum=2)
    m = tiny_model(n_layers=8)
    r = _row(cfg, m=m)
    mem = memory.breakdown(m, layouts(dp=4, dp_shard=4, tp=2, zero=3, micro_batch=2,
                                      grad_accum=2), seq_len=SEQ, compiled_loss=True)
    mem = {k: v.item() for k, v in mem.items()}
    for k in ("params", "grads", "optimizer", "activations", "other", "total"):
        assert r[f"{k}_gib"] == pytest.approx(float(mem[k]) / 2**30, rel=1e-12)
    assert bool(r["fits"]) == bool(memory.fits(mem["total"], 10.0))


def test_sequence_parallel_is_off_without_tp():
    # with tp = 1 sequence_parallel=True must not change anything
    a = _row(ParallelConfig(dp=2, sequence_parallel=True))
    b = _row(ParallelConfig(dp=2, sequence_parallel=False))
    assert a["step_time_s"] == b["step_time_s"] and a["total_gib"] == b["total_gib"]


def test_llama_13b_on_32_h100_is_plausible():
    m, gpu, cl = load_model("llama-13b"), load_gpu("h100-sxm"), load_cluster("dgx-h100")
    cfg = ParallelConfig(dp=32, zero=3, dp_shard=8, micro_batch=1, grad_accum=32)  # HSDP
    r = evaluate(m, gpu, cl, Layouts.from_configs([cfg]), 4096).iloc[0]
    assert r["tokens_per_step"] == 4 * 2**20
    # MFU cannot beat the matmul efficiency of the card (0.80)
    assert 0.3 < r["mfu"] < 0.8
    assert np.isfinite(r["step_time_s"]) and r["fits"]


def test_strategy_labels():
    r = _row(ParallelConfig(dp=2, tp=2, pp=2, zero=3, grad_accum=2))
    assert r["strategy"].startswith("TP2 x PP2 x FSDP")
    assert r["family"] == "TP + PP + FSDP"
    assert _row(ParallelConfig(dp=8, zero=3, dp_shard=4))["family"] == "HSDP"
    assert _row(ParallelConfig())["strategy"] == "single GPU"


def test_time_to_train():
    from trainplan.cost.step_time import time_to_train
    # 2.6e11 tokens at 2.6e5 tokens/s = 1e6 s = 11.574 days; 32 GPUs x 1e6 s / 3600 GPU-hours
    t = time_to_train(2.6e11, 2.6e5, 32)
    assert t["seconds"] == pytest.approx(1e6)
    assert t["days"] == pytest.approx(1e6 / 86400)
    assert t["gpu_hours"] == pytest.approx(32e6 / 3600)
