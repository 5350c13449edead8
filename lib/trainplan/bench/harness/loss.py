"""Output layer and cross-entropy fused and chunked: the (B, S, V) logits never exist whole.

Why: with V = 32000 the logits dominate the memory that does not shrink with FSDP. At
micro-batch 16, sequence 2048 they are 2 GiB in bf16, 4 GiB as the fp32 upcast of the loss,
and their gradient again: about 8 GiB of a step's peak, which caps the micro-batch (and so the
amortisation of each step's fixed costs). Here the output matmul, the loss and both gradients
are computed chunk by chunk in the forward pass (the scheme of Liger-Kernel's fused linear
cross-entropy, Hsu et al. 2024): per chunk of tokens, logits (c, V) -> log-sum-exp and loss ->
dlogits = (softmax - onehot) / N -> grad_h = dlogits W and grad_W += dlogits^T h; backward
only scales the stored gradients. The matmul FLOPs are the unfused path's, so nothing is
recomputed; peak extra memory is one (c, V) fp32 chunk plus the (V, H) fp32 accumulator.

Precision follows the unfused path it replaces (step.cross_entropy after a bf16 output layer):
matmuls in the compute dtype (autocast's if on, else the inputs'), log-softmax in fp32,
dlogits cast back for the two gradient matmuls, the weight gradient accumulated in fp32.

Labels equal to IGNORE (-100, `data.rows.IGNORE`: prompts and padding of instruction data)
carry no loss, as in F.cross_entropy's default: the mean is over the positions with a loss, a
chunk without any adds nothing, and with none at all the loss is nan and every gradient zero.
The count is a tensor, so a compiled chunk serves every mask.

In the harness: `--loss fused` (train.py) turns the model's `output` into a
`LinearCrossEntropy`; the model's forward then stops at the final norm and the step's loss
calls that module with (h, labels), so FSDP2's hooks on it gather the weight and
reduce-scatter its gradient (parallelize.apply_fsdp).
"""

from __future__ import annotations

import torch
from torch import nn

from trainplan.bench.flags import LOSS_CHUNK as DEFAULT_CHUNK
from trainplan.bench.flags import LOSSES  # noqa: F401
from trainplan.bench.flags import add_loss_arguments as add_arguments  # noqa: F401
from trainplan.errors import SpecError, TrainplanError

IGNORE = -100  # F.cross_entropy's default ignore_index; data.rows.IGNORE


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _chunk_grad(logits: torch.Tensor, labels: torch.Tensor, n_total: torch.Tensor,
                dtype: torch.dtype):
    """(loss sum over the chunk, dlogits of the mean loss) from (c, V) logits; fp32 inside.

    `n_total`: positions with a loss in the whole batch (a tensor, >= 1); rows whose label
    is IGNORE add no loss and get zero dlogits.
    """
    logits = logits.float()
    keep = labels != IGNORE  # (c,)
    safe = torch.where(keep, labels, 0)[:, None]  # any real class; masked below
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    target = logits.gather(1, safe).squeeze(1)  # (c,)
    probs = torch.exp(logits - lse[:, None])  # softmax (c, V)
    probs.scatter_add_(1, safe, torch.full_like(target, -1.0)[:, None])
    scale = keep.float() / n_total  # (c,): 1/N for a position with a loss, else 0
    return torch.where(keep, lse - target, 0.0).sum(), (probs * scale[:, None]).to(dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, chunk_fn):
        dtype = _compute_dtype(h)
        with torch.autocast(h.device.type, enabled=False):
            hc_all, w = h.to(dtype), weight.to(dtype)
            n = hc_all.shape[0]
            count = (labels != IGNORE).sum()  # positions with a loss; 0 gives nan, as F does
            n_grad = count.clamp(min=1).float()
            grad_h = torch.empty_like(hc_all)
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            for s in range(0, n, chunk):
                hc = hc_all[s:s + chunk]  # (c, H)
                part, dlogits = chunk_fn(hc @ w.t(), labels[s:s + chunk], n_grad, dtype)
                loss += part
                grad_h[s:s + chunk] = dlogits @ w  # (c, H)
                grad_w += (dlogits.t() @ hc).float()  # (V, H)
        ctx.save_for_backward(grad_h.to(h.dtype), grad_w.to(weight.dtype))
        return loss / count

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
    gradients, IGNORE labels included (tests/bench/test_loss.py). `compile` fuses each chunk's
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


class LinearCrossEntropy(nn.Linear):
    """The output layer as the loss: forward(h (B, S, H), labels (B, S)) -> the mean
    cross-entropy of h W^T (`fused_linear_cross_entropy`). It holds the very `weight`
    Parameter of the layer it replaces, so names, a tie to the embedding, initialisation
    (model.init_normal) and checkpoints are those of the standard path."""

    def __init__(self, linear: nn.Linear, chunk: int = DEFAULT_CHUNK, compile: bool = False):
        nn.Module.__init__(self)  # not nn.Linear's: it would draw a new weight
        if linear.bias is not None:
            raise SpecError("fused loss: the output layer has a bias; use --loss standard")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        self.chunk, self.compile_chunk = chunk, compile

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(h, self.weight, labels, self.chunk,
                                          self.compile_chunk)


def check(args) -> None:
    """Refuse (one line) `--loss fused` where it is not built: tensor parallel (its output
    is vocab-sharded), pipeline stages, context parallel, the `transformers` baseline."""
    chunk = args.loss_chunk
    if getattr(args, "loss", "standard") != "fused":
        if chunk != DEFAULT_CHUNK:
            raise TrainplanError(f"--loss-chunk {chunk} is --loss fused's chunk; add --loss "
                                 "fused or leave the chunk out")
        return
    if chunk < 1:
        raise TrainplanError(f"--loss-chunk = {chunk} must be a whole number >= 1")
    supported = "it runs on one process, DDP and FSDP2 (ZeRO 1-3, HSDP)"
    for flag in ("tp", "pp", "cp"):
        if getattr(args, flag) > 1:
            raise TrainplanError(f"--loss fused with --{flag} {getattr(args, flag)}: {supported}"
                                 "; not with tensor, pipeline or context parallel; use "
                                 f"--{flag} 1 or --loss standard")
    if getattr(args, "impl", "trainplan") != "trainplan":
        raise TrainplanError(f"--loss fused with --impl {args.impl}: {supported} on the "
                             "harness's own model; use --loss standard")


def for_model(model: nn.Module, args):
    """With `--loss fused`: swap `model.output` for a `LinearCrossEntropy` in place (the
    model's forward then returns the final-norm hidden states) and return it, the step's
    loss function `(h, labels) -> loss`; else None."""
    if getattr(args, "loss", "standard") != "fused":
        return None
    model.output = LinearCrossEntropy(model.output, args.loss_chunk, args.compile)
    return model.output


def layout_fields(args) -> dict:
    """The record's layout field of the loss: {"loss": "standard" | "fused"}."""
    return {"loss": getattr(args, "loss", "standard")}
