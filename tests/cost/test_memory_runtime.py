"""The harness's precision-path memory terms (trainplan.cost.memory_runtime)."""

import dataclasses

import numpy as np
import pytest

from conftest import layouts
from trainplan.cost import memory, params
from trainplan.cost import memory_runtime as rt
from trainplan.specs import load_model

M = load_model("llama-1.3b")
LAY = dict(tp=1, pp=1, cp=1, ep=1, recompute=0, sequence_parallel=False, pp_schedule=0,
           pp_virtual=1)


def total(**kw):
    args = {**LAY, "dp_shard": kw.get("dp", 1), "zero": 0, "micro_batch": 8, "grad_accum": 1,
            **kw}
    return memory.breakdown(M, layouts(**args), seq_len=2048, compiled_loss=True)["total"].item()


@pytest.mark.parametrize("dp, tp, pp, zero, path", [
    (1, 1, 1, 0, rt.SINGLE), (1, 4, 1, 0, rt.AUTOCAST), (1, 1, 4, 0, rt.AUTOCAST),
    (2, 1, 1, 0, rt.DDP), (2, 1, 1, 2, rt.FSDP), (2, 2, 1, 0, rt.FSDP), (2, 1, 2, 0, rt.FSDP),
])
def test_harness_path_follows_parallelize(dp, tp, pp, zero, path):
    assert rt.harness_path(dp, tp, pp, zero) == path


def test_one_gpu_keeps_a_bf16_stream_and_the_weight_casts():
    """One GPU: the stream is bf16 (no fp32 block input kept) but fp32 weights are still
    cast under autocast (their bf16 copies kept); TP alone keeps both."""
    assert rt.fp32_stream([rt.AUTOCAST, rt.DDP, rt.FSDP, rt.SINGLE]).tolist() == \
        [True, True, False, False]
    assert rt.stream_bytes(rt.SINGLE) == 2.0 and rt.stream_bytes(rt.AUTOCAST) == 4.0
    kw = dict(tp=1, sequence_parallel=False)
    assert rt.autocast_token_bytes(M, path=rt.SINGLE, **kw) == 0.0
    assert rt.autocast_token_bytes(M, path=rt.AUTOCAST, **kw) == 2.0 * M.hidden
    casts = dict(tp=1, ep=1, recompute=0)
    assert rt.weight_copy_bytes(M, path=rt.SINGLE, **casts) == \
        rt.weight_copy_bytes(M, path=rt.AUTOCAST, **casts) > 0


@pytest.mark.parametrize("bad", [dict(dp=0), dict(tp=0), dict(pp=-1), dict(zero=-1)])
def test_harness_path_rejects_bad_degrees(bad):
    with pytest.raises(ValueError):
        rt.harness_path(**{"dp": 1, "tp": 1, "pp": 1, "zero": 0, **bad})


def test_autocast_block_extra_matches_the_microbenchmark():
    # 76,136.06 (autocast-fp32) - 65,864.3 (bf16) B/token at 16,384 tokens
    per_token = float(rt.autocast_token_bytes(M, path=rt.AUTOCAST, tp=1, sequence_parallel=False))
    copies = float(rt.weight_copy_bytes(M, path=rt.AUTOCAST, tp=1, ep=1, recompute=0))
    assert per_token + copies / 16384 == pytest.approx(76136.06 - 65864.3, rel=1e-3)
    assert rt.weight_copy_bytes(M, path=rt.FSDP, tp=1, ep=1, recompute=0) == 0
    assert rt.weight_copy_bytes(M, path=rt.AUTOCAST, tp=1, ep=1, recompute=1) == 0


def test_terms_grow_with_micro_batch_pp_and_shrink_with_dp():
    assert total(micro_batch=16) > total(micro_batch=8) > total(micro_batch=4)
    # weight copies are per micro-batch, not per token: less than linear in tokens
    a, b = (memory.activation_bytes(M, layouts(**LAY, micro_batch=mb, grad_accum=1),
                                    seq_len=2048, compiled_loss=True, path=rt.AUTOCAST).item()
            for mb in (4, 8))
    assert b < 2 * a
    fsdp = [total(dp=d, zero=3) for d in (2, 4, 8)]
    assert fsdp[0] > fsdp[1] > fsdp[2]
    # more pipeline micro-batches: more receive buffers on the first stage
    assert total(pp=2, micro_batch=2, grad_accum=16) > total(pp=2, micro_batch=2, grad_accum=8)


