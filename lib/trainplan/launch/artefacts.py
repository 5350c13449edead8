"""Launch artefacts from a plan: a torchrun script, a Slurm batch script, a Kubernetes manifest.

`trainplan launch` takes the planner's best layout (or a pinned one) and
writes what a team runs on its cluster, plus a README of how to start,
watch and stop it. The training command in all three is the proxy harness,
`python -m trainplan.bench.harness.train` with the layout's flags, so what the tests
run here on CPU (two torchrun agents, a one-host Slurm cluster) is the same
script the cluster gets, with other numbers.

The harness command is checked by the harness's own parser and argument
checks before anything is written; flags the harness does not have yet
(checkpointing, the collective timeout) are left out and the README says so,
rather than writing a script that fails at its first line.

The artefacts hold no absolute paths of this machine: checkpoints and logs
go under the submit or working folder unless CKPT_DIR or LOG_DIR say
otherwise, and the rendezvous host comes from the scheduler or RDZV_HOST.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.launch.render import readme, render_k8s, render_shell

TARGETS = ("torchrun", "slurm", "k8s")
FILES = {"torchrun": "torchrun.sh", "slurm": "train.sbatch", "k8s": "pytorchjob.yaml"}

# Environment of every rank. Why each: NVLink SHARP multicast (NVLS) is off because not
# every host (or container) can create multicast objects, and NCCL runs its ring and tree
# algorithms without it; the TORCH_NCCL settings make a stuck collective end the job with a
# flight-recorder dump instead of hanging forever.
BASE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # on a collective timeout: tear the process down
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # write the flight recorder's trace of the hang
    "TORCH_FR_BUFFER_SIZE": "2000",  # last collectives the flight recorder keeps
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",  # the watchdog thread itself stuck
    "OMP_NUM_THREADS": "1",  # torchrun's default too, but said out loud
    "PYTHONUNBUFFERED": "1",  # log lines reach the per-node log as they happen
    # restarted workers must not reuse the agent's store, or they reach the dead rank's keys
    # and fail to form a new process group (pytorch/pytorch#135712; tests/faults/README.md)
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}
CHECKPOINT_FLAGS = ("--ckpt-dir", "--ckpt-every", "--ckpt-keep", "--ckpt-async", "--resume")
TIMEOUT_FLAG = "--collective-timeout-s"
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class LaunchError(TrainplanError):
    """A launch request that cannot be turned into artefacts (target, folder, layout)."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the artefacts need beyond the layout: run length, restarts, timeouts, env."""

    target: str  # torchrun | slurm | k8s
    steps: int = 1000  # optimizer steps of the run
    warmup: int = 5  # first steps the harness does not time
    ckpt_every: int = 0  # steps between checkpoints; 0: every ckpt_interval_min of steps
    ckpt_interval_min: float = 30.0  # at most this much work lost to a failure (page 5)
    ckpt_keep: int = 3  # checkpoints kept (an older one survives a torn newest one)
    max_restarts: int = 3  # torchrun restarts of all workers after a failure
    collective_timeout_s: int = 1800  # a collective waiting this long is a hang
    join_timeout_s: int = 900  # agents wait this long for every node at a rendezvous
    time_limit_min: int = 24 * 60  # Slurm --time
    warn_s: int = 600  # Slurm warns this long before the time limit (--signal)
    save_grace_s: int = 300  # workers' time to write the emergency checkpoint and stop
    rdzv_port: int = 29500
    cpu: bool = False  # CPU processes with gloo (the tests' proxy), no GPUs requested
    synthetic: bool = False  # synthetic tokens instead of the data pipeline
    compile: bool = True  # torch.compile the blocks (GPU only)
    image: str = "trainplan:0.1.0"  # container image with torch and trainplan (k8s)
    job_name: str = ""  # default: model-GPUsxGPU
    env: dict = field(default_factory=dict)  # extra NAME=VALUE, e.g. the knob study's NCCL

    def __post_init__(self):
        if self.target not in TARGETS:
            raise LaunchError(f"--target {self.target!r} is not valid; use one of "
                              f"{list(TARGETS)}")
        if self.warmup >= self.steps:
            raise LaunchError(f"--warmup {self.warmup} must be < --steps {self.steps}")
        if self.warn_s <= self.save_grace_s:
            raise LaunchError(f"--warn-s {self.warn_s} must exceed --save-grace-s "
                              f"{self.save_grace_s}: the save must end before the limit")
        if self.warn_s >= self.time_limit_min * 60:
            raise LaunchError(f"--warn-s {self.warn_s} must be shorter than --time-limit-min "
                              f"{self.time_limit_min} (in seconds)")
        if not 1024 <= self.rdzv_port <= 65535:
            raise LaunchError(f"--rdzv-port {self.rdzv_port} is not valid; use 1024-65535")
        for name, value in self.env.items():
            if not ENV_NAME.match(name) or "\n" in value:
                raise LaunchError(f"--env {name}={value!r} is not valid; use NAME=VALUE with "
                                  "NAME in capitals, digits and _")


