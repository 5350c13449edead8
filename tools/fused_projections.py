"""Do fused QKV and gate/up projections pay on this card? One A/B, printed and written.

Times forward + backward (autocast bf16, fp32 weights, each block compiled with
`fullgraph=True`, median of the steps after 4 warm-up ones) of `--blocks` blocks of
`--model` at micro-batch `--micro-batch` and sequence 2048, four ways: the harness's
separate `wq/wk/wv` and `w1/w3` matmuls ("none"), and the weights of one or both groups
concatenated into one wider matmul per step ("qkv", "ffn", "qkv+ffn": Megatron's fused
layout, at the cost of one weight copy). Seconds per forward + backward, per variant and
compile mode, two repeats each, as JSON lines in `--out` (each with the card and provenance).
Run: python tools/fused_projections.py --micro-batch 24 --blocks 6 --out FILE
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from trainplan.bench.harness.model import TransformerBlock, apply_rope, rope_tables
from trainplan.records.provenance import provenance, utc_now
from trainplan.specs import load_model

VARIANTS = ("none", "qkv", "ffn", "qkv+ffn")


def attention_fused(self, x, cos, sin):
    """The harness's `Attention.forward` with q, k and v from one matmul."""
    B, S, _ = x.shape
    nq, nkv = self.wq.weight.shape[0], self.wk.weight.shape[0]
    qkv = F.linear(x, torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]))
    q, k, v = (t.view(B, S, -1, self.head_dim) for t in qkv.split([nq, nkv, nkv], dim=-1))
    q, k = apply_rope(q, cos[:S], sin[:S]), apply_rope(k, cos[:S], sin[:S])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(y.transpose(1, 2).reshape(B, S, -1))


def feed_forward_fused(self, x):
    """The harness's SwiGLU with gate and up from one matmul."""
    f = self.w1.weight.shape[0]
    gate, up = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).split([f, f], dim=-1)
    return self.w2(F.silu(gate) * up)


def time_variant(variant: str, mode: str | None, spec, blocks: int, batch: int, seq: int,
                 steps: int = 12) -> float:
    """Median seconds of one forward + backward through `blocks` compiled blocks."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([TransformerBlock(spec) for _ in range(blocks)]).cuda()
    for block in layers:
        if "qkv" in variant:
            block.attention.forward = attention_fused.__get__(block.attention)
        if "ffn" in variant:
            block.feed_forward.forward = feed_forward_fused.__get__(block.feed_forward)
        block.compile(fullgraph=True, mode=mode)
    cos, sin = rope_tables(seq, spec.head_dim, device="cuda")
    x = torch.randn(batch, seq, spec.hidden, device="cuda", requires_grad=True)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            h = x
            for block in layers:
                h = block(h, cos, sin)
        h.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del layers
    torch.cuda.empty_cache()
    kept = sorted(times[4:])
    return kept[len(kept) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1.3b")
    p.add_argument("--micro-batch", type=int, default=24)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--modes", default="default,max-autotune-no-cudagraphs")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    spec = load_model(a.model)
    with open(a.out, "w") as out:
        for mode in a.modes.split(","):
            for repeat in range(2):
                for variant in VARIANTS:
                    s = time_variant(variant, None if mode == "default" else mode, spec,
                                     a.blocks, a.micro_batch, 2048)
                    row = {"kind": "fused_projections", "recorded_at": utc_now(),
                           "card": torch.cuda.get_device_name(), "model": a.model,
                           "blocks": a.blocks, "micro_batch": a.micro_batch, "seq_len": 2048,
                           "mode": mode, "variant": variant, "repeat": repeat, "s": s,
                           "provenance": provenance()}
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
