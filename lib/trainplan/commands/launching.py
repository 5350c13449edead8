"""`trainplan launch`: the plan's best layout (or a pinned one) as ready-to-run artefacts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from trainplan.commands.args import UsageError, positive_int
from trainplan.commands.planning import LAYOUT_FLAGS, add_layout, hardware, layout_pins
from trainplan.errors import ERROR_PREFIX, MAX_LINE, PresetNotFound, TrainplanError
from trainplan.launch.artefacts import TARGETS, LaunchError, LaunchSettings, plan_and_generate
from trainplan.launch.folder import check_inputs, check_out_dir, write
from trainplan.launch.inputs import env_settings, spec_file, train_arg_paths, train_args
from trainplan.launch.job import PLAN_SIZES, PLAN_SPECS
from trainplan.launch.render import TARGET_FLAGS
from trainplan.loader import fit_line, quote, shown
from trainplan.specs import load_model

# LaunchSettings' defaults, for the flags whose default is None here: a flag given is told
# from one left out, and refused where this run would not read it (`_check_used`)
DEFAULT = {f.name: f.default for f in dataclasses.fields(LaunchSettings)}
DEFAULTED = ("warmup", "time_limit_min", "warn_s", "rdzv_port", "image")
PLANNED = (*PLAN_SPECS, *PLAN_SIZES)  # what a plan file names, and a flag or scenario may too
SPEC_KINDS = {"model": "models", "gpu": "hardware", "cluster": "clusters",
              "scenario": "scenarios"}  # data/ folders of the presets
FLAG_VALUE = re.compile(r"--([a-z][a-z-]*) ([^\s;,:()]+)")  # "--dp-shard 8" in a message


def _env_pair(text: str) -> tuple[str, str]:
    import argparse

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not NAME=VALUE")
    name, value = text.split("=", 1)
    return name, value


def _non_negative_int(text: str) -> int:
    import argparse

    if text == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a whole number >= 0") from None


def register(verbs) -> None:
    p = verbs.add_parser("launch", help="write torchrun, Slurm or Kubernetes launch artefacts")
    a = p.add_argument
    a("--scenario", default=None, help="data/scenarios NAME or YAML: model, GPUs, sequence, "
                                       "batch and token budget, as the runbook has them")
    a("--plan", default=None, metavar="FILE",
      help="the layout of a `trainplan plan --json` file's decision (its first plan in older "
           "files), and the model, GPU, cluster and sizes it was planned for")
    a("--model", default=None, help="preset, YAML or Hugging Face config.json (the scenario's "
                                    "or plan's)")
    a("--gpu", default=None, help="preset name or YAML file (the scenario's or plan's)")
    a("--cluster", default=None, help="interconnect preset or YAML file (the scenario's or "
                                      "plan's, else the GPU preset's; printed on stderr)")
    a("--calibration", default=None, metavar="FILE",
      help="a calibration file to apply to --gpu (default: a GPU preset's own)")
    a("--gpus", type=positive_int, default=None, help="GPUs in the job (the scenario's)")
    a("--gpus-per-node", type=positive_int, default=None, help="default: the cluster's")
    a("--seq-len", type=positive_int, default=None, help="default: the scenario's, else 4096")
    a("--global-batch-tokens", type=positive_int, default=None,
      help="default: the scenario's, else 4M")
    a("--json", action="store_true", help="print one JSON object on stdout")
    add_layout(p)
    a("--data", default="", help="shards of `trainplan data prepare`: the job runs the "
                                 "trainer on them (without: the proxy harness)")
    a("--train-arg", action="append", default=[], metavar="FLAG=VALUE",
      help="a further trainer flag (with --data), e.g. --train-arg lr=2e-4 (repeatable, each "
           "flag once; not one launch writes itself, such as steps or data)")
    a("--target", required=True, help="torchrun | slurm | k8s")
    a("--out", required=True, help="folder to write (must not exist, or be empty; never one "
                                   "that is or holds what the job reads)")
    a("--force", action="store_true", help="replace a non-empty --out folder")
    a("--job-name", default="", help="default: MODEL-GPUSxGPU")
    a("--steps", type=_non_negative_int, default=0,
      help="optimizer steps, at most 1e9 (default: the scenario's token budget over the "
           "global batch)")
    a("--warmup", type=_non_negative_int, default=None,
      help=f"steps not timed (the harness: without --data; default {DEFAULT['warmup']})")
    a("--ckpt-every", type=_non_negative_int, default=0,
      help="steps between checkpoints (default: page 5's checkpoint plan)")
    a("--ckpt-keep", type=_non_negative_int, default=0,
      help="checkpoints kept (default: page 5's checkpoint plan)")
    a("--max-restarts", type=_non_negative_int, default=3)
    a("--collective-timeout-s", type=positive_int, default=1800)
    a("--join-timeout-s", type=positive_int, default=900)
    a("--time-limit-min", type=positive_int, default=None,
      help=f"Slurm --time (slurm; default {DEFAULT['time_limit_min']})")
    a("--warn-s", type=positive_int, default=None,
      help=f"Slurm warning before the time limit (slurm; default {DEFAULT['warn_s']})")
    a("--save-grace-s", type=positive_int, default=300, help="time for the emergency save")
    a("--rdzv-port", type=positive_int, default=None,
      help=f"rendezvous port (torchrun, slurm; default {DEFAULT['rdzv_port']})")
    a("--image", default=None, help=f"container image (k8s; default {DEFAULT['image']})")
    a("--env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
      help="extra environment for every rank (repeatable, each NAME once), e.g. the knob "
           "study's NCCL_ALGO")
    a("--cpu", action="store_true", help="CPU processes with gloo, no GPUs (tests, proxy)")
    a("--synthetic", action="store_true", help="synthetic tokens (harness, without --data)")
    a("--no-compile", action="store_true", help="do not torch.compile the blocks")
    p.set_defaults(run=cmd_launch, fmt=format_launch)


def _check_used(args) -> None:
    """Refuse a flag this run would not read: trainer flags without --data, the harness's
    with it, a flag of another --target (`render.TARGET_FLAGS`)."""
    if args.train_arg and not args.data:
        raise UsageError(f"--train-arg {quote(args.train_arg[0])} is not used without --data "
                         "(the proxy harness runs); trainer flags need --data SHARDS")
    if args.data and (args.warmup is not None or args.synthetic):
        flag = f"--warmup {args.warmup}" if args.warmup is not None else "--synthetic"
        raise UsageError(f"{flag} is not used with --data (the trainer runs); it is the proxy "
                         "harness's, without --data")
    if args.cpu and args.no_compile:
        raise UsageError("--no-compile is not used with --cpu (CPU runs are never compiled); "
                         "leave one out")
    for flag in dict.fromkeys(f for flags in TARGET_FLAGS.values() for f in flags):
        value = getattr(args, flag[2:].replace("-", "_"))
        users = [t for t, flags in TARGET_FLAGS.items() if flag in flags]
        if value is not None and args.target not in users:
            raise UsageError(f"{flag} {quote(value)} is not used with --target {args.target}; "
                             f"only --target {' or '.join(users)} reads it")


def resolve(args) -> dict:
    """Model, GPU, cluster, GPUs, sequence, batch, token budget and pins: flags first, then
    the scenario's, then the plan file's (its layout too; `_check_planned` refuses a value
    that differs from the file's); one line for what is missing."""
    from trainplan.launch import job
    from trainplan.specs import load_scenario

    sc = load_scenario(args.scenario) if args.scenario else None
    pins, facts = job.plan_file_pins(args.plan) if args.plan else ({}, {})
    pins = {k: v for k, v in pins.items() if k in LAYOUT_FLAGS}  # what the search takes
    flags = layout_pins(args)
    pins.update(flags)
    given = {k: getattr(args, k) or (getattr(sc, k) if sc else None) for k in PLANNED}
    got = {**{k: given[k] or facts.get(k) for k in PLANNED},
           "seq_len": given["seq_len"] or facts.get("seq_len") or 4096,
           "global_batch_tokens": given["global_batch_tokens"] or facts.get(
               "global_batch_tokens") or 4 * 2**20,
           "token_budget": sc.token_budget if sc else None,
           "title": sc.title if sc else "", "pins": pins, "planned": facts,
           "from_plan": [k for k in PLAN_SPECS if not given[k] and k in facts]}
    # where each value no flag gave came from, as a message names it (`_attributed`)
    got["named"] = {k: ("the plan's", v) for k, v in pins.items() if k not in flags}
    for k in PLAN_SIZES:
        source = ("the --scenario's" if given[k] else "the plan's" if k in facts else
                  "the default")
        if not getattr(args, k) and got[k] is not None:
            got["named"][k] = (source, got[k])
    for key in ("model", "gpu", "gpus"):
        if got[key] is None:
            raise UsageError(f"launch needs --{key} (or a --scenario or --plan that names it)")
    if args.cpu:  # gloo processes cannot run ring attention: the search keeps cp at 1
        if int(pins.get("cp", 1)) > 1:
            from trainplan.bench.harness.context import NEEDS_CUDA  # no torch at import

            cp = f"--cp {pins['cp']}" if "cp" in flags else f"the plan's cp {pins['cp']}"
            raise UsageError(f"{cp} with --cpu: {NEEDS_CUDA}; use --cp 1 or launch on GPUs")
        pins["cp"] = 1
    return got


def _specs(args, got: dict):
    """(model, GPU, cluster) specs of `got`; a name the plan file gave that is no preset is
    one line asking for the spec it was planned from."""
    try:
        m = load_model(got["model"])
        return (m, *hardware(args, got["gpu"], got["cluster"]))
    except PresetNotFound as err:
        bad = [k for k in got["from_plan"] if quote(got[k]) in str(err)]  # the name it quotes
        if not bad:
            raise
        raise UsageError(f"{err}; --plan '{shown(args.plan)}' names it: give --{bad[0]} with the "
                         "spec it was planned from") from None


def _check_planned(args, got: dict, used: dict) -> None:
    """Refuse a model, GPU, cluster or size given by a flag or the scenario that is not the
    plan file's: a plan made for one is not the layout of another."""
    for key, planned in got["planned"].items():
        if used[key] == planned:
            continue
        flag, value = f"--{key.replace('_', '-')}", getattr(args, key)
        if value and str(value) != str(used[key]):  # a spec file: named by what it holds
            source = [f"{flag} '", (value,), f"' ({key} {quote(used[key])})"]
        elif value:
            source = [f"{flag} {quote(value)}"]
        else:
            source = [f"the --scenario's {key} {quote(used[key])}"]
        fix = f"leave {flag} out, or plan again for it" if value else "plan again for it"
        raise UsageError(fit_line(["--plan '", (args.plan,), f"' was made for {key} "
                                   f"{quote(planned)}, not ", *source,
                                   f"; {fix} (`trainplan plan --json`)"],
                                  MAX_LINE - len(ERROR_PREFIX)))


def _check_positions(m, got: dict) -> None:
    """Refuse a sequence longer than a model with learned positions has positions for,
    naming where the length came from (a flag, the scenario, the plan file, the default)."""
    n, most = got["seq_len"], m.max_positions
    if m.positions != "learned" or n <= most:
        return
    source = got["named"].get("seq_len", ("",))[0]
    who = f"{source} seq_len {n}" if source else f"--seq-len {n}"
    if source == "the default":
        who += " (no --seq-len, --scenario or --plan gives one)"
    fix = "plan again with" if source == "the plan's" else "give"
    raise UsageError(f"{who} is longer than model {quote(m.name)} takes: its learned "
                     f"positions end at max_positions {most}; {fix} --seq-len {most} or less")


def _attributed(text: str, named: dict) -> str:
    """`text` with each `--flag VALUE` whose value no flag gave named by where it came from
    (`named`: key -> (source, value)): "--dp-shard 8" -> "the plan's dp_shard 8", and "its"
    where the source named just before is the same one."""
    last = None

    def name(match: re.Match) -> str:
        nonlocal last
        key = match[1].replace("-", "_")
        if key not in named or match[2] not in (str(named[key][1]), quote(named[key][1])):
            return match[0]
        source = named[key][0]
        said = "its" if source == last and source != "the default" else source
        last = source
        return f"{said} {key} {match[2]}"
    return FLAG_VALUE.sub(name, text)


def _inputs(args, got: dict | None = None) -> list[tuple[str, str]]:
    """(how it was named, path) of each file and folder the job or launch reads: --data, the
    spec files (the scenario's or plan's model too, with `got`), --plan, --calibration and
    the --train-arg paths."""
    found = [(f"--{k}", getattr(args, k)) for k in ("data", "plan", "calibration")
             if getattr(args, k)]
    for key, kind in SPEC_KINDS.items():
        name = getattr(args, key) or (got or {}).get(key)
        path = spec_file(str(name), kind) if name else None
        if path is not None:
            found.append((f"--{key}" if getattr(args, key) else
                          f"the plan's {key}" if key in got["from_plan"] else
                          f"the --scenario's {key}", str(path)))
    return found + train_arg_paths(train_args(args.train_arg))


def cmd_launch(args) -> dict:
    if args.target not in TARGETS:  # before any planning: a typo answers at once
        raise UsageError(f"--target {quote(args.target)} is not valid; use one of {list(TARGETS)}")
    _check_used(args)
    out = Path(args.out)
    check_out_dir(out, args.force, _inputs(args))
    got = resolve(args)
    check_inputs(out, _inputs(args, got))
    given = {k: getattr(args, k) for k in DEFAULTED if getattr(args, k) is not None}
    settings = LaunchSettings(
        target=args.target, steps=args.steps, ckpt_every=args.ckpt_every,
        ckpt_keep=args.ckpt_keep, data=args.data, train_args=train_args(args.train_arg),
        max_restarts=args.max_restarts, collective_timeout_s=args.collective_timeout_s,
        join_timeout_s=args.join_timeout_s, save_grace_s=args.save_grace_s, cpu=args.cpu,
        synthetic=args.synthetic, compile=not args.no_compile, job_name=args.job_name,
        env=env_settings(args.env), **given)  # the rest: LaunchSettings' defaults
    m, gpu, cluster = _specs(args, got)
    _check_planned(args, got, {"model": m.name, "gpu": gpu.name, "cluster": cluster.name,
                               **{k: got[k] for k in PLAN_SIZES}})
    _check_positions(m, got)
    try:
        launch = plan_and_generate(m, gpu, cluster, gpus=got["gpus"], seq_len=got["seq_len"],
                                   global_batch_tokens=got["global_batch_tokens"],
                                   settings=settings, model_arg=got["model"], pins=got["pins"],
                                   gpus_per_node=args.gpus_per_node, title=got["title"],
                                   token_budget=got["token_budget"])
    except TrainplanError as err:  # the planner's line names flags: say where values came from
        if not isinstance(err, LaunchError):  # the launched module's own flags: as they are
            err.args = (_attributed(str(err), got["named"]),)
        raise
    write(launch, out, force=args.force)
    return {"out": str(out), **launch.summary}


def format_launch(out: dict) -> str:
    p = out["plan"]
    ckpt = (f"checkpoints every {out['checkpoint_every']:,} steps "
            f"({out['checkpoint_every_min']:.1f} min), keep {out['checkpoint_keep']}"
            + (" (page 5's plan)" if out["checkpoint_from_plan"] else " (as given)"))
    lines = [f"wrote {', '.join(out['files'])} into {out['out']}: {out['target']}, "
             f"{out['nodes']} node(s) x {out['procs_per_node']}, {p['strategy']}, "
             f"{out['steps']:,} steps, predicted {p['tokens_per_s_per_gpu']:,.0f} "
             f"tokens/s/GPU; {ckpt}; alert below "
             f"{out['alert']['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"]
    if not out["checkpointing"]:
        lines.append("note: the launched module has no checkpoint flags; the artefacts do not "
                     "checkpoint")
    return "\n".join(lines)
