"""`trainplan validate`: the proof rerun on new hardware in one command.

    trainplan validate --gpus N --suite FILE [FILE ...] --out DIR [--budget-s S]
        [--launches 3] [--only TAG ...] [--skip-micro] [--calibration FILE]
        [--continue-from DIR] [--sweep]

Stages, everything written under DIR:
1. microbenchmarks (`trainplan.bench.micro.stage`): under torchrun, N processes,
   GEMMs of the suite's model, attention, collectives 64 KiB - 1 GiB on GPUs
   (small sizes on CPU), then on GPUs ring attention and the GEMMs of the suite's
   other models (fp8 ones where it runs fp8) -> DIR/micro.jsonl;
2. calibration of the card from those records only (`trainplan.calibrate.fit`,
   what `trainplan calibrate` does) -> DIR/calibration/<gpu preset>.yaml,
   used by this run's predictions and re-predictions. Instead of 1-2:
   `--calibration FILE` (a calibration of this card made before),
   `--continue-from DIR0` (DIR0's, if it is of this card), or `--skip-micro`
   (the committed calibration of the card, else the datasheet);
3. the suites (`trainplan.bench.series.suite`): a prediction of every selected config
   recorded first (DIR/predictions.jsonl), then `--launches` launches of each
   in order (DIR/measurements.jsonl), a failed launch -> DIR/failed.jsonl;
   `--continue-from DIR0` skips the configs DIR0 measured, saw fail or skipped itself;
   `--sweep`: each repetition one launch per GPU count running all its
   configs (`trainplan.bench.series.suite_sweep`; equal to separate launches on
   GPU-bound configs, docs/measurement.md);
4. comparison over DIR's records (`trainplan.compare.accuracy`, with weak scaling,
   `trainplan.compare.scaling`) -> DIR/compare.json; DIR/validate.json holds the run.

`--budget-s` is the wall time of the whole command: a config starts only if
its launches fit, a launch is stopped at the limit, and COMPARE_RESERVE_S is
kept back for the comparison.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from trainplan.bench.micro import stage as micro_stage
from trainplan.compare.accuracy import compare
from trainplan.compare.matching import error_summary
from trainplan.compare.scaling import weak_scaling
from trainplan.errors import UsageError
from trainplan.loader import MAX_LOG_BYTES, json_lines, load_json, quote

COMPARE_RESERVE_S = 25.0  # kept back from the budget for the comparison and the report
RECORD_FILES = ("micro.jsonl", "predictions.jsonl", "measurements.jsonl", "failed.jsonl")


class Clock:
    """Seconds since the start, the deadline, and progress lines on stderr (rich)."""

    def __init__(self, budget_s: float, reserve_s: float = COMPARE_RESERVE_S):
        from rich.console import Console

        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.reserve_s = reserve_s
        self.console = Console(stderr=True, highlight=False)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spare(self) -> float:
        """Seconds left for measuring: the budget less the comparison's reserve."""
        return self.left() - self.reserve_s

    def say(self, text: str) -> None:
        self.console.print(f"[bold]validate[/bold] [{time.monotonic() - self.start:6.1f} s] {text}")


# ---------------------------------------------------------------- checks (before any write)


def select_jobs(paths: list[str], only: list[str], gpus: int) -> list[tuple[dict, dict]]:
    """(suite, config) pairs to run, in the order given; bad input raises one line."""
    from trainplan.bench.series import suite as suite_mod  # pandas: not loaded at import

    jobs, seen = [], {}
    for path in paths:
        loaded = suite_mod.load_suite(path)
        for cfg in loaded["configs"]:
            tag = cfg["tag"]
            if tag in seen:
                first_suite, first = seen[tag]
                if (suite_mod.base_model(first_suite, first), first.get("layout"),
                        first["gpus"]) != (suite_mod.base_model(loaded, cfg), cfg.get("layout"),
                                           cfg["gpus"]):
                    raise UsageError(f"config {tag!r} of {path} differs from the one of that tag "
                                     "in an earlier suite; tags must name one config")
                continue
            seen[tag] = (loaded, cfg)
            jobs.append((loaded, cfg))
    unknown = [t for t in only if t not in seen]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r} is not a config of {paths}; tags: {list(seen)}")
    jobs = [j for j in jobs if not only or j[1]["tag"] in only]
    big = [c["tag"] for _, c in jobs if c["gpus"] > gpus]
    if big:
        raise UsageError(f"configs {big} need more than --gpus {gpus}; pick others with --only")
    return jobs


def check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; name a folder")
    held = [f for f in RECORD_FILES if (out / f).exists()]
    if held:
        raise UsageError(f"--out {str(out)!r} already holds {held}; records are appended, so "
                         "use a new folder")


