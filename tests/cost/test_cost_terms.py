"""Each cost term against a value worked out by hand for the tiny model of conftest.py.

Tiny model: l = 4, h = 64, a = 4, f = 128, V = 100, SwiGLU, RoPE, untied;
N (flop params) = 170,816; one block's matrices = 16,384 + 24,576 = 40,960.
Easy GPU: 100 TFLOP/s peak, matmul 50 %, attention 25 %; 1 TB/s HBM at 50 %.
Easy cluster: 4 GPUs a node; 100 GB/s x 0.5 inside, 10 GB/s x 0.5 across;
latency 10 us inside, 20 us across.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import layouts, tiny_model
from trainplan.cost import comms, compute, memory, params
from trainplan.cost import memory_runtime as rt
from trainplan.cost.compute import FULL, NONE, SELECTIVE
from trainplan.specs import load_model

GiB = 2**30
P = 177_216  # tiny total params (= stage params at tp = pp = 1)


# ================================================================ compute


def test_model_flops_per_token(tiny):
    # 6 N + 12 l h s = 6 * 170,816 + 12 * 4 * 64 * 32
    assert compute.model_flops_per_token(tiny, 32) == 1_024_896 + 98_304 == 1_123_200


def test_model_flops_per_token_llama_13b():
    m = load_model("llama-13b")
    n = 13_015_864_320 - 32000 * 5120
    assert compute.model_flops_per_token(m, 4096) == 6 * n + 12 * 40 * 5120 * 4096


def test_matmul_flops_per_token_per_layer(tiny):
    assert compute.matmul_flops_per_token_per_layer(tiny, 1) == 2 * 40_960 == 81_920
    assert compute.matmul_flops_per_token_per_layer(tiny, 2) == 40_960
    moe = tiny_model(n_experts=4, top_k=2)  # attention + 2 experts + router (64 x 4)
    assert compute.matmul_flops_per_token_per_layer(moe, 1) == 2 * (16_384 + 2 * 24_576 + 256)


def test_attention_flops_per_token_per_layer(tiny):
    # 4 s h / tp: Q K^T and A V, 2 s h each
    assert compute.attention_flops_per_token_per_layer(tiny, 32, 1) == 4 * 32 * 64 == 8_192
    assert compute.attention_flops_per_token_per_layer(tiny, 32, 2) == 4_096


def test_elementwise_bytes_per_token_per_layer(tiny):
    # forward elements: norms + residuals 10 h, RoPE 2 (h + h_kv), SwiGLU 3 f; x 3 (fwd + bwd) x 2 B
    # tp = 2 with SP: 10 * 64 / 2 = 320; (2 * 128 + 3 * 128) / 2 = 320 -> 6 * 640
    assert compute.elementwise_bytes_per_token_per_layer(tiny, 2, True) == 6 * 640 == 3_840
    # without SP the 10 h part is not split: 6 * (640 + 320)
    assert compute.elementwise_bytes_per_token_per_layer(tiny, 2, False) == 5_760
    # GELU (2 f) with learned positions (no RoPE), tp = 1: 6 * (640 + 256)
    gpt = tiny_model(mlp="gelu", positions="learned", max_positions=32)
    assert compute.elementwise_bytes_per_token_per_layer(gpt, 1, True) == 6 * 896


def test_loss_bytes_per_token(tiny):
    assert compute.loss_bytes_per_token(tiny, 1) == 20 * 100 == 2_000
    assert compute.loss_bytes_per_token(tiny, 4) == 500


def test_recompute_factors():
    np.testing.assert_array_equal(
        compute.recompute_matmul_factor(np.array([NONE, SELECTIVE, FULL])), [0.0, 0.0, 1.0])
    np.testing.assert_allclose(
        compute.recompute_elementwise_factor(np.array([NONE, SELECTIVE, FULL])),
        [0.0, 1 / 3, 1 / 3])


def test_microbatch_compute_time_last_stage(tiny, gpu):
    # seq 32, micro-batch 2, tp 2, pp 2, no recompute, SP: 64 tokens, 2 blocks on the stage
    mm = 3 * 40_960 * 2 + 3 * 2 * 100 * 64 / 2  # 3 passes x blocks + output layer = 264,960
    attn = 3 * 4_096 * 2  # 24,576
    elem = 2 * 3_840 + 2_000  # blocks + loss over the gathered logits (all V on each rank)
    expected = 64 * (mm / 5e13 + attn / 2.5e13 + elem / 5e11)
    got = compute.microbatch_compute_time(tiny, gpu, seq_len=32, micro_batch=2, tp=2, cp=1, pp=2,
                                          recompute=NONE, sequence_parallel=True)
    assert mm == 264_960
    assert got == pytest.approx(expected, rel=1e-12)


def test_microbatch_compute_time_full_recompute_inner_stage(tiny, gpu):
    # full recompute: 4 matmul passes, element-wise x (1 + 1/3); not last stage: no output layer
    # cp = 2 halves the tokens of the rank
    tokens = 2 * 32 / 2
    mm = 4 * 40_960 * 2
    attn = 4 * 4_096 * 2
    elem = (4 / 3) * 2 * 3_840
    expected = tokens * (mm / 5e13 + attn / 2.5e13 + elem / 5e11)
    got = compute.microbatch_compute_time(tiny, gpu, seq_len=32, micro_batch=2, tp=2, cp=2, pp=2,
                                          recompute=FULL, sequence_parallel=True,
                                          last_stage=False)
    assert got == pytest.approx(expected, rel=1e-12)


def test_optimizer_step_time(gpu):
    # 32 bytes per parameter held at 0.5 TB/s
    assert compute.optimizer_step_time(gpu, 1e9) == pytest.approx(32e9 / 5e11)


# ================================================================ memory


def _states(m, zero, dp_shard, cp=1, tp=1, pp=1, ep=1):
    kw = dict(tp=tp, pp=pp, ep=ep, zero=zero, dp_shard=dp_shard, cp=cp)
    return (float(memory.weights_bytes(m, **kw)), float(memory.grads_bytes(m, **kw)),
            float(memory.optimizer_bytes(m, **kw)))


def test_zero0_is_16_bytes_per_param(tiny):
    w, g, o = _states(tiny, zero=0, dp_shard=1)
    assert (w, g, o) == (2 * P, 2 * P, 12 * P)
    assert w + g + o == 16 * P


def test_zero1_shards_the_optimizer(tiny):
    assert _states(tiny, zero=1, dp_shard=4) == (2 * P, 2 * P, 12 * P / 4)


def test_zero2_shards_grads_too(tiny):
    assert _states(tiny, zero=2, dp_shard=4) == (2 * P, 2 * P / 4, 12 * P / 4)


def test_zero3_shards_everything(tiny):
    assert _states(tiny, zero=3, dp_shard=4) == (2 * P / 4, 2 * P / 4, 12 * P / 4)
    assert sum(_states(tiny, zero=3, dp_shard=4)) == 4 * P


def test_zero3_shards_over_context_parallel_ranks_too(tiny):
    assert _states(tiny, zero=3, dp_shard=2, cp=4) == (2 * P / 8, 2 * P / 8, 12 * P / 8)


def test_zero_with_tp_and_pp_uses_stage_params(tiny):
    stage = 44_480  # tp 2, pp 2 (test_params.py)
    assert _states(tiny, zero=1, dp_shard=2, tp=2, pp=2) == (2 * stage, 2 * stage, 6 * stage)


def test_moe_experts_shard_over_dp_divided_by_ep():
    m = tiny_model(n_experts=4, top_k=2)
    p = float(params.stage_params_per_rank(m, 1, 1, 2))
    share = float(params.expert_share(m, 1, 1, 2))
    # ZeRO-1 over 8 ranks; experts over 8 / ep = 4
    expected = 12 * (p * (1 - share) / 8 + p * share / 4)
    assert _states(m, zero=1, dp_shard=8, ep=2)[2] == pytest.approx(expected)


@pytest.mark.parametrize(("tp", "sp", "expected"), [
    # (norm inputs 2 h / sp + norm outputs 2 h whole, attention (2 h + 2 h_kv) / tp,
    # MLP 4 f / tp); with SP the linears keep their all-gathered input (DTensor), so the
    # norm outputs are 2 h = 128 whole, also under selective recompute (collective outputs)
    (1, False, {NONE: 256 + 256 + 512, SELECTIVE: 128 + 256 + 256, FULL: 64}),
    (2, True, {NONE: 64 + 128 + 128 + 256, SELECTIVE: 64 + 128 + 128 + 128, FULL: 32}),
    (2, False, {NONE: 256 + 128 + 256, SELECTIVE: 128 + 128 + 128, FULL: 64}),
])
def test_activation_elements_per_token_per_layer(tiny, tp, sp, expected):
    for rc, value in expected.items():
        got = memory.activation_elements_per_token_per_layer(
            tiny, tp=tp, recompute=rc, sequence_parallel=sp)
        assert got == value, (tp, sp, rc)


def test_activation_elements_gqa_gelu_and_moe():
    gqa = tiny_model(n_kv_heads=2)  # h_kv = 32: attention 2 * 64 + 2 * 32 = 192
    assert memory.activation_elements_per_token_per_layer(
        gqa, tp=1, recompute=NONE, sequence_parallel=False) == 256 + 192 + 512
    gelu = tiny_model(mlp="gelu")  # 2 f
    assert memory.activation_elements_per_token_per_layer(
        gelu, tp=1, recompute=NONE, sequence_parallel=False) == 256 + 256 + 256
    moe = tiny_model(n_experts=4, top_k=2)  # 4 f x 2 experts + permuted in/out 2 h x 2
    assert memory.activation_elements_per_token_per_layer(
        moe, tp=1, recompute=NONE, sequence_parallel=False) == 256 + 256 + 1024 + 256


def test_layer_activation_bytes(tiny):
    # 2 bytes x (b s / cp) tokens x elements: mb 2, seq 32, cp 2, tp 2, SP, none -> 2 * 32 * 576
    got = memory.layer_activation_bytes(tiny, seq_len=32, micro_batch=2, tp=2, cp=2,
                                        recompute=NONE, sequence_parallel=True)
    assert got == 2 * 32 * 576


@pytest.mark.parametrize(("pp", "m", "code", "v", "expected"), [
    (1, 8, 0, 1, 1.0),  # no pipeline: one micro-batch at a time
    (1, 8, 2, 1, 1.0),
    (4, 8, 0, 1, 4.0),  # 1F1B: min(p, m)
    (4, 2, 0, 1, 2.0),
    (4, 8, 2, 1, 8.0),  # GPipe: all m
    (4, 8, 1, 2, 4 * (1 + 3 / 8)),  # interleaved: min(p, m) (1 + (p - 1) / (p v))
    (8, 16, 1, 4, 8 * (1 + 7 / 32)),
])
def test_microbatches_in_flight(pp, m, code, v, expected):
    assert memory.microbatches_in_flight(pp, m, code, v) == pytest.approx(expected)


def test_logits_bytes(tiny):
    # 10 bytes x b s / cp tokens x V / tp = 10 * 64 * 50
    assert memory.logits_bytes(tiny, seq_len=32, micro_batch=2, tp=2, cp=1) == 32_000


def test_activation_bytes_no_pipeline(tiny):
    # 4 blocks x 2 B x 64 tokens x 1,024 elements + logits 10 x 64 x 100
    got = memory.activation_bytes(tiny, layouts(micro_batch=2, grad_accum=8, recompute=NONE,
                                                sequence_parallel=False), seq_len=32).item()
    assert got == 4 * 2 * 64 * 1_024 + 64_000


def test_activation_bytes_1f1b_first_stage(tiny):
    # pp 2, m 8: first stage keeps min(2, 8) = 2 micro-batches of its 2 blocks
    per_layer = 2 * 64 * 1_024
    first = per_layer * 2 * 2
    last = per_layer * 2 + 64_000
    got = memory.activation_bytes(tiny, layouts(micro_batch=2, grad_accum=8, pp=2, recompute=NONE,
                                                sequence_parallel=False), seq_len=32).item()
    assert got == max(first, last) == first


def test_activation_bytes_full_recompute_adds_one_rebuilt_block(tiny):
    """Kept block inputs (4 blocks x 2 x 64 tokens x 64) plus one rebuilt block (2 x 64 tokens
    x 1,024 B): beside the logits (64,000 B) under expandable segments, which lend the freed
    logits' pages to the rebuilt block, on top of them under the caching allocator."""
    L = layouts(micro_batch=2, grad_accum=1, recompute=FULL, sequence_parallel=False)
    kept, rebuilt, logits = 4 * 2 * 64 * 64, 2 * 64 * 1_024, 64_000
    got = {a: memory.activation_bytes(tiny, L, seq_len=32, allocator=a).item()
           for a in rt.ALLOCATORS}
    assert got[rt.CACHING] == kept + rebuilt + logits
    assert got[rt.EXPANDABLE] == kept + max(rebuilt, logits)
    assert memory.activation_bytes(tiny, L, seq_len=32).item() == got[rt.EXPANDABLE]


