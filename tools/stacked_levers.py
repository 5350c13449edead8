"""The harness with each of its two bf16 levers on or off: one A/B per lever.

On one GPU the harness compiles the whole model and carries a bf16 residual stream
(`bench.harness.parallelize`). This runs `trainplan.bench.harness.train` with its own flags
after turning either back, or on under DDP, where asked:
  --stream fp32          leave the embedding's fp32 output as the stream (fp32 weights under
                         autocast make it fp32), as DDP, TP or PP alone do;
  --compile-scope block  compile each block apart, as the layouts with wrappers do;
  --ddp                  also apply the levers asked for (bf16, model) under DDP alone (zero
                         0, tp = pp = cp = 1), whose hooks are per parameter, not per block;
  --module trainplan.train
                         run the training path (its flags) instead of the harness: both build
                         their layouts through the same `parallelize`.
The defaults (bf16, model) are the harness's own. Everything else (layout, micro-batch,
--loss fused, allocator settings through the environment) is the harness's flags. Run:
torchrun --standalone --nproc-per-node N tools/stacked_levers.py \
    [--stream fp32|bf16] [--compile-scope block|model] [--ddp] [--module M] FLAGS
"""

from __future__ import annotations

import argparse
import runpy
import sys

from trainplan.proctree import survive_closed_output

survive_closed_output()  # before torch, as `python -m trainplan.train` does

from trainplan.bench.harness import parallelize  # noqa: E402


def _levers(stream: str, scope: str, ddp: bool):
    """`parallelize.parallelize` with the stream and the compile scope as asked."""
    real_parallelize, real_compile = parallelize.parallelize, parallelize.apply_compile
    ddp_alone = [False]  # set per call of parallelize: the layout is DDP and nothing else

    def apply_compile(part, whole=False):
        real_compile(part, whole=(whole or ddp_alone[0]) and scope == "model")

    def parallelize_as_asked(model, cfg, *args, **kwargs):
        ddp_alone[0] = ddp and cfg.dp > 1 and cfg.zero == 0 and cfg.tp == cfg.pp == cfg.cp == 1
        out = real_parallelize(model, cfg, *args, **kwargs)
        on = model.autocast_stream or ddp_alone[0]
        model.autocast_stream = on and stream == "bf16"  # read at forward
        if ddp_alone[0]:
            out.notes.append(f"levers under DDP: stream {stream}, compile scope {scope}")
        return out

    parallelize.apply_compile, parallelize.parallelize = apply_compile, parallelize_as_asked


if __name__ == "__main__":
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--stream", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--compile-scope", choices=("block", "model"), default="model")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--module", default="trainplan.bench.harness.train",
                   choices=("trainplan.bench.harness.train", "trainplan.train"))
    levers, rest = p.parse_known_args()
    _levers(levers.stream, levers.compile_scope, levers.ddp)
    sys.argv = [levers.module, *rest]
    runpy.run_module(levers.module, run_name="__main__", alter_sys=True)