@dataclass
class Launch:
    """The generated artefacts (file name -> text) and the numbers they were built from."""

    files: dict[str, str]
    summary: dict


# ---------------------------------------------------------------- the pieces


def job_name(model: str, gpus: int, gpu: str) -> str:
    """A name that Slurm, torchrun and Kubernetes (DNS-1123, 63 characters) all accept."""
    text = re.sub(r"[^a-z0-9-]+", "-", f"{model}-{gpus}x{gpu}".lower()).strip("-")
    return text[:63].rstrip("-") or "trainplan"


def mesh(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node): whole nodes, or one partial node."""
    if gpus <= gpus_per_node:
        return 1, gpus
    return gpus // gpus_per_node, gpus_per_node


def checkpoint_every(s: LaunchSettings, step_time_s: float) -> int:
    """Steps between checkpoints: given, or as many steps as fit in ckpt_interval_min."""
    if s.ckpt_every:
        return s.ckpt_every
    return max(1, math.floor(s.ckpt_interval_min * 60 / step_time_s))


def harness_args(par: dict, model: str, seq_len: int, s: LaunchSettings) -> list[str]:
    """The harness flags of one layout and run, without checkpoint flags."""
    if par["cp"] > 1 or par["ep"] > 1:
        raise LaunchError(f"the layout has cp={par['cp']}, ep={par['ep']}: the harness "
                          "implements neither yet; pin --cp 1 --ep 1")
    args = ["--model", model, "--seq-len", str(seq_len), "--dp", str(par["dp"]),
            "--tp", str(par["tp"]), "--pp", str(par["pp"]), "--zero", str(par["zero"])]
    if par["zero"] and par["dp_shard"] != par["dp"]:
        args += ["--dp-shard", str(par["dp_shard"])]
    args += ["--micro-batch", str(par["micro_batch"]), "--grad-accum", str(par["grad_accum"]),
             "--recompute", par["recompute"]]
    if par["pp"] > 1:
        args += ["--pp-schedule", par["pp_schedule"], "--pp-virtual", str(par["pp_virtual"])]
    if par["tp"] > 1 and not par["sequence_parallel"]:
        args.append("--no-sequence-parallel")
    args += ["--steps", str(s.steps), "--warmup", str(s.warmup), "--no-progress"]
    if s.cpu:
        args.append("--cpu")
    elif s.compile:
        args.append("--compile")
    if s.synthetic:
        args.append("--synthetic")
    return args


def harness_accepts(args: list[str]) -> bool:
    """Whether the harness's parser knows these flags (imports torch: slow once)."""
    from trainplan.bench.harness import train  # torch: not loaded at import

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            train.parse_args(args)
        except SystemExit:
            return False
    return True


def check_harness(args: list[str]) -> None:
    """Refuse a command the harness would refuse at its first line, with its own reason."""
    from trainplan.bench.harness import train  # torch: not loaded at import

    if not harness_accepts(args):
        raise LaunchError(f"the harness refuses {' '.join(args)!r}; see "
                          "`python -m trainplan.bench.harness.train --help`")
    try:
        train.check_args(train.parse_args(args))
    except TrainplanError as err:
        raise LaunchError(f"the harness refuses this run: {err}") from None


def optional_args(base: list[str], s: LaunchSettings, every: int,
                  ckpt_dir: str) -> tuple[list[str], dict]:
    """Checkpoint and timeout flags, each kept only if the harness has it."""
    ckpt = ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(every), "--ckpt-keep",
            str(s.ckpt_keep), "--ckpt-async", "--resume"]
    timeout = [TIMEOUT_FLAG, str(s.collective_timeout_s)]
    has = {"checkpointing": harness_accepts(base + ckpt),
           "collective_timeout": harness_accepts(base + timeout)}
    extra = (ckpt if has["checkpointing"] else []) + (timeout if has["collective_timeout"]
                                                        else [])
    check_harness(base + extra)
    return extra, has


def environment(s: LaunchSettings) -> dict[str, str]:
    """BASE_ENV, then the user's --env settings (which win)."""
    return {**BASE_ENV, **s.env}


