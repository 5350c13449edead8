"""`trainplan plan` and `trainplan memory`: rank layouts, or price one layout's memory."""

from __future__ import annotations

import argparse

from trainplan.commands.args import UsageError, positive_int
from trainplan.cost.memory_runtime import ALLOCATORS, EXPANDABLE
from trainplan.specs import ParallelConfig, cluster_for, load_cluster, load_model

LAYOUT_FLAGS = {  # flag -> (type, choices, help)
    "dp": (positive_int, None, "data-parallel degree"),
    "tp": (positive_int, None, "tensor-parallel degree (inside a node)"),
    "pp": (positive_int, None, "pipeline stages"),
    "cp": (positive_int, None, "context-parallel degree"),
    "ep": (positive_int, None, "expert-parallel degree (MoE)"),
    "zero": (int, (0, 1, 2, 3), "ZeRO stage: 0 DDP, 1, 2, 3 = FSDP"),
    "dp_shard": (positive_int, None, "ranks a ZeRO-3 shard spans (< dp is HSDP)"),
    "micro_batch": (positive_int, None, "sequences per micro-batch"),
    "grad_accum": (positive_int, None, "micro-batches per step"),
    "recompute": (str, ("none", "selective", "full"), "activation recompute"),
    "pp_schedule": (str, ("1f1b", "interleaved", "gpipe"), "pipeline schedule"),
    "pp_virtual": (positive_int, None, "virtual stages per rank (interleaved)"),
}


def add_common(p: argparse.ArgumentParser, *, gpus: bool) -> None:
    p.add_argument("--model", required=True, help="preset name or YAML file")
    p.add_argument("--gpu", required=True, help="preset name or YAML file")
    add_hardware_extras(p)
    if gpus:
        p.add_argument("--gpus", required=True, type=positive_int)
        p.add_argument("--gpus-per-node", type=positive_int, default=None,
                       help="default: the cluster's")
    p.add_argument("--seq-len", type=positive_int, default=4096)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_hardware_extras(p: argparse.ArgumentParser) -> None:
    """--cluster (default: the GPU's own) and --calibration, for every verb pricing a GPU."""
    p.add_argument("--cluster", default=None,
                   help="interconnect preset or YAML file (default: the GPU preset's, e.g. "
                        "dgx-a100 for a100-80gb; printed on stderr)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="a calibration file to apply to --gpu (default: a GPU preset's own "
                        "committed one; none for a GPU YAML file)")


def hardware(args, gpu_name: str, cluster: str | None = None):
    """(GPU with its calibration, cluster spec) for a verb's flags (`cluster`: instead of
    --cluster); the cluster chosen for the user, if any, is noted on stderr once the verb
    succeeds (`cli.main`)."""
    from trainplan.calibrate.store import load_gpu  # pandas: not loaded for --help
    gpu = load_gpu(gpu_name, calibration=args.calibration)
    name, note = cluster_for(gpu, cluster or args.cluster)
    if note and hasattr(args, "notes"):
        args.notes.append(note)
    return gpu, load_cluster(name)


def add_layout(p: argparse.ArgumentParser) -> None:
    for name, (typ, choices, help_) in LAYOUT_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=typ, choices=choices,
                       default=None, help=help_)


def register(verbs) -> None:
    p = verbs.add_parser("plan", help="rank the parallel layouts for a model on a cluster")
    add_common(p, gpus=True)
    p.add_argument("--global-batch-tokens", type=positive_int, default=4 * 2**20)
    p.add_argument("--top", type=positive_int, default=5)
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: the block linears in torchao float8 (cost.fp8); H100/H200 only")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default=None,
                   help="with --precision fp8, its scaling: tensorwise (fp8 FSDP2 all-gather; "
                        "default) or rowwise")
    p.add_argument("--loss", choices=("standard", "fused"), default="standard",
                   help="fused: the output layer and loss chunk by chunk (the harness's --loss "
                        "fused); plans with tp, pp or cp > 1 are priced standard (each says)")
    add_allocator(p)
    add_layout(p)
    p.set_defaults(run=cmd_plan, fmt=format_plan)

    p = verbs.add_parser("memory", help="per-GPU memory of one layout")
    add_common(p, gpus=False)
    add_allocator(p)
    add_layout(p)
    p.set_defaults(run=cmd_memory, fmt=format_memory)


def add_allocator(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allocator", choices=ALLOCATORS, default=EXPANDABLE,
                   help="the CUDA caching allocator's mode the job runs: expandable "
                        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which trainplan's "
                        "runs and launch scripts set) or caching (PyTorch's default), which "
                        "holds more memory reserved")


def layout_pins(args) -> dict:
    return {k: getattr(args, k) for k in LAYOUT_FLAGS if getattr(args, k) is not None}


def _specs(args):
    m = load_model(args.model)
    return (m, *hardware(args, args.gpu))


def cmd_plan(args) -> dict:
    if args.fp8_recipe is not None and args.precision != "fp8":
        raise UsageError(f"--fp8-recipe {args.fp8_recipe} prices fp8 scaling; add --precision "
                         "fp8 or leave the recipe out")
    m, gpu, cluster = _specs(args)  # before importing pandas: a bad preset answers at once
    from trainplan.compare.trust import validation  # pandas: not loaded for --help
    from trainplan.launch.choice import decided
    from trainplan.train.support import not_runnable
    out = decided(m, gpu, cluster, gpus=args.gpus, seq_len=args.seq_len,
                  global_batch_tokens=args.global_batch_tokens, pins=layout_pins(args),
                  top=args.top, gpus_per_node=args.gpus_per_node, precision=args.precision,
                  fp8_recipe=args.fp8_recipe or "tensorwise", loss=args.loss,
                  allocator=args.allocator)
    for p in out["plans"]:  # what `trainplan train` and `launch` can run (train.support)
        why = not_runnable({**p["parallel"], "precision": args.precision}, m)
        p["runnable"] = why is None
        if why:
            p["not_runnable_why"] = why
    return validation(out, m, gpu)


