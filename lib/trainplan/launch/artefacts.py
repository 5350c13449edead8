"""Launch artefacts from a plan: a torchrun script, a Slurm batch script, a Kubernetes manifest.

`trainplan launch` takes the planner's best layout (or a pinned one, or a plan file) and
writes what a team runs on its cluster, plus a README of how to start, watch and stop it.
With `--data` (shards of `trainplan data prepare`) the command is the trainer,
`python -m trainplan.train`, on the team's model and data; without it, the proxy harness
(`trainplan.bench.harness.train`), which measures the plan on the stdlib corpus or
synthetic tokens. Either way what the tests run here on CPU (two torchrun agents, a
one-host Slurm cluster) is the same script the cluster gets, with other numbers.

Every setting comes from the plan (`launch.job`): the layout, micro-batch, gradient
accumulation and recompute from the chosen plan, the run's length from the token budget,
the checkpoint interval and keep count from page 5's checkpoint plan, the throughput
alert from the plan's validated error band. A flag given by hand wins and is said so.
The command is checked by the trainer's (or harness's) own parser before anything is
written; `launch.folder` writes the files into --out.

The artefacts hold no absolute paths of this machine: checkpoints and logs go under the
submit or working folder unless CKPT_DIR or LOG_DIR say otherwise, the data under
DATA_DIR, and the rendezvous host comes from the scheduler or RDZV_HOST.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from dataclasses import dataclass, field

from trainplan.bench.flags import MAX_COLLECTIVE_TIMEOUT_S
from trainplan.errors import TrainplanError
from trainplan.launch.folder import write  # noqa: F401 (re-exported: notebooks/06_launch.ipynb)
from trainplan.launch.inputs import MAX_STEPS, STEPS_WORDS
from trainplan.launch.render import MAX_TIME_LIMIT_MIN, readme, render_k8s, render_shell
from trainplan.loader import QUOTE, quote

TARGETS = ("torchrun", "slurm", "k8s")
FILES = {"torchrun": "torchrun.sh", "slurm": "train.sbatch", "k8s": "pytorchjob.yaml"}

# Environment of every rank. Why each: NVLink SHARP multicast (NVLS) is off because not
# every host (or container) can create multicast objects, and NCCL runs its ring and tree
# algorithms without it; the TORCH_NCCL settings make a stuck collective end the job with a
# flight-recorder dump instead of hanging forever.
BASE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # the allocator `plan` prices
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
DATA, LOGS, CKPT = "DATA", "LOGS", "CKPT"  # placeholders, replaced by the script's variables
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
SAFE_PATH = re.compile(r"[\w./@+-]+")
# A container image reference: [registry[:port]/]name[:tag][@digest], at most 255 characters.
IMAGE = re.compile(r"[a-z0-9][a-z0-9._/-]*(:[0-9]+/[a-z0-9._/-]+)?(:[\w][\w.-]{0,127})?"
                   r"(@[a-z0-9]+:[0-9a-f]{32,})?")
JOB_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # DNS-1123 label (Kubernetes)
WEEK_S = 7 * 24 * 3600
# Ranges of the restart and timing settings (LaunchSettings): (least, most, the most in words).
BOUNDS = {
    "steps": (0, MAX_STEPS, STEPS_WORDS),  # the trainer has no bound; `inputs.MAX_STEPS`
    # 10,000 restarts at page 5's 10-minute restart are 69 days of restarting, not training
    "max_restarts": (0, 10_000, "restarts of all workers"),
    # the launched module's own bound (bench.flags): a collective stuck a week is a hang
    "collective_timeout_s": (1, MAX_COLLECTIVE_TIMEOUT_S, "up to 7 days"),
    # torchrun's default is 600 s; a node a week late to a rendezvous is not coming
    "join_timeout_s": (1, WEEK_S, "up to 7 days"),
    # the emergency save before a stop; one that needs a week is no grace period
    "save_grace_s": (1, WEEK_S, "up to 7 days"),
}


class LaunchError(TrainplanError):
    """A launch request that cannot be turned into artefacts (target, settings, layout)."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the artefacts need beyond the layout: run length, restarts, timeouts, env."""

    target: str  # torchrun | slurm | k8s
    steps: int = 0  # optimizer steps of the run; 0: the scenario's token budget
    warmup: int = 5  # first steps the harness does not time (harness only)
    ckpt_every: int = 0  # steps between checkpoints; 0: page 5's checkpoint plan
    ckpt_keep: int = 0  # checkpoints kept; 0: page 5's checkpoint plan
    data: str = ""  # shards of `trainplan data prepare`: run the trainer on them
    train_args: tuple = ()  # further trainer flags, e.g. ("--lr", "2e-4")
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
    image: str = "trainplan:0.2.0"  # container image with torch and trainplan (k8s)
    job_name: str = ""  # default: model-GPUsxGPU
    env: dict = field(default_factory=dict)  # extra NAME=VALUE, e.g. the knob study's NCCL

    def __post_init__(self):
        if self.target not in TARGETS:
            raise LaunchError(f"--target {quote(self.target)} is not valid; use one of "
                              f"{list(TARGETS)}")
        for name, (least, most, words) in BOUNDS.items():
            if not least <= getattr(self, name) <= most:
                raise LaunchError(f"--{name.replace('_', '-')} {getattr(self, name)} is not "
                                  f"valid; use {least}-{most} ({words})")
        if self.steps and not self.data and self.warmup >= self.steps:  # the harness's
            raise LaunchError(f"--warmup {self.warmup} must be < --steps {self.steps}")
        if self.ckpt_keep == 1:
            raise LaunchError("--ckpt-keep 1 is not valid: keep at least 2, so that one "
                              "complete checkpoint survives while the next is written")
        if not 1 <= self.time_limit_min <= MAX_TIME_LIMIT_MIN:
            raise LaunchError(f"--time-limit-min {self.time_limit_min} is not valid; use "
                              f"1-{MAX_TIME_LIMIT_MIN} (up to 365 days)")
        slurm = self.target == "slurm"  # the one target with a time limit (render.TARGET_FLAGS)
        if slurm and self.warn_s <= self.save_grace_s:
            raise LaunchError(f"--warn-s {self.warn_s} must exceed --save-grace-s "
                              f"{self.save_grace_s}: the save must end before the limit")
        if slurm and self.warn_s >= self.time_limit_min * 60:
            raise LaunchError(f"--warn-s {self.warn_s} must be shorter than --time-limit-min "
                              f"{self.time_limit_min} (in seconds)")
        if not 1024 <= self.rdzv_port <= 65535:
            raise LaunchError(f"--rdzv-port {self.rdzv_port} is not valid; use 1024-65535")
        if len(self.image) > 255 or not IMAGE.fullmatch(self.image):
            raise LaunchError(f"--image {quote(self.image)} is not an image reference; use "
                              "[REGISTRY/]NAME[:TAG][@DIGEST], e.g. trainplan:0.2.0")
        if self.job_name and not JOB_NAME.fullmatch(self.job_name):
            raise LaunchError(f"--job-name {quote(self.job_name)} is not valid; use at most 63 "
                              "lower-case letters, digits and -, starting and ending with a "
                              "letter or digit")
        if self.data and not SAFE_PATH.fullmatch(self.data):
            raise LaunchError(f"--data {quote(self.data)} is not valid here; use a path of "
                              "letters, digits and . _ / @ + - (it is written into the scripts)")
        for name, value in self.env.items():
            if not ENV_NAME.match(name) or "\n" in value:
                raise LaunchError(f"--env {quote(f'{name}={value}')} is not valid; use "
                                  "NAME=VALUE with NAME in capitals, digits and _")


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


