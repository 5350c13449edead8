"""The cost terms added for issue 4's misses: compiled-loss logits, gradients at the peak,
DTensor sequence-parallel inputs, TP exchanges as all-gather + reduce-scatter, and the
copy kernels of FSDP2 and DDP."""

import dataclasses

import numpy as np
import pytest

from conftest import layouts, tiny_model
from trainplan.calibrate.store import load_gpu
from trainplan.cost import comms, compute, memory
from trainplan.specs import load_cluster


def test_compiled_loss_keeps_four_bytes_per_logit():
    m = tiny_model()
    kw = dict(seq_len=32, micro_batch=2, tp=2, cp=1)
    assert memory.compiled_logits_bytes(m, **kw) == 4 * 64 * m.vocab / 2
    assert memory.head_peak_bytes(m, compiled_loss=True, logits_scale=3.0, **kw) == \
        memory.compiled_logits_bytes(m, **kw)
    assert memory.head_peak_bytes(m, compiled_loss=False, logits_scale=1.5, **kw) == \
        1.5 * memory.logits_bytes(m, **kw)


@pytest.mark.parametrize(("ga", "pp", "grads", "acts", "expected"), [
    (1, 1, 10.0, 100.0, 0.0),   # created as activations are freed: never on top of them
    (1, 1, 150.0, 100.0, 50.0),  # more gradients than activations: the end of backward
    (2, 1, 10.0, 100.0, 10.0),  # accumulation keeps them across micro-batches
    (8, 2, 10.0, 100.0, 10.0),  # a pipeline runs forwards while gradients exist
])
def test_grads_at_peak(ga, pp, grads, acts, expected):
    assert memory.grads_at_peak(grads, acts, grad_accum=ga, pp=pp) == expected


def test_breakdown_total_is_the_visible_sum():
    m = tiny_model()
    out = memory.breakdown(m, layouts(dp=2, dp_shard=2, zero=2, micro_batch=2,
                                      sequence_parallel=False), seq_len=32, compiled_loss=True)
    out = {k: v.item() for k, v in out.items()}
    assert out["grads"] == 0.0
    assert out["total"] == pytest.approx(sum(out[k] for k in ("params", "grads", "optimizer",
                                                                "activations", "other")))


def test_sequence_parallel_keeps_the_gathered_linear_inputs():
    m = tiny_model()
    h = m.hidden
    sp = memory.activation_elements_per_token_per_layer(m, tp=4, recompute=0,
                                                        sequence_parallel=True)
    no_sp = memory.activation_elements_per_token_per_layer(m, tp=4, recompute=0,
                                                           sequence_parallel=False)
    assert no_sp - sp == pytest.approx(2 * h - 2 * h / 4)  # only the norm inputs shrink
    one = memory.activation_elements_per_token_per_layer(m, tp=1, recompute=0,
                                                         sequence_parallel=True)
    assert one == memory.activation_elements_per_token_per_layer(m, tp=1, recompute=0,
                                                                 sequence_parallel=False)


def test_tp_exchange_is_gather_plus_scatter_with_sp():
    cl = load_cluster("dgx-h100")
    cl = dataclasses.replace(cl, collectives=(("all_gather", 20.0, 300.0),
                                              ("all_reduce", 30.0, 350.0),
                                              ("reduce_scatter", 30.0, 330.0)))
    s = 64e6
    ag = comms.collective_time(cl, "all_gather", s, 2, 2)
    rs = comms.collective_time(cl, "reduce_scatter", s, 2, 2)
    ar = comms.collective_time(cl, "all_reduce", s, 2, 2)
    assert comms.tp_pair_time(cl, act_bytes=s, tp=2, sequence_parallel=True) == ag + rs
    assert comms.tp_pair_time(cl, act_bytes=s, tp=2, sequence_parallel=False) == ar
    assert comms.tp_pair_time(cl, act_bytes=s, tp=1, sequence_parallel=True) == 0.0


def test_dp_copy_bytes():
    per_mb, per_step = compute.dp_copy_bytes_per_param(np.array([3, 2, 1, 0, 0, 3]),
                                                       np.array([2, 2, 2, 1, 1, 1]),
                                                       np.array([2, 2, 2, 2, 1, 2]))
    gather, reduce = 4 + 6 / 2, 6
    assert per_mb.tolist() == [2 * gather + reduce, gather + reduce, 0, 0, 0, 0]
    # ZeRO-1 once a step; DDP 16 B; one replica nothing; a shard group of one is DDP
    assert per_step.tolist() == [0, 0, gather + reduce, 16, 0, 16]


def test_dp_copy_time_uses_the_measured_hbm_rate():
    gpu = load_gpu("h200-sxm", calibrated=False)
    per_mb, _ = compute.dp_copy_time(gpu, 1e9, zero=2, shard_ranks=4, dp_ranks=4)
    assert per_mb == pytest.approx((4 + 1.5 + 6) * 1e9 / (gpu.hbm_tbps * 1e12
                                                          * gpu.memory_efficiency))
