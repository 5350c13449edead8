"""The fused, chunked output layer + cross-entropy equals the unfused path (CPU), with
ignored (-100) labels too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainplan.bench.harness.loss import IGNORE, LinearCrossEntropy, fused_linear_cross_entropy
from trainplan.bench.harness.step import cross_entropy
from trainplan.errors import SpecError


def _inputs(dtype=torch.float32, B=2, S=24, H=16, V=50):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, S, H, generator=g, dtype=dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g, dtype=dtype)).requires_grad_()
    return h, w, torch.randint(V, (B, S), generator=g)


def _assert_same(got, ref, h, w, scale=1.0, bf16=False):
    """`got` and `ref` losses equal in value, and in their gradients to h and w after
    scaling by `scale` (step.py divides by the micro-batch count): fp32 or bf16 tolerances."""
    got_h, got_w = torch.autograd.grad(got * scale, (h, w))
    ref_h, ref_w = torch.autograd.grad(ref * scale, (h, w))
    tol = dict(rtol=1e-3, atol=1e-3) if bf16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, ref, **tol)
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close((got_h, got_w), (ref_h, ref_w), **tol)
    return got_h, got_w


@pytest.mark.parametrize("chunk", [1, 7, 48, 4096])
def test_value_and_gradients_equal_f_cross_entropy(chunk):
    """Any chunking, including uneven and larger-than-N chunks; the loss scaled as in step.py."""
    h, w, y = _inputs()
    ref = F.cross_entropy(F.linear(h, w).flatten(0, 1), y.flatten())
    got = fused_linear_cross_entropy(h, w, y, chunk=chunk)
    _assert_same(got, ref, h, w, scale=0.5)


def test_bf16_autocast_matches_the_unfused_path():
    """Under autocast the matmuls run in bf16 and the softmax in fp32, as step.cross_entropy."""
    h, w, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy(F.linear(h, w), y)
        got = fused_linear_cross_entropy(h, w, y, chunk=16)
    got_h, got_w = _assert_same(got, ref, h, w, bf16=True)
    assert got.dtype == torch.float32 and got_h.dtype == h.dtype and got_w.dtype == w.dtype


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_bad_chunk_is_refused(chunk):
    h, w, y = _inputs()
    with pytest.raises(SpecError, match="chunk"):
        fused_linear_cross_entropy(h, w, y, chunk=chunk)


def test_label_count_must_match():
    h, w, y = _inputs()
    with pytest.raises(SpecError, match="labels"):
        fused_linear_cross_entropy(h, w, y[:, :-1])


def _masked(y: torch.Tensor, rows: slice) -> torch.Tensor:
    """`y` with positions `rows` of the flat (B*S,) labels and every third one IGNORE (-100):
    a prompt-like run of masked positions plus a scatter of padding."""
    y = y.clone().flatten()
    y[rows] = IGNORE
    y[::3] = IGNORE
    return y.view(2, -1)


@pytest.mark.parametrize("chunk", [1, 5, 16, 4096])
def test_ignored_labels_match_f_cross_entropy(chunk):
    """Mean over the positions with a loss; chunks 0-15 hold no loss at chunk 16."""
    h, w, y = _inputs()
    y = _masked(y, slice(0, 16))
    assert (y == IGNORE).any() and (y != IGNORE).any()
    ref = cross_entropy(F.linear(h, w), y)
    got = fused_linear_cross_entropy(h, w, y, chunk=chunk)
    got_h, _ = _assert_same(got, ref, h, w, scale=0.5)
    assert got_h.flatten(0, 1)[:16].abs().sum() == 0  # no loss, no gradient there


def test_ignored_labels_under_bf16_autocast():
    h, w, y = _inputs()
    y = _masked(y, slice(20, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy(F.linear(h, w), y)
        got = fused_linear_cross_entropy(h, w, y, chunk=8)
    _assert_same(got, ref, h, w, bf16=True)


def test_all_ignored_gives_what_f_cross_entropy_gives():
    """No position with a loss: nan, as F.cross_entropy's mean over none, and zero gradients."""
    h, w, y = _inputs()
    y = torch.full_like(y, IGNORE)
    ref = cross_entropy(F.linear(h, w), y)
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    got = fused_linear_cross_entropy(h, w, y, chunk=7)
    got_h, got_w = torch.autograd.grad(got, (h, w))
    assert torch.isnan(ref) and torch.isnan(got)
    assert torch.equal(got_h, ref_h) and torch.equal(got_w, ref_w)
    assert got_h.abs().sum() == 0 and got_w.abs().sum() == 0


def test_linear_cross_entropy_module_keeps_the_weight():
    """The module the harness swaps in: same Parameter, same loss as the layer + step's loss."""
    h, w, y = _inputs()
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    before = lin.weight
    head = LinearCrossEntropy(lin, chunk=10)
    assert head.weight is before and [n for n, _ in head.named_parameters()] == ["weight"]
    y = _masked(y, slice(0, 4))
    torch.testing.assert_close(head(h, y), cross_entropy(lin(h), y), rtol=1e-6, atol=1e-6)
