"""The harness with the bf16 levers that change its code, stacked: one A/B per lever.

Runs `trainplan.bench.harness.train` with its own flags after applying, where asked:
  --stream bf16       cast the embedding's output to the autocast dtype, so the residual
                      stream is bf16 where fp32 weights are autocast (one GPU, DDP, TP, PP);
  --compile-scope model  compile the whole model as one graph instead of each block, so
                      Inductor may fuse across block boundaries (the default: `block`).
Everything else (micro-batch, --loss fused, allocator settings through the environment)
is the harness's own. Run: torchrun --standalone --nproc-per-node 1 tools/stacked_levers.py
[--stream fp32|bf16] [--compile-scope block|model] HARNESS_FLAGS
"""

from __future__ import annotations

import argparse
import runpy
import sys

import torch

from trainplan.bench.harness import model, parallelize


def _to_autocast_dtype(module, inputs, out):
    kind = out.device.type
    return out.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else out


def _bf16_stream(build):
    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.tok_embeddings.register_forward_hook(_to_autocast_dtype)
    return init


def _compile_model(part) -> None:
    part.compile(fullgraph=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--stream", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--compile-scope", choices=("block", "model"), default="block")
    levers, rest = p.parse_known_args()
    if levers.stream == "bf16":
        model.Transformer.__init__ = _bf16_stream(model.Transformer.__init__)
    if levers.compile_scope == "model":
        parallelize.apply_compile = _compile_model
    sys.argv = ["trainplan.bench.harness.train", *rest]
    runpy.run_module("trainplan.bench.harness.train", run_name="__main__", alter_sys=True)
