"""`trainplan train`: train the team's model on prepared shards, under torchrun; `trainplan
export`: a checkpoint as a Hugging Face folder.

    trainplan train --model M --data DIR[:W]... --steps N [--nproc-per-node P]
                    [--nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID] [--dry-run]
                    [layout, optimizer, evaluation, logging, checkpoint and export flags]

Every flag is checked here first (the trainer's own parser, the model, the layout against
`nproc_per_node x nnodes` ranks, the shards against the model's vocabulary, the headers of
the --init-from weights against the model), so bad input is one line and exit 2 before a
process starts; so is a --ckpt-dir that the ranks would refuse (not a folder, checkpoints
there without --resume, none verifying with --resume and without --fresh, the one to resume
past --steps or of another model), by the ranks' rule on the manifests, the folders'
listings and sizes and DCP's index: hashing the shards would read the whole checkpoint
before the ranks read it again, so a folder that only its hashes reject is refused by the
ranks. Then torchrun runs `trainplan.train` with the same flags; its progress lines go to
stderr as it runs. A rank's own refusal is that one line and exit 2, without torchrun's
traceback (`run_torchrun`). SIGTERM, SIGINT and SIGHUP to `trainplan train` are passed on
to torchrun, and it waits for the ranks (`proctree.supervise`). A run the trainer reports
stopped by SIGTERM (exit 143, or its summary `preempted`: its emergency checkpoint taken)
is reported as a stop to resume, not as a failure; after SIGINT it is `interrupted`.

    trainplan export --ckpt DIR --model M --out HF_DIR [--seq-len N] [--dtype bfloat16]

DIR is a run's --ckpt-dir (its newest verified checkpoint; a warning names the newer ones
that do not verify) or one step's folder; HF_DIR gets model.safetensors and config.json,
which `transformers` loads (`train.export`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from trainplan.commands.args import (
    UsageError,
    check_endpoint,
    non_negative_int,
    positive_int,
    single_node_flags,
)

LAUNCH = ("nproc_per_node", "nnodes", "rdzv_endpoint", "rdzv_id", "dry_run")
ZERO_OK = ("zero", "dp_shard", "lr_warmup", "seed", "eval_every", "ckpt_every")  # 0: a setting
RDZV_ID = "trainplan"  # --rdzv-id of a multi-node run that names none
DRAIN_S = 10.0  # after torchrun exits: seconds its ranks' last output may still take


def register(verbs) -> None:
    from trainplan.train.flags import add_arguments  # argparse only: no torch

    p = verbs.add_parser("train", help="train a model on prepared token shards (torchrun)")
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks on this node")
    g.add_argument("--nnodes", type=positive_int, default=1)
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous")
    g.add_argument("--rdzv-id", default=None,
                   help=f"the job's rendezvous id (with --nnodes N > 1; default {RDZV_ID})")
    g.add_argument("--dry-run", action="store_true", help="check and print the command only")
    add_arguments(p)
    whole_numbers(p)
    p.set_defaults(run=cmd_train, fmt=format_train)

    e = verbs.add_parser("export", help="a training checkpoint as a Hugging Face folder")
    e.add_argument("--ckpt", required=True, help="a run's --ckpt-dir, or one step's folder")
    e.add_argument("--model", required=True, help="the model it was trained as (preset, YAML "
                                                  "or config.json)")
    e.add_argument("--out", required=True, help="a new folder")
    e.add_argument("--seq-len", type=positive_int, default=4096,
                   help="max_position_embeddings written into config.json")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=cmd_export, fmt=lambda out: f"exported {out['ckpt']} to {out['out']}")


def whole_numbers(parser) -> None:
    """The trainer's integer flags parsed as every verb parses its counts (`positive_int`, or
    `non_negative_int` for `ZERO_OK`): '1e3' and '4_096' are taken, and a refusal names the
    range; the trainer gets them back as plain integers (`trainer_argv`)."""
    for action in parser._actions:
        if action.type is int:
            action.type = non_negative_int if action.dest in ZERO_OK else positive_int


def trainer_argv(args) -> list[str]:
    """The trainer's flags of `args`, as given (defaults left out)."""
    from trainplan.train.flags import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    out: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def check(args) -> None:
    """The trainer's checks, run here: flags, model (and that --export can write it), layout,
    shards, the --init-from weights' headers, the --ckpt-dir (one line, exit 2)."""
    from pathlib import Path

    from trainplan.bench.harness import parallelize as par_mod
    from trainplan.bench.harness import train as harness
    from trainplan.data.shards import open_shards
    from trainplan.specs import load_model
    from trainplan.specs.bounds import check_run
    from trainplan.specs.checks import check_positions
    from trainplan.train import batches, loop

    check_rendezvous(args)
    loop.check_args(args)
    check_run(seq_len=args.seq_len, micro_batch=args.micro_batch)
    spec = load_model(args.model)
    check_positions(spec, args.seq_len)
    if args.export:  # a model the export cannot write is refused now, not after the run
        from trainplan.train import export

        export.check_export(spec, Path(args.export), dtype="float32", max_positions=args.seq_len)
    world = args.nproc_per_node * args.nnodes
    import torch  # the run starts here: its device is this host's

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    par_mod.check_layout(harness.layout(args), spec, world, seq_len=args.seq_len,
                         device_type=device)
    for folder, _ in batches.parse_mixture(args.data):
        open_shards(folder, "train", args.tokenizer, spec.vocab)
    if args.eval_every:  # rank 0's held-out batches, read as the run reads them
        cfg = harness.layout(args)
        loop.eval_groups(args, cfg, spec, 0, cfg.dp, torch.device("cpu"))
    if args.init_from:
        from trainplan.train import export  # safetensors' headers: no tensor is read

        export.check_weights(spec, args.init_from)
    if args.ckpt_dir:
        check_ckpt_dir(args, spec)


