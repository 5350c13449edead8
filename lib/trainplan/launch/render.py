"""The text of the launch artefacts: shell scripts from templates, the manifest, the README.

`trainplan.launch.artefacts` decides what goes in (layout, flags, environment);
this module only lays it out. The shell scripts are templates under
`templates/` with `{{name}}` placeholders, so that they read as the
scripts they are; the Kubernetes manifest is built as a dict and written
with `yaml.safe_dump`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

TEMPLATES = Path(__file__).resolve().parent / "templates"
K8S_CKPT_MOUNT = "/checkpoints"
K8S_RDZV_PORT = 29400  # the training operator's default rendezvous port
# The `launch` flags that only some targets read (every target reads the others), as the
# renderers below read them; `trainplan launch` refuses one given for another target.
TARGET_FLAGS = {
    "torchrun": ("--rdzv-port",),  # torchrun.sh: RDZV_PORT's default
    "slurm": ("--rdzv-port", "--time-limit-min", "--warn-s"),  # train.sbatch, its README
    "k8s": ("--image",),  # the manifest's container (its rendezvous port: K8S_RDZV_PORT)
}


def _render(name: str, values: dict) -> str:
    """Fill {{key}} placeholders of a template; a missing key is a bug, not user input."""
    text = (TEMPLATES / name).read_text()
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(values[m[1]]), text)


def _shell_lines(args: list[str], indent: str = "        ", width: int = 88) -> str:
    """Harness arguments as continued shell lines, never splitting a flag from its value."""
    groups, cur = [], []
    for a in args:
        if a.startswith("--") and cur:
            groups.append(cur)
            cur = []
        cur.append(a if a.startswith('"$') else shlex.quote(a))
    groups.append(cur)
    lines, line = [], ""
    for g in (" ".join(g) for g in groups):
        if line and len(indent + line + " " + g) > width:
            lines.append(line)
            line = g
        else:
            line = f"{line} {g}".strip()
    lines.append(line)
    return " \\\n".join(indent + x for x in lines)


def _exports(env: dict) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


# Slurm --time's bound (LaunchSettings): a year, above any partition's MaxTime; Slurm keeps
# the limit as 32-bit minutes (slurm.h: time_limit), so a larger one is no real request.
MAX_TIME_LIMIT_MIN = 365 * 24 * 60


def _slurm_time(minutes: int) -> str:
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


# ---------------------------------------------------------------- the targets


def render_shell(template: str, ctx: dict) -> str:
    """torchrun.sh or train.sbatch from its template."""
    s = ctx["settings"]
    values = {
        "title": ctx["title"], "job_name": ctx["name"], "nnodes": ctx["nnodes"],
        "nproc": ctx["nproc"], "rdzv_port": s.rdzv_port, "join_timeout_s": s.join_timeout_s,
        "max_restarts": s.max_restarts, "save_grace_s": s.save_grace_s, "warn_s": s.warn_s,
        "time_limit": _slurm_time(s.time_limit_min), "env_exports": _exports(ctx["env"]),
        "gpu_line": "" if s.cpu else f"#SBATCH --gpus-per-node={ctx['nproc']}\n",
        "cpus_per_task": ctx["nproc"] if s.cpu else 8 * ctx["nproc"],
        "harness_lines": _shell_lines(_placed(ctx["args"], '"$DATA_DIR"', '"$LOG_DIR"')
                                      + ctx["extra"]("\"$CKPT_DIR\"")),
        "module": ctx["module"],
        "data_line": (f'DATA_DIR="${{DATA_DIR:-{ctx["data"]}}}"  # shards of `trainplan data '
                      'prepare`, on storage every node reads\n' if ctx["data"] else ""),
    }
    return _render(template, values)


def _placed(args: list[str], data: str, logs: str) -> list[str]:
    """The command's flags with the DATA and LOGS placeholders replaced."""
    return [data if a == "DATA" else logs if a == "LOGS" else a for a in args]


def render_k8s(ctx: dict) -> str:
    """A Kubeflow PyTorchJob (kubeflow.org/v1) with an elastic policy, as YAML."""
    s = ctx["settings"]
    name, nnodes, nproc = ctx["name"], ctx["nnodes"], ctx["nproc"]
    command = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{name}-worker-0:{K8S_RDZV_PORT}",
               "--rdzv-id", name, "--rdzv-conf", f"join_timeout={s.join_timeout_s}",
               "--max-restarts", str(s.max_restarts), "--monitor-interval", "5",
               "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
               "--shutdown-timeout", str(s.save_grace_s),
               "-m", ctx["module"],
               *_placed(ctx["args"], ctx["data"], f"{K8S_CKPT_MOUNT}/{name}/logs"),
               *ctx["extra"](f"{K8S_CKPT_MOUNT}/{name}")]
    resources = ({"requests": {"cpu": str(nproc)}, "limits": {"cpu": str(nproc)}} if s.cpu else
                 {"limits": {"nvidia.com/gpu": nproc}, "requests": {"nvidia.com/gpu": nproc}})
    container = {
        "name": "pytorch",  # the operator's expected container name
        "image": s.image,
        "command": command,
        "env": [{"name": k, "value": v} for k, v in ctx["env"].items()],
        "resources": resources,
        "volumeMounts": [{"name": "checkpoints", "mountPath": K8S_CKPT_MOUNT},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {
        "metadata": {"labels": {"app": "trainplan", "trainplan/job": name}},
        "spec": {
            "terminationGracePeriodSeconds": s.save_grace_s + 30,  # SIGTERM -> checkpoint
            "containers": [container],
            "volumes": [
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{name}-ckpt"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL's shared memory
            ],
        },
    }
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app": "trainplan"}},
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "rdzvPort": K8S_RDZV_PORT, "rdzvId": name,
                              "minReplicas": nnodes, "maxReplicas": nnodes,
                              "maxRestarts": s.max_restarts,
                              "rdzvConf": [{"key": "join_timeout",
                                            "value": str(s.join_timeout_s)}]},
            "nprocPerNode": str(nproc),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": s.max_restarts},
            "pytorchReplicaSpecs": {"Worker": {"replicas": nnodes, "restartPolicy": "OnFailure",
                                               "template": pod}},
        },
    }
    head = (f"# {ctx['title']}\n"
            "# Kubeflow PyTorchJob (kubeflow.org/v1) with an elastic policy, generated by\n"
            "# `trainplan launch`. Needs the Kubeflow training operator and a\n"
            f"# PersistentVolumeClaim {name}-ckpt that every pod can mount.\n")
    return head + yaml.safe_dump(job, sort_keys=False, width=100)