def test_ddp_costs_more_than_one_gpu_by_buckets_and_graph_split():
    one, ddp = total(dp=1), total(dp=2)
    s = params.stage_params_per_rank(M, 1, 1, 1)
    assert ddp - one > 4 * s  # at least the fp32 buckets
    assert rt.ddp_split_scale(rt.DDP, True) == rt.DDP_SPLIT_SCALE
    assert rt.ddp_split_scale(rt.DDP, False) == 0


def test_fsdp_no_sync_keeps_unsharded_fp32_grads():
    kw = dict(path=rt.FSDP, tp=1, pp=1, ep=1, dp_shard=4, cp=1)
    s = params.stage_params_per_rank(M, 1, 1, 1)
    assert rt.grad_bytes(M, zero=2, grad_accum=2, **kw) == 4 * s
    assert rt.grad_bytes(M, zero=3, grad_accum=2, **kw) == 4 * s / 4
    assert rt.grad_bytes(M, zero=2, grad_accum=1, **kw) == 4 * s / 4


def test_stream_pools_only_under_sharded_fsdp():
    kw = dict(tp=1, pp=1, ep=1, cp=1, zero=2)
    assert rt.stream_pool_bytes(M, path=rt.AUTOCAST, dp_shard=1, **kw) == 0
    two, four = (float(rt.stream_pool_bytes(M, path=rt.FSDP, dp_shard=d, **kw)) for d in (2, 4))
    assert two > four > 0


def test_pipeline_buffers_scale_with_grad_accum_and_vanish_without_pp():
    kw = dict(path=rt.AUTOCAST, seq_len=2048, micro_batch=2, tp=1, cp=1, sequence_parallel=False)
    assert rt.pp_buffer_bytes(M, grad_accum=8, pp=1, **kw) == 0
    assert rt.pp_buffer_bytes(M, grad_accum=16, pp=2, **kw) == \
        2 * rt.pp_buffer_bytes(M, grad_accum=8, pp=2, **kw) == 16 * 4 * 4096 * 2048


def test_interleaved_first_rank_keeps_three_sets_of_buffers_with_two_virtual_stages():
    """Rank 0 of PP 4 x 2 virtual runs stage 0 (gradient receives) and stage 4 (activation
    and gradient receives): three sets of m fp32 boundaries, 1.5 GiB at m = 16, mb 2,
    s 2048 on the 1.3B model, against 0.5 for one."""
    kw = dict(path=rt.AUTOCAST, seq_len=2048, micro_batch=2, tp=1, cp=1, sequence_parallel=False,
              grad_accum=16, pp=4)
    one = float(rt.pp_buffer_bytes(M, **kw))
    assert float(rt.pp_buffer_bytes(M, pp_virtual=2, **kw)) == 3 * one == 3 * 2**29
    assert float(rt.pp_buffer_bytes(M, pp_virtual=4, **kw)) == 7 * one


def test_vectorised_over_layouts():
    lay = layouts(**{**LAY, "tp": np.array([1, 2, 4])}, dp_shard=np.array([1, 1, 1]),
                  zero=np.array([0, 0, 0]), micro_batch=8, grad_accum=1)
    out = memory.breakdown(M, lay, seq_len=2048, compiled_loss=True)
    assert out["total"].shape == (3,) and np.all(np.diff(out["total"]) < 0)


def test_root_group_is_what_the_stage_holds_outside_its_blocks():
    # llama-1.3b: input table and output layer V h each, plus the final norm h
    assert rt.root_group_params_per_rank(M, 1, 1, 1) == 2 * 32000 * 2048 + 2048
    # vocab-parallel over tp; the norm is replicated
    assert rt.root_group_params_per_rank(M, 2, 1, 1) == 32000 * 2048 + 2048
    # a pipeline stage keeps one end only
    assert rt.root_group_params_per_rank(M, 1, 2, 1) == 32000 * 2048 + 2048


def test_copy_in_pool_holds_root_and_block_outputs_and_root_casts():
    kw = dict(path=rt.FSDP, tp=1, pp=1, ep=1, zero=2, cp=1)
    root, block = 2 * 32000 * 2048 + 2048, 50_597_888  # hand counts for llama-1.3b
    s = params.stage_params_per_rank(M, 1, 1, 1)
    for d in (2, 4):
        pool = float(rt.stream_pool_bytes(M, dp_shard=d, **kw))
        assert pool - 4 * s / d == pytest.approx(2 * (root + block + root / d))
    # 2 bytes x (R + B + R / 2) = 0.4605 GiB; rank 0's copy-in pool measured 0.46
    assert (float(rt.stream_pool_bytes(M, dp_shard=2, **kw)) - 2 * s) / 2**30 == \
        pytest.approx(0.4605, abs=5e-4)