def module(s: LaunchSettings) -> str:
    """The Python module torchrun starts: the trainer on the team's data, else the harness."""
    return "trainplan.train" if s.data else "trainplan.bench.harness.train"


def harness_args(par: dict, model: str, seq_len: int, s: LaunchSettings) -> list[str]:
    """The harness flags of one layout and run, without checkpoint flags."""
    if par["ep"] > 1:
        raise LaunchError(f"the layout has ep={par['ep']}: the harness does not implement "
                          "expert parallel yet; pin --ep 1")
    if par["cp"] > 1 and s.cpu:
        raise LaunchError(f"the layout has cp={par['cp']}: context parallel runs on GPUs "
                          "only; pin --cp 1 with --cpu")
    args = ["--model", model, "--seq-len", str(seq_len), "--dp", str(par["dp"]),
            "--tp", str(par["tp"]), "--pp", str(par["pp"]), "--zero", str(par["zero"])]
    if par["zero"] and par["dp_shard"] != par["dp"]:
        args += ["--dp-shard", str(par["dp_shard"])]
    args += ["--micro-batch", str(par["micro_batch"]), "--grad-accum", str(par["grad_accum"]),
             "--recompute", par["recompute"]]
    if par["cp"] > 1:
        args += ["--cp", str(par["cp"])]
    if par["pp"] > 1:
        args += ["--pp-schedule", par["pp_schedule"], "--pp-virtual", str(par["pp_virtual"])]
    if par["tp"] > 1 and not par["sequence_parallel"]:
        args.append("--no-sequence-parallel")
    if s.data:
        args[2:2] = ["--data", DATA]
        args += ["--steps", str(s.steps), "--log-dir", LOGS, *s.train_args]
    else:
        args += ["--steps", str(s.steps), "--warmup", str(s.warmup), "--no-progress"]
    if s.cpu:
        args.append("--cpu")
    elif s.compile:
        args.append("--compile")
    if s.synthetic and not s.data:
        args.append("--synthetic")
    return args


