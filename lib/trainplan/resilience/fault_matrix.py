"""The fault matrix of runbook page 5: every fault-injection test, its guarantee, its result.

    python -m trainplan.resilience.fault_matrix   # -> data/measurements/fault-matrix-DATE.json

runs `pytest tests/faults --junitxml=...` (real torchrun, CPU, gloo; about 3
minutes on 2 cores), reads the JUnit XML and writes one JSON table: for each
test, the scenario in plain words, the guarantee it checks, its pytest node
id, outcome and duration, with the date, commit and versions of the run. The
words live in SCENARIOS below, next to nothing else, so that a new test under
tests/faults/ without its words shows up as `described: false` (and fails
tests/resilience/test_fault_matrix.py). Exit 0 when every test passed, 1 when one did
not (the table is written either way), 2 for bad flags. Each run writes a new dated file
(records are never rewritten); page 5 reads the newest (`latest`).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET  # noqa: S405 (our own pytest's report, not foreign input)
from datetime import datetime, timezone
from pathlib import Path

from trainplan import loader
from trainplan.records import provenance

REPO = Path(__file__).resolve().parents[3]
TESTS = "tests/faults"

# test function -> (scenario, guarantee); "{param}" takes the test's parameter id
SCENARIOS = {
    "test_sigkill_one_rank_mid_step_loses_at_most_one_interval_and_ends_identical": (
        "SIGKILL of one rank mid-step",
        "torchrun restarts the group; training resumes from the last checkpoint, loses at "
        "most one interval, and ends bit-identical to an uninterrupted run"),
    "test_kill_during_each_save_phase_ignores_the_partial_checkpoint": (
        "SIGKILL during a save, at each phase (staging, writing shards, DCP done without "
        "manifest, manifest written not renamed, manifest renamed)",
        "the partial checkpoint is ignored and the previous one loads (after the rename, the "
        "new one); the run ends identical"),
    "test_hung_rank_fails_the_step_within_the_collective_timeout_then_restarts": (
        "a hung rank",
        "the collective timeout ends the step within its bound; the group restarts from the "
        "last checkpoint and ends identical"),
    "test_sigusr1_and_sigterm_take_emergency_checkpoints_within_the_grace_window": (
        "preemption: SIGUSR1 to one rank (Slurm's warning), SIGTERM to the torchrun agent",
        "an emergency checkpoint commits within the 30 s grace window; SIGTERM stops the job "
        "(exit 143) and the requeued job resumes without losing a step, ending identical"),
    "test_soak_random_kills_end_identical_and_report_effective_training_time": (
        "random SIGKILLs at a set MTBF (short soak)",
        "every failure loses at most two intervals, the run ends identical; the measured "
        "effective training time ratio is reported beside the planner's"),
    "test_corruption_is_detected_reported_in_one_line_and_the_previous_is_chosen": (
        "newest checkpoint damaged: {param}",
        "detected (size, sha256 or missing manifest), reported in one line, the previous "
        "checkpoint is chosen"),
    "test_resume_from_a_corrupted_newest_loads_the_previous_and_ends_identical": (
        "resume with a flipped byte in the newest checkpoint",
        "the previous checkpoint loads and the run ends identical"),
    "test_failed_writes_are_reported_training_goes_on_last_committed_survives": (
        "write failure (ENOSPC) and disk full (EFBIG) during asynchronous saves",
        "training goes on, each failure is reported in one line, the last committed "
        "checkpoint survives, no half-written folder is left"),
    "test_restart_on_fewer_ranks_reshards_to_the_same_state": (
        "restart on fewer ranks (2 -> 1)",
        "DCP reshards on load: the same model and optimizer state bit for bit, the same "
        "next loss"),
    "test_bad_checkpoint_flags_are_refused_in_one_line": (
        "bad checkpoint flag ({param})", "refused in one line naming the value"),
    "test_fault_specs_parse_and_bad_ones_name_the_clause": (
        "malformed fault-injection spec", "refused, naming the bad clause"),
    "test_manifest_verification_and_retention": (
        "retention with an old unfinished save, a save in flight and a damaged file",
        "the last k verified checkpoints are kept, a save in flight is never deleted, a "
        "damaged checkpoint is skipped"),
    "test_every_single_bit_flip_of_a_manifest_is_refused_or_loads_the_saved_state": (
        "every single-bit flip of a checkpoint's manifest",
        "each is refused (its own checksum, JSON, UTF-8) or parses to the same manifest, "
        "whose load is exactly the saved state"),
    "test_a_duplicate_key_is_refused_even_where_the_checksum_matches": (
        "a manifest with a key twice", "refused, even where its checksum matches"),
    "test_every_file_of_the_folder_must_be_listed_and_every_listed_file_there": (
        "manifest and folder disagree: {param}",
        "the checkpoint does not verify; the reason names the file or field"),
    "test_a_resealed_metadata_that_calls_code_is_refused_before_it_runs": (
        "a checkpoint's DCP index (.metadata) replaced by a pickle that calls code, and "
        "the manifest resealed",
        "verify unpickles the index with DCP's own types only: refused, nothing it names "
        "runs, and no resume or export reads it"),
    "test_retention_counts_only_verified_checkpoints": (
        "retention with the newest checkpoints corrupt",
        "only verified checkpoints count: the newest verified one is never deleted"),
    "test_retention_keeps_the_newest_verified_when_newer_ones_are_corrupt": (
        "the last k checkpoints corrupt, the run started again (--fresh) and killed early",
        "its new checkpoints survive; the next resume loads the newest verified one and the "
        "run ends identical"),
    "test_resume_with_every_checkpoint_corrupt_refuses_with_exit_2": (
        "--resume where every checkpoint fails verification",
        "refused with exit 2 in one line naming each folder and why; nothing is deleted"),
    "test_a_failed_final_save_exits_non_zero_in_one_line": (
        "the final save fails (ENOSPC)",
        "the run exits 1, saying in one line that its last steps are not on disk"),
    "test_rng_state_round_trips_through_json": (
        "RNG state across a restart", "torch, numpy and Python RNG states restored exactly"),
    "test_data_position_resumes_the_same_sample_stream": (
        "data loader position across a restart",
        "the resumed run reads the same sample stream, across an epoch boundary too"),
    "test_one_rank_save_and_resume_restore_model_optimizer_and_rng": (
        "one-rank save and resume",
        "model, optimizer and RNG restored exactly; a folder with checkpoints is not "
        "overwritten without --resume"),
    "test_the_async_stager_survives_being_closed_after_each_stage_as_torch_2_11_does": (
        "asynchronous saves reuse one pinned staging copy (torch 2.11 closes it after each "
        "stage)",
        "the second and later saves stage correctly instead of failing with "
        "KeyError: <class 'type'>"),
    "test_a_non_tensor_entry_is_refused_not_unpickled": (
        "a checkpoint holding a non-tensor (pickled) entry",
        "the loader refuses it instead of unpickling it"),
}


def describe(name: str) -> tuple[str, str, bool]:
    """(scenario, guarantee, described) of a test name such as `test_x[param]`."""
    base, _, param = name.partition("[")
    param = param[:-1] if param.endswith("]") else param
    param = re.sub(r"^(?:[a-z_]+\d+-)+", "", param)  # pytest's ids of dicts: "kw0-..."
    if base not in SCENARIOS:
        return base.removeprefix("test_").replace("_", " "), "", False
    scenario, guarantee = SCENARIOS[base]
    return scenario.replace("{param}", param or "-"), guarantee, True


def node_id(classname: str, name: str) -> str:
    """pytest node id from a JUnit testcase (`tests.faults.test_x` + `test_y[p]`)."""
    parts = classname.split(".")
    if parts and parts[0] != "tests":
        parts = ["tests", *parts]
    return "/".join(parts) + ".py::" + name


def parse_junit(xml_text: str) -> list[dict]:
    """One row per testcase: node id, scenario, guarantee, outcome, duration."""
    rows = []
    for case in ET.fromstring(xml_text).iter("testcase"):  # noqa: S314
        name = case.get("name", "")
        children = {child.tag for child in case}
        outcome = ("failed" if "failure" in children else "error" if "error" in children
                   else "skipped" if "skipped" in children else "passed")
        scenario, guarantee, described = describe(name)
        rows.append({"scenario": scenario, "guarantee": guarantee,
                     "test": node_id(case.get("classname", ""), name), "outcome": outcome,
                     "duration_s": round(float(case.get("time", 0) or 0), 2),
                     "described": described})
    return rows


def matrix(rows: list[dict], *, command: list[str], started: str, wall_s: float) -> dict:
    import torch

    commit = provenance.git_commit()
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("passed", "failed", "error", "skipped")}
    rows = sorted(rows, key=lambda r: r["test"])  # file order, not the workers' finishing order
    for r in rows:
        r.update(date=started, commit=commit)
    return {"kind": "fault-matrix", "date": started, "commit": commit,
            "command": " ".join(command), "wall_s": round(wall_s, 1), "counts": counts,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "rows": rows}


def latest(folder: str | Path) -> dict:
    """The newest fault matrix in `folder` (its `fault-matrix*.json` files, by their `date`)."""
    found = [loader.load_json(p, what="fault matrix")
             for p in sorted(Path(folder).glob("fault-matrix*.json"))]
    if not found:
        raise FileNotFoundError(f"no fault-matrix*.json in {folder}")
    return max(found, key=lambda m: m["date"])


def pytest_command(workers: int, extra: list[str]) -> list[str]:
    """pytest on tests/faults (the JUnit flag is added by `main`)."""
    return ["-m", "pytest", "-q", *(["-n", str(workers)] if workers > 1 else []), TESTS, *extra]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainplan.resilience.fault_matrix",
                                description="Run tests/faults and write the fault matrix.")
    p.add_argument("--out", default=None,
                   help="a new file (default data/measurements/fault-matrix-YYYYMMDD.json)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers; 1 = none")
    p.add_argument("--from-junit", default=None,
                   help="build the table from this JUnit XML instead of running pytest")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        print(f"error: --workers = {args.workers} must be >= 1", file=sys.stderr)
        return 2
    if args.from_junit and not Path(args.from_junit).is_file():
        print(f"error: --from-junit {args.from_junit}: no such file", file=sys.stderr)
        return 2
    if args.out is None:  # a new dated file: the committed ones are records, never rewritten
        day = datetime.now(timezone.utc).strftime("%Y%m%d")
        args.out = f"data/measurements/fault-matrix-{day}.json"
        if Path(args.out).exists():
            print(f"error: {args.out} exists (records are never rewritten); name a new file "
                  "with --out", file=sys.stderr)
            return 2
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(args.from_junit or Path(tmp) / "faults.xml")
        command = ["(from JUnit XML)", str(junit)]
        if not args.from_junit:
            command = ["python", *pytest_command(args.workers, args.pytest_args)]
            subprocess.run([sys.executable, *command[1:], f"--junitxml={junit}"], cwd=REPO)
        if not junit.is_file():
            print("error: pytest wrote no JUnit report (did it start?)", file=sys.stderr)
            return 1
        rows = parse_junit(junit.read_text())
    table = matrix(rows, command=command, started=started,
                   wall_s=(datetime.now(timezone.utc) - t0).total_seconds())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    c = table["counts"]
    print(f"fault matrix: {len(rows)} tests, {c['passed']} passed, {c['failed']} failed, "
          f"{c['error']} errors, {c['skipped']} skipped -> {out}")
    undescribed = [r["test"] for r in rows if not r["described"]]
    if undescribed:
        print(f"warning: no scenario words for {', '.join(undescribed)} (add them to "
              "trainplan.resilience.fault_matrix.SCENARIOS)", file=sys.stderr)
    return 0 if c["passed"] + c["skipped"] == len(rows) and rows else 1


if __name__ == "__main__":
    sys.exit(main())