def test_copy_in_pool_takes_two_blocks_where_a_block_outweighs_the_root():
    """Beside the root's output and casts, the second block's output and the first block's
    casts, which fit in nothing freed before them."""
    small_vocab = dataclasses.replace(M, vocab=8)  # root group far smaller than a block
    kw = dict(path=rt.FSDP, tp=1, pp=1, ep=1, zero=3, cp=1, dp_shard=4)
    block = params.layer_params_per_rank(small_vocab, 1, 1)
    root = rt.root_group_params_per_rank(small_vocab, 1, 1, 1)
    s = params.stage_params_per_rank(small_vocab, 1, 1, 1)
    pool = float(rt.stream_pool_bytes(small_vocab, **kw))
    assert pool - 4 * s / 4 == pytest.approx(2 * (root + 2 * block + root / 4 + block / 4))


def test_copy_in_pool_at_the_70b_width_is_the_pool_measured():
    """llama-70b's first two blocks (block 1.6 x the root group): 4.81 GiB under ZeRO-3 on
    4 GPUs, 2.72 under TP 2 x FSDP 2 and 3.12 on a one-block pipeline stage (CP 2 x PP 2,
    ZeRO-1), where rank 0's copy-in pools in data/measurements/validate-h200x4-20261129/
    measured 4.82, 2.73 and 3.13 GiB."""
    m = load_model("llama-70b:2-layers")
    copy_in = {}
    for tp, pp, cp, zero, d in ((1, 1, 1, 3, 4), (2, 1, 1, 3, 2), (1, 2, 2, 1, 1)):
        kw = dict(path=rt.FSDP, tp=tp, pp=pp, ep=1, zero=zero, cp=cp, dp_shard=d)
        s = params.stage_params_per_rank(m, tp, pp, 1)
        copy_in[tp, pp] = (float(rt.stream_pool_bytes(m, **kw))
                           - 4 * s / (d * cp)) / 2**30
    assert copy_in[1, 1] == pytest.approx(4.8242, rel=0.01)
    assert copy_in[2, 1] == pytest.approx(2.7344, rel=0.01)
    assert copy_in[1, 2] == pytest.approx(3.1250, rel=0.01)



def test_copy_in_pool_where_the_roots_freed_casts_hold_the_first_block():
    """llama3-8b's 128k vocabulary at d = 2: the first block's casts and output (B (1 + 1/d)
    <= R / d) fit where the root's casts were, so the pool is R + R / d: 1.47 GiB under
    TP 2 x FSDP 2 and 2.94 under ZeRO-3, where rank 0's pools in
    data/measurements/validate-h200x4-20261129/ measured 1.48 and 2.95 GiB."""
    m = load_model("data/models/llama3-8b.yaml:4-layers")
    for tp, measured in ((2, 1.4844), (1, 2.9492)):
        kw = dict(path=rt.FSDP, tp=tp, pp=1, ep=1, zero=3, cp=1, dp_shard=2)
        s = params.stage_params_per_rank(m, tp, 1, 1)
        root = rt.root_group_params_per_rank(m, tp, 1, 1)
        copy_in = float(rt.stream_pool_bytes(m, **kw)) - 4 * s / 2
        assert copy_in == pytest.approx(2 * (root + root / 2))
        assert copy_in / 2**30 == pytest.approx(measured, rel=0.02)

def test_stream_pools_zero_off_fsdp_and_shrink_with_shard_degree():
    kw = dict(tp=1, pp=1, ep=1, cp=1)
    for path in (rt.AUTOCAST, rt.DDP):
        assert rt.stream_pool_bytes(M, path=path, zero=2, dp_shard=4, **kw) == 0
    assert rt.stream_pool_bytes(M, path=rt.FSDP, zero=0, dp_shard=4, **kw) == 0  # d = 1
    pools = rt.stream_pool_bytes(M, path=rt.FSDP, zero=3, dp_shard=np.array([2, 4, 8, 16]), **kw)
    assert np.all(np.diff(pools) < 0) and np.all(pools > 0)
    # wider tensor parallelism shards every stream's share
    tps = rt.stream_pool_bytes(M, path=rt.FSDP, zero=3, dp_shard=2, tp=np.array([1, 2, 4]),
                               pp=1, ep=1, cp=1)
    assert np.all(np.diff(tps) < 0)


