"""The harness with a bf16 residual stream where it autocasts fp32 weights: one A/B.

Where FSDP2 does not run (one GPU, DDP, TP or PP alone) the harness keeps fp32 weights under
`torch.autocast`, so the embedding's output, and with it the residual stream, is fp32; under
FSDP2's bf16 parameters it is bf16. This runs `trainplan.bench.harness.train` with its flags
after casting the embedding's output to the autocast dtype (a forward hook), so that the two
precisions of the stream can be timed side by side on one machine.
Run: torchrun --standalone --nproc-per-node 1 tools/bf16_stream.py HARNESS_FLAGS
"""

from __future__ import annotations

import runpy
import sys

import torch

from trainplan.bench.harness import model

_build = model.Transformer.__init__


def _to_autocast_dtype(module, inputs, out):
    kind = out.device.type
    return out.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else out


def _with_hook(self, *args, **kwargs):
    _build(self, *args, **kwargs)
    self.tok_embeddings.register_forward_hook(_to_autocast_dtype)


if __name__ == "__main__":
    model.Transformer.__init__ = _with_hook
    sys.argv = ["trainplan.bench.harness.train", *sys.argv[1:]]
    runpy.run_module("trainplan.bench.harness.train", run_name="__main__", alter_sys=True)