def test_buffer_bytes(tiny):
    block = 41_088
    stage = params.stage_params_per_rank(tiny, 1, 1, 1)
    kw = dict(tp=1, pp=1, ep=1, dp=2, dp_shard=2, cp=1)
    assert memory.buffer_bytes(tiny, zero=0, **kw) == 4 * stage  # DDP: every fp32 gradient
    assert memory.buffer_bytes(tiny, zero=1, **kw) == 4 * block
    assert memory.buffer_bytes(tiny, zero=2, **kw) == 4 * block
    assert memory.buffer_bytes(tiny, zero=3, **kw) == 8 * block
    # one replica: no reducer, no buckets
    assert memory.buffer_bytes(tiny, zero=0, tp=1, pp=1, ep=1, dp=1, dp_shard=1, cp=1) == 0
    # a ZeRO stage over one rank shards nothing: priced as DDP
    assert memory.buffer_bytes(tiny, zero=3, tp=1, pp=1, ep=1, dp=2, dp_shard=1, cp=1) == \
        4 * stage
    # context-parallel ranks join the shard group
    assert memory.buffer_bytes(tiny, zero=3, tp=1, pp=1, ep=1, dp=1, dp_shard=1, cp=2) == \
        8 * block


def test_breakdown_sums_terms_with_the_runtime_terms(tiny):
    """FSDP2 ZeRO-3 by hand: sharded fp32 weights, gradients and Adam; block activations plus
    the head's inputs; the buffers, FSDP2's side-stream pool and the 8% fragmentation of
    activations on top under the caching allocator (trainplan.cost.memory_runtime)."""
    out = memory.breakdown(tiny, layouts(dp=4, dp_shard=4, zero=3, micro_batch=2, grad_accum=8,
                                         recompute=NONE, sequence_parallel=False), seq_len=32,
                           allocator=rt.CACHING)
    out = {k: v.item() for k, v in out.items()}  # the one layout's terms
    block = 41_088  # 4 * 64^2 attention + 3 * 64 * 128 SwiGLU + 2 * 64 norms
    states = 4 * P / 4 + 4 * P / 4 + 8 * P / 4
    tokens = 2 * 32
    acts = 4 * 2 * 64 * 1_024 + 64_000 + tokens * 64 * (2 + 2)  # + final norm and head inputs
    # reduce-scatter stream 4S/d; copy-in stream 2 bytes x (R + 2 B + R/d + B/d): here a
    # block (41,088) outweighs the root group R (embeddings, norm, head: 2 x 100 x 64 + 64)
    root = 2 * 100 * 64 + 64
    pool = 4 * P / 4 + 2 * (root + 2 * block + root / 4 + block / 4)
    assert float(out["params"] + out["grads"] + out["optimizer"]) == pytest.approx(states)
    assert float(out["activations"]) == pytest.approx(acts)
    assert float(out["other"]) == pytest.approx(8 * block + pool + 0.08 * acts)
    parts = sum(float(out[k]) for k in ("params", "grads", "optimizer", "activations", "other"))
    assert parts == pytest.approx(float(out["total"]))


