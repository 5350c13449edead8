"""`trainplan compare` and `trainplan calibrate`: predicted vs measured, and a card's constants.

    trainplan compare [--records FILE ...] [--no-repredict] --json
    trainplan calibrate --records FILE ... | --committed [--host-records FILE ...]
        --gpu PRESET [--out PATH] --json
    trainplan validate --gpus N --suite FILE [FILE ...] --out DIR [--budget-s S]
        [--launches 3] [--only TAG ...] [--skip-micro] [--calibration FILE]
        [--continue-from DIR] [--sweep] --json

`compare` reads prediction and measurement records (default: the committed
data/measurements/*.jsonl) and prints the error table (`trainplan.compare.accuracy`).
`calibrate` fits the card's efficiency constants to microbenchmark records
only and writes data/hardware/calibration/<gpu>.yaml (or --out); the
planner then uses them for that card (`trainplan.calibrate.fit`); with --host-records
the host terms come from those files' host-bench records alone (this machine's host) and
the host-bench records of --records are set aside; --committed adds the record files the
card's committed calibration lists (its `sources`, under data/measurements). `validate`
runs microbenchmarks, calibration, a suite (predictions first) and the
comparison in one command, everything under DIR (`trainplan.validate`).
`compare` adds weak-scaling efficiency where the records allow
(`trainplan.compare.scaling`).
"""

from __future__ import annotations

from pathlib import Path

from trainplan.commands.args import check_out_file, distinct_files, positive_float, positive_int
from trainplan.compare.scaling import format_scaling, weak_scaling
from trainplan.errors import UsageError
from trainplan.loader import quote


def register(verbs) -> None:
    p = verbs.add_parser("compare", help="predicted against measured, from the records")
    p.add_argument("--records", nargs="+", default=None, metavar="FILE",
                   help="record files (default: data/measurements/*.jsonl)")
    p.add_argument("--no-repredict", dest="repredict", action="store_false",
                   help="skip the re-predictions with today's planner")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=cmd_compare, fmt=format_compare)

    p = verbs.add_parser("calibrate", help="a card's efficiency constants from microbenchmarks")
    p.add_argument("--records", nargs="+", default=[], metavar="FILE",
                   help="files holding microbenchmark records")
    p.add_argument("--committed", action="store_true",
                   help="also the record files of the card's committed calibration (with "
                        "--host-records: this machine's host terms, every other term as "
                        "committed)")
    p.add_argument("--host-records", nargs="+", default=None, metavar="FILE",
                   help="the host terms from these files' host-bench records only (bench.micro "
                        "--benches host,host-step on this machine); those in --records are "
                        "set aside")
    p.add_argument("--gpu", required=True, help="GPU preset the records calibrate")
    p.add_argument("--out", default=None,
                   help="where to write (default: data/hardware/calibration/GPU.yaml)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=cmd_calibrate, fmt=format_calibrate)

    p = verbs.add_parser("validate", help="microbenchmarks, calibration, a suite and the "
                         "comparison on this machine, in one command")
    p.add_argument("--gpus", type=positive_int, required=True,
                   help="GPUs (CPU ranks without GPUs) for the microbenchmarks; the most a "
                        "config may use")
    p.add_argument("--suite", nargs="+", required=True, metavar="FILE",
                   help="suite files (data/suites/*.yaml), run in this order")
    p.add_argument("--out", required=True, metavar="DIR", help="a new folder for every file")
    p.add_argument("--budget-s", type=positive_float, default=530.0,
                   help="wall time of the whole command, seconds (default 530)")
    p.add_argument("--launches", type=positive_int, default=3, help="launches per config")
    p.add_argument("--only", nargs="+", default=None, metavar="TAG", help="these configs only")
    p.add_argument("--allow-busy", action="store_true",
                   help="measure even when other processes hold GPU memory (figures contended)")
    p.add_argument("--sweep", action="store_true",
                   help="each repetition: one launch per GPU count running all its configs "
                        "(saves ~20 s a config; on a GPU it times as separate launches where "
                        "the step is GPU-bound: docs/measurement.md)")
    p.add_argument("--skip-micro", action="store_true",
                   help="no microbenchmarks: the card's committed calibration, else datasheet")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="a calibration of this card made before (no microbenchmarks)")
    p.add_argument("--continue-from", default=None, metavar="DIR",
                   help="an earlier --out: its calibration (same card) is used and the "
                        "configs it measured or saw fail are not run again")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=cmd_validate, fmt=format_validate)