def _parser(trainer: bool):
    """The launched module's own argument parser (imports torch: slow once)."""
    if trainer:
        from trainplan.train import loop  # torch: not loaded at import

        return loop.parse_args, loop.check_args
    from trainplan.bench.harness import train  # torch: not loaded at import

    return train.parse_args, train.check_args


def harness_refusal(args: list[str], trainer: bool = False) -> str | None:
    """The launched module's parser's one-line complaint about `args`; None if it takes them."""
    parse, _ = _parser(trainer)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            parse(args)
        except SystemExit:
            lines = err.getvalue().strip().splitlines() or ["unknown error"]
            return lines[-1].partition("error: ")[2][:2 * QUOTE] or lines[-1][:2 * QUOTE]
    return None


def check_harness(args: list[str], trainer: bool = False) -> None:
    """Refuse a command the launched module would refuse at its first line, with its reason."""
    parse, check = _parser(trainer)
    name = "trainplan.train" if trainer else "trainplan.bench.harness.train"
    why = harness_refusal(args, trainer)
    if why is not None:
        raise LaunchError(f"{name} refuses this run: {why}; see `python -m {name} --help`")
    try:
        check(parse(args))
    except TrainplanError as err:
        raise LaunchError(f"{name} refuses this run: {err}") from None


def optional_args(base: list[str], s: LaunchSettings, every: int, keep: int,
                  ckpt_dir: str) -> tuple[list[str], dict]:
    """Checkpoint and timeout flags, each kept only if the launched module has it."""
    trainer = bool(s.data)
    ckpt = ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(every), "--ckpt-keep", str(keep),
            "--ckpt-async", "--resume"]
    timeout = [TIMEOUT_FLAG, str(s.collective_timeout_s)]
    has = {"checkpointing": harness_refusal(base + ckpt, trainer) is None,
           "collective_timeout": harness_refusal(base + timeout, trainer) is None}
    extra = (ckpt if has["checkpointing"] else []) + (timeout if has["collective_timeout"]
                                                        else [])
    check_harness(base + extra, trainer)
    return extra, has


def environment(s: LaunchSettings) -> dict[str, str]:
    """BASE_ENV, then the user's --env settings (which win)."""
    return {**BASE_ENV, **s.env}