def readme(ctx: dict) -> str:
    """How to start, watch and stop the job, with the plan's numbers for a healthy run."""
    s = ctx["settings"]
    p, name, target = ctx["plan"], ctx["name"], s.target
    start = {
        "torchrun": [f"On each of the {ctx['nnodes']} node(s), from a shared folder:",
                     "", "    RDZV_HOST=<first node's address> ./torchrun.sh", "",
                     "Logs: `logs/<job>/<node>.log`, one per node."],
        "slurm": ["From the folder the logs and checkpoints go in:", "",
                  "    sbatch train.sbatch", "",
                  "Logs: `<job>-<id>.out` (the batch script) and "
                  "`logs/<job>-<id>-<node>.out`, one per node; a requeued job appends."],
        "k8s": [f"Create the PersistentVolumeClaim `{name}-ckpt`, then:", "",
                "    kubectl apply -f pytorchjob.yaml", "",
                f"Logs: `kubectl logs -f {name}-worker-0` (one pod per node)."],
    }[target]
    stop = {
        "torchrun": "Ctrl-C or `kill -TERM <agent pid>` on every node: the agents pass SIGTERM "
                    "to the workers, which checkpoint and stop.",
        "slurm": "`scancel <id>` stops it for good; `scontrol requeue <id>` stops it and puts "
                 "it back in the queue (it resumes from the newest complete checkpoint).",
        "k8s": f"`kubectl delete pytorchjob {name}` (pods get SIGTERM, then "
               f"{s.save_grace_s + 30} s to checkpoint).",
    }[target]
    ckpt = (f"every {ctx['ckpt_every']:,} steps (about {ctx['ckpt_every_min']:.1f} minutes "
            f"of work at the predicted step time), the newest {ctx['ckpt_keep']} kept, and on "
            "SIGTERM or SIGUSR1; a restart resumes from the newest complete one"
            if ctx["has"]["checkpointing"] else
            "NOT WRITTEN: the launched module has no checkpoint flags, so a restart starts "
            "from step 0")
    timeout = (f"{s.collective_timeout_s} s" if ctx["has"]["collective_timeout"] else
               "the launched module's default (it has no flag for it); the NCCL watchdog "
               "settings below still turn a hang into a dump and an exit")
    mem = p["memory_gib"]["total"]
    lines = [
        f"# {ctx['title']}", "",
        f"Generated by `trainplan launch` for {ctx['gpus']} GPU(s) as {ctx['nnodes']} "
        f"node(s) x {ctx['nproc']} process(es): **{p['strategy']}** "
        + " ".join(f"{k}={v}" for k, v in p["parallel"].items()) + ".", "",
        "## Start", "", *start, "",
        "## Watch", "",
        "Healthy, by the plan (after the warm-up steps):", "",
        f"- step time {p['step_time_s']:.3f} s, {p['tokens_per_step']:,} tokens a step;",
        f"- {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
        f"{p['tokens_per_s']:,.0f} tokens/s in all, MFU {p['mfu']:.1%};",
        f"- {mem:.1f} GiB of memory per GPU (the card's reserved memory reads somewhat more).",
        "",
        f"Alert: below {ctx['alert']['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
        f"({ctx['alert']['basis']}).", "",
        "Throughput well below the plan on every rank: compare the settings with the plan. "
        "One slow rank: a straggler (see the runbook, page 6).", "",
        "## Stop", "", stop, "",
        "## Settings", "",
        f"- checkpoints: {ckpt};",
        f"- collective timeout: {timeout};",
        f"- restarts: torchrun restarts all workers up to {s.max_restarts} times after a "
        f"failure; agents wait {s.join_timeout_s} s for every node at a rendezvous;",
        "- environment: " + ", ".join(f"`{k}={v}`" for k, v in ctx["env"].items()) + ".",
    ]
    if target == "slurm":
        lines.append(f"- Slurm: time limit {_slurm_time(s.time_limit_min)}; {s.warn_s} s "
                     "before it, USR1 makes the workers write an emergency checkpoint and stop, "
                     "and the job requeues itself.")
    return "\n".join(lines) + "\n"
