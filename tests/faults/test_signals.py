"""Preemption: SIGUSR1 (Slurm's `--signal=USR1@T` warning) and SIGTERM (the kill itself).

SIGUSR1 goes to one rank; the ranks agree on it at the next step boundary,
take an emergency checkpoint and train on. SIGTERM goes to the torchrun
agent, as a scheduler sends it; the agent forwards it to every worker and
waits GRACE_S (30 s, torchrun's `close` timeout; Slurm's KillWait default is
also 30 s) before SIGKILL. The workers finish the step they are in, commit
an emergency checkpoint, and exit 143. The requeued job resumes from it
without losing a step, and ends identical to the uninterrupted run.
"""

from __future__ import annotations

import pytest

from faults.harness import LAYOUT_2, launch
from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt.store import GRACE_S


@pytest.mark.slow
def test_sigusr1_and_sigterm_take_emergency_checkpoints_within_the_grace_window(
        reference, tiny_yaml, tmp_path):
    root = tmp_path / "ckpt"
    args = [*LAYOUT_2, "--steps", "12", "--ckpt-every", "5", "--ckpt-keep", "3", "--resume"]
    first = launch(tiny_yaml, root, args, fault="usr1@step:4:rank:1;term@step:8:rank:0",
                   digest="8")
    assert first.rc != 0, "the job was preempted; torchrun should not report success"
    signals = {e["action"]: e for e in first.of("fault")}
    emergency = {e["signal"]: e for e in first.of("emergency")}
    assert set(emergency) == {"SIGUSR1", "SIGTERM"}, first.explain()
    for name, action, step in (("SIGUSR1", "usr1", 4), ("SIGTERM", "term", 8)):
        saved = first.of("saved", step=step, reason=name)
        assert emergency[name]["ok"] and emergency[name]["step"] == step and saved, first.explain()
        took = saved[0]["t"] - signals[action]["t"]
        print(f"{name} at step {step}: checkpoint committed {took:.2f} s after the signal "
              f"(grace {GRACE_S:.0f} s)")
        assert took < GRACE_S
        assert mf.verify(root / mf.step_name(step))[0] is not None
    assert first.digest(8) == reference.digest(8), "the signals disturbed training"
    assert not first.of("saved", step=9), "training went on after SIGTERM"

    second = launch(tiny_yaml, root, args)  # the requeued job
    assert second.rc == 0, second.explain()
    assert [e["step"] for e in second.of("resume", attempt=0)][-1] == 8  # nothing lost
    assert second.digest(12, "end") == reference.digest(12), "final state differs"