def test_fits_leaves_room_outside_the_allocator():
    assert memory.fits(8 * GiB, 10.0)  # 10 GiB card less 2 GiB outside the allocator
    assert not memory.fits(8 * GiB + 1, 10.0)
    np.testing.assert_array_equal(memory.fits(np.array([1, 9]) * GiB, 10.0), [True, False])


# ================================================================ comms


def test_ring_bytes():
    assert comms.ring_bytes("all_reduce", 1000, 4) == 2 * 3 / 4 * 1000 == 1500
    assert comms.ring_bytes("reduce_scatter", 1000, 4) == 750
    assert comms.ring_bytes("all_gather", 1000, 8) == 875
    assert comms.ring_bytes("all_to_all", 1000, 2) == 500
    assert comms.ring_bytes("all_reduce", 1000, 1) == 0


def test_collective_time_inside_a_node(cluster):
    # 4 ranks in a node: 10 us x log2 4 + 2 * 3/4 * 1e9 B / (100 GB/s * 0.5)
    got = comms.collective_time(cluster, "all_reduce", 1e9, 4, 4)
    assert got == pytest.approx(20e-6 + 1.5e9 / 50e9, rel=1e-12)


def test_collective_time_across_nodes(cluster):
    # 8 ranks over 2 nodes: 20 us x log2 8 + 7/8 * 1e9 B / (10 GB/s * 0.5)
    got = comms.collective_time(cluster, "reduce_scatter", 1e9, 8, 8)
    assert got == pytest.approx(60e-6 + 0.875e9 / 5e9, rel=1e-12)
    # same group size, but it spans 16 consecutive ranks (tp = 2 inside): still across nodes
    assert comms.collective_time(cluster, "reduce_scatter", 1e9, 8, 16) == pytest.approx(got)