def cmd_memory(args) -> dict:
    m, gpu, cluster = _specs(args)
    pins = layout_pins(args)
    from trainplan.plan.planner import memory  # pandas: not loaded for --help
    from trainplan.plan.search import check_pins  # pandas: not loaded for --help
    check_pins(m, pins, None, cluster.gpus_per_node, args.seq_len)  # sizes first, as `plan`
    cfg = ParallelConfig(**pins)
    return memory(m, gpu, cluster, cfg, args.seq_len, allocator=args.allocator)


def format_plan(out: dict) -> str:
    priced = ""  # what the plans were priced with beyond the defaults
    if out.get("precision") == "fp8":
        rate = "measured" if out["fp8"]["validated"] else "GEMM rate not measured"
        priced = f", fp8 {out['fp8']['recipe']} ({rate})"
    if out.get("loss") == "fused":
        priced += ", fused loss (data-parallel plans)"
    if out.get("allocator", EXPANDABLE) != EXPANDABLE:
        priced += f", {out['allocator']} allocator"
    head = (f"{out['model']} on {out['gpus']} x {out['gpu']} ({out['cluster']}){priced}, seq "
            f"{out['seq_len']}, {out['global_batch_tokens']:,} tokens a step: "
            f"{out['searched']:,} layouts in {out['elapsed_s']:.3f} s")
    lines = [head, f"{'#':>2}  {'strategy':<28}{'zero':>5}{'mb':>4}{'accum':>6}  {'recompute':<10}"
                   f"{'schedule':<15}{'GiB':>7}{'fits':>6}{'band':>7}{'step s':>9}"
                   f"{'tok/s/GPU':>11}{'MFU':>7}  trust"]
    for i, p in enumerate(out["plans"], 1):
        par = p["parallel"]
        sched = "-" if par["pp"] == 1 else par["pp_schedule"] + (
            f" v{par['pp_virtual']}" if par["pp_virtual"] > 1 else "")
        lines.append(
            f"{i:>2}  {p['strategy']:<28}{par['zero']:>5}{par['micro_batch']:>4}"
            f"{par['grad_accum']:>6}  {par['recompute']:<10}{sched:<15}"
            f"{p['memory_gib']['total']:>7.1f}"
            f"{'yes' if p['fits'] else 'NO':>6}{_band(p['validation']['memory']):>7}"
            f"{p['step_time_s']:>9.3f}"
            f"{p['tokens_per_s_per_gpu']:>11,.0f}{p['mfu']:>7.1%}  {_trust(p['validation'])}"
            + ("" if p["runnable"] else "; not runnable yet")
            + ("; priced with the standard loss" if p.get("loss") == "standard" else ""))
    why = sorted({p["not_runnable_why"] for p in out["plans"] if not p["runnable"]})
    then = ("`trainplan launch` runs the decision below" if out["decision"]["launchable"]
            else "nothing of this model can be launched yet")
    lines += [f"not runnable yet: {w} ({then})" for w in why]
    return "\n".join(lines + _decision_lines(out["decision"]))


def _band(margin: dict) -> str:
    """A plan's memory with its band's margin: the band's upper end in GiB, and "!" where
    it is above what the allocator can use; "-" where no band was measured."""
    if margin["upper_gib"] is None:
        return "-"
    return f"{margin['upper_gib']:.1f}" + ("" if margin["fits"] else "!")


def _decision_lines(d: dict) -> list[str]:
    """The decision (`launch.choice`) in a line or two below the table."""
    p, m = d["plan"], d["plan"]["memory_margin"]
    upper = "no memory band on this card" if m["upper_gib"] is None else (
        f"up to {m['upper_gib']:.1f} of {m['usable_gib']:.1f} GiB usable with its band")
    lines = ["band: predicted GiB x the upper end of the family's measured memory band ('!': "
             "above what the allocator can use)",
             f"decision: #{d['rank']} {p['strategy']} (micro-batch "
             f"{p['parallel']['micro_batch']}, recompute {p['parallel']['recompute']}), "
             f"{p['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {p['memory_gib']['total']:.1f} GiB, "
             f"{upper}" + ("" if d["launchable"] else "; not launchable yet")]
    if m["fits"] is False:
        lines.append("  no plan fits with its band's margin: this one has the most headroom; "
                     "check peak memory in a short trial run")
    if d["passed_over"]:
        q, qm = d["passed_over"], d["passed_over"]["memory_margin"]
        lines.append(f"  passed over: #{q['rank']} {q['strategy']}, up to {qm['upper_gib']:.1f} "
                     f"GiB with its band; the decision is "
                     f"{1 - p['tokens_per_s'] / q['tokens_per_s']:.1%} slower")
    return lines


def _trust(v: dict) -> str:
    """A plan's validation in a few words: its family's measured band, or not validated."""
    if not v["validated"]:
        return "not validated"
    return f"measured {v['low']:.2f}-{v['high']:.2f}x ({v['configs']} configs)"


def format_memory(out: dict) -> str:
    mem = out["memory_gib"]
    lines = [f"{out['model']} on {out['gpu']} ({out['gpu_memory_gib']:g} GiB), layout "
             + " ".join(f"{k}={v}" for k, v in out["parallel"].items())]
    lines += [f"  {k:<12}{v:>9.2f} GiB" for k, v in mem.items()]
    lines.append(f"  fits: {'yes' if out['fits'] else 'NO'} (allocator: {out['allocator']})")
    return "\n".join(lines)