def read_previous(path: str | None, launches: int) -> tuple[dict, dict]:
    """--continue-from: (its validate.json, tag -> outcome of the configs it measured in full
    or saw fail, or carried from the run it continued: those are not run again)."""
    if path is None:
        return {}, {}
    prev = load_json(Path(path) / "validate.json", error=UsageError, max_bytes=MAX_LOG_BYTES,
                     what="validate.json of an earlier --out")
    if not isinstance(prev, dict):
        raise UsageError(f"--continue-from {quote(path)}: its validate.json is not a report of "
                         "`trainplan validate`; name the --out of an earlier run")
    try:
        skip = {o["tag"]: o for o in list(prev.get("carried", [])) + list(prev.get("configs", []))
                if o["status"] == "failed"
                or (o["status"] == "measured" and o["launches"] >= launches)}
    except (KeyError, TypeError, AttributeError):
        raise UsageError(f"--continue-from {quote(path)}: its validate.json lacks the configs' "
                         "tag, status and launches; name the --out of an earlier run") from None
    return prev, skip


def gpu_count_check(gpus: int, cuda: bool) -> None:
    if cuda:
        import torch
        if torch.cuda.device_count() < gpus:
            raise UsageError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPUs")


# ---------------------------------------------------------------- stages



def calibration_file(args, preset: str, prev: dict) -> str | None:
    """The calibration file to take instead of measuring one (checked), or None."""
    from trainplan.calibrate import store as cal_store  # pandas: not loaded at import

    given = args.calibration
    if given is None and prev:
        old = Path(args.continue_from) / "calibration" / f"{preset}.yaml"
        return str(old) if old.is_file() else None  # another card: measure or --skip-micro
    if given is None:
        return None
    cal = cal_store.load(preset, given)
    if cal is None:
        raise UsageError(f"--calibration {given!r}: no such file")
    if cal["gpu"] != preset:
        raise UsageError(f"--calibration {given!r} is for {cal['gpu']}, this card is {preset}; "
                         "leave it out to measure one")
    return given


def calibration(args, out: Path, gpu, given: str | None, cuda: bool, model: str,
                clock: Clock) -> dict:
    """Stage 2: the calibration of `gpu` (a GPUSpec) this run uses: {"source", "path", "label"}."""
    from trainplan.calibrate import fit as calibrate  # pandas: not loaded at import
    from trainplan.calibrate import store as cal_store  # pandas: not loaded at import

    preset = gpu.name
    target = out / "calibration" / f"{preset}.yaml"
    if given is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(given, target)
        return {"source": f"file {given}", "path": str(target),
                "label": cal_store.load(preset, target)["label"]}
    if args.skip_micro:
        committed = cal_store.load(preset)
        return {"source": "committed" if committed else "datasheet",
                "path": str(cal_store.path_for(preset)) if committed else None,
                "label": committed["label"] if committed else "datasheet"}
    t0 = time.monotonic()
    clock.say(f"microbenchmarks on {args.gpus} {'GPUs' if cuda else 'CPU ranks'}")
    micro = micro_stage.run_micro(out, args.gpus, model, cuda, clock)
    if cuda and args.gpus >= 2:
        micro_stage.run_ring_micro(micro, args.gpus, model, clock)
    if cuda and getattr(args, "fp8", False):  # a suite runs fp8: its GEMMs' curve
        micro_stage.run_fp8_micro(micro, model, clock)
    if cuda and getattr(args, "gemm_models", None):  # the suite's other widths
        micro_stage.run_gemm_micro(micro, args.gemm_models, args.gpus, clock)
    cal = calibrate.build([micro], gpu)
    calibrate.write(cal, target)
    clock.say(f"calibrated {preset} from {micro.name} ({time.monotonic() - t0:.0f} s): "
              f"matmul {cal['matmul_efficiency']:.3f}, attention {cal['attention_efficiency']:.3f}"
              f" of peak -> {target}")
    return {"source": "measured", "path": str(target), "label": cal["label"]}


@contextlib.contextmanager
def calibration_in(cal: dict, out: Path):
    """Predictions and re-predictions of this run use DIR's calibration of the card.

    The measured or given file (in DIR/calibration) is named to `calibrate.store.load_gpu`
    for the run (`explicit`), so it applies to the card whether that is a preset or a YAML
    file, and the repository's committed calibrations are neither used nor overwritten.
    """
    from trainplan.calibrate import store as cal_store  # pandas: not loaded at import

    own = cal["path"] is not None and cal["source"] != "committed"
    with cal_store.explicit(cal["path"] if own else None):
        yield


