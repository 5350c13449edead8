"""Run one measurement series from the command line, and its summary table.

    PYTHONPATH=lib python -m trainplan.bench.series.run data/suites/NAME.yaml --out DIR \
        [--launches 3] [--only TAG ...] [--budget-s 540] [--sweep]

The series is `trainplan.bench.series.suite` (predictions first, then separate launches)
or, with `--sweep`, `trainplan.bench.series.suite_sweep` (one launch per GPU count and
repetition).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainplan.bench.series.suite import (
    card_name,
    load_suite,
    measure,
    predict_all,
    train_command,
)
from trainplan.bench.series.suite_sweep import measure_sweep, sweep_only
from trainplan.errors import TrainplanError


def run_suite(path: str, out: Path, launches: int, only: list[str], budget_s: float,
              sweep: bool = False) -> list:
    """Predict every selected config of the suite at `path`, then measure them within the budget
    (in separate launches, or with `sweep` one launch per GPU count and repetition)."""
    suite = load_suite(path)
    jobs = selected(suite, only)
    if sweep:
        sweep_only(jobs)  # before the predictions: nothing half-written
    out.mkdir(parents=True, exist_ok=True)
    card = card_name()
    run_id = new_run_id(path)
    preds = predict_all(jobs, out, card, run_id)
    rows, _ = measurer(sweep)(jobs, preds, out, run_id, launches, time.monotonic() + budget_s)
    return rows


def selected(suite: dict, only: list[str]) -> list[tuple[dict, dict]]:
    """(suite, config) of the configs `only` names, in the suite's order (all if empty)."""
    return [(suite, c) for c in suite["configs"] if not only or c["tag"] in only]


def new_run_id(path: str) -> str:
    """The series' run id: the suite file's stem and the UTC start time."""
    return f"{Path(path).stem}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


def launch_commands(path: str, out: Path, only: list[str]) -> list[tuple[str, list[str]]]:
    """(tag, command) of each selected config's first launch, as `run_suite` would start it;
    nothing is predicted, written or started (`trainplan bench --suite ... --dry-run`)."""
    suite, run_id = load_suite(path), new_run_id(path)
    return [(c["tag"], train_command(s, c, out, run_id))
            for s, c in selected(suite, only)]


def measurer(sweep: bool):
    """`measure` (separate launches), or with `sweep` suite_sweep's `measure_sweep`: the same
    arguments and results."""
    return measure_sweep if sweep else measure


def print_table(rows) -> None:
    print(f"{'config':<24}{'n':>2}{'pred s':>9}{'meas s':>9}{'err':>7}{'tok/s/GPU':>11}"
          f"{'MFU':>7}{'pred GiB':>9}{'rsv GiB':>9}")
    for tag, pred, done in rows:
        if not done:
            print(f"{tag:<24} 0  (not measured)")
            continue
        step = sorted(s["step_time_s"] for s in done)[len(done) // 2]
        rate = sorted(s["tokens_per_s_per_gpu"] for s in done)[len(done) // 2]
        mfu = sorted(s["mfu"] for s in done)[len(done) // 2]
        rsv = max((s["peak_mem_reserved_gib"] or 0.0) for s in done)  # 0 on CPU
        err = pred["step_time_s"] / step - 1
        print(f"{tag:<24}{len(done):>2}{pred['step_time_s']:>9.3f}{step:>9.3f}{err:>+7.1%}"
              f"{rate:>11,.0f}{mfu or 0.0:>7.1%}{pred['memory_gib']['total']:>9.1f}{rsv:>9.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.series.run")
    p.add_argument("suite")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--sweep", action="store_true",
                   help="each repetition: one launch per GPU count running all its configs "
                        "(suite_sweep.py); times as separate launches on GPU-bound configs")
    args = p.parse_args(argv)
    try:
        rows = run_suite(args.suite, args.out, args.launches, args.only, args.budget_s,
                         args.sweep)
    except TrainplanError as err:
        print(f"suite: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
