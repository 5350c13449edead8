"""Parameter counts: exact published totals, the N of 6N, and per-rank shares."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_model
from trainplan.cost import params
from trainplan.specs import load_model

PUBLISHED = {
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
    "mixtral-8x7b": 46_702_792_704,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize(("name", "count"), sorted(PUBLISHED.items()))
def test_total_params_match_published_counts_exactly(name, count):
    assert params.total_params(load_model(name)) == count


def test_gpt2_xl_preset_is_gpt_style():
    m = load_model("gpt2-xl")
    assert (m.mlp, m.positions, m.norm, m.bias, m.tied_embeddings) == (
        "gelu", "learned", "layernorm", True, True)


def test_gpt2_xl_count_by_hand():
    # GPT-2 XL: h 1600, 48 layers, f 6400, V 50257, 1024 positions, LayerNorm, biases, tied.
    h, f, V, P, L = 1600, 6400, 50257, 1024, 48
    attn = h * 3 * h + 3 * h + h * h + h  # fused qkv + bias, out proj + bias
    mlp = h * f + f + f * h + h
    norms = 2 * 2 * h
    block = attn + mlp + norms
    expected = V * h + P * h + L * block + 2 * h  # tables, blocks, final LayerNorm
    assert expected == 1_557_611_200
    assert params.total_params(load_model("gpt2-xl")) == expected


def test_tiny_model_parts_by_hand(tiny):
    assert params.attention_params(tiny) == 64 * (64 + 2 * 64) + 64 * 64 == 16_384
    assert params.expert_params(tiny) == 3 * 64 * 128 == 24_576
    assert params.norm_params(tiny) == 64
    assert params.layer_params(tiny) == 16_384 + 24_576 + 2 * 64 == 41_088
    assert params.embedding_params(tiny) == 100 * 64 == 6_400
    assert params.output_params(tiny) == 100 * 64 + 64 == 6_464
    assert params.total_params(tiny) == 6_400 + 4 * 41_088 + 6_464 == 177_216


def test_gqa_shrinks_only_k_and_v():
    m = tiny_model(n_kv_heads=2)  # h_kv = 2 heads x 16 = 32
    assert m.kv_dim == 32
    assert params.attention_params(m) == 64 * (64 + 2 * 32) + 64 * 64 == 12_288


def test_gelu_mlp_and_layernorm_with_biases():
    m = tiny_model(mlp="gelu", norm="layernorm", bias=True)
    assert params.expert_params(m) == 2 * 64 * 128 + 128 + 64
    assert params.norm_params(m) == 2 * 64
    assert params.attention_params(m) == 16_384 + (64 + 128) + 64


def test_moe_router_and_experts():
    m = tiny_model(n_experts=4, top_k=2)
    assert params.router_params(m) == 64 * 4
    assert params.layer_params(m) == 16_384 + 4 * 24_576 + 256 + 128
    assert params.active_layer_params(m) == 16_384 + 2 * 24_576 + 256 + 128


def test_flop_params_excludes_input_table_counts_output_layer(tiny):
    # 4 blocks + output matmul V h + final norm h; the 6,400-entry input table is a lookup
    assert params.flop_params(tiny) == 4 * 41_088 + 6_400 + 64 == 170_816
    assert params.flop_params(tiny) == params.total_params(tiny) - params.embedding_params(tiny)


def test_flop_params_counts_output_layer_when_tied():
    tied = tiny_model(tied_embeddings=True)
    untied = tiny_model()
    assert params.total_params(tied) == params.total_params(untied) - 6_400
    assert params.flop_params(tied) == params.flop_params(untied) == 170_816


def test_flop_params_excludes_learned_position_table():
    m = tiny_model(positions="learned", max_positions=32)
    assert params.embedding_params(m) == 6_400 + 32 * 64
    assert params.flop_params(m) == 170_816


def test_flop_params_mixtral_counts_only_routed_experts():
    m = load_model("mixtral-8x7b")
    h, f, kv, V = 4096, 14336, 1024, 32000
    block = h * (h + 2 * kv) + h * h + 2 * 3 * h * f + h * 8 + 2 * h
    assert params.flop_params(m) == 32 * block + V * h + h


def test_flop_params_llama_13b():
    m = load_model("llama-13b")
    assert params.flop_params(m) == 13_015_864_320 - 32000 * 5120


# ---------------------------------------------------------------- per rank


def test_layer_params_per_rank_splits_matrices_not_norms(tiny):
    assert params.layer_params_per_rank(tiny, 2, 1) == (16_384 + 24_576) / 2 + 128 == 20_608
    assert params.layer_params_per_rank(tiny, 1, 1) == 41_088


def test_stage_params_per_rank_no_pipeline(tiny):
    # pp = 1: all 4 blocks plus both ends; tp = 2 splits matrices and both V h tables,
    # the final norm (64) stays whole on every rank
    assert params.stage_params_per_rank(tiny, 1, 1, 1) == 177_216
    assert params.stage_params_per_rank(tiny, 2, 1, 1) == 4 * 20_608 + 6_400 / 2 + 6_400 / 2 + 64


def test_stage_params_per_rank_pipeline_worst_stage(tiny):
    # pp = 2, tp = 2: 2 blocks + the larger end (output 6,400 / 2 + norm 64 > input 6,400 / 2)
    assert params.stage_params_per_rank(tiny, 2, 2, 1) == 2 * 20_608 + 3_264 == 44_480
    # pp = 4, tp = 1: one block + output layer
    assert params.stage_params_per_rank(tiny, 1, 4, 1) == 41_088 + 6_464


def test_stage_params_per_rank_tied_keeps_a_copy_on_the_last_stage():
    m = tiny_model(tied_embeddings=True)
    assert params.stage_params_per_rank(m, 1, 1, 1) == 4 * 41_088 + 6_400 + 64
    assert params.stage_params_per_rank(m, 1, 2, 1) == 2 * 41_088 + 6_400 + 64


def test_stage_params_per_rank_is_vectorised(tiny):
    got = params.stage_params_per_rank(tiny, np.array([1, 2]), np.array([1, 2]), np.array([1, 1]))
    np.testing.assert_allclose(got, [177_216, 44_480])


def test_moe_per_rank_experts_split_by_ep():
    m = tiny_model(n_experts=4, top_k=2)
    # ep = 2: two experts here; router and norms replicated
    assert params.layer_params_per_rank(m, 1, 2) == 16_384 + 2 * 24_576 + 256 + 128
    assert params.dense_layer_params_per_rank(m, 2) == 16_384 / 2 + 256 + 128
    share = params.expert_share(m, 1, 1, 2)
    stage = params.stage_params_per_rank(m, 1, 1, 2)
    assert share == pytest.approx(4 * 2 * 24_576 / stage)
    assert params.expert_share(tiny_model(), 1, 1, 1) == 0
