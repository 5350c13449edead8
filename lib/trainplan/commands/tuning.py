"""`trainplan tune` (the knob study and its report) and `trainplan suggest` (a starting config)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainplan.commands.args import UsageError, positive_float, positive_int
from trainplan.commands.planning import add_hardware_extras, hardware
from trainplan.loader import quote
from trainplan.tune.knobs import EFFECT_KNOBS, without_loader_flags
from trainplan.tune.study import make_suite, storage_path


def share(text: str) -> float:
    """A number in [0, 1]: the effects stage's share of the study's GPU-hours."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a share in [0, 1]")
    return value


def base_spec(text: str) -> str:
    """'best', 'plan' or a trial number (a whole number >= 0)."""
    if text in ("best", "plan") or (text.isdigit() and text.isascii()):
        return text if not text.isdigit() else str(int(text))
    raise argparse.ArgumentTypeError(f"{quote(text)} is not a base; use best, plan or a trial "
                                     "number")


def knob_list(text: str) -> list[str]:
    """Comma-separated knob names of the effects stage."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in EFFECT_KNOBS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{quote(text)}: {quote(bad[0]) if bad else 'no knob'} "
                                         f"is not an effects knob; use {', '.join(EFFECT_KNOBS)}")
    return names


def register(verbs) -> None:
    # Flags whose default is None: "given" is told from "left out" (`_refuse_unused`); the
    # default is applied where the flag is used (`cmd_tune`, `run_effects`'s own defaults).
    p = verbs.add_parser("tune", help="tune throughput knobs with Optuna under a GPU-hour budget")
    p.add_argument("--suite", help="tune suite YAML (data/suites/tune-*.yaml)")
    p.add_argument("--model", help="model preset or YAML file (instead of --suite)")
    p.add_argument("--gpus", type=positive_int, default=None,
                   help="with --model: GPUs (ranks; default 1); a suite names its own")
    p.add_argument("--seq-len", type=positive_int, default=None)
    p.add_argument("--storage", default=None,
                   help="journal file (PATH or journal:PATH) or sqlite:///PATH; with --report "
                        "the default is the committed study "
                        "(data/measurements/tune-proxy-h200x4-20261128/)")
    p.add_argument("--study-name", default=None,
                   help="default: the suite's file name or the model's name, as given")
    p.add_argument("--gpu-hours", type=positive_float, default=None,
                   help="the study's total budget: wall time x GPUs of every launch")
    p.add_argument("--trials", type=positive_int, default=None,
                   help="search: configurations to measure in all (default 30; resumes count "
                        "earlier ones)")
    p.add_argument("--cpu", action="store_true", help="the tiny gloo proxy on CPU ranks")
    p.add_argument("--synthetic", action="store_true", help="synthetic tokens in the harness")
    p.add_argument("--records", default=None, help="measurement records (GPU only); default: "
                   "STORAGE-measurements.jsonl beside the storage")
    p.add_argument("--stop-after-s", type=positive_float, default=None,
                   help="start no launch that would end after this many seconds of this run")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="search: launches at once, each on its own --suite gpus of the "
                        "machine's GPUs (default 1)")
    p.add_argument("--search-batch", type=positive_int, default=None,
                   help="search: up to this many trials run one after another in one launch "
                        "(default 1; a sweep: the start is paid once; configs of one NCCL "
                        "setting a launch; with --workers 1)")
    p.add_argument("--effects-share", type=share, default=None,
                   help="share of --gpu-hours for the paired effects stage after the search "
                        "(default 0: search only; 1: effects only)")
    p.add_argument("--base", type=base_spec, default=None,
                   help="effects stage: vary knobs around 'best' (the search's best trial; "
                        "the default), 'plan' (the planner's fastest config of the space) or "
                        "a trial number")
    p.add_argument("--effects-halfwidth", type=positive_float, default=None,
                   help="effects stage: pair until each effect's 95%% interval is within "
                        "+- this many percent (default 3)")
    p.add_argument("--effects-knobs", type=knob_list, default=None,
                   help="effects stage: comma-separated knobs to vary (default: all of "
                        "nccl_algo, nccl_proto, num_workers, prefetch_factor, grad_accum, "
                        "micro_batch, pack)")
    p.add_argument("--effects-max-pairs", type=positive_int, default=None,
                   help="effects stage: at most this many pairs per variant (default 20)")
    p.add_argument("--effects-pairing", choices=("sweep", "sweep-nccl", "launches"),
                   default=None,
                   help="effects stage: 'sweep' (the default) runs the open variants of the "
                        "knobs one process can switch (not NCCL's) one pair each in one "
                        "launch; 'sweep-nccl' NCCL's too, each run making its process groups "
                        "under its own NCCL_* (check the machine first: torchrun ... -m "
                        "trainplan.bench.micro.nccl_env; with tensor parallel it runs as "
                        "'sweep'); 'launches' a launch a run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", action="store_true", help="analyse the stored study instead")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=cmd_tune, fmt=format_tune)

    p = verbs.add_parser("suggest", help="a starting config from model size, GPUs, dataset")
    p.add_argument("--model-size", required=True, help="parameters, e.g. 7B, 1.3B, 350M, 8x7B")
    p.add_argument("--gpus", required=True, type=positive_int)
    p.add_argument("--dataset-tokens", required=True,
                   help="tokens to train on, e.g. 2e9, 500M, 1T (suffixes K M B T)")
    p.add_argument("--gpu", default="h100-sxm", help="GPU preset or YAML file")
    add_hardware_extras(p)
    p.add_argument("--seq-len", type=positive_int, default=4096)
    p.add_argument("--global-batch-tokens", type=positive_int, default=None,
                   help="default: by model size (Brown et al. 2020, Table 2.1)")
    p.add_argument("--study", default=None, help="tune storage whose findings to cite; "
                   "default: the committed study if there is one")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=cmd_suggest, fmt=format_suggest)


# Flags (dest names, parser order) that only running a study reads, and of those the ones
# only the search (share < 1) or only the effects stage (share > 0) reads.
RUN_FLAGS = ("suite", "model", "gpus", "seq_len", "gpu_hours", "trials", "cpu", "synthetic",
             "records", "stop_after_s", "workers", "search_batch", "effects_share", "base",
             "effects_halfwidth", "effects_knobs", "effects_max_pairs", "effects_pairing",
             "no_progress")
SEARCH_FLAGS = ("trials", "workers", "search_batch")
EFFECTS_FLAGS = ("base", "effects_halfwidth", "effects_knobs", "effects_max_pairs",
                 "effects_pairing")


def _given(args, dest: str) -> str | None:
    """The flag as the user gave it ("--workers 4", "--cpu"); None where it was left out."""
    value = getattr(args, dest)
    if value is None or value is False:
        return None
    flag = f"--{dest.replace('_', '-')}"
    if value is True:
        return flag
    if isinstance(value, list):
        value = ",".join(value)
    return f"{flag} {f'{value:g}' if isinstance(value, float) else quote(value)}"


def _refuse_unused(args) -> None:
    """Refuse (one line, before anything is read or written) a flag the run would ignore."""
    if args.report:
        given = next(filter(None, (_given(args, d) for d in RUN_FLAGS)), None)
        if given:
            raise UsageError(f"{given} is for running a study; --report only reads one "
                             "(--storage, --study-name, --json): leave it out")
        if args.storage is None and args.study_name is not None:
            raise UsageError(f"--study-name {quote(args.study_name)} needs --storage: without "
                             "it --report reads the committed studies whole")
        return
    if args.suite and args.gpus is not None:
        raise UsageError(f"--gpus {args.gpus} is not used with --suite (the suite names its "
                         "own gpus); leave it out or edit the suite")
    if args.cpu and args.records is not None:
        raise UsageError(f"--records {quote(args.records)} is not used with --cpu (CPU "
                         "launches write no measurement records); leave it out")
    share = args.effects_share or 0.0
    if share == 0.0:
        flags, why = EFFECTS_FLAGS, "--effects-share 0 (the default) runs no effects stage"
    elif share == 1.0:
        flags, why = SEARCH_FLAGS, "--effects-share 1 runs no search"
    else:
        flags, why = (), ""  # both stages run: every flag is read
    given = next(filter(None, (_given(args, d) for d in flags)), None)
    if given:
        raise UsageError(f"{given} is not used: {why}; change --effects-share or leave it out")


def study_name(suite_path: str | None, model: str | None) -> str:
    """The default --study-name: the file name of the suite or model, less .yaml/.yml; a
    preset's name whole (llama-1.3b is not a path: no suffix is cut)."""
    name = Path(suite_path or model or "").name
    for suffix in (".yaml", ".yml"):
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name


