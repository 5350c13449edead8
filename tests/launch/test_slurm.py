"""The generated Slurm batch script, run by a real one-host Slurm cluster that the test starts.

munged, slurmctld and slurmd (Debian's slurm-wlm; `make system-deps` installs
them) run on localhost from a temporary folder (`slurm_cluster.py`); the
script `trainplan launch --target slurm --cpu` writes for the tiny proxy
(one node, one torchrun agent, two gloo ranks) is submitted with `sbatch`:
 1. it runs to completion;
 2. a running job gets Slurm's time-limit warning (USR1 to the batch shell,
    as `--signal=B:USR1@T` sends it): the workers write an emergency
    checkpoint, the job requeues itself and resumes from it;
 3. a running job is requeued by an operator (`scontrol requeue`, SIGTERM to
    the steps): the same checkpoint, requeue and resume.
The three jobs run side by side (`jobs`: the node offers a slot to each; they
mostly sleep, and a requeued job waits out Slurm's requeue delay), once per
test session; each test checks its own.
Slurm missing is a failure, not a skip: `make test` installs it first.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from filelock import FileLock
from tests.launch.helpers import TINY_LAYOUT, launch_json, run_env, summaries, tiny_yaml
from tests.launch.slurm_cluster import SlurmCluster, free_port, missing_tools

STEPS = 30
TIMEOUT = 180
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
SLOW_STEPS = "sleep@step:*:s:0.2:restart:*"  # steps long enough to interrupt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_tools()
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): run "
                    "`make system-deps` (apt-get install slurm-wlm munge)")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=2 * len(INTERRUPTS))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _submit(cluster: SlurmCluster, tmp: Path, steps: int, **env) -> tuple[str, dict, Path]:
    """Generate the batch script for the tiny proxy and sbatch it; (job id, summary, folder)."""
    summary = launch_json(["--model", tiny_yaml(tmp), "--gpus", "2", "--gpus-per-node", "2",
                           *TINY_LAYOUT, "--steps", str(steps), "--ckpt-every", "5",
                           "--target", "slurm", "--out", tmp / "artefacts",
                           "--rdzv-port", str(free_port()), "--time-limit-min", "10",
                           "--warn-s", "60", "--save-grace-s", "20",
                           "--join-timeout-s", "60"], tmp)
    work = tmp / "work"
    work.mkdir()
    env = run_env(SLURM_CONF=str(cluster.conf), **env)  # sbatch hands it to the job
    proc = cluster.run("sbatch", "--parsable", str(tmp / "artefacts" / "train.sbatch"),
                       cwd=work, env=env)
    return proc.stdout.strip().split(";")[0], summary, work


def _wait(cluster, jid, cond, what, timeout=TIMEOUT) -> dict:
    end = time.monotonic() + timeout
    job = {}
    while time.monotonic() < end:
        job = cluster.job(jid)
        if cond(job):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {jid}: timed out waiting for {what}; last {job}\n"
                         f"{cluster.logs()}")


def _logs(work: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(work.rglob("*.out")))


def _interrupt_warn(cluster, jid):  # what --signal=B:USR1@T does before the time limit
    cluster.run("scancel", "--batch", "--signal=USR1", jid)


def _interrupt_requeue(cluster, jid):  # an operator's requeue: SIGTERM to the steps
    cluster.run("scontrol", "requeue", jid)


# job: how it is interrupted once its first checkpoint is complete (None: it runs to the end)
INTERRUPTS = {"complete": None, "warned": _interrupt_warn, "requeued": _interrupt_requeue}


def _run_jobs(cluster: SlurmCluster, root: Path) -> dict[str, dict]:
    """Submit the three jobs at once, interrupt each as soon as it has a complete checkpoint,
    wait for all to end: {job: {"jid", "summary", "work", "state", "logs"} or {"skip"}}."""
    started, out = {}, {}
    for name, interrupt in INTERRUPTS.items():
        (root / name).mkdir(parents=True)
        env = {"TRAINPLAN_FAULT": SLOW_STEPS} if interrupt else {}
        started[name] = _submit(cluster, root / name, STEPS, **env)
    waiting = {}  # the jobs still to interrupt: (job id, its checkpoint folder)
    for name, (jid, summary, work) in started.items():
        if INTERRUPTS[name] and not summary["checkpointing"]:
            cluster.run("scancel", jid)
            out[name] = {"skip": "waiting on checkpointing: the harness has no "
                                 "--ckpt-dir/--resume yet"}
        elif INTERRUPTS[name]:
            waiting[name] = (jid, work / "checkpoints" / summary["job_name"])
    end = time.monotonic() + TIMEOUT
    while waiting and time.monotonic() < end:
        for name, (jid, ckpt) in list(waiting.items()):
            if cluster.job(jid)["JobState"] == "RUNNING" and any(
                    ckpt.glob("step-*/manifest.json")):
                INTERRUPTS[name](cluster, jid)
                del waiting[name]
        time.sleep(0.5)
    if waiting:
        raise AssertionError(f"jobs {sorted(waiting)}: timed out waiting for a first complete "
                             f"checkpoint\n{cluster.logs()}")
    for name, (jid, summary, work) in started.items():
        if name in out:
            continue
        restarts = "1" if INTERRUPTS[name] else None  # an interrupted job ends requeued once
        job = _wait(cluster, jid, lambda j, r=restarts: j["JobState"] in DONE and (
            r is None or j.get("Restarts") == r), f"the {name} job to end")
        out[name] = {"jid": jid, "summary": summary, "work": str(work), "logs": _logs(work),
                     "state": (job["JobState"], job["ExitCode"])}
    return out


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict[str, dict]:
    """`_run_jobs` once per test session, whichever xdist worker asks first (a file lock)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's
    done = shared / "slurm-jobs.json"
    with FileLock(str(shared / "slurm-jobs.lock")):
        if not done.is_file():
            cluster = request.getfixturevalue("cluster")
            done.write_text(json.dumps(_run_jobs(cluster, shared / "slurm-jobs")))
    return json.loads(done.read_text())


