"""The one-GPU harness with each of its two bf16 levers on or off: one A/B per lever.

On one GPU the harness compiles the whole model and carries a bf16 residual stream
(`bench.harness.parallelize`). This runs `trainplan.bench.harness.train` with its own flags
after turning either back, where asked:
  --stream fp32          leave the embedding's fp32 output as the stream (fp32 weights under
                         autocast make it fp32), as DDP, TP or PP alone do;
  --compile-scope block  compile each block apart, as the layouts with wrappers do.
The defaults (bf16, model) are the harness's own. Everything else (micro-batch, --loss
fused, allocator settings through the environment) is the harness's flags. Run:
torchrun --standalone --nproc-per-node 1 tools/stacked_levers.py \
    [--stream fp32|bf16] [--compile-scope block|model] HARNESS_FLAGS
"""

from __future__ import annotations

import argparse
import runpy
import sys

from trainplan.bench.harness import parallelize


def _levers(stream: str, scope: str):
    """`parallelize.parallelize` with the stream and the compile scope as asked."""
    real_parallelize, real_compile = parallelize.parallelize, parallelize.apply_compile

    def apply_compile(part, whole=False):
        real_compile(part, whole=whole and scope == "model")

    def parallelize_as_asked(model, *args, **kwargs):
        out = real_parallelize(model, *args, **kwargs)
        model.autocast_stream = model.autocast_stream and stream == "bf16"  # read at forward
        return out

    parallelize.apply_compile, parallelize.parallelize = apply_compile, parallelize_as_asked


if __name__ == "__main__":
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--stream", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--compile-scope", choices=("block", "model"), default="model")
    levers, rest = p.parse_known_args()
    _levers(levers.stream, levers.compile_scope)
    sys.argv = ["trainplan.bench.harness.train", *rest]
    runpy.run_module("trainplan.bench.harness.train", run_name="__main__", alter_sys=True)
