"""`trainplan bench`: start the proxy harness under torchrun, or run a measurement suite.

    trainplan bench --model M [--nproc-per-node N] [layout flags] [harness flags]
                    [--impl trainplan|hf-baseline|hf-trainer] [--records PATH] [--json]
                    [--nnodes N (--node-rank R --master-addr H [--master-port P]
                                 | --rdzv-endpoint H:P --rdzv-id ID)]
                    [--dry-run] [-- any further train.py flags]
    trainplan bench --suite FILE --out DIR [--launches 3] [--only TAG ...] [--budget-s S]
                    [--dry-run]

One launch: every input is checked here first (flags, the model preset, the
layout against the world size `nproc_per_node x nnodes`, the baseline's
limits), so bad input is one line and exit 2 before any process starts. Then
`torchrun` runs `trainplan.bench.harness.train` (or, for transformers' Trainer,
`trainplan.bench.harness.hf_trainer`);
its progress bar goes to stderr as it runs, and its one-line JSON summary is
read back and printed (or returned whole with --json). On a multi-node launch
only the node holding rank 0 gets a summary. Flags after `--` go to the
harness unchecked by this parser but checked by the harness's own (so flags
train.py gains later, e.g. checkpointing, pass through).

A suite (`trainplan.bench.series.suite`): predictions first, then each config's
launches, then the table and the side-by-side ratios (`bench.sidebyside`).
Its progress lines go to stderr, so --json keeps stdout to one object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from trainplan.commands.args import (
    UsageError,
    check_endpoint,
    non_negative_int,
    positive_float,
    positive_int,
    single_node_flags,
)
from trainplan.commands.planning import LAYOUT_FLAGS
from trainplan.loader import quote
from trainplan.records.schema import IMPLS  # ours, transformers' model in our loop, Trainer


def _choice(text: str, valid: tuple[str, ...]) -> str:
    if text not in valid:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; use one of {list(valid)}")
    return text


HARNESS_FLAGS = {  # flag -> (type, help); passed on to train.py as given
    "model": (str, "model preset or YAML file"),
    "layers": (positive_int, "keep only this many blocks (a layer slice)"),
    "seq_len": (positive_int, "sequence length"),
    "steps": (positive_int, "steps in all, warm-up included"),
    "warmup": (non_negative_int, "first steps not timed"),
    "lr": (positive_float, "learning rate"),
    "max_norm": (float, "gradient clipping norm; 0 = off"),
    "seed": (non_negative_int, "seed of weights and data"),
    "num_workers": (non_negative_int, "data loader workers"),
    "data": (lambda t: _choice(t, ("stdlib", "instruct")),
             "stdlib (packed text) or instruct (prompt/response records; --pad: one padded "
             "record a row)"),
    "instruct_file": (str, "JSON-lines records for --data instruct (default: from the stdlib)"),
    "prefetch_factor": (positive_int, "batches each loader worker prepares"),
    "run_id": (str, "shared by the configs of one launch series"),
    "precision": (lambda t: _choice(t, ("bf16", "fp8")),
                  "fp8: block linears in torchao float8 (GPU of compute capability >= 8.9)"),
    "fp8_recipe": (lambda t: _choice(t, ("tensorwise", "rowwise")), "fp8 scaling recipe"),
    "loss": (lambda t: _choice(t, ("standard", "fused")),
             "fused: output layer + cross-entropy chunk by chunk (one process, DDP, FSDP2)"),
    "loss_chunk": (positive_int, "tokens per chunk of --loss fused"),
}
SWITCHES = ("compile", "synthetic", "cpu", "pin_memory", "no_sequence_parallel", "no_progress",
            "pad")




def register(verbs) -> None:
    p = verbs.add_parser("bench", help="run the proxy harness under torchrun, or a suite",
                         allow_abbrev=False)
    g = p.add_argument_group("launch")
    g.add_argument("--impl", choices=list(IMPLS), default="trainplan",
                   help="our model; transformers' LlamaForCausalLM in our loop; or trained "
                        "by transformers' Trainer")
    g.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="ranks per node (default 1)")
    g.add_argument("--nnodes", type=positive_int, default=1, help="nodes")
    g.add_argument("--node-rank", type=int, default=None, help="this node (static rendezvous)")
    g.add_argument("--master-addr", default=None, help="node 0's address (static rendezvous)")
    g.add_argument("--master-port", type=positive_int, default=None, help="default 29500")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of a c10d rendezvous")
    g.add_argument("--rdzv-id", default=None, help="job id shared by the nodes (c10d)")
    g.add_argument("--records", default=None, help="append a measurement record (GPU runs)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the command (with --suite: each config's), start nothing")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("harness", nargs="*", default=[], help="after --: more train.py flags")
    h = p.add_argument_group("harness (train.py)")
    for name, (typ, help_) in HARNESS_FLAGS.items():
        h.add_argument(f"--{name.replace('_', '-')}", dest=name, type=typ, default=None,
                       help=help_)
    for name in SWITCHES:
        h.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_true")
    for name, (typ, choices, help_) in LAYOUT_FLAGS.items():
        h.add_argument(f"--{name.replace('_', '-')}", dest=name, type=typ, choices=choices,
                       default=None, help=help_)
    s = p.add_argument_group("suite")
    s.add_argument("--suite", default=None, help="suite YAML (data/suites/...)")
    s.add_argument("--out", default=None, help="folder for the suite's record files")
    s.add_argument("--launches", type=positive_int, default=None, help="per config (default 3)")
    s.add_argument("--only", nargs="+", default=None, metavar="TAG")
    s.add_argument("--budget-s", type=positive_float, default=None,
                   help="seconds for the launches (default 540)")
    p.set_defaults(run=cmd_bench, fmt=format_bench)


# ---------------------------------------------------------------- checks


def _harness_argv(args) -> list[str]:
    argv = []
    for name in (*HARNESS_FLAGS, *LAYOUT_FLAGS):
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += [f"--{n.replace('_', '-')}" for n in SWITCHES if getattr(args, n)]
    if args.records:
        argv += ["--records", args.records]
    return argv + list(args.harness)  # not --json: that would hide the harness's progress


def _check_rendezvous(args) -> None:
    """Refuse (one line) rendezvous flags the node count or the rendezvous kind does not use,
    and a malformed endpoint or port; `master_port` None means not given (default 29500)."""
    if args.nnodes == 1:
        single_node_flags(args, ("node_rank", "master_addr", "master_port", "rdzv_endpoint",
                                 "rdzv_id"))
        return
    if args.rdzv_endpoint is not None:
        check_endpoint(args.rdzv_endpoint)
        if not args.rdzv_id:
            raise UsageError("--rdzv-endpoint needs --rdzv-id (the same job id on every node)")
        if (args.node_rank is not None or args.master_addr is not None
                or getattr(args, "master_port", None) is not None):
            raise UsageError("--node-rank/--master-addr/--master-port are for a static "
                             "rendezvous; with --rdzv-endpoint (c10d) the ranks are assigned: "
                             "leave them out")
        return
    if args.master_addr is None or args.node_rank is None:
        raise UsageError(f"--nnodes = {args.nnodes} needs --master-addr and --node-rank "
                         "(static), or --rdzv-endpoint and --rdzv-id (c10d)")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank = {args.node_rank} must be in 0..{args.nnodes - 1}")
    if args.master_port is not None and args.master_port > 65535:
        raise UsageError(f"--master-port = {args.master_port} must be in 1..65535")


def _check_harness(args, argv: list[str]) -> None:
    """Parse and check the harness arguments as train.py will, before anything starts."""
    from trainplan.bench.harness import parallelize as par_mod  # torch: not loaded for --help
    from trainplan.bench.harness import train  # torch: not loaded for --help

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            targs = train.parse_args(argv)
    except SystemExit:
        last = [ln for ln in err.getvalue().splitlines() if ln.strip()][-1:]
        raise UsageError(f"harness flags: {last[0].split('error: ', 1)[-1] if last else argv}"
                         ) from None
    targs.impl = args.impl  # train.py gets it from torchrun_command; its checks read it
    train.check_args(targs)
    spec = train.load_spec(targs)
    cfg = train.layout(targs)
    import torch

    device = "cuda" if torch.cuda.is_available() and not targs.cpu else "cpu"  # this host runs it
    par_mod.check_layout(cfg, spec, args.nproc_per_node * args.nnodes, seq_len=targs.seq_len,
                         device_type=device)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not targs.cpu else 0
    if gpus and args.nproc_per_node > gpus:
        raise UsageError(f"--nproc-per-node = {args.nproc_per_node} but this node has {gpus} "
                         f"GPUs; use at most {gpus} (or --cpu)")
    if args.impl != "trainplan":
        from trainplan.bench.harness import hf_baseline, hf_trainer  # torch: not for --help

        hf_baseline.check(spec, cfg)
        hf_baseline.require_transformers()
        if args.impl == hf_trainer.IMPL:
            hf_trainer.check(targs, spec, cfg, args.nproc_per_node * args.nnodes)


def torchrun_command(args, argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", str(args.nproc_per_node)]
    if args.nnodes == 1:
        cmd.insert(3, "--standalone")
    elif args.rdzv_endpoint:
        cmd += ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
    else:
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                "--master-addr", args.master_addr, "--master-port", str(args.master_port)]
    from trainplan.bench.flags import harness_entry  # numpy: not loaded for --help

    module, impl = harness_entry(args.impl)
    return cmd + ["-m", module, *argv, *impl]


# ---------------------------------------------------------------- run


def cmd_bench(args) -> dict:
    if args.suite is not None:
        return _run_suite(args)
    for flag in ("out", "only", "launches", "budget_s"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} belongs to --suite; add --suite FILE")
    args.nproc_per_node = args.nproc_per_node or 1
    if args.model is None:
        raise UsageError("bench needs --model M (a preset or YAML file), or --suite FILE")
    _check_rendezvous(args)
    args.master_port = args.master_port or 29500
    if args.records and Path(args.records).is_dir():
        raise UsageError(f"--records = {quote(args.records)} is a folder; name a .jsonl file")
    argv = _harness_argv(args)
    _check_harness(args, argv)
    cmd = torchrun_command(args, argv)
    if args.dry_run:
        return {"command": cmd, "dry_run": True, "summary": None}
    from trainplan.bench.series.suite import NO_MULTICAST  # pandas: not loaded for --help

    env = {**NO_MULTICAST, **os.environ, "PYTHONUNBUFFERED": "1"}  # the user's setting wins
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.splitlines()
    summaries = [ln for ln in lines if ln.startswith("{")]
    for ln in lines:
        if not ln.startswith("{"):
            print(ln, file=sys.stderr)
    if proc.returncode:
        raise UsageError(f"the harness exited with code {proc.returncode} (its error is above); "
                         f"command: {' '.join(cmd)}")
    summary = json.loads(summaries[-1]) if summaries else None
    return {"command": cmd, "dry_run": False, "summary": summary}


def _run_suite(args) -> dict:
    from trainplan.bench.series import run, sidebyside, suite  # pandas: not loaded for --help

    for flag in ("model", "records", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port",
                 "node_rank", "nproc_per_node"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} does not go with --suite: the suite "
                             "names its own model and launches each config standalone")
    given = _harness_argv(args)  # the first flag given, with its value if it has one
    first = " ".join(given[:2] if given[1:2] and not given[1].startswith("--") else given[:1])
    if args.nnodes > 1 or args.impl != "trainplan" or given:
        raise UsageError(f"--suite runs standalone launches of its own configs (flags, impl "
                         f"and GPUs per config){f', so {first} is not used' if given else ''}"
                         "; leave out --nnodes, --impl and harness flags")
    if not args.out:
        raise UsageError("--suite needs --out DIR (where its record files go)")
    loaded = suite.load_suite(args.suite)
    tags = [c["tag"] for c in loaded["configs"]]
    for tag in args.only or []:
        if tag not in tags:
            raise UsageError(f"--only {quote(tag)} is not a config of {args.suite}; tags: {tags}")
    if args.dry_run:
        return {"suite": args.suite, "out": args.out, "dry_run": True,
                "commands": run.launch_commands(args.suite, Path(args.out), args.only or [])}
    with contextlib.redirect_stdout(sys.stderr):  # the runner's progress lines
        rows = run.run_suite(args.suite, Path(args.out), args.launches or 3, args.only or [],
                             540.0 if args.budget_s is None else args.budget_s)
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        run.print_table(rows)
    out = sidebyside.compare(loaded["configs"], rows)
    return {"suite": args.suite, "out": args.out, "table": table.getvalue(), **out}


def format_bench(out: dict) -> str:
    if "suite" in out and out.get("dry_run"):
        return "\n".join(f"{tag}: {' '.join(cmd)}" for tag, cmd in out["commands"])
    if "suite" in out:
        from trainplan.bench.series.sidebyside import format_comparison  # numpy: not for --help

        return out["table"] + format_comparison(out)
    if out["dry_run"]:
        return " ".join(out["command"])
    s = out["summary"]
    if s is None:
        return "done (no summary on this node: rank 0 runs on another node)"
    lay = s["layout"]
    name = (f"{s['model']} {s['impl']}: dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} zero "
            f"{lay['zero']} mb {lay['micro_batch']} x {lay['grad_accum']}"
            f"{' compiled' if lay['compile'] else ''} on {s['ranks']} x {s['card']}")
    mfu = f", MFU {s['mfu']:.1%}" if s.get("mfu") is not None else ""
    mem = (f", peak reserved {s['peak_mem_reserved_gib']:.1f} GiB"
           if s.get("peak_mem_reserved_gib") is not None else "")
    return (f"{name}\n  {s['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU{mfu}, step "
            f"{s['step_time_s']:.3f} s (median of {len(s['step_times_s'])}, "
            f"{s['warmup_steps_dropped']} warm-up dropped){mem}\n  loss "
            f"{s['losses'][0]:.4f} -> {s['losses'][-1]:.4f}")
