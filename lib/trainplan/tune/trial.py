"""One trial launch of the knob study: the harness under torchrun, watched, measured, recorded.

`trainplan.tune.study` decides what to run; this module runs it: builds the
`torchrun ... -m trainplan.bench.harness.train` command and environment of a config
(`trainplan.tune.knobs`), waits for it while reporting its spend every
`HEARTBEAT_S` seconds (so the budget stays enforced, and a killed study has
its spend on record), stops it when told, and pools launches into one
figure with its interval.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.proctree import failure_reason, stop_tree
from trainplan.records.provenance import nvidia_smi
from trainplan.records.stats import rate_ci
from trainplan.tune import knobs

HEARTBEAT_S = 2.0  # seconds between spend updates: what a killed study can leave uncounted


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the study process dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _torchrun(suite: dict) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={suite['gpus']}"]


def train_args(suite: dict, cfg: dict, cpu: bool) -> list[str]:
    """The `trainplan.bench.harness.train` arguments of one config of the suite."""
    lay = suite["layout"]
    args = ["--model", suite["model"], "--seq-len", str(suite["seq_len"]),
            "--steps", str(suite["warmup"] + knobs.windows(cfg, suite)),
            "--warmup", str(suite["warmup"]), "--json", "--no-progress"]
    for k in ("dp", "tp", "pp"):
        args += [f"--{k}", str(lay.get(k, 1))]
    if suite.get("data", "stdlib") != "stdlib":
        args += ["--data", suite["data"]]
    args += knobs.harness_args(cfg) + [str(a) for a in suite["extra_args"]]
    return args + (["--cpu"] if cpu else [])


def launch_command(suite: dict, cfg: dict, cpu: bool) -> list[str]:
    """torchrun of the harness for one config: one launch, one run."""
    return [*_torchrun(suite), "-m", "trainplan.bench.harness.train",
            *train_args(suite, cfg, cpu)]


def sweep_command(suite: dict, runs_file: Path) -> list[str]:
    """torchrun of a sweep (`trainplan.bench.series.sweep`): the runs listed in `runs_file`
    (JSON, [{"tag", "args"}]) one after another in one launch."""
    return [*_torchrun(suite), "-m", "trainplan.bench.series.sweep", str(runs_file)]


def launch_env(cfg: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lib = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (lib, env.get("PYTHONPATH")) if p)
    for name, value in knobs.env(cfg).items():
        if value is None:
            env.pop(name, None)  # "default": NCCL chooses; an inherited value must not leak in
        else:
            env[name] = value
    return env


def _watch(cmd, env, tick, deadline_s: float) -> tuple[list[dict], str, float]:
    """Run `cmd`, calling `tick(elapsed)` every HEARTBEAT_S seconds (a reason to stop, or
    None); (the JSON lines it printed, even when stopped, error text or "", wall seconds)."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True,
                                preexec_fn=_die_with_parent, start_new_session=True)
        stop = None
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                stop = tick(elapsed) or ("timeout" if elapsed > deadline_s else None)
                if stop:
                    stop_tree(proc)  # torchrun, and its workers in their own sessions
                    break
        seconds = time.monotonic() - start
        out.seek(0), err.seek(0)
        lines = []
        for ln in out.read().splitlines():
            if ln.startswith("{"):
                with contextlib.suppress(ValueError):  # a line cut by the stop
                    lines.append(json.loads(ln))
        if stop:
            return lines, f"stopped: {stop}", seconds
        if proc.returncode or not lines:
            return lines, failure_reason(proc.returncode, err.read()), seconds
        return lines, "", seconds


def run_launch(cmd, env, *, tick, deadline_s: float) -> tuple[dict | None, str, float]:
    """Run one harness launch; (summary or None, error text, wall seconds).

    `tick(elapsed)` is called every HEARTBEAT_S seconds and returns a reason
    to stop ("budget", "time") or None; the launch is then terminated.
    """
    lines, error, seconds = _watch(cmd, env, tick, deadline_s)
    return (None if error else lines[-1]), error, seconds


