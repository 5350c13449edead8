"""The fused, chunked output layer + cross-entropy equals the unfused path (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainplan.bench.harness.loss import fused_linear_cross_entropy
from trainplan.bench.harness.step import cross_entropy
from trainplan.errors import SpecError


def _inputs(dtype=torch.float32, B=2, S=24, H=16, V=50):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, S, H, generator=g, dtype=dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g, dtype=dtype)).requires_grad_()
    return h, w, torch.randint(V, (B, S), generator=g)


@pytest.mark.parametrize("chunk", [1, 7, 48, 4096])
def test_value_and_gradients_equal_f_cross_entropy(chunk):
    """Any chunking, including uneven and larger-than-N chunks; the loss scaled as in step.py."""
    h, w, y = _inputs()
    ref = F.cross_entropy(F.linear(h, w).flatten(0, 1), y.flatten())
    ref_h, ref_w = torch.autograd.grad(ref * 0.5, (h, w))
    got = fused_linear_cross_entropy(h, w, y, chunk=chunk)
    got_h, got_w = torch.autograd.grad(got * 0.5, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_matches_the_unfused_path():
    """Under autocast the matmuls run in bf16 and the softmax in fp32, as step.cross_entropy."""
    h, w, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy(F.linear(h, w), y)
        got = fused_linear_cross_entropy(h, w, y, chunk=16)
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    got_h, got_w = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32 and got_h.dtype == h.dtype and got_w.dtype == w.dtype
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_h, ref_h, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got_w, ref_w, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_bad_chunk_is_refused(chunk):
    h, w, y = _inputs()
    with pytest.raises(SpecError, match="chunk"):
        fused_linear_cross_entropy(h, w, y, chunk=chunk)


def test_label_count_must_match():
    h, w, y = _inputs()
    with pytest.raises(SpecError, match="labels"):
        fused_linear_cross_entropy(h, w, y[:, :-1])
