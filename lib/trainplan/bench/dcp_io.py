"""The torch.distributed.checkpoint plumbing under `ckpt.Checkpointer`.

A writer that hashes each rank's shards as it writes them, a load planner
that refuses anything but tensors, the one reusable stager for asynchronous
saves, and the small helpers the checkpointer's error handling needs.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from trainplan.bench import manifest as mf
from trainplan.bench.faults import Faults
from trainplan.errors import TrainplanError


class CheckpointError(TrainplanError):
    """A checkpoint flag, directory or file that cannot be used."""

# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor
# and sympy (about a second per process), which a run without --ckpt-dir skips.


def shard_writer(path: Path, *, rank: int, step: int, faults: Faults):
    """DCP's file writer, plus: hash this rank's shards, and the `save:writing` fault point."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            results = future.wait()
            faults.at("save:writing", step)
            names = sorted({r.storage_data.relative_path for r in results})
            mf.write_json(path / f"rank-{rank:05d}.files.json",
                          {n: mf.file_entry(path / n) for n in names})
            return future

    return Writer(str(path))


def tensors_only_planner():
    """DCP's load planner, refusing non-tensor entries (DCP would unpickle them)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is not a "
                                  "tensor; this loader reads tensors only")

    return TensorsOnly()


@contextlib.contextmanager
def one_process():
    """DCP warns on every call without a process group; one rank is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def make_stager(device):
    """One stager for the whole run, so its CPU copy (pinned on GPU) is allocated once
    and reused by every asynchronous save; None where this torch lacks DefaultStager
    (DCP then stages into fresh memory each time). Reuse is safe because a save
    always waits for the previous one to finish writing first."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    cuda = device.type == "cuda"
    try:
        return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=cuda))
    except (TypeError, AssertionError, RuntimeError):  # an older signature or no accelerator
        return None


def process_start() -> float:
    """Wall time at which this process started (Linux /proc), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def dcp_errors() -> tuple:
    """What a failed DCP call raises: its CheckpointException is a BaseException."""
    from torch.distributed.checkpoint import CheckpointException

    return (Exception, CheckpointException)


def one_line(err: BaseException) -> str:
    failures = getattr(err, "failures", None)  # dcp.CheckpointException: {rank: (exc, trace)}
    if failures:
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in failures.items())
    return f"{type(err).__name__}: {err}".splitlines()[0]


@dataclass
class PendingSave:
    step: int
    path: Path
    future: object
    started: float
    stall_s: float
    reason: str
    written: float | None = None  # perf_counter when the background write finished
