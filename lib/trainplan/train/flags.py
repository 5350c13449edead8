"""The trainer's flags (`python -m trainplan.train`, `trainplan train`): argparse only, so the
command line's --help and its checks do not import torch."""

from __future__ import annotations

from trainplan.bench import flags as bench_flags

SCHEDULES = ("cosine", "linear", "constant")  # learning-rate decay after warm-up (train.optim)
# defaults a check compares with (`train.loop.check_args`): a flag left at its default is not
# "given" where it has no effect (--eval-batches without --eval-every, --lr-floor of constant)
EVAL_BATCHES = 8
LR_FLOOR = 0.1


def add_arguments(p) -> None:
    """The trainer's flags (also `trainplan train`'s, which passes them on)."""
    a = p.add_argument
    a("--model", required=True, help="preset, model YAML, or a Hugging Face config.json "
                                     "(or its folder)")
    a("--init-from", default=None, help="weights to start from: a .safetensors file or a "
                                        "Hugging Face folder; default: fresh, from --seed")
    a("--data", nargs="+", required=True, metavar="DIR[:WEIGHT]",
      help="folders made by `trainplan data prepare`; several are mixed by weight")
    a("--tokenizer", default=None, help="check that the shards were made with this tokenizer.json")
    a("--seq-len", type=int, default=2048)
    for name, helptext in (("dp", "data-parallel degree"), ("tp", "tensor-parallel degree"),
                           ("pp", "pipeline stages"), ("cp", "context-parallel degree (GPU only)"),
                           ("ep", "expert parallel (must be 1)")):
        a(f"--{name}", type=int, default=1, help=helptext)
    a("--zero", type=int, default=3, help="0 DDP, 1-2 FSDP2 no reshard, 3 FSDP2 reshard")
    a("--dp-shard", type=int, default=0, help="ranks per FSDP shard group; < dp is HSDP")
    a("--micro-batch", type=int, default=1, help="sequences per micro-batch per dp rank")
    a("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    a("--recompute", default="none", choices=["none", "selective", "full"])
    a("--no-sequence-parallel", action="store_true")
    a("--pp-schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"])
    a("--pp-virtual", type=int, default=1)
    a("--compile", action="store_true",
      help="torch.compile each block (one GPU: the whole model) and the loss")
    a("--steps", type=int, required=True, help="optimizer steps in all")
    a("--lr", type=float, default=3e-4, help="peak learning rate")
    a("--lr-schedule", default="cosine", choices=SCHEDULES)
    a("--lr-warmup", type=int, default=0, help="steps of linear warm-up from 0")
    a("--lr-floor", type=float, default=LR_FLOOR,
      help="final learning rate as a fraction of the peak (cosine, linear)")
    a("--weight-decay", type=float, default=0.1, help="AdamW decay of the matrices")
    a("--max-norm", type=float, default=1.0, help="clip the gradient norm; 0 = off")
    a("--seed", type=int, default=0, help="weights and data order (>= 0)")
    a("--eval-every", type=int, default=0, help="held-out loss every N steps; 0 = off")
    a("--eval-batches", type=int, default=EVAL_BATCHES,
      help="with --eval-every: micro-batches per rank per evaluation")
    a("--log-dir", default=None, help="training.jsonl and TensorBoard events (tb/) go here")
    a("--log-every", type=int, default=10, help="progress line and metrics every N steps")
    a("--export", default=None, help="after training: safetensors + config.json for "
                                     "transformers in this new folder (needs --ckpt-dir)")
    a("--cpu", action="store_true", help="CPU and gloo even where a GPU is present")
    a("--no-progress", action="store_true", help="no progress lines")
    a("--json", action="store_true", help="print the run's summary as one JSON line")
    bench_flags.add_checkpoint_arguments(p)
    bench_flags.add_monitor_arguments(p)
    bench_flags.add_precision_arguments(p)
    bench_flags.add_loss_arguments(p)
    bench_flags.add_gc_arguments(p)
