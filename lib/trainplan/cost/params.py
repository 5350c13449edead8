"""Parameter counts of a decoder-only transformer, whole and per rank.

Formulas for a Llama-style decoder: embeddings V h (twice if untied), per layer
attention h (h + 2 h_kv) + h h, SwiGLU MLP 3 h f (GELU MLP 2 h f), two norms 2 h
(LayerNorm 4 h with its biases), final norm.
Checked against the published counts of Llama 2 7B/13B/70B, Mixtral 8x7B and
GPT-2 XL in tests/cost/test_params.py.

Functions taking a layout accept numpy arrays for the degrees (tp, pp, ep)
so that the search evaluates thousands of layouts at once.
"""

from __future__ import annotations

import numpy as np

from trainplan.specs import ModelSpec


def norm_params(m: ModelSpec) -> int:
    """One normalisation layer: RMSNorm has a weight (h); LayerNorm a weight and a bias (2 h)."""
    return m.hidden * (2 if m.norm == "layernorm" else 1)


def attention_params(m: ModelSpec) -> int:
    """Q, K, V and output projections: h (h + 2 h_kv) + h h, plus biases if any."""
    h, kv = m.hidden, m.kv_dim
    weights = h * (h + 2 * kv) + h * h
    biases = (h + 2 * kv) + h if m.bias else 0
    return weights + biases


def expert_params(m: ModelSpec) -> int:
    """One MLP (one expert for MoE): SwiGLU 3 h f (gate, up, down); GELU 2 h f (+ biases)."""
    h, f = m.hidden, m.ffn
    if m.mlp == "swiglu":
        return 3 * h * f + ((2 * f + h) if m.bias else 0)
    return 2 * h * f + ((f + h) if m.bias else 0)


def router_params(m: ModelSpec) -> int:
    """MoE router: one h x n_experts matrix per layer (Mixtral); none for dense models."""
    return m.hidden * m.n_experts if m.is_moe else 0


def layer_params(m: ModelSpec) -> int:
    """One transformer block: attention + all experts + router + two norms."""
    return (attention_params(m) + m.n_experts * expert_params(m) + router_params(m)
            + 2 * norm_params(m))


def embedding_params(m: ModelSpec) -> int:
    """Input token table V h, plus the learned position table if any."""
    pos = m.max_positions * m.hidden if m.positions == "learned" else 0
    return m.vocab * m.hidden + pos


def output_params(m: ModelSpec) -> int:
    """Output projection V h (0 when tied to the input table) plus the final norm."""
    return (0 if m.tied_embeddings else m.vocab * m.hidden) + norm_params(m)


def total_params(m: ModelSpec) -> int:
    """Every parameter, counted once."""
    return embedding_params(m) + m.n_layers * layer_params(m) + output_params(m)


def active_layer_params(m: ModelSpec) -> int:
    """Parameters one token touches in a block: only top_k experts of an MoE layer."""
    return (attention_params(m) + m.top_k * expert_params(m) + router_params(m)
            + 2 * norm_params(m))


def flop_params(m: ModelSpec) -> int:
    """N of the 6 N FLOPs-per-token rule: every active parameter except lookup tables.

    The input embedding and position tables are lookups (no matmul) and are
    left out; the output layer's matmul is real work and counts, also when its
    weight is tied to the input table (Chowdhery et al. 2022 (PaLM), app. B).
    """
    return m.n_layers * active_layer_params(m) + m.vocab * m.hidden + norm_params(m)


# ---------------------------------------------------------------- per rank


def layer_params_per_rank(m: ModelSpec, tp, ep):
    """One block's parameters on one rank: matrices split by tp, experts by ep; norms replicated.

    Megatron-style tensor parallelism splits Q/K/V/gate/up by columns and the
    output/down projections by rows (Shoeybi et al. 2019); experts are spread
    over ep ranks, each expert's matrices split by tp as well.
    """
    tp = np.asarray(tp)
    experts_here = np.maximum(m.n_experts // np.asarray(ep), 1)
    matrices = attention_params(m) + experts_here * expert_params(m)
    return matrices / tp + router_params(m) + 2 * norm_params(m)


def dense_layer_params_per_rank(m: ModelSpec, tp):
    """The non-expert part of one block on one rank (replicated across expert-parallel ranks)."""
    return attention_params(m) / np.asarray(tp) + router_params(m) + 2 * norm_params(m)


def stage_params_per_rank(m: ModelSpec, tp, pp, ep):
    """Parameters held by one rank of the most loaded pipeline stage.

    Each stage holds n_layers / pp blocks; the first also holds the input
    table, the last the output layer and final norm (both vocab-parallel over
    tp). With pp = 1 one stage holds both ends.
    """
    tp, pp = np.asarray(tp), np.asarray(pp)
    blocks = (m.n_layers / pp) * layer_params_per_rank(m, tp, ep)
    first = m.vocab * m.hidden / tp + (embedding_params(m) - m.vocab * m.hidden)
    last = (output_params(m) - norm_params(m)) / tp + norm_params(m)
    if m.tied_embeddings:  # each end stage keeps its own copy of the shared table
        last = last + np.where(pp > 1, m.vocab * m.hidden / tp, 0)
    ends = np.where(pp > 1, np.maximum(first, last), first + last)
    return blocks + ends


def expert_share(m: ModelSpec, tp, pp, ep):
    """Fraction of a rank's stage parameters that are expert weights (0 for dense models).

    Experts are sharded over fewer data-parallel ranks than the dense weights
    (the data-parallel group divided by ep), so ZeRO sharding treats them apart.
    """
    if not m.is_moe:
        return np.zeros_like(np.asarray(tp, dtype=float))
    experts_here = np.maximum(m.n_experts // np.asarray(ep), 1)
    expert_part = (m.n_layers / np.asarray(pp)) * experts_here * expert_params(m) / np.asarray(tp)
    return expert_part / stage_params_per_rank(m, tp, pp, ep)