def run_sweep(cmd, env, *, tick, deadline_s: float) -> tuple[list[dict], str, float]:
    """Run one sweep launch (`sweep_command`); (rank 0's line of every run that finished,
    also when the launch was stopped or crashed, error text or "", wall seconds). A line is
    {"tag", "position", "summary" or "error", "elapsed_s"}."""
    lines, error, seconds = _watch(cmd, env, tick, deadline_s)
    return [ln for ln in lines if "tag" in ln], error, seconds


def stop_reason(error: str) -> str:
    """Why `tick` or the deadline stopped a launch ("budget", "time", "timeout"), else ""."""
    return error.split(": ", 1)[1] if error.startswith("stopped: ") else ""


def sweep_launch(suite: dict, entries: list[dict], env: dict, *, tick
                 ) -> tuple[dict[str, dict], float, str, float]:
    """Run `entries` ([{"tag", "args"[, "env"]}]) in one sweep launch (`run_sweep`, its
    deadline `launch_timeout_s` per two runs); ({tag: rank 0's line}, the launch's start in
    GPU-seconds: its wall time less its runs', times its GPUs; error text or ""; seconds)."""
    with tempfile.TemporaryDirectory(prefix="tune-sweep-") as tmp:
        runs_file = Path(tmp) / "runs.json"
        runs_file.write_text(json.dumps(entries))
        lines, error, seconds = run_sweep(
            sweep_command(suite, runs_file), env, tick=tick,
            deadline_s=suite["launch_timeout_s"] * max(1.0, len(entries) / 2))
    ran = sum(float(ln.get("elapsed_s", 0.0)) for ln in lines)
    return ({ln["tag"]: ln for ln in lines}, max(0.0, seconds - ran) * suite["gpus"], error,
            seconds)


def pooled(summaries: list[dict]) -> dict:
    """Tokens/s/GPU over every kept step of every launch, with its bootstrap 95% interval.
    Only tokens that train count (each step's `trained_share`, 1 but where instruction
    labels are masked), so packed and padded rows compare by the work they do."""
    amounts, times = [], []
    for s in summaries:
        per_gpu = s["tokens_per_step"] / s["ranks"]
        shares = s.get("trained_share") or [1.0] * len(s["step_times_s"])
        amounts += [per_gpu * share for share in shares]
        times += s["step_times_s"]
    rate = rate_ci(amounts, times)
    return {"tokens_per_s_per_gpu": rate.estimate, "ci": rate.as_list(), "ci_enough": rate.enough,
            "windows": len(times), "launch_rates": [s["tokens_per_s_per_gpu"] for s in summaries],
            "mfu": summaries[-1].get("mfu"),
            "peak_mem_reserved_gib": max((s.get("peak_mem_reserved_gib") or 0.0)
                                         for s in summaries)}


def card_name(cpu: bool) -> str:
    """The GPU's name from nvidia-smi, or "cpu"; torch is not imported here, so the study
    process holds no CUDA context on a card its launches measure."""
    if cpu:
        return "cpu"

    names = nvidia_smi()[0]
    if not names:
        raise TrainplanError("no GPU found (nvidia-smi lists none); pass --cpu for the CPU proxy")
    return names[0]


def device_groups(workers: int, gpus: int, cpu: bool) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of `workers` concurrent launches, `gpus` devices each,
    disjoint; [None] * workers on CPU. Too few devices raises one line."""
    if cpu:
        return [None] * workers
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(len(nvidia_smi()[0]))]
    if workers * gpus > len(ids):
        raise TrainplanError(f"--workers {workers}: {workers} x {gpus} GPUs needed, this machine "
                             f"shows {len(ids)}; use --workers {max(1, len(ids) // gpus)}")
    return [",".join(ids[w * gpus:(w + 1) * gpus]) for w in range(workers)]


def gpu_for(card: str, suite: dict):
    """The card's preset with its committed calibration applied where one exists (as the
    planner and `validate` use it), else the suite's fallback preset's datasheet figures."""
    from trainplan.calibrate.store import card_preset, load_gpu  # pandas: not loaded at import
    return load_gpu(card_preset(card) or suite["gpu"])
