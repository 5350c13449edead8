"""The fused loss's head in the memory model (`cost.memory.fused_logits_bytes`)."""

import numpy as np

from conftest import layouts
from trainplan.cost import memory
from trainplan.specs import load_model

M = load_model("llama-1.3b")
LAY = dict(dp=1, dp_shard=1, zero=0, tp=1, pp=1, cp=1, ep=1, recompute=0,
           sequence_parallel=False, pp_schedule=0, pp_virtual=1, grad_accum=1)


def _breakdown(micro_batch, **kw):
    return memory.breakdown(M, layouts(**LAY, micro_batch=micro_batch), seq_len=2048,
                            compiled_loss=True, **kw)


def test_fused_loss_replaces_the_logits_by_one_chunk():
    """At micro-batch 16 x 2048 the whole logits' term gives way to one chunk's and the
    gradients the fused loss keeps; everything else is the same."""
    plain, fused = _breakdown(16), _breakdown(16, fused_loss=True)
    assert _breakdown(16, fused_loss=False) == plain  # the default prices the standard loss
    kw = dict(seq_len=2048, micro_batch=16, cp=1)
    saved = memory.compiled_logits_bytes(M, tp=1, **kw) - memory.fused_logits_bytes(M, **kw)
    assert saved > 2**30  # GiB of the 4 GiB compiled head
    assert np.isclose(plain["activations"] - fused["activations"], saved)
    assert fused["total"] < plain["total"]
    assert all(np.isclose(plain[k], fused[k]) for k in ("params", "optimizer"))


def test_fused_head_grows_with_the_chunk_until_it_holds_the_micro_batch():
    kw = dict(seq_len=2048, micro_batch=1, cp=1)
    small, whole, over = (memory.fused_logits_bytes(M, chunk=c, **kw) for c in (512, 2048, 8192))
    assert small < whole == over
    one, many = (memory.fused_logits_bytes(M, seq_len=2048, micro_batch=b, cp=1)
                 for b in (2, 32))
    std = [memory.compiled_logits_bytes(M, seq_len=2048, micro_batch=b, tp=1, cp=1)
           for b in (2, 32)]
    assert many / one < 4 < std[1] / std[0]  # 16x the tokens: the standard head 16x