def check_ckpt_dir(args, spec) -> None:
    """--ckpt-dir as the ranks will take it: a folder, or where one can be made; its
    checkpoints as `resume_choice` without their contents; the one --resume loads not past
    --steps, and of `spec` by DCP's index (tensor names and shapes). One line, exit 2."""
    from pathlib import Path

    from trainplan.bench.ckpt.store import check_root, check_steps, resume_choice
    from trainplan.errors import SpecError
    from trainplan.train import export

    check_root(Path(args.ckpt_dir))
    choice = resume_choice(Path(args.ckpt_dir), args.resume, args.fresh, contents=False)
    if choice[0] == "error":
        raise UsageError(choice[1])
    path, manifest = choice[1], choice[2]
    if path is not None:
        check_steps(Path(path).name, manifest["step"], args.steps)
        try:
            export.check_checkpoint_model(Path(path), spec)
        except SpecError as err:
            raise UsageError(f"--resume: {err}; resume with the model it was saved from, or "
                             "start in another --ckpt-dir") from None


def check_rendezvous(args) -> None:
    """`trainplan bench`'s rule for a c10d rendezvous, with its endpoint pattern: rendezvous
    flags need --nnodes N > 1, and then HOST:PORT with a port in 1..65535 and a non-empty id
    (default RDZV_ID); one line, exit 2."""
    if args.nnodes == 1:
        single_node_flags(args, ("rdzv_endpoint", "rdzv_id"))
        return
    if not args.rdzv_endpoint:
        raise UsageError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the node "
                         "that hosts the rendezvous, the same on every node)")
    check_endpoint(args.rdzv_endpoint)
    if args.rdzv_id is not None and not args.rdzv_id.strip():
        raise UsageError("--rdzv-id is empty; name the job (the same id on every node), or "
                         f"leave it out for {RDZV_ID!r}")


def command(args) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", str(args.nproc_per_node)]
    if args.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id",
                args.rdzv_id if args.rdzv_id is not None else RDZV_ID]
    argv = [a for a in trainer_argv(args) if a != "--json"]
    return cmd + ["-m", "trainplan.train", *argv, "--json"]


def cmd_train(args) -> dict:
    args.warmup, args.synthetic, args.impl = 0, False, "trainplan"
    check(args)
    cmd = command(args)
    if args.dry_run:
        return {"command": cmd, "dry_run": True, "summary": None}
    from trainplan.bench.series.suite import NO_MULTICAST  # pandas: not loaded for --help

    env = {**NO_MULTICAST, **os.environ, "PYTHONUNBUFFERED": "1"}  # the user's setting wins
    rc, lines, refusal, signals = run_torchrun(cmd, env)
    for ln in lines:
        if not ln.startswith("{"):
            print(ln, file=sys.stderr)
    summaries = [ln for ln in lines if ln.startswith("{")]
    summary = json.loads(summaries[-1]) if summaries else None
    if signal.SIGINT in signals:  # Ctrl-C: torchrun and its ranks have ended
        raise KeyboardInterrupt
    if refusal is not None:  # the ranks' own one line, without torchrun's traceback
        raise UsageError(refusal)
    stopped = rc == 143 or (rc != 0 and bool(summary and summary.get("preempted")))
    if rc not in (0, 143) and not stopped:
        after = "".join(f" after {signal.Signals(s).name}" for s in dict.fromkeys(signals))
        raise UsageError(f"the trainer exited with code {rc}{after} (its error is above); "
                         f"command: {' '.join(cmd)}")
    return {"command": cmd, "dry_run": False, "summary": summary, "stopped": stopped,
            "exit_code": 128 + signal.SIGTERM if stopped else 0}  # as a shell reports SIGTERM