def cmd_compare(args) -> dict:
    from trainplan.compare.accuracy import compare  # numpy: not loaded for --help
    from trainplan.compare.trust import family_bands  # pandas: not loaded for --help

    distinct_files(("--records", p) for p in args.records or ())  # else counted twice
    out = compare(args.records, repredictions=args.repredict)
    out["families"] = family_bands(out)
    out["scaling"] = weak_scaling(out["rows"])
    return out


def cmd_validate(args) -> dict:
    if args.skip_micro and args.calibration:  # calibration_file refuses another card's FILE
        raise UsageError(f"--skip-micro (the committed calibration) and --calibration "
                         f"{quote(args.calibration)} name two calibrations; give one")
    from trainplan.validate import validate  # numpy: not loaded for --help
    return validate(args)


def format_validate(report: dict) -> str:
    """The configs' outcomes, then the comparison table (last), then weak scaling."""
    lines = [f"{report['card']} x {report['gpus']} ({report['gpu_preset']}), calibration "
             f"{report['calibration']['label']} ({report['calibration']['source']}), "
             f"{report['allocator']} allocator; "
             f"{report['elapsed_s']:.0f} s of {report['budget_s']:.0f}; records in {report['out']}"]
    for o in report["configs"]:
        why = f"  {o['reason']}" if o["reason"] else ""
        lines.append(f"  {o['tag']:<26}{o['status']:<10}{o['launches']} launch(es){why}")
    for tag in report["skipped"]:
        lines.append(f"  {tag:<26}{'skipped':<10}done in the run continued from")
    return "\n".join(lines) + "\n" + format_compare(report["compare"])


def cmd_calibrate(args) -> dict:
    from trainplan.calibrate import fit as calibrate  # pandas: not loaded for --help
    from trainplan.calibrate import store as calibration  # pandas: not loaded for --help
    from trainplan.calibrate.store import load_gpu  # pandas: not loaded for --help

    gpu = load_gpu(args.gpu, calibrated=False)
    if not args.records and not args.committed:
        raise UsageError("calibrate: give --records FILE ..., --committed, or both")
    committed = calibration.committed_sources(gpu.name) if args.committed else []
    named = [*(("--committed", p) for p in committed), *(("--records", p) for p in args.records)]
    host = [("--host-records", p) for p in args.host_records or ()]
    distinct_files(named)  # a file twice would count its records twice
    distinct_files(host)  # beside --records it may be: their host records are set aside
    out = args.out or calibration.path_for(gpu.name)
    gpu_file = [("--gpu", args.gpu)] if Path(args.gpu).is_file() else []
    check_out_file(out, [*named, *host, *gpu_file], extra=calibrate.TMP_EXTRA)
    cal = calibrate.build([p for _, p in named], gpu, args.host_records)  # raises before writing
    path = calibrate.write(cal, out)
    return {"path": str(path), **cal}


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.1%}"