def test_collective_time_one_rank_is_free(cluster):
    assert comms.collective_time(cluster, "all_reduce", 1e9, 1, 1) == 0
    np.testing.assert_array_equal(
        comms.collective_time(cluster, "all_gather", 1e6, np.array([1, 1]), np.array([1, 8])),
        [0.0, 0.0])


def test_collective_time_two_ranks_latency_floor(cluster):
    # n = 2: one latency step (log2 2 = 1) plus 1/2 S / bw
    got = comms.collective_time(cluster, "all_gather", 1e6, 2, 2)
    assert got == pytest.approx(10e-6 + 0.5e6 / 50e9)


def test_p2p_time(cluster):
    assert comms.p2p_time(cluster, 1e6, 2) == pytest.approx(10e-6 + 1e6 / 50e9)
    assert comms.p2p_time(cluster, 1e6, 8) == pytest.approx(20e-6 + 1e6 / 5e9)


def test_dp_microbatch_time_by_zero_stage(cluster):
    # stage params 1e6, 4 shards in a node: gather 2e6 B, reduce-scatter 4e6 B, each 3/4
    ag = 20e-6 + 0.75 * 2e6 / 50e9
    rs = 20e-6 + 0.75 * 4e6 / 50e9
    kw = dict(stage_params=1e6, dp_shard=4, cp=1, tp=1)
    assert comms.dp_microbatch_time(cluster, zero=3, **kw) == pytest.approx(2 * ag + rs)
    assert comms.dp_microbatch_time(cluster, zero=2, **kw) == pytest.approx(ag + rs)
    assert comms.dp_microbatch_time(cluster, zero=1, **kw) == 0
    assert comms.dp_microbatch_time(cluster, zero=0, **kw) == 0


