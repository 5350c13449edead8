"""The flags the proxy harness and the trainer share: checkpointing, monitoring, precision,
the loss, the garbage collector; and which module runs each implementation (`--impl`).

Argparse only, so that `trainplan train --help` and the command line's checks do not import
torch; the code that reads them is `bench.ckpt.store`, `bench.harness.monitor`,
`bench.harness.float8`, `bench.harness.loss` and `bench.harness.host`.
"""

from __future__ import annotations

import argparse

# --loss and --loss-chunk's default: the losses the planner prices (numpy only, no torch)
from trainplan.cost.memory import FUSED_CHUNK as LOSS_CHUNK
from trainplan.cost.memory import LOSSES
from trainplan.loader import quote

# defaults a check compares with: a flag left at its default is not "given" where unused
CKPT_DEFAULTS = {"ckpt_keep": 2, "ckpt_threads": 1, "ckpt_hash": "while-writing"}
FP8_RECIPE = "tensorwise"
GC_DEFAULTS = {"gc_every": 1, "gc_full_every": 1000}

MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600  # a collective waiting a week is a hang, not a slow step

HARNESS = "trainplan.bench.harness.train"
ENTRIES = {"hf-trainer": "trainplan.bench.harness.hf_trainer"}  # its own loop: Trainer's


def harness_entry(impl: str) -> tuple[str, list[str]]:
    """The module torchrun runs for implementation `impl` (`records.schema.IMPLS`) and the
    flags that pick it there:
    our model and transformers' model in our loop run train.py (`--impl hf-baseline`);
    transformers' Trainer runs its own module, which takes train.py's other flags."""
    if impl in ENTRIES:
        return ENTRIES[impl], []
    return HARNESS, ["--impl", impl] if impl != "trainplan" else []


def timeout_seconds(text: str) -> float:
    """--collective-timeout-s: a number of seconds, at most `MAX_COLLECTIVE_TIMEOUT_S`; nan and
    values <= 0 are left to `bench.ckpt.store.check_args`, which checks the checkpoint flags."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a number of seconds") from None
    if value > MAX_COLLECTIVE_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not valid; use a number of seconds "
                                         f"> 0, at most {MAX_COLLECTIVE_TIMEOUT_S} (7 days)")
    return value


def add_checkpoint_arguments(p) -> None:
    """--ckpt-dir, --ckpt-every, --ckpt-keep, --ckpt-async, --resume ... (`bench.ckpt.store`)."""
    g = p.add_argument_group("checkpointing (trainplan.bench.ckpt.store)")
    g.add_argument("--ckpt-dir", default=None, help="save checkpoints here (one folder per step)")
    g.add_argument("--ckpt-every", type=int, default=0,
                   help="save every N steps; 0 = only at the end and on SIGTERM/SIGUSR1")
    g.add_argument("--ckpt-keep", type=int, default=CKPT_DEFAULTS["ckpt_keep"],
                   help="keep the last K complete checkpoints (K >= 2)")
    g.add_argument("--ckpt-async", action="store_true",
                   help="dcp.async_save: stage a CPU copy, write it on a background thread")
    g.add_argument("--ckpt-threads", type=int, default=CKPT_DEFAULTS["ckpt_threads"],
                   help="DCP writer threads per rank (one shard file each), written in parallel")
    g.add_argument("--ckpt-hash", choices=("while-writing", "after-writing"),
                   default=CKPT_DEFAULTS["ckpt_hash"],
                   help="when each shard's sha256 for the manifest is taken: as its bytes are "
                        "written (default), or by reading it back after all writing (to compare)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest verified checkpoint in --ckpt-dir; an empty "
                        "folder starts at step 0, one whose checkpoints all fail verification "
                        "is refused (exit 2)")
    g.add_argument("--fresh", action="store_true",
                   help="with --resume: where no checkpoint in --ckpt-dir verifies, start at "
                        "step 0 instead of refusing (the folders that fail are left as they are)")
    g.add_argument("--collective-timeout-s", type=timeout_seconds, default=None,
                   help="process-group timeout: a step with a hung rank fails after this long")


def add_monitor_arguments(p) -> None:
    """--metrics, --straggler-tolerance, --alert-tokens-per-s-per-gpu ... (`harness.monitor`)."""
    g = p.add_argument_group("monitoring (trainplan.bench.harness.monitor)")
    g.add_argument("--metrics", default=None,
                   help="rank 0 appends one JSON line per step (all ranks' numbers) here")
    g.add_argument("--straggler-tolerance", type=float, default=0.10,
                   help="a rank more than this share above the median over ranks is a straggler")
    g.add_argument("--straggler-window", type=int, default=5,
                   help="measured steps whose median decides a straggler")
    g.add_argument("--alert-tokens-per-s-per-gpu", type=float, default=None,
                   help="alert when tokens/s/GPU over the window falls below this; default off")
    g.add_argument("--alert-window", type=int, default=5,
                   help="measured steps the alert's rate is taken over")


def add_precision_arguments(p) -> None:
    """--precision bf16|fp8 and --fp8-recipe (`bench.harness.float8`)."""
    g = p.add_argument_group("precision (trainplan.bench.harness.float8)")
    g.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="fp8: the block linears in torchao float8 (a CUDA GPU of compute "
                        "capability >= 8.9: H100, H200); bf16 otherwise (fp32 on CPU)")
    g.add_argument("--fp8-recipe", default=FP8_RECIPE, choices=("tensorwise", "rowwise"),
                   help="fp8 scaling: tensorwise (with FSDP2: weights all-gathered in fp8) or "
                        "rowwise (a scale per row)")


def add_loss_arguments(p) -> None:
    """--loss standard|fused and --loss-chunk (`bench.harness.loss`)."""
    g = p.add_argument_group("loss (trainplan.bench.harness.loss)")
    g.add_argument("--loss", default="standard", choices=LOSSES,
                   help="fused: output layer and cross-entropy chunk by chunk, the (B, S, V) "
                        "logits never whole (one process, DDP, FSDP2)")
    g.add_argument("--loss-chunk", type=int, default=LOSS_CHUNK,
                   help="with --loss fused: tokens per chunk (best a divisor of micro-batch x "
                        "seq-len, so one compiled graph serves every chunk)")


GC_MODES = ("python", "step")


def add_gc_arguments(p) -> None:
    """--gc, --gc-every, --gc-full-every (`bench.harness.host`: when the collector runs)."""
    g = p.add_argument_group("garbage collector (trainplan.bench.harness.host)")
    g.add_argument("--gc", default="step", choices=GC_MODES,
                   help="step: freeze after set-up, collect the young generations at step "
                        "starts on every rank (default); python: CPython's automatic collector")
    g.add_argument("--gc-every", type=int, default=GC_DEFAULTS["gc_every"],
                   help="with --gc step, collect the young generations every Nth step")
    g.add_argument("--gc-full-every", type=int, default=GC_DEFAULTS["gc_full_every"],
                   help="with --gc step, a full collection every Nth step instead (long runs)")