def cmd_tune(args) -> dict:
    _refuse_unused(args)
    if args.report:
        from trainplan.tune.report import COMMITTED, committed, report  # pandas: not for --help
        if args.storage is not None:
            return report(args.storage, args.study_name)
        if not COMMITTED.is_file():
            raise UsageError(f"no committed study at {COMMITTED}; pass --storage PATH")
        return committed()  # with the committed effects-only studies' families
    if args.storage is None:
        raise UsageError("--storage is required to run a study (a journal file to create or "
                         "resume)")
    storage_path(args.storage)  # a value naming no file: refused before anything is made
    if args.gpu_hours is None:
        raise UsageError("--gpu-hours is required to run a study (or pass --report)")
    if bool(args.suite) == bool(args.model):
        raise UsageError("give exactly one of --suite FILE or --model M")
    workers, batch = args.workers or 1, args.search_batch or 1
    if batch > 1 and workers > 1:
        raise UsageError(f"--search-batch {batch} runs on one group of GPUs; "
                         f"use --workers 1 with it (or --search-batch 1)")
    from trainplan.tune.loop import run_stages  # numpy: not loaded for --help
    suite = make_suite(suite_path=args.suite, model=args.model, gpus=args.gpus or 1,
                       seq_len=args.seq_len)
    if args.cpu and "compile" not in suite["space"]:
        suite["space"] = {**suite["space"], "compile": [False]}  # no C++ toolchain assumed
    if args.synthetic and suite["data"] != "stdlib":
        raise UsageError(f"--synthetic makes its own tokens; the suite's data is "
                         f"{suite['data']!r} (leave out --synthetic)")
    if args.synthetic and "--synthetic" not in suite["extra_args"]:
        suite["extra_args"], dropped = without_loader_flags(suite["extra_args"])
        suite["extra_args"].append("--synthetic")
        if dropped:  # the suite's, for its real data: the harness refuses them beside --synthetic
            print(f"tune --synthetic: the suite's {' '.join(dropped)} left out (synthetic "
                  "tokens need no data loader)", file=sys.stderr)
    name = args.study_name or study_name(args.suite, args.model)
    effects = {key: value for key, value in (  # left out: `run_effects`'s defaults
        ("base", args.base), ("halfwidth", args.effects_halfwidth),
        ("knob_names", args.effects_knobs), ("max_pairs", args.effects_max_pairs),
        ("pairing", args.effects_pairing)) if value is not None}
    return run_stages(suite, storage=args.storage, name=name, gpu_hours=args.gpu_hours,
                      trials=args.trials or 30, effects_share=args.effects_share or 0.0,
                      effects=effects, cpu=args.cpu, records_path=args.records,
                      stop_after_s=args.stop_after_s, progress=not args.no_progress,
                      workers=workers, batch=batch)


