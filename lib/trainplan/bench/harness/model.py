"""The proxy model: a plain, single-device decoder-only transformer.

Llama-style by default (RMSNorm, rotary positions, SwiGLU MLP, grouped-query
attention through `F.scaled_dot_product_attention`, untied output layer), with
the GPT-style options of `ModelSpec` (GELU MLP, learned positions, LayerNorm,
biases, tied embeddings) where they cost a line or two. There is no parallelism
in this file: `parallelize.py` applies every layout from outside, which is why
the module names follow torchtitan (`tok_embeddings`, `layers`, `norm`,
`output`; inside a block `attention.wq/wk/wv/wo` and `feed_forward.w1/w2/w3`)
and why `forward` tolerates `tok_embeddings`, `norm` and `output` being None
(a pipeline stage keeps only its own share of the model).

Shapes in comments: B batch, S sequence, H hidden, nh query heads, nkv
key/value heads, hd head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainplan.bench.harness.loss import LinearCrossEntropy
from trainplan.errors import SpecError
from trainplan.specs import ModelSpec

INIT_STD = 0.02  # GPT-2 / Llama initialisation; projections into the residual are scaled down


def slice_spec(spec: ModelSpec, n_layers: int) -> ModelSpec:
    """The same model at its real width with only `n_layers` blocks.

    Per-layer time and memory at the target width (e.g. 13B: hidden 5120) can
    then be measured on one or two GPUs that could never hold the whole model.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise SpecError(f"slice_spec n_layers = {n_layers!r} is not valid; use a whole number >= 1")
    return dataclasses.replace(spec, n_layers=n_layers, name=f"{spec.name}-slice{n_layers}")


def norm_layer(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps, bias=spec.bias)


def rope_tables(seq_len: int, head_dim: int, device=None,
                theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim), fp32.

    Half-split ("rotate_half") convention as in transformers' Llama, so the
    Hugging Face baseline and this model compute the same function.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # (S, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, n, hd) queries or keys by the angles of their positions."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, S, 1, hd)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.head_dim = spec.head_dim
        self.n_rep = spec.n_heads // spec.n_kv_heads  # query heads per key/value head
        self.rope = spec.positions == "rope"
        self.wq = nn.Linear(spec.hidden, spec.n_heads * spec.head_dim, bias=spec.bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.bias)
        self.wo = nn.Linear(spec.n_heads * spec.head_dim, spec.hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape  # under tensor parallel x is the all-gathered, full sequence
        # Head counts come from the projection widths (-1), so a tensor-parallel
        # shard that holds nh/tp heads needs no attribute patched.
        q = self.wq(x).view(B, S, -1, self.head_dim)  # (B, S, nh, hd)
        k = self.wk(x).view(B, S, -1, self.head_dim)  # (B, S, nkv, hd)
        v = self.wv(x).view(B, S, -1, self.head_dim)  # (B, S, nkv, hd)
        if self.rope:
            q, k = apply_rope(q, cos[:S], sin[:S]), apply_rope(k, cos[:S], sin[:S])
        if self.n_rep > 1:  # GQA: each key/value head serves n_rep query heads
            k = k.repeat_interleave(self.n_rep, dim=2)  # (B, S, nh, hd)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, S, hd)
        y = y.transpose(1, 2).reshape(B, S, -1)  # (B, S, nh * hd)
        return self.wo(y)  # (B, S, H)


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Linear(spec.hidden, spec.ffn, bias=spec.bias)  # gate (SwiGLU) or up (GELU)
        self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=spec.bias)  # down
        self.w3 = nn.Linear(spec.hidden, spec.ffn, bias=spec.bias) if self.swiglu else None  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> (B, S, H)
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))  # inner (B, S, F)
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + mlp(norm(.))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attention_norm = norm_layer(spec)
        self.attention = Attention(spec)
        self.ffn_norm = norm_layer(spec)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


@torch.no_grad()
def init_normal(model: nn.Module, n_layers: int, residual: tuple[str, ...]) -> None:
    """GPT-2's initialisation of every linear and embedding weight (Radford et al. 2019).

    N(0, INIT_STD), with the projections that write into the residual stream
    (names ending in `residual`) scaled by 1 / sqrt(2 n_layers), since each
    block adds two of them; biases zero. Norms are left to the caller. Shared
    with the HF baseline so both models start from the same distribution.
    """
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(residual) else INIT_STD
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)


class Transformer(nn.Module):
    """Token ids (B, S) -> logits (B, S, V); or hidden states in and out for a pipeline stage."""

    def __init__(self, spec: ModelSpec, max_seq_len: int = 4096):
        super().__init__()
        if spec.is_moe:
            raise SpecError(
                f"model {spec.name!r} has n_experts = {spec.n_experts}; the proxy harness "
                "builds dense models only (n_experts = 1)"
            )
        if spec.positions == "learned" and max_seq_len > spec.max_positions:
            max_seq_len = spec.max_positions
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings = (
            nn.Embedding(spec.max_positions, spec.hidden) if spec.positions == "learned" else None
        )
        # A dict keyed by the global block index: a pipeline stage deletes the
        # blocks it does not own and the names of the rest stay stable.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.n_layers)})
        self.norm = norm_layer(spec)
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False)
        # Under autocast, carry the residual stream in the autocast dtype (bf16) rather than
        # the fp32 of the embedding's output: `parallelize` sets it on one GPU.
        self.autocast_stream = False
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are not state: non-persistent, rebuilt by init_weights.
        cos, sin = rope_tables(max_seq_len, spec.head_dim, theta=spec.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @classmethod
    def from_spec(cls, spec: ModelSpec, max_seq_len: int = 4096) -> Transformer:
        return cls(spec, max_seq_len=max_seq_len)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise every parameter and buffer in place.

        Called by the constructor, and again after a model built on the meta
        device has been materialised with `to_empty` (possibly already sharded:
        the init ops work on DTensors too).
        """
        device = buffer_device or self.rope_cos.device
        cos, sin = rope_tables(self.max_seq_len, self.spec.head_dim, device=device,
                               theta=self.spec.rope_theta)
        self.rope_cos, self.rope_sin = cos, sin
        init_normal(self, self.spec.n_layers, residual=("wo", "w2"))
        for module in self.modules():
            if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (B, S) ids on the first stage, (B, S, H) hidden states on later ones
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.pos_embeddings is not None and self.tok_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos_embeddings(positions)  # (B, S, H)
        if self.autocast_stream and torch.is_autocast_enabled(h.device.type):
            h = h.to(torch.get_autocast_dtype(h.device.type))  # fp32 weights, bf16 stream
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)  # (B, S, H)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None or isinstance(self.output, LinearCrossEntropy):
            return h  # (B, S, H): a stage's output, or the fused loss applies the output layer
        return self.output(h)  # (B, S, V)


def count_params(model: nn.Module) -> int:
    """Parameters of a (single-device) module; a tied table is counted once."""
    return sum(p.numel() for p in model.parameters())


def flop_params(model: Transformer) -> int:
    """N of the 6N FLOPs rule: every parameter but the input embedding table(s).

    A lookup is no matmul (Chowdhery et al. 2022 (PaLM), app. B); a tied output layer still
    multiplies by the table, so with tied embeddings it is counted once.
    """
    n = count_params(model) - model.tok_embeddings.weight.numel()
    if model.pos_embeddings is not None:
        n -= model.pos_embeddings.weight.numel()
    if model.spec.tied_embeddings:
        n += model.tok_embeddings.weight.numel()
    return n