def test_dp_step_time_ddp_all_reduce_across_nodes(cluster):
    # DDP over dp = 8 (two nodes): all-reduce of 4-byte grads, overlappable, nothing blocking
    over, block = comms.dp_step_time(cluster, stage_params=1e6, zero=0, dp=8, dp_shard=1, cp=1,
                                     tp=1)
    assert over == pytest.approx(60e-6 + 2 * 7 / 8 * 4e6 / 5e9)
    assert block == 0


def test_dp_step_time_zero1_blocking(cluster):
    # ZeRO-1 over 4 in a node: reduce-scatter 4e6 B + all-gather 2e6 B, blocking
    over, block = comms.dp_step_time(cluster, stage_params=1e6, zero=1, dp=4, dp_shard=4, cp=1,
                                     tp=1)
    assert over == 0
    assert block == pytest.approx((20e-6 + 0.75 * 4e6 / 50e9) + (20e-6 + 0.75 * 2e6 / 50e9))


def test_dp_step_time_hsdp_replica_all_reduce(cluster):
    # HSDP: 2 replicas of 4-way shards; all-reduce of the 4e6 / 4 B shard across nodes (span 8)
    over, block = comms.dp_step_time(cluster, stage_params=1e6, zero=3, dp=8, dp_shard=4, cp=1,
                                     tp=1)
    assert over == pytest.approx(20e-6 + 2 * 1 / 2 * 1e6 / 5e9)
    assert block == 0