def format_tune(out: dict) -> str:
    if "top_knobs" in out:
        from trainplan.tune.report import format_report  # pandas: not loaded for --help
        return format_report(out)
    if "message" not in out:
        lines = [f"study {out['study']} ({out['storage']}): search {out['search']}"]
    else:
        lines = [f"study {out['study']} ({out['storage']}) on {out['card']}: {out['message']}",
                 f"  {out['trials']} configurations measured ({out['new_trials']} in this run), "
                 f"{out['gpu_hours']:.3f} of {out['budget_gpu_hours']:g} GPU-hours spent"]
    if out.get("best"):
        b = out["best"]
        lines.append(f"  best: trial {b['trial']}, {b['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
                     f"(95% CI {b['ci'][0]:,.0f}-{b['ci'][1]:,.0f}): {b['config']}")
    if out.get("effects"):
        e = out["effects"]
        lines.append(f"  effects ({e['design']}, {e['family']}, base {e['base_from']}): "
                     f"{e['message']}; {e['pairs']} pairs ({e['new_pairs']} in this run)")
        for v in e["variants"]:
            ci = (f"{v['effect_pct']:+.1f}% +- {v['halfwidth_pct']:.1f}" if v["ci_pct"]
                  else "no interval yet" if v["pairs"] else "not run")
            lines.append(f"    {v['variant']}: {ci} ({v['pairs']} pairs)")
    return "\n".join(lines)


def cmd_suggest(args) -> dict:
    from trainplan.tune.suggest import parse_tokens, suggest  # numpy: not loaded for --help
    tokens = parse_tokens(args.dataset_tokens)
    gpu, cluster = hardware(args, args.gpu)
    return suggest(args.model_size, gpus=args.gpus, dataset_tokens=tokens,
                   gpu=args.gpu, cluster=cluster.name, seq_len=args.seq_len,
                   global_batch_tokens=args.global_batch_tokens, study=args.study,
                   gpu_spec=gpu, cluster_spec=cluster)


def format_suggest(out: dict) -> str:
    from trainplan.tune.suggest import format_text  # numpy: not loaded for --help
    return format_text(out)
