"""`trainplan checkpoint`: checkpoint size, stall, interval and lost work against node failures."""

from __future__ import annotations

from trainplan.commands.args import UsageError, positive_float, positive_int
from trainplan.resilience.checkpoint import digits, plan_checkpoints
from trainplan.specs import load_model

KEYS = ("interval_min", "checkpoint_gb", "stall_s", "expected_lost_min", "worst_lost_min", "ettr",
        "meets_requirement")  # README, "Command line"; `as_dict` adds the terms behind them


def register(verbs) -> None:
    p = verbs.add_parser("checkpoint", help="plan checkpoint cadence and storage against failures")
    p.add_argument("--model", required=True, help="preset name or YAML file")
    p.add_argument("--gpus", required=True, type=positive_int)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--node-mtbf-hours", required=True, type=positive_float,
                   help="mean time between failures of one node (published: 1,536-6,336 h)")
    p.add_argument("--write-gbps-per-node", required=True, type=positive_float,
                   help="storage write bandwidth per node, GB/s (published: 1-3)")
    p.add_argument("--restart-minutes", required=True, type=positive_float,
                   help="failure to first training step again")
    p.add_argument("--max-lost-minutes", type=positive_float, default=30.0,
                   help="worst-case wall time a failure may cost, restart included")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--async", dest="mode", action="store_const", const="async",
                      help="asynchronous saves: stall only for the copy to host memory (default)")
    mode.add_argument("--sync", dest="mode", action="store_const", const="sync",
                      help="synchronous saves: stall for the whole write")
    p.add_argument("--keep", type=positive_int, default=2, help="checkpoints retained (>= 2)")
    p.add_argument("--host-copy-gbps", type=positive_float, default=None,
                   help="assumed GPU-to-host copy rate per GPU, GB/s (the async stall; "
                        "default 25)")
    p.add_argument("--shard-gpus", type=positive_int, default=None,
                   help="GPUs one copy of the state is split over (default: all; HSDP: a node)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="also save the bf16 weights (14 instead of 12 bytes/param)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=cmd_checkpoint, fmt=format_checkpoint, mode="async")


def cmd_checkpoint(args) -> dict:
    if args.mode == "sync" and args.host_copy_gbps is not None:
        raise UsageError(f"--host-copy-gbps {args.host_copy_gbps} prices the async copy to "
                         "host; --sync saves stall for the whole write: leave one out")
    copy = {} if args.host_copy_gbps is None else {"host_copy_gbps": args.host_copy_gbps}
    model = load_model(args.model)
    from trainplan.cost.params import total_params  # numpy: not loaded for --help
    plan = plan_checkpoints(
        total_params(model), args.gpus, args.node_mtbf_hours, args.write_gbps_per_node,
        args.restart_minutes, args.max_lost_minutes, gpus_per_node=args.gpus_per_node,
        mode=args.mode, keep=args.keep, **copy,
        bf16_weights=args.bf16_weights, shard_gpus=args.shard_gpus)
    return {"model": model.name, "gpus": args.gpus, **plan.as_dict()}


def format_checkpoint(out: dict) -> str:
    why = {"daly": "Daly's optimum", "max_lost": "shortened to meet the lost-work limit",
           "persist": "no shorter than one save's persist time"}[out["limited_by"]]
    verdict = "meets" if out["meets_requirement"] else "DOES NOT meet"
    return "\n".join([
        f"{out['model']} on {out['gpus']} GPUs ({out['nodes']} nodes), {out['mode']} saves, "
        f"job MTBF {digits(out['job_mtbf_hours'])} h",
        f"  checkpoint      {digits(out['checkpoint_gb'])} GB ({out['bytes_per_param']} B/param), "
        f"{digits(out['per_node_gb'])} GB per node",
        f"  stall           {digits(out['stall_s'], 2)} s per save; durable after "
        f"{digits(out['persist_s'])} s",
        f"  Young / Daly    {digits(out['young_min'])} / {digits(out['daly_min'])} min of training "
        "between saves",
        f"  interval        {digits(out['interval_min'])} min ({why})",
        f"  lost / failure  expected {digits(out['expected_lost_min'])} min, worst "
        f"{digits(out['worst_lost_min'])} min: {verdict} the {out['max_lost_min']:g} min limit",
        f"  ETTR            {out['ettr']:.2%}",
        f"  retention       keep {out['keep']}: {out['retention_gb']:,.0f} GB, "
        f"{out['peak_storage_gb']:,.0f} GB while a save is in flight",
    ])
