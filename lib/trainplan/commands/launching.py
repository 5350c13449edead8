"""`trainplan launch`: the plan's best layout (or a pinned one) as ready-to-run artefacts."""

from __future__ import annotations

from pathlib import Path

from trainplan.commands.args import UsageError, positive_float, positive_int
from trainplan.commands.planning import add_common, add_layout, layout_pins
from trainplan.launch.artefacts import (
    TARGETS,
    LaunchSettings,
    check_out_dir,
    plan_and_generate,
    write,
)
from trainplan.specs import load_cluster, load_model


def _env_pair(text: str) -> tuple[str, str]:
    import argparse

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    name, value = text.split("=", 1)
    return name, value


def _non_negative_int(text: str) -> int:
    import argparse

    if text == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0") from None


def register(verbs) -> None:
    p = verbs.add_parser("launch", help="write torchrun, Slurm or Kubernetes launch artefacts")
    add_common(p, gpus=True)
    p.add_argument("--global-batch-tokens", type=positive_int, default=4 * 2**20)
    add_layout(p)
    a = p.add_argument
    a("--target", required=True, help="torchrun | slurm | k8s")
    a("--out", required=True, help="folder to write (must not exist, or be empty)")
    a("--force", action="store_true", help="replace a non-empty --out folder")
    a("--job-name", default="", help="default: MODEL-GPUSxGPU")
    a("--steps", type=positive_int, default=1000, help="optimizer steps of the run")
    a("--warmup", type=_non_negative_int, default=5, help="steps not timed")
    a("--ckpt-every", type=_non_negative_int, default=0,
      help="steps between checkpoints (0: --ckpt-interval-min of predicted steps)")
    a("--ckpt-interval-min", type=positive_float, default=30.0)
    a("--ckpt-keep", type=positive_int, default=3)
    a("--max-restarts", type=_non_negative_int, default=3)
    a("--collective-timeout-s", type=positive_int, default=1800)
    a("--join-timeout-s", type=positive_int, default=900)
    a("--time-limit-min", type=positive_int, default=24 * 60, help="Slurm --time")
    a("--warn-s", type=positive_int, default=600, help="Slurm warning before the time limit")
    a("--save-grace-s", type=positive_int, default=300, help="time for the emergency save")
    a("--rdzv-port", type=positive_int, default=29500)
    a("--image", default="trainplan:0.1.0", help="container image (k8s)")
    a("--env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
      help="extra environment for every rank (repeatable), e.g. the knob study's NCCL_ALGO")
    a("--cpu", action="store_true", help="CPU processes with gloo, no GPUs (tests, proxy)")
    a("--synthetic", action="store_true", help="synthetic tokens instead of the data pipeline")
    a("--no-compile", action="store_true", help="do not torch.compile the blocks")
    p.set_defaults(run=cmd_launch, fmt=format_launch)


def cmd_launch(args) -> dict:
    if args.target not in TARGETS:  # before any planning: a typo answers at once
        raise UsageError(f"--target {args.target!r} is not valid; use one of {list(TARGETS)}")
    out = Path(args.out)
    check_out_dir(out, args.force)
    settings = LaunchSettings(
        target=args.target, steps=args.steps, warmup=args.warmup, ckpt_every=args.ckpt_every,
        ckpt_interval_min=args.ckpt_interval_min, ckpt_keep=args.ckpt_keep,
        max_restarts=args.max_restarts, collective_timeout_s=args.collective_timeout_s,
        join_timeout_s=args.join_timeout_s, time_limit_min=args.time_limit_min,
        warn_s=args.warn_s, save_grace_s=args.save_grace_s, rdzv_port=args.rdzv_port,
        cpu=args.cpu, synthetic=args.synthetic, compile=not args.no_compile, image=args.image,
        job_name=args.job_name, env=dict(args.env))
    from trainplan.calibrate.store import load_gpu  # pandas: not loaded for --help

    m, gpu, cluster = load_model(args.model), load_gpu(args.gpu), load_cluster(args.cluster)

    launch = plan_and_generate(m, gpu, cluster, gpus=args.gpus, seq_len=args.seq_len,
                               global_batch_tokens=args.global_batch_tokens, settings=settings,
                               model_arg=args.model, pins=layout_pins(args),
                               gpus_per_node=args.gpus_per_node)
    write(launch, out, force=args.force)
    return {"out": str(out), **launch.summary}


def format_launch(out: dict) -> str:
    p = out["plan"]
    lines = [f"wrote {', '.join(out['files'])} into {out['out']}: {out['target']}, "
             f"{out['nodes']} node(s) x {out['procs_per_node']}, {p['strategy']}, "
             f"predicted {p['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"]
    if not out["checkpointing"]:
        lines.append("note: the harness has no checkpoint flags yet; the artefacts do not "
                     "checkpoint")
    return "\n".join(lines)
