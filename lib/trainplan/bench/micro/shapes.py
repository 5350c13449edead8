"""The model's own GEMM shapes, attention FLOPs and collective bus factors: pure arithmetic.

Kept apart from the timing code in `micro.py` (which needs torch and a GPU)
so that calibration and tests can use it on any machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainplan.errors import SpecError
from trainplan.specs import ModelSpec, load_model

SWEEP_MICRO_BATCHES = (1, 2, 4)  # at --seq-len: the 1.3B block's GPU time crosses its host's

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
KiB, GiB = 2**10, 2**30


def whole(low: int = 1, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpecError(f"{name} = {value!r} is not valid; use a whole number >= {low}")




@dataclass(frozen=True)
class GemmShape:
    """One forward GEMM: (M, K) @ (K, N), `count` times per layer (or per model)."""

    name: str  # module it comes from (model.py names in brackets in `gemm_shapes`)
    m: int
    n: int
    k: int
    count: int = 1
    per_layer: bool = True  # False: once per model (the output layer)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def gemm_shapes(spec: ModelSpec | str, tp: int = 1, tokens: int = 16384) -> list[GemmShape]:
    """The forward GEMMs of one rank for a Llama/GPT-style model, `tokens` rows each.

    Tensor parallel (Megatron column/row split) divides the output width of
    q, k/v, gate/up and the output layer, and the input width of out and down.
    Per layer: q [wq] (T, h/t, h); k and v [wk, wv] (T, kv/t, h) x 2; out [wo]
    (T, h, h/t); gate and up [w1, w3] (T, f/t, h) x 2 (SwiGLU; one `up` for a
    GELU MLP); down [w2] (T, h, f/t). Once: output (T, V/t, h). The backward
    pass runs two GEMMs of the same FLOPs per forward GEMM.
    """
    spec = load_model(spec) if isinstance(spec, str) else spec
    whole(tp=tp, tokens=tokens)
    for name in ("n_heads", "n_kv_heads", "ffn", "vocab"):
        if getattr(spec, name) % tp:
            raise SpecError(f"tp = {tp} does not divide {spec.name}.{name} = "
                            f"{getattr(spec, name)}; use a divisor of it")
    h, kv, f, t = spec.hidden, spec.kv_dim, spec.ffn, tp
    up = 2 if spec.mlp == "swiglu" else 1
    return [
        GemmShape("q", tokens, h // t, h),
        GemmShape("kv", tokens, kv // t, h, count=2),
        GemmShape("out", tokens, h, h // t),
        GemmShape("gate_up" if up == 2 else "up", tokens, f // t, h, count=up),
        GemmShape("down", tokens, h, f // t),
        GemmShape("output", tokens, spec.vocab // t, h, per_layer=False),
    ]


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True,
                    backward: bool = True) -> float:
    """FLOPs of attention's two matmuls (Q K^T and P V), as the MFU convention counts them.

    Forward 4 b a s^2 d (2 matmuls of 2 b a s^2 d); backward twice that, so
    forward + backward 12 b a s^2 d: per token and layer 12 s h with h = a d,
    the attention term of the 6 N + 12 l h s convention (Narayanan et al.
    2021). Causal kernels skip the masked half, so the work done, and the
    TFLOP/s we report, is half; multiply by 2 for the dense-equivalent rate
    that MFU's convention credits. Flash attention's recompute of Q K^T in the
    backward pass is not counted (as `flash-attn`'s own benchmark counts 2.5x).
    """
    fwd = 4.0 * batch * heads * seq * seq * head_dim
    total = fwd * (3 if backward else 1)
    return total / 2 if causal else total


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests doc/PERFORMANCE.md)."""
    if op not in COLLECTIVES:
        raise SpecError(f"collective {op!r} is not valid; use one of {list(COLLECTIVES)}")
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def parse_size(text: str) -> int:
    """Bytes in '65536', '64K', '64KiB', '4M', '1G' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise SpecError(f"size {text!r} is not valid; use e.g. 65536, 64K, 64KiB, 4M, 1G")
    return int(match[1]) * 2 ** (10 * " KMG".index((match[2] or " ").upper()))


def parse_sizes(text: str) -> list[int]:
    """'64K..1G' (every power of two between) or a comma list '64K,1M,1G'."""
    if ".." in text:
        low, high = (parse_size(s) for s in text.split("..", 1))
        if not 0 < low <= high:
            raise SpecError(f"sizes {text!r} are not valid; use LOW..HIGH with 0 < LOW <= HIGH")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 2
        return sizes
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0:
        raise SpecError(f"sizes {text!r} are not valid; use e.g. 64K..1G or 64K,1M")
    return sizes