def format_compare(out: dict) -> str:
    def errors(fig):
        st, mem = fig["step_time_error"], fig["memory_error"]
        return (f"|error| median / max: step time {_pct(st['median'])[1:]} / "
                f"{_pct(st['max'])[1:]}, peak reserved memory {_pct(mem['median'])[1:]} / "
                f"{_pct(mem['max'])[1:]}")

    head = out.get("headline_host")
    where = f" on {head}, the largest host measured (the headline; " if head else " ("
    lines = [f"{out['configs']} configs compared{where}predictions recorded before the "
             f"measurements); {errors(out)}"]
    hosts, pooled = out.get("hosts") or {}, out.get("all_hosts")
    if pooled and len(hosts) > 1:
        lines.append(f"all {len(hosts)} hosts pooled: {pooled['configs']} configs; "
                     f"{errors(pooled)}")
    width = out.get("width_check") or {}
    if width.get("configs"):
        lines.append(f"width check, layer slices of the target model (in no figure above): "
                     f"{width['configs']} configs; {errors(width)}")
    lines.append(f"{'config':<22}{'n':>3}{'pred s':>8}{'meas s':>8}{'95% interval':>18}"
                 f"{'err':>8}{'pred GiB':>9}{'meas GiB':>9}{'err':>8}")
    for r in out["rows"]:
        ci = r["measured_step_time_ci"]
        pred = "-" if r["predicted_step_time_s"] is None else f"{r['predicted_step_time_s']:.3f}"
        pmem = "-" if r["predicted_memory_gib"] is None else f"{r['predicted_memory_gib']:.1f}"
        mmem = "-" if r["measured_memory_gib"] is None else f"{r['measured_memory_gib']:.1f}"
        lines.append(
            f"{r['config'][:21]:<22}{r['launches']:>2}{'*' if r['flagged'] else ' '}{pred:>8}"
            f"{r['measured_step_time_s']:>8.3f}{f'{ci[0]:.3f}-{ci[1]:.3f}':>18}"
            f"{_pct(r['step_time_error']):>8}{pmem:>9}{mmem:>9}{_pct(r['memory_error']):>8}")
    if out["flagged_configs"]:
        lines.append("* fewer than 3 launches")
    for f in out.get("failed", []):
        bound = f["memory_error_at_most"]
        why = "out of memory" if f["out_of_memory"] else f["reason"][:80]
        if bound is not None:
            why += (f"; predicted {f['predicted_memory_gib']:.2f} GiB"
                    f"{' (fits)' if f['predicted_fits'] else ''}, memory error {_pct(bound)} "
                    "or worse")
        lines.append(f"failed: {f['config']} on {f['host']}, {f['launches_failed']} "
                     f"launch(es): {why}")
    for r in out["refused"]:
        lines.append(f"refused: {r['prediction']} for {r['config']} ({r['reason']})")
    if "repredicted" in out:
        rp = out["repredicted"]
        lines.append(f"re-predicted now on the headline host (not in the headline): datasheet "
                     f"{_pct(rp['datasheet']['step_time_error']['median'])[1:]} median, "
                     f"calibrated [{rp['calibration']}] "
                     f"{_pct(rp['calibrated']['step_time_error']['median'])[1:]} median")
    if "repredicted" in width:
        lines.append(f"width check re-predicted now: calibrated "
                     f"{errors(width['repredicted']['calibrated'])}")
    for p in width.get("per_layer", []):
        lines.append(f"  per layer, {p['to']} less {p['from']} on {p['host']}: step "
                     f"{1e3 * p['predicted_step_s']:.1f} ms predicted, "
                     f"{1e3 * p['measured_step_s']:.1f} ms measured "
                     f"({_pct(p['step_time_error'])}); memory "
                     f"{p['predicted_memory_gib']:.2f} / {p['measured_memory_gib']:.2f} GiB "
                     f"({_pct(p['memory_error'])})")
    if out.get("families"):
        lines.append(format_families(out["families"]))
    if out.get("scaling", {}).get("series"):
        lines.append(format_scaling(out["scaling"]))
    return "\n".join(lines)


def format_families(bands: list[dict]) -> str:
    """Per layout family and card class: configs, measured / predicted throughput, |error|,
    and the largest spread of one config's launches on one host (`trust.family_bands`)."""
    lines = ["per layout family (every host of a card class; measured / predicted tokens/s):",
             f"  {'class':<8}{'family':<22}{'n':>3}{'low':>7}{'median':>8}{'high':>7}"
             f"{'step max':>10}{'mem max':>9}{'launches':>10}  status"]
    for b in bands:
        status = ("within 10%" if b["within_targets"] else "outside 10%") \
            if b["validated"] else "not validated (1 config)"
        lines.append(f"  {b['card_class']:<8}{b['family'][:21]:<22}{b['configs']:>3}"
                     f"{b['low']:>7.2f}{b['median']:>8.2f}{b['high']:>7.2f}"
                     f"{_pct(b['step_time_error']['max'])[1:]:>10}"
                     f"{_pct(b['memory_error']['max'])[1:]:>9}"
                     f"{_pct(b.get('launch_spread'))[1:] or '-':>10}  {status}")
    return "\n".join(lines)


def format_calibrate(out: dict) -> str:
    lines = [f"{out['label']} -> {Path(out['path'])}",
             f"  matmul fraction    {out['matmul_efficiency']:.3f} "
             f"(preset {out['preset']['matmul_efficiency']:.2f})",
             f"  attention fraction {out['attention_efficiency']:.3f} "
             f"(preset {out['preset']['attention_efficiency']:.2f})"]
    for op, f in out["collectives"].items():
        lines.append(f"  {op:<15} alpha {f['latency_us']:.1f} us, bus bandwidth "
                     f"{f['busbw_gbps']:.0f} GB/s (fit |error| median "
                     f"{f['rel_error_median']:.1%}, max {f['rel_error_max']:.1%})")
    if "host_records" in out:
        host = out["host_records"]
        lines.append(f"  host terms from   {', '.join(host['from'])} only; "
                     f"{host['set_aside']} host-bench record(s) of --records set aside")
    return "\n".join(lines)
