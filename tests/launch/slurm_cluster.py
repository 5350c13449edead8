"""A one-host Slurm cluster in a temporary folder, for the launch tests.

Debian's `slurm-wlm` and `munge` (installed by `make system-deps`): munged,
slurmctld and slurmd run in the foreground as children of the test, with
every file (key, socket, state, spool, logs, slurm.conf) under one folder
and free ports, so two test runs on one machine do not meet. Process
tracking is `proctrack/linuxproc` and tasks are not confined
(`task/none`): no cgroups or systemd are needed, as in a container. With
`cpus`, the node offers that many CPUs whatever the host has
(`SlurmdParameters=config_overrides`), so that jobs which mostly wait can
run side by side.
`stop()` ends the three daemons it started (by their process ids) and any
job still running.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_tools() -> list[str]:
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
    return [t for t in tools if not shutil.which(t) and not Path("/usr/sbin", t).exists()]


def _node_resources() -> tuple[int, int]:
    """(CPUs, RealMemory MiB) as slurmd itself counts them."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    cpus = int(re.search(r"CPUs=(\d+)", out)[1])
    mem = int(re.search(r"RealMemory=(\d+)", out)[1])
    return cpus, mem


class SlurmCluster:
    """munged + slurmctld + slurmd on localhost; `env` points Slurm's clients at it."""

    def __init__(self, root: Path, cpus: int | None = None):
        self.root = root
        self.cpus_wanted = cpus
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(mode=0o700, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        cpus, mem = _node_resources()
        cpus = self.cpus_wanted or cpus
        self.cpus = cpus
        lines = {
            "ClusterName": "trainplantest",
            "SlurmctldHost": "localhost",
            "SlurmctldPort": free_port(),
            "SlurmdPort": free_port(),
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={r / 'munge' / 'munge.socket'},cred_expire=10",  # requeue wait
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "StateSaveLocation": r / "state",
            "SlurmdSpoolDir": r / "spool",
            "SlurmctldPidFile": r / "slurmctld.pid",
            "SlurmdPidFile": r / "slurmd.pid",
            "SlurmctldLogFile": r / "log" / "slurmctld.log",
            "SlurmdLogFile": r / "log" / "slurmd.log",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "SchedulerType": "sched/builtin",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "JobRequeue": 1,
            "MinJobAge": 600,  # keep finished jobs visible to `scontrol show job`
            "KillWait": 15,  # seconds between SIGTERM and SIGKILL: room for the emergency save
            "SlurmctldTimeout": 30,
            "SlurmdTimeout": 30,
            "InactiveLimit": 0,
            "SchedulerParameters": "sched_interval=1",
        }
        if self.cpus_wanted:
            lines["SlurmdParameters"] = "config_overrides"  # the CPUs below, not the host's
        text = "".join(f"{k}={v}\n" for k, v in lines.items())
        text += (f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} "
                 "State=UNKNOWN\n"
                 "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP\n")
        self.conf.write_text(text)

    def start(self, timeout: float = 60) -> None:
        self.write_config()
        r = self.root
        log = open(r / "log" / "daemons.out", "ab")  # noqa: SIM115 (closed with the daemons)
        self._log = log
        self.procs["munged"] = subprocess.Popen(
            ["munged", "-F", "--force", f"--key-file={r / 'munge' / 'munge.key'}",
             f"--socket={r / 'munge' / 'munge.socket'}", f"--pid-file={r / 'munge' / 'pid'}",
             f"--log-file={r / 'log' / 'munged.log'}", f"--seed-file={r / 'munge' / 'seed'}"],
            stdout=log, stderr=log, env=self.env)
        self._wait(lambda: (r / "munge" / "munge.socket").exists(), timeout, "munged socket")
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log, stderr=log, env=self.env)
        self._wait(self._ctld_up, timeout, "slurmctld to answer")
        self.procs["slurmd"] = subprocess.Popen(
            ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)], stdout=log, stderr=log,
            env=self.env)
        self._wait(self._node_idle, timeout, "node localhost to be idle")

    def _ctld_up(self) -> bool:
        return self.run("scontrol", "ping", check=False).returncode == 0

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout
        return "idle" in out

    def _wait(self, ok, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for "
                                       f"{what}:\n{self.logs()}")
            if ok():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.logs()}")

    def run(self, *cmd: str, check: bool = True, cwd=None,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (SLURM_CONF in `env`)."""
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env or self.env,
                              timeout=30, cwd=cwd)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, RestartCnt, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace")
                                                      .splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel jobs, then end the daemons this object started, newest first."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", "root", check=False)
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()
