"""Output layer and cross-entropy fused and chunked: the (B, S, V) logits never exist whole.

Why: with V = 32000 the logits dominate the memory that does not shrink with
FSDP. At micro-batch 16, sequence 2048 they are 2 GiB in bf16, 4 GiB as the
fp32 upcast of the loss, and their gradient again: about 8 GiB of a step's
peak, which caps the micro-batch (and so the amortisation of each step's
fixed costs) on an 80 GB H100 and costs headroom on H200. Here the output
matmul, the loss and both gradients are computed chunk by chunk in the
forward pass (the scheme of Liger-Kernel's fused linear cross-entropy, Hsu et
al. 2024): per chunk of tokens, logits (c, V) -> log-sum-exp and loss ->
dlogits = (softmax - onehot) / N -> grad_h = dlogits W and grad_W +=
dlogits^T h; backward only scales the stored gradients. The matmul FLOPs are
those of the unfused path (forward, input gradient, weight gradient), so
nothing is recomputed; peak extra memory is one (c, V) fp32 chunk plus the
(V, H) fp32 weight-gradient accumulator.

Precision follows the unfused path it replaces (step.cross_entropy after a
bf16 output layer): matmuls in the compute dtype (the autocast dtype if
autocast is on, else the inputs' dtype), log-softmax in fp32, dlogits cast
back to the compute dtype for the two gradient matmuls; the weight gradient
is accumulated over chunks in fp32.

Off by default; not wired into the model yet (the lead's README lines say
how). Every label must be a real class (no ignore_index): our loader packs
sequences without padding.
"""

from __future__ import annotations

import torch

from trainplan.errors import SpecError

DEFAULT_CHUNK = 4096  # tokens per chunk: a (4096, 32000) fp32 chunk is 0.5 GiB


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _chunk_grad(logits: torch.Tensor, labels: torch.Tensor, n_total: int, dtype: torch.dtype):
    """(loss sum over the chunk, dlogits of the mean loss) from (c, V) logits; fp32 inside."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    target = logits.gather(1, labels[:, None]).squeeze(1)  # (c,)
    probs = torch.exp(logits - lse[:, None])  # softmax (c, V)
    probs.scatter_add_(1, labels[:, None], torch.full_like(target, -1.0)[:, None])
    return (lse - target).sum(), (probs / n_total).to(dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, chunk_fn):
        dtype = _compute_dtype(h)
        with torch.autocast(h.device.type, enabled=False):
            hc_all, w = h.to(dtype), weight.to(dtype)
            n = hc_all.shape[0]
            grad_h = torch.empty_like(hc_all)
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            for s in range(0, n, chunk):
                hc = hc_all[s:s + chunk]  # (c, H)
                part, dlogits = chunk_fn(hc @ w.t(), labels[s:s + chunk], n, dtype)
                loss += part
                grad_h[s:s + chunk] = dlogits @ w  # (c, H)
                grad_w += (dlogits.t() @ hc).float()  # (V, H)
        ctx.save_for_backward(grad_h.to(h.dtype), grad_w.to(weight.dtype))
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None


_compiled_chunk = None


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               chunk: int = DEFAULT_CHUNK, compile: bool = False) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` against `labels`, without whole logits.

    h: (N, H) or (B, S, H) final hidden states (after the last norm);
    weight: (V, H), the output layer's; labels: (N,) or (B, S) class ids.
    Equals `step.cross_entropy(F.linear(h, weight), labels)` in value and
    gradients (tests/bench/test_loss.py). `compile` fuses each chunk's
    element-wise work (upcast, log-sum-exp, softmax, scatter, cast) into one
    kernel; pick `chunk` dividing N so one graph serves every chunk.
    """
    global _compiled_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise SpecError(f"fused loss chunk = {chunk!r} is not valid; use a whole number >= 1")
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if h2.shape[0] != y.shape[0]:
        raise SpecError(f"fused loss: {h2.shape[0]} hidden states but {y.shape[0]} labels")
    fn = _chunk_grad
    if compile:
        if _compiled_chunk is None:
            _compiled_chunk = torch.compile(_chunk_grad, dynamic=False)
        fn = _compiled_chunk
    return _FusedLinearCrossEntropy.apply(h2, weight, y, chunk, fn)