def test_tp_microbatch_time(cluster):
    # tp 4 in a node, 2 blocks: 2 fwd + 2 bwd all-reduce-equivalents per block; full adds 2
    one = 20e-6 + 1.5 * 1e6 / 50e9
    assert comms.tp_microbatch_time(cluster, act_bytes=1e6, tp=4, layers=2,
                                    recompute_full=False) == pytest.approx(8 * one)
    assert comms.tp_microbatch_time(cluster, act_bytes=1e6, tp=4, layers=2,
                                    recompute_full=True) == pytest.approx(12 * one)
    assert comms.tp_microbatch_time(cluster, act_bytes=1e6, tp=1, layers=2,
                                    recompute_full=False) == 0


def test_ep_microbatch_time(cluster):
    # ep 8 over two nodes: 4 all-to-alls per block (dispatch, combine; fwd, bwd), 3 blocks
    one = 60e-6 + 7 / 8 * 1e6 / 5e9
    assert comms.ep_microbatch_time(cluster, token_bytes=1e6, ep=8, tp=1,
                                    layers=3) == pytest.approx(12 * one)


def test_pp_exposed_time(cluster):
    # stage span 2 -> neighbours within 4 ranks: inside a node; 11 transfers, both directions
    assert comms.pp_exposed_time(cluster, boundary_bytes=1e6, pp=4, n_transfers=11,
                                 stage_span=2) == pytest.approx(22 * (10e-6 + 1e6 / 50e9))
    # stage span 4 -> across nodes
    assert comms.pp_exposed_time(cluster, boundary_bytes=1e6, pp=4, n_transfers=11,
                                 stage_span=4) == pytest.approx(22 * (20e-6 + 1e6 / 5e9))
    assert comms.pp_exposed_time(cluster, boundary_bytes=1e6, pp=1, n_transfers=11,
                                 stage_span=4) == 0


def test_collective_latency_grows_with_log2_n(cluster):
    t2 = comms.collective_time(cluster, "all_reduce", 0, 2, 2)
    t4 = comms.collective_time(cluster, "all_reduce", 0, 4, 4)
    assert t4 == pytest.approx(2 * t2)
    assert math.isclose(float(t2), 10e-6)