G8 = load_model("data/models/llama3-8b.yaml")


def root_reduce(m, *, tp=1, zero=2, dp_shard=4, path=rt.FSDP, micro_batch=2, seq_len=4096,
                compiled_loss=True):
    head = rt.head_block_bytes(m, seq_len=seq_len, micro_batch=micro_batch, cp=1,
                               compiled_loss=compiled_loss)
    return float(rt.root_reduce_bytes(m, path=path, tp=tp, pp=1, ep=1, zero=zero,
                                      dp_shard=dp_shard, cp=1, head_block=head))


def test_root_reduce_input_is_fp32_root_group_where_no_head_block_holds_it():
    # llama3-8b, 128k vocabulary: 4 x (2 V h + h) bytes = 3.91 GiB; the head's bf16 logits
    # of 8,192 tokens are 1.96 GiB, too small to hold it (the 4 x H200 snapshot: 4,010 MiB)
    root = 2 * 128256 * 4096 + 4096
    assert root_reduce(G8) == 4.0 * root
    assert root_reduce(G8) / 2**20 == pytest.approx(4010, abs=5)
    assert root_reduce(G8, zero=3, dp_shard=2) == 4.0 * root  # unsharded: any stage, any d


def test_root_reduce_input_reuses_a_head_block_that_holds_it():
    # TP 2 halves the root (vocab-parallel) while the loss keeps whole logits: 4 R = L
    assert root_reduce(G8, tp=2, dp_shard=2) == 0.0
    # the 1.3B proxy at micro-batch 8: logits (1.95 GiB) outweigh 4 R (0.49 GiB)
    assert root_reduce(M, micro_batch=8, seq_len=2048) == 0.0
    # ... but not at 4,096 tokens (0.24 GiB of logits)
    assert root_reduce(M, micro_batch=1, seq_len=4096) == 4.0 * (2 * 32000 * 2048 + 2048)
    # the eager loss frees fp32 logits, twice the block
    assert root_reduce(M, micro_batch=2, seq_len=4096, compiled_loss=False) == 0.0


def test_root_reduce_zero_off_fsdp_and_with_a_shard_group_of_one():
    for path in (rt.AUTOCAST, rt.DDP):
        assert root_reduce(G8, path=path) == 0.0
    assert root_reduce(G8, dp_shard=1) == 0.0
    assert root_reduce(G8, zero=0) == 0.0


def test_breakdown_other_carries_the_root_reduce_segment():
    lay = layouts(**{**LAY, "dp": 4, "dp_shard": 4, "zero": 2, "micro_batch": 2,
                     "grad_accum": 1})
    b = memory.breakdown(G8, lay, seq_len=4096, compiled_loss=True, allocator=rt.CACHING)
    sharding = dict(tp=1, pp=1, ep=1, zero=2, dp_shard=4, cp=1)
    known = memory.buffer_bytes(G8, dp=4, **sharding) \
        + rt.stream_pool_bytes(G8, path=rt.FSDP, **sharding) \
        + rt.fragmentation_bytes(b["activations"])
    assert b["other"].item() - known.item() == pytest.approx(root_reduce(G8))
    parts = sum(b[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    assert b["total"].item() == pytest.approx(parts.item())


def test_replicate_logits_keep_a_second_whole_copy_under_tensor_parallel(monkeypatch):
    """Shard(-1) -> Replicate gathers into one whole buffer and concatenates into another:
    2 bytes x tokens x V more at the head under TP (1.96 GiB for llama3-8b at mb 2, s 4096),
    none without it; the harness path's last stage carries exactly that much more."""
    g8 = load_model("data/models/llama3-8b.yaml:4-layers")
    kw = dict(seq_len=4096, micro_batch=2, cp=1)
    copy = float(rt.replicate_gather_bytes(g8, tp=2, **kw))
    assert rt.replicate_gather_bytes(g8, tp=1, **kw) == 0
    assert rt.replicate_gather_bytes(g8, tp=4, **kw) == copy
    assert copy / 2**30 == pytest.approx(1.957, abs=1e-3)
    L = layouts(**{**LAY, "tp": 2}, micro_batch=2, grad_accum=1)

    def acts():
        return np.asarray(memory.activation_bytes(g8, L, seq_len=4096, path=rt.AUTOCAST)).item()

    with_copy = acts()
    monkeypatch.setattr(rt, "replicate_gather_bytes", lambda *a, **k: 0.0)
    assert with_copy - acts() == pytest.approx(copy)