def compare_records(out: Path, repredict: bool) -> dict:
    """Stage 4: `trainplan compare` over DIR's records, with weak scaling.

    Re-predictions look the GPU up by preset name, so a GPU given as a YAML
    file (CPU tests) goes without them."""
    files = [out / f for f in ("predictions.jsonl", "measurements.jsonl", "failed.jsonl")
             if (out / f).is_file()]
    if files:
        result = compare(files, repredictions=repredict)
    else:  # nothing predicted (all done before): compare() would read the committed records
        none = error_summary([])
        result = {"headline_host": None, "configs": 0, "step_time_error": none,
                  "memory_error": none, "hosts": {},
                  "all_hosts": {"configs": 0, "step_time_error": none, "memory_error": none},
                  "rows": [], "refused": [], "measured_configs": 0, "flagged_configs": 0,
                  "predicted_not_measured": [], "files": []}
    result["scaling"] = weak_scaling(result["rows"])
    failed = out / "failed.jsonl"
    result["failed_launches"] = ([v for _, v in json_lines(failed)] if failed.is_file() else [])
    return result


# ---------------------------------------------------------------- the command


def validate(args) -> dict:
    from trainplan.bench.harness.host import allocator_env
    from trainplan.bench.series import run as series_run  # pandas: not loaded at import
    from trainplan.bench.series import suite as suite_mod  # pandas: not loaded at import
    from trainplan.calibrate.store import load_gpu  # pandas: not loaded at import

    allocator = allocator_env(os.environ)  # the launches', in the predictions' provenance too
    out = Path(args.out)
    jobs = select_jobs(args.suite, args.only or [], args.gpus)
    if args.sweep:
        series_run.sweep_only(jobs)  # one line before any work: Trainer configs run alone
    prev, skip = read_previous(args.continue_from, args.launches)
    check_out(out)
    import torch

    cuda = torch.cuda.is_available()
    gpu_count_check(args.gpus, cuda)
    if cuda and not args.allow_busy:
        suite_mod.check_gpus_idle()
    clock = Clock(args.budget_s)
    card = suite_mod.card_name()
    gpu_source = suite_mod.gpu_preset(card, jobs[0][0])
    gpu = load_gpu(gpu_source, calibrated=False)
    preset = gpu.name
    model = jobs[0][0].get("model") or suite_mod.base_model(*jobs[0])  # the micro's shapes
    if prev and prev.get("card") != card:  # another card: its runs say nothing of this one
        clock.say(f"{args.continue_from} ran on {prev.get('card')}, this is {card}: "
                  "measuring everything again")
        skip = {}
    given = calibration_file(args, preset, prev)
    args.fp8 = any(suite_mod.precision(s, c)["precision"] == "fp8" for s, c in jobs)
    args.gemm_models = sorted({suite_mod.base_model(s, c) for s, c in jobs} - {model})
    out.mkdir(parents=True, exist_ok=True)
    cal = calibration(args, out, gpu, given, cuda, model, clock)
    clock.say(f"card {card} -> preset {preset}; calibration: {cal['label']} ({cal['source']})")

    def done_before(cfg):
        o = skip.get(cfg["tag"])
        return o is not None and (o["gpus"], o["layout"], o["compile"]) == (
            cfg["gpus"], suite_mod.full_layout(cfg), bool(cfg.get("compile", False)))

    skipped = [c["tag"] for _, c in jobs if done_before(c)]
    jobs = [j for j in jobs if not done_before(j[1])]
    if skipped:
        clock.say(f"skipped, done in {args.continue_from}: {', '.join(skipped)}")
    run_id = f"validate-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    with calibration_in(cal, out):
        preds = suite_mod.predict_all(jobs, out, card, run_id)
        if cuda and not args.allow_busy:  # a microbenchmark killed at its limit leaves nothing
            suite_mod.check_gpus_idle()
        clock.say(f"{len(preds)} predictions recorded -> {out / 'predictions.jsonl'}; measuring "
                  f"{len(jobs)} configs x {args.launches} launches, "
                  f"{clock.spare():.0f} s left for them")
        with contextlib.redirect_stdout(sys.stderr):  # the runner's progress lines
            rows, outcomes = series_run.measurer(args.sweep)(
                jobs, preds, out, run_id, args.launches, clock.deadline - COMPARE_RESERVE_S)
        report = {"out": str(out), "card": card, "gpu_preset": preset, "gpus": args.gpus,
                  "run_id": run_id, "suites": args.suite, "launches": args.launches,
                  "sweep": args.sweep, "allocator": allocator,
                  "budget_s": args.budget_s, "calibration": cal, "skipped": skipped,
                  "carried": [skip[t] for t in skipped],  # for a run continued from this one
                  "configs": outcomes, "compare": None}
        write_json(out / "validate.json", report)  # already enough for --continue-from
        clock.say("comparing predicted with measured")
        result = compare_records(out, repredict=Path(gpu_source).suffix not in (".yaml", ".yml"))
    write_json(out / "compare.json", result)
    report.update(compare=result, elapsed_s=round(time.monotonic() - clock.start, 1))
    write_json(out / "validate.json", report)
    clock.say(f"done in {report['elapsed_s']:.0f} s -> {out / 'compare.json'}")
    return report


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


__all__ = ["validate", "COMPARE_RESERVE_S"]
