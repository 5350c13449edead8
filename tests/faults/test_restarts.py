"""A rank dies or hangs; torchrun restarts the group; training resumes and ends where it would have.

Each test launches the 2-rank tiny run under real torchrun with
`--max-restarts`, injects a fault through TRAINPLAN_FAULT
(`trainplan.bench.ckpt.faults`), and checks the guarantee from the run's event
log (`DIR/events.jsonl`) and its state digest against the uninterrupted
reference (conftest.py).
"""

from __future__ import annotations

import pytest

from faults.harness import LAYOUT_2, launch

STEPS = ["--steps", "12"]


@pytest.mark.slow
def test_sigkill_one_rank_mid_step_loses_at_most_one_interval_and_ends_identical(
        reference, tiny_yaml, tmp_path):
    every = 3
    run = launch(tiny_yaml, tmp_path / "ckpt",
                 [*LAYOUT_2, *STEPS, "--ckpt-every", str(every), "--resume"],
                 restarts=1, fault="kill@step:8:rank:1")
    assert run.rc == 0, run.explain()
    kills = run.of("fault", action="kill")
    assert [(k["rank"], k["step"], k["attempt"]) for k in kills] == [(1, 8, 0)], run.explain()
    resumed = run.of("resume", attempt=1)
    assert resumed, "torchrun did not restart the group, or it did not resume\n" + run.explain()
    lost = (kills[0]["step"] - 1) - resumed[0]["step"]  # steps completed before the kill, redone
    print(f"SIGKILL at step 8: resumed from step {resumed[0]['step']}, {lost} step(s) lost "
          f"(interval {every})")
    assert 0 <= lost <= every
    assert run.digest(12, "end") == reference.digest(12), "final state differs from the reference"


# (phase, step of the save killed, rank killed): one restart each, in this order
PHASES = [("staging", 4, 1), ("writing", 6, 1), ("metadata", 8, 0), ("manifest", 10, 0),
          ("committed", 10, 0)]


@pytest.mark.slow
def test_kill_during_each_save_phase_ignores_the_partial_checkpoint(reference, tiny_yaml,
                                                                    tmp_path):
    fault = ";".join(f"kill@save:{phase}:step:{step}:rank:{rank}:restart:{attempt}"
                     for attempt, (phase, step, rank) in enumerate(PHASES))
    run = launch(tiny_yaml, tmp_path / "ckpt",
                 [*LAYOUT_2, *STEPS, "--ckpt-every", "2", "--resume"],
                 restarts=len(PHASES), fault=fault, timeout=240)
    assert run.rc == 0, run.explain()
    problems = []
    for attempt, (phase, step, _) in enumerate(PHASES):
        resumed = run.of("resume", attempt=attempt + 1)
        if not resumed:
            problems.append(f"{phase}: no resume after the kill")
            continue
        line = resumed[0]["line"]
        if phase == "committed":  # the manifest was renamed: that checkpoint is complete
            want, skipped = step, None
        else:
            want, skipped = step - 2, f"step-{step:06d}: no manifest"
        print(f"killed at save:{phase} of step {step}: {line}")
        if resumed[0]["step"] != want:
            problems.append(f"{phase}: resumed from {resumed[0]['step']}, expected {want}")
        cleaned = run.of("save_failed", step=step)  # a surviving rank 0 dropped the folder
        if skipped and skipped not in line and not cleaned:
            problems.append(f"{phase}: the resume line does not report {skipped!r}: {line}")
    assert not problems, "\n".join(problems) + "\n" + run.explain()
    assert run.digest(12, "end") == reference.digest(12), "final state differs from the reference"


@pytest.mark.slow
def test_hung_rank_fails_the_step_within_the_collective_timeout_then_restarts(
        reference, tiny_yaml, tmp_path):
    timeout_s, slack_s = 5.0, 10.0  # slack: the exception's way out (teardown, traceback)
    run = launch(tiny_yaml, tmp_path / "ckpt",
                 [*LAYOUT_2, *STEPS, "--ckpt-every", "3", "--resume",
                  "--collective-timeout-s", str(timeout_s)],
                 restarts=1, fault="hang@step:8:rank:1")
    assert run.rc == 0, run.explain()
    hang = run.of("fault", action="hang")
    crashes = [c for c in run.of("crash", attempt=0) if c["rank"] == 0]
    assert hang and crashes, "no hang, or rank 0 did not fail\n" + run.explain()
    assert "Timed out" in crashes[0]["error"], crashes[0]
    ended_after = crashes[0]["t"] - hang[0]["t"]
    resumed = run.of("resume", attempt=1)
    assert resumed and resumed[0]["step"] == 6, run.explain()
    restart_s = resumed[0]["t"] - hang[0]["t"]
    print(f"hung rank: step failed {ended_after:.1f} s after the hang (timeout {timeout_s} s), "
          f"resumed {restart_s:.1f} s after it")
    assert timeout_s - 0.5 <= ended_after <= timeout_s + slack_s
    assert run.digest(12, "end") == reference.digest(12), "final state differs from the reference"