def generate(plan_out: dict, *, model_arg: str, gpus_per_node: int, settings: LaunchSettings,
             gpu_memory_gib: float, title: str = "") -> Launch:
    """The artefacts for the first plan of a `trainplan.plan.planner.plan` answer."""
    p = plan_out["plans"][0]
    if not p["fits"]:
        raise LaunchError(f"the layout {p['strategy']} needs {p['memory_gib']['total']:.1f} GiB "
                          f"per GPU, more than the {gpu_memory_gib:g} GiB card; unpin it or "
                          "choose one that fits (`trainplan plan`)")
    gpus = plan_out["gpus"]
    nnodes, nproc = mesh(gpus, gpus_per_node)
    name = settings.job_name or job_name(plan_out["model"], gpus, plan_out["gpu"])
    if not re.match(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", name):
        raise LaunchError(f"--job-name {name!r} is not valid; use lowercase letters, digits "
                          "and '-', at most 63, starting and ending with a letter or digit")
    args = harness_args(p["parallel"], model_arg, plan_out["seq_len"], settings)
    args += monitor_args(p)
    check_harness(args)
    every = checkpoint_every(settings, p["step_time_s"])
    extra, has = optional_args(args, settings, every, "CKPT")
    ctx = {
        "settings": settings, "plan": p, "gpus": gpus, "nnodes": nnodes, "nproc": nproc,
        "name": name, "args": args, "env": environment(settings), "has": has,
        "ckpt_every": every,
        "title": title or f"{plan_out['model']} on {gpus} x {plan_out['gpu']}",
        "extra": lambda ckpt_dir: [ckpt_dir if a == "CKPT" else a for a in extra],
    }

    body = (render_k8s(ctx) if settings.target == "k8s"
            else render_shell(FILES[settings.target], ctx))
    files = {FILES[settings.target]: body, "README.md": readme(ctx)}
    summary = {"target": settings.target, "job_name": name, "nodes": nnodes,
               "procs_per_node": nproc, "files": sorted(files), "harness_args": args,
               "checkpoint_every": every if has["checkpointing"] else None, **has,
               "env": ctx["env"], "plan": p}
    return Launch(files=files, summary=summary)


def plan_and_generate(m, gpu, cluster, *, gpus: int, seq_len: int, global_batch_tokens: int,
                      settings: LaunchSettings, model_arg: str, pins: dict | None = None,
                      gpus_per_node: int | None = None, title: str = "") -> Launch:
    """Plan (the best layout, or the pinned one) and generate: `trainplan launch` and page 6.

    Context and expert parallel are pinned to 1 unless asked for: the harness
    runs neither yet, so the best plan it can run is the one to launch.
    """
    from trainplan.plan.planner import plan  # pandas: not loaded at import

    gpn = gpus_per_node or cluster.gpus_per_node
    planned = plan(m, gpu, cluster, gpus=gpus, seq_len=seq_len,
                   global_batch_tokens=global_batch_tokens, pins={"cp": 1, "ep": 1,
                                                                  **(pins or {})},
                   top=1, gpus_per_node=gpn)
    return generate(planned, model_arg=model_arg, gpus_per_node=gpn, settings=settings,
                    gpu_memory_gib=gpu.memory_gib, title=title)


def steps_for(token_budget: float, tokens_per_step: int) -> int:
    """Optimizer steps that train on the whole token budget (the last step may run over)."""
    return max(1, math.ceil(token_budget / tokens_per_step))


ALERT_FRACTION = 0.8  # tokens/s below this share of the plan, sustained: page someone
STRAGGLER_RATIO = 1.15  # a rank whose step time is this much above the median is a straggler
METRICS_PATH = "logs/metrics.jsonl"  # per-step metrics and alerts, written by rank 0


def monitor_args(p: dict, path: str = METRICS_PATH) -> list[str]:
    """Harness flags that make the run watch itself against this plan (bench/monitor.py).

    The alert line and straggler tolerance are the ones `watch` gives the
    operator, so the metrics file and the runbook's table agree.
    """
    from trainplan.bench.harness.monitor import launch_flags  # torch: not loaded at import

    return launch_flags({"step_time_s": p["step_time_s"],
                         "straggler_step_time_s": STRAGGLER_RATIO * p["step_time_s"],
                         "alert_tokens_per_s_per_gpu": ALERT_FRACTION * p["tokens_per_s_per_gpu"]},
                        path)


def watch(summary: dict, settings: LaunchSettings) -> dict:
    """The numbers an operator watches, from the plan: healthy values and alert lines."""
    p = summary["plan"]
    every = summary["checkpoint_every"] or 0
    return {
        "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"],
        "tokens_per_s": p["tokens_per_s"],
        "step_time_s": p["step_time_s"],
        "mfu": p["mfu"],
        "memory_gib": p["memory_gib"]["total"],
        "alert_tokens_per_s_per_gpu": ALERT_FRACTION * p["tokens_per_s_per_gpu"],
        "straggler_step_time_s": STRAGGLER_RATIO * p["step_time_s"],
        "checkpoint_every_steps": every,
        "checkpoint_every_min": every * p["step_time_s"] / 60,
        "collective_timeout_min": settings.collective_timeout_s / 60,
        "max_restarts": settings.max_restarts,
        "warn_min": settings.warn_s / 60,
        "save_grace_s": settings.save_grace_s,
    }


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse a folder that would lose files, before anything is computed or written."""
    if out.exists() and not out.is_dir():
        raise LaunchError(f"--out {str(out)!r} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise LaunchError(f"--out {str(out)!r} exists and is not empty; add --force to "
                          "replace it, or name a new folder")


def write(launch: Launch, out: Path, force: bool = False) -> Path:
    """Write the files into `out` all at once: a temporary folder beside it, then a rename."""
    out = Path(out)
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for fname, text in launch.files.items():
            path = tmp / fname
            path.write_text(text)
            if fname.endswith((".sh", ".sbatch")):
                path.chmod(0o755)
        tmp.chmod(0o755)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.rename(out, old / "d")
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