def generate(plan_out: dict, *, model_arg: str, gpus_per_node: int, settings: LaunchSettings,
             gpu_memory_gib: float, schedule, alert: dict, title: str = "") -> Launch:
    """The artefacts for the first plan of a `trainplan.plan.planner.plan` answer, with page
    5's checkpoint `schedule` (`job.schedule`) and the throughput `alert` (`job.alert`)."""
    p = plan_out["plans"][0]
    if not p["fits"]:
        raise LaunchError(f"the layout {p['strategy']} needs {p['memory_gib']['total']:.1f} GiB "
                          f"per GPU, more than the {gpu_memory_gib:g} GiB card; unpin it or "
                          "choose one that fits (`trainplan plan`)")
    gpus = plan_out["gpus"]
    nnodes, nproc = mesh(gpus, gpus_per_node)
    name = settings.job_name or job_name(plan_out["model"], gpus, plan_out["gpu"])  # JOB_NAME
    every = settings.ckpt_every or schedule.every_steps
    keep = settings.ckpt_keep or schedule.keep
    every_min = every * p["step_time_s"] / 60.0
    args = harness_args(p["parallel"], model_arg, plan_out["seq_len"], settings)
    args += monitor_args(p, alert["tokens_per_s_per_gpu"])
    check_harness(args, bool(settings.data))
    extra, has = optional_args(args, settings, every, keep, CKPT)
    ctx = {
        "settings": settings, "plan": p, "gpus": gpus, "nnodes": nnodes, "nproc": nproc,
        "name": name, "args": args, "env": environment(settings), "has": has,
        "ckpt_every": every, "ckpt_keep": keep, "ckpt_every_min": every_min,
        "module": module(settings), "data": settings.data, "alert": alert,
        "title": title or f"{plan_out['model']} on {gpus} x {plan_out['gpu']}",
        "extra": lambda ckpt_dir: [ckpt_dir if a == CKPT else a for a in extra],
    }
    body = (render_k8s(ctx) if settings.target == "k8s"
            else render_shell(FILES[settings.target], ctx))
    files = {FILES[settings.target]: body, "README.md": readme(ctx)}
    summary = {"target": settings.target, "job_name": name, "nodes": nnodes,
               "procs_per_node": nproc, "files": sorted(files), "module": module(settings),
               "harness_args": args, "steps": settings.steps,
               "checkpoint_every": every if has["checkpointing"] else None,
               "checkpoint_keep": keep, "checkpoint_every_min": every_min,
               "checkpoint_planned_interval_min": schedule.plan.interval_min,
               "checkpoint_from_plan": not (settings.ckpt_every or settings.ckpt_keep),
               "alert": alert, **has, "env": ctx["env"], "plan": p}
    return Launch(files=files, summary=summary)


def plan_and_generate(m, gpu, cluster, *, gpus: int, seq_len: int, global_batch_tokens: int,
                      settings: LaunchSettings, model_arg: str, pins: dict | None = None,
                      gpus_per_node: int | None = None, title: str = "",
                      token_budget: float | None = None) -> Launch:
    """Plan (the best layout the trainer runs, or the pinned one) and generate: `trainplan
    launch` and page 6. The run is `token_budget` long unless `settings.steps` says;
    checkpoints and the alert follow `launch.job`."""
    from trainplan.launch import job  # pandas: not loaded at import

    gpn = gpus_per_node or cluster.gpus_per_node
    planned = job.best_runnable(m, gpu, cluster, gpus=gpus, seq_len=seq_len,
                                global_batch_tokens=global_batch_tokens, pins=pins,
                                gpus_per_node=gpn, env=environment(settings))
    p = planned["plans"][0]
    if not settings.steps:
        if token_budget is None:
            raise LaunchError("give --steps N, or a --scenario whose token budget sets them")
        settings = dataclasses.replace(settings, steps=job.steps_for(
            token_budget, p["tokens_per_step"], 0 if settings.data else settings.warmup))
    return generate(planned, model_arg=model_arg, gpus_per_node=gpn, settings=settings,
                    gpu_memory_gib=gpu.memory_gib, title=title,
                    schedule=job.schedule(m, gpus, gpn, p), alert=job.alert(m, gpu, seq_len, p))


STRAGGLER_RATIO = 1.15  # a rank whose step time is this much above the median is a straggler
METRICS_PATH = "logs/metrics.jsonl"  # per-step metrics and alerts, written by rank 0


def monitor_args(p: dict, alert_tokens_per_s_per_gpu: float,
                 path: str = METRICS_PATH) -> list[str]:
    """Flags that make the run watch itself against this plan (bench/harness/monitor.py).

    The alert line and straggler tolerance are the ones `watch` gives the operator, so
    the metrics file and the runbook's table agree.
    """
    from trainplan.bench.harness.monitor import launch_flags  # torch: not loaded at import

    return launch_flags({"step_time_s": p["step_time_s"],
                         "straggler_step_time_s": STRAGGLER_RATIO * p["step_time_s"],
                         "alert_tokens_per_s_per_gpu": alert_tokens_per_s_per_gpu}, path)


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
        "alert_tokens_per_s_per_gpu": summary["alert"]["tokens_per_s_per_gpu"],
        "straggler_step_time_s": STRAGGLER_RATIO * p["step_time_s"],
        "checkpoint_every_steps": every,
        "checkpoint_every_min": every * p["step_time_s"] / 60,
        "checkpoint_keep": summary["checkpoint_keep"],
        "collective_timeout_min": settings.collective_timeout_s / 60,
        "max_restarts": settings.max_restarts,
        "warn_min": settings.warn_s / 60,
        "save_grace_s": settings.save_grace_s,
    }