@pytest.mark.slow
def test_sbatch_runs_the_generated_script_to_completion(jobs):
    got = jobs["complete"]
    jid, work, logs = got["jid"], Path(got["work"]), got["logs"]
    assert got["state"] == ["COMPLETED", "0:0"], logs[-4000:]
    name = got["summary"]["job_name"]
    assert (work / f"{name}-{jid}.out").exists(), "the batch script's log"
    assert len(list((work / "logs").glob(f"{name}-{jid}-*.out"))) == 1, "one log per node"
    (run,) = summaries(logs)
    assert run["ranks"] == 2 and len(run["losses"]) == STEPS


def _interrupted_and_resumed(got: dict) -> tuple[list[dict], str]:
    if "skip" in got:
        pytest.skip(got["skip"])
    logs = got["logs"]
    assert got["state"] == ["COMPLETED", "0:0"], logs[-4000:]
    return summaries(logs), logs


def _check_resumed(runs: list[dict], logs: str) -> None:
    """The first attempt stopped after an emergency checkpoint; the second began after it."""
    assert len(runs) == 2, logs[-4000:]
    first, last = runs
    assert first["preempted"] and first["checkpoint"]["emergency"], logs[-4000:]
    assert last["checkpoint"]["resumed_from"] and not last["preempted"]
    assert last["first_step"] == first["checkpoint"]["last_committed"] + 1
    assert last["first_step"] - 1 + len(last["losses"]) == STEPS


@pytest.mark.slow
def test_time_limit_warning_checkpoints_requeues_and_resumes(jobs):
    runs, logs = _interrupted_and_resumed(jobs["warned"])
    assert "USR1: time limit near" in logs and "requeueing job" in logs
    _check_resumed(runs, logs)


@pytest.mark.slow
def test_operator_requeue_checkpoints_and_resumes(jobs):
    runs, logs = _interrupted_and_resumed(jobs["requeued"])
    _check_resumed(runs, logs)
