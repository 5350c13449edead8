"""A short soak: random SIGKILLs at a set MTBF; measured effective training time beside the model.

Each torchrun attempt draws its kill from the seed: an exponential delay
(mean MTBF, counted from the attempt's first step) and a victim rank; at
most MAX_KILLS attempts are killed, so the test is bounded (about 40 s).
Steps are slowed to SLEEP_S so that a checkpoint interval is a few seconds
of wall time, as on a real job, rather than milliseconds.

The guarantees: every failure loses at most interval + persist (two
intervals, with asynchronous saves), and the run, killed three times, still
ends bit for bit where the uninterrupted one does. Printed: the measured
effective training time ratio (useful step time over wall time from the
first step), the same from the event log's accounting (1 - lost / total),
and the planner's first-order prediction for the measured interval, stall,
persist and restart times (`trainplan.resilience.checkpoint.ettr`).
"""

from __future__ import annotations

import statistics

import pytest

from faults.harness import LAYOUT_2, REF_STEPS, launch

MTBF_S, SEED, MAX_KILLS = 6.0, 9, 3  # seed 9: kills after 4.0 s, 4.2 s and 2.8 s
SLEEP_S = 0.3
EVERY = 4


def predicted_ettr(interval, stall, persist, restart, mtbf) -> float:
    """The planner's model; the same first-order formula if the planner is not importable."""
    try:
        from trainplan.resilience.checkpoint import ettr
    except ImportError:
        def ettr(interval, stall, persist, restart, mtbf):
            return (1 - stall / interval) * (1 - (interval / 2 + persist + restart)
                                             / (mtbf + restart))
    return ettr(interval, stall, persist, restart, mtbf)


@pytest.mark.slow
def test_soak_random_kills_end_identical_and_report_effective_training_time(
        reference, tiny_yaml, tmp_path):
    fault = (f"kill@random:mtbf:{MTBF_S}:seed:{SEED}:max:{MAX_KILLS};"
             f"sleep@step:*:s:{SLEEP_S}:restart:*")
    run = launch(tiny_yaml, tmp_path / "ckpt",
                 [*LAYOUT_2, "--steps", str(REF_STEPS), "--ckpt-every", str(EVERY),
                  "--ckpt-async", "--resume"], restarts=MAX_KILLS, fault=fault, timeout=240)
    assert run.rc == 0, run.explain()
    kills = run.of("fault", action="kill")
    assert 1 <= len(kills) <= MAX_KILLS, run.explain()
    assert run.digest(REF_STEPS, "end") == reference.digest(REF_STEPS), "final state differs"

    # a kill in the final save leaves the last attempt no step to time: use the reference's
    step_s = SLEEP_S + (run.summary["step_time_s"] or reference.summary["step_time_s"])
    lost_steps, restarts = [], []
    for kill in kills:
        resumed = run.of("resume", attempt=kill["attempt"] + 1)
        assert resumed, run.explain()
        lost_steps.append(kill["step"] - 1 - resumed[0]["step"])
        restarts.append(resumed[0]["t"] - kill["t"])
    assert all(0 <= n <= 2 * EVERY for n in lost_steps), (lost_steps, run.explain())

    first_step = run.of("resume", attempt=0)[0]["t"]
    total = run.events[-1]["t"] - first_step
    useful = REF_STEPS * step_s
    saves = run.of("saved")
    stall = statistics.mean(s["stall_s"] for s in saves)
    persist = statistics.mean(s["persist_s"] for s in saves)
    lost = sum(restarts) + sum(lost_steps) * step_s + len(saves) * stall
    measured, accounted = useful / total, 1 - lost / total
    model = predicted_ettr(EVERY * step_s, stall, persist, statistics.mean(restarts), MTBF_S)
    print(f"soak: {len(kills)} kills in {total:.1f} s (MTBF {MTBF_S} s), lost steps {lost_steps}, "
          f"restart {statistics.mean(restarts):.1f} s, interval {EVERY * step_s:.2f} s, "
          f"stall {stall * 1e3:.0f} ms, persist {persist * 1e3:.0f} ms")
    print(f"soak ETTR: measured {measured:.2f}, accounted 1 - lost/total {accounted:.2f}, "
          f"planner model {model:.2f}")
    assert 0 < measured <= 1
    assert abs(measured - accounted) < 0.2, "the event log does not account for the wall time"
