"""The model spec: a decoder-only transformer's shape, checked on construction.

Apart from the package's other specs so that `specs.hf` (Hugging Face configs) can build one
without importing the package that dispatches to it; `trainplan.specs` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainplan.errors import SpecError
from trainplan.loader import quote
from trainplan.specs.bounds import MAX_PARAMS
from trainplan.specs.checks import check_fields


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: Llama-style (SwiGLU, RoPE, RMSNorm) or GPT-style."""

    name: str
    n_layers: int  # transformer blocks
    hidden: int  # model width h
    n_heads: int  # query heads a
    ffn: int  # MLP inner width f (per expert for MoE)
    vocab: int  # vocabulary size V
    n_kv_heads: int = 0  # key/value heads for GQA; 0 means = n_heads (multi-head attention)
    mlp: Literal["swiglu", "gelu"] = "swiglu"  # gelu: the plain 2-matrix GPT MLP
    positions: Literal["rope", "learned"] = "rope"
    max_positions: int = 0  # rows of the learned position table (positions: learned)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    bias: bool = False  # GPT-2 style biases in every linear layer
    tied_embeddings: bool = False  # output layer shares the input embedding table
    rope_theta: float = 10000.0  # rotary base (Llama 2: 1e4, Llama 3: 5e5)
    norm_eps: float = 1e-5  # epsilon of every RMSNorm/LayerNorm
    n_experts: int = 1  # MoE experts per layer (1 = dense)
    top_k: int = 1  # experts each token is routed to
    source: str = ""  # where the numbers come from

    def __post_init__(self):
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        check_fields(
            self,
            positive=("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab",
                      "n_experts", "top_k", "rope_theta", "norm_eps"),
            non_negative=("max_positions",),
        )
        if self.hidden % self.n_heads:
            raise SpecError(
                f"ModelSpec.hidden = {self.hidden} is not divisible by n_heads = {self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise SpecError(
                f"ModelSpec.n_kv_heads = {self.n_kv_heads} must divide n_heads = {self.n_heads}"
            )
        if self.top_k > self.n_experts:
            raise SpecError(
                f"ModelSpec.top_k = {self.top_k} exceeds n_experts = {self.n_experts}"
            )
        if self.positions == "learned" and self.max_positions <= 0:
            raise SpecError("ModelSpec.max_positions must be > 0 when positions is 'learned'")
        if self.size_bound() > MAX_PARAMS:
            raise SpecError(f"ModelSpec {quote(self.name)}: about {self.size_bound():.2e} "
                            f"parameters is too many; at most {MAX_PARAMS:.2e} (check hidden, ffn, "
                            "n_layers, n_experts, vocab)")

    def size_bound(self) -> int:
        """An upper bound on the parameter count (`cost.params.total_params` is exact): a
        block's attention 4 h^2, each expert 3 h f with its biases and router share, norms
        and biases 10 h; two tables V h and the positions."""
        h = self.hidden
        block = 4 * h * h + self.n_experts * (3 * h * self.ffn + 2 * self.ffn + 2 * h) + 10 * h
        return self.n_layers * block + (2 * self.vocab + self.max_positions + 2) * h

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1
