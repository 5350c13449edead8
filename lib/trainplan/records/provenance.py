"""Provenance: where and with what a record was made (docs/measurement.md, "Records").

Kept apart from the record schema (`trainplan.records.schema`), which stamps every
record with `provenance()`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "PYTORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
                "ACCELERATE_", "OMP_NUM_THREADS")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASS", "AUTH", "CRED", "URL")
_URL_USERINFO = re.compile(r"://[^/@\s]*@")  # scheme://user:password@host
_REPO = Path(__file__).resolve().parents[3]
COMMIT_ENV = "TRAINPLAN_GIT_COMMIT"


def _run(*cmd: str, cwd: Path = _REPO) -> str | None:
    """Stdout of a command, or None if it is missing, fails or hangs."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(root: Path = _REPO, environ=None) -> str | None:
    """The commit a record or a build is of: $TRAINPLAN_GIT_COMMIT if set (a copy of the
    tree on another machine may carry a stale .git: a commit it is told wins), else git's
    HEAD in `root`, else None."""
    environ = os.environ if environ is None else environ
    told = environ.get(COMMIT_ENV, "").strip()
    return told or _run("git", "rev-parse", "HEAD", cwd=root) or None


@functools.lru_cache(maxsize=1)
def nvidia_smi() -> tuple[list[str], str | None]:
    """GPU names and driver version from nvidia-smi; ([], None) where there is none."""
    out = _run("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
    rows = [[c.strip() for c in line.split(",")] for line in (out or "").splitlines() if line]
    return [r[0] for r in rows], (rows[0][1] if rows and len(rows[0]) > 1 else None)


def env_knobs(environ=None) -> dict[str, str]:
    """The variables of `ENV_PREFIXES` that are set: NCCL, torch, CUDA, the compiler's
    (TORCHINDUCTOR_*, TORCHDYNAMO_*: max-autotune changes kernels), accelerate's, threads.

    Values of names containing TOKEN, KEY, SECRET, PASS, AUTH, CRED or URL, and values that
    carry a user or password in a URL (`scheme://user:pw@host`, a remote cache's, say), are
    never recorded: such a name appears with the value "<redacted>".
    """
    environ = os.environ if environ is None else environ
    return {name: "<redacted>" if any(w in name.upper() for w in _SECRET_WORDS)
            or _URL_USERINFO.search(value) else value
            for name, value in sorted(environ.items()) if name.startswith(ENV_PREFIXES)}


def provenance() -> dict:
    """Where and with what a record was made (docs/measurement.md, "Records").

    git commit (else $TRAINPLAN_GIT_COMMIT, else None) and whether tracked
    files differ from it, UTC date, sha256 of the hostname (never the name
    itself), GPU name and count, driver, torch / CUDA / NCCL versions, Python,
    and the environment knobs of `env_knobs`.
    """
    import torch

    gpu_names, driver = nvidia_smi()
    cuda_ok = torch.cuda.is_available()
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda_ok else None
    except (AttributeError, RuntimeError, TypeError):
        nccl = None
    commit = git_commit()
    checked = commit is not None and not os.environ.get(COMMIT_ENV, "").strip()  # git's own
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no") if checked else None
    return {
        "git_commit": commit,
        "git_dirty": bool(dirty) if checked else None,
        "date": utc_now(),
        "host_sha256": hashlib.sha256(socket.gethostname().encode()).hexdigest(),
        "gpu_name": torch.cuda.get_device_name(0) if cuda_ok else (gpu_names or [None])[0],
        "gpu_count": torch.cuda.device_count() if cuda_ok else len(gpu_names),
        "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
        "python": sys.version.split()[0], "platform": platform.platform(),
        "env": env_knobs(),
    }