def run_torchrun(cmd: list[str], env: dict) -> tuple[int, list[str], str | None, list[int]]:
    """Run torchrun's `cmd` to its end (`proctree.supervise`: SIGTERM, SIGINT, SIGHUP to this
    process are passed on to it, so the ranks' emergency checkpoint and their last lines
    are not lost), its stderr copied to ours as it comes (`proctree.Relay`), its stdout
    kept. Returns (exit code, stdout lines, refusal, the signals passed on): `refusal` is the
    first line in which a rank refused its input (`proctree.own_error`), where the run then
    failed; the lines held from it on are dropped then (the other ranks' copies of the
    line, torchrun's traceback of the failed ranks), and shown where the run succeeded."""
    from trainplan.proctree import Relay, supervise

    read, write = os.pipe()
    relay = Relay(read)
    try:
        rc, out, signals = supervise(cmd, env, write, drain_s=DRAIN_S)
    finally:
        os.close(write)
    relay.thread.join(DRAIN_S)
    refusal = relay.refusal if rc != 0 else None
    if refusal is None:
        relay.show("".join(relay.held))
    return rc, out.decode("utf-8", errors="replace").splitlines(), refusal, signals


def format_train(out: dict) -> str:
    if out["dry_run"]:
        return " ".join(out["command"])
    s = out["summary"] or {}
    if out.get("stopped"):
        ck = s.get("checkpoint")
        if ck is not None and (last := ck.get("last_committed")) != s.get("last_step"):
            newest = f"step {last}" if last is not None else "none: it starts at step 0"
            return (f"stopped at step {s.get('last_step')} of {s.get('steps')}, its checkpoint "
                    f"not saved (the FAILED line above); run the same command with --resume to"
                    f" continue from the newest committed ({newest})")
        return (f"stopped at step {s.get('last_step')} of {s.get('steps')} with a checkpoint; "
                "run the same command with --resume to continue")
    if not s.get("losses"):  # resumed at its last step: nothing was left to train
        return (f"{s.get('model')} is already at step {s.get('last_step')} of {s.get('steps')}"
                " (its checkpoint): nothing left to train")
    evals = s.get("evals") or []
    held = f", held-out loss {evals[-1]['eval_loss']:.4f}" if evals else ""
    export = f"; exported to {s['export']}" if s.get("export") else ""
    return (f"trained {s.get('model')} to step {s.get('last_step')} of {s.get('steps')} "
            f"({s.get('layout')}): loss {s['losses'][-1]:.4f}{held}{export}")


def cmd_export(args) -> dict:
    from pathlib import Path

    from trainplan.bench.ckpt import manifest as mf
    from trainplan.specs import load_model
    from trainplan.specs.bounds import check_run
    from trainplan.train import export  # torch: not loaded for --help
    from trainplan.train.paths import check_apart

    check_run(seq_len=args.seq_len)  # max_position_embeddings: the planner's longest sequence
    check_apart("--out", args.out, [("--ckpt", args.ckpt, "the checkpoint it is exported from"
                                     ", where a folder its manifest does not list fails "
                                     "verification; name a folder outside it")])
    spec, skipped = load_model(args.model), []
    export.check_export(spec, Path(args.out), dtype=args.dtype, max_positions=args.seq_len)
    folder = export.checkpoint_folder(Path(args.ckpt), skipped)  # reads it: after the rest
    export.export_checkpoint(folder, spec, Path(args.out), dtype=args.dtype,
                             max_positions=args.seq_len)
    if skipped:  # the user asked for the newest: say that an older one was exported
        args.notes.append(f"warning: exported {folder.name}, an older checkpoint: the newer "
                          f"ones in {args.ckpt} do not verify ({mf.skipped_line(skipped)}); "
                          "give --ckpt one step's folder to export another")
    return {"ckpt": str(folder), "out": args.out, "skipped": [n for n, _ in skipped]}
