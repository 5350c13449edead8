"""The torch.distributed.checkpoint plumbing under `ckpt.Checkpointer`.

A writer that hashes each rank's shards as it writes them, a load planner
that refuses anything but tensors, the one reusable stager for asynchronous
saves, and the small helpers the checkpointer's error handling needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt.faults import Faults
from trainplan.errors import TrainplanError


class CheckpointError(TrainplanError):
    """A checkpoint flag, directory or file that cannot be used."""

# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor
# and sympy (about a second per process), which a run without --ckpt-dir skips.


def shard_writer(path: Path, *, rank: int, step: int, faults: Faults, threads: int = 1,
                 timings: dict | None = None, hash_while_writing: bool = True):
    """DCP's file writer (`threads` files per rank, written in parallel), plus: the sha256
    and size of this rank's shards in `rank-NNNNN.files.json`, the `save:writing` fault
    point, and, into `timings`, the seconds spent writing (fsync included) and then
    finishing the hashes.

    With `hash_while_writing` each shard is hashed by the thread that writes it, as its
    bytes pass (`_HashingStream`), so the hash is ready when the file is closed and the
    disk never idles for it; a shard whose stream was not written front to back, or whose
    size on disk disagrees, is read back and hashed after all writing (as every shard is
    without it)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.hashed: dict[str, dict | None] = {}  # file name -> entry (None: unusable)
            # DCP's writer keeps its FileSystem in `self.fs` (torch 2.2-2.13); on one that
            # does not, every shard is read back and hashed after writing instead
            if hash_while_writing and hasattr(getattr(self, "fs", None), "create_stream"):
                self.fs = _hashing_fs(type(self.fs), self.hashed)()

        def write_data(self, plan, planner):
            start = time.perf_counter()
            future = super().write_data(plan, planner)
            results = future.wait()
            written = time.perf_counter()
            faults.at("save:writing", step)
            names = sorted({r.storage_data.relative_path for r in results})
            entries = shard_entries(path, names, self.hashed)
            mf.write_json(path / f"rank-{rank:05d}.files.json", entries)
            if timings is not None:
                timings.update(write_s=written - start, hash_s=time.perf_counter() - written,
                               bytes=sum(e["bytes"] for e in entries.values()),
                               hashed_while_writing=sum(bool(self.hashed.get(n))
                                                        for n in names))
            return future

    return Writer(str(path), thread_count=threads)


def shard_entries(path: Path, names: list[str], hashed: dict) -> dict:
    """sha256 and size of each shard `names` in `path`: the hash taken while it was
    written where its byte count agrees with the file on disk, else read back (in
    parallel threads: hashlib frees the GIL)."""
    def usable(name: str) -> bool:
        entry = hashed.get(name)
        try:
            return bool(entry) and entry["bytes"] == (path / name).stat().st_size
        except OSError:
            return False

    ready = {n: hashed[n] for n in names if usable(n)}
    rest = [n for n in names if n not in ready]
    if rest:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(rest)))) as pool:
            ready.update(zip(rest, pool.map(lambda n: mf.file_entry(path / n), rest),
                             strict=True))
    return {n: ready[n] for n in names}


class _HashingStream:
    """A file opened for writing that hashes every byte written through it; on close it
    leaves `{"sha256", "bytes"}` in `hashed[name]`, or None where the bytes did not go
    to the file front to back (a seek, a short write, an error), so the hash cannot be
    trusted. Everything else is the wrapped stream's (tell, flush, fileno for fsync)."""

    def __init__(self, raw, name: str, hashed: dict):
        self._raw, self._name, self._hashed = raw, name, hashed
        self._sha, self._bytes, self._linear = hashlib.sha256(), 0, True

    def write(self, b) -> int:
        n = self._raw.write(b)
        size = memoryview(b).nbytes
        if n is not None and n != size:
            self._linear = False
        self._sha.update(b)  # releases the GIL for large buffers: other writers go on
        self._bytes += size
        return n

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def seek(self, *args) -> int:
        pos = self._raw.seek(*args)
        self._linear = self._linear and pos == self._bytes
        return pos

    def spoil(self) -> None:
        """The write failed part way: no hash for this file."""
        self._linear = False

    def close(self) -> None:
        if not self._raw.closed:
            self._raw.close()
        if self._name not in self._hashed:  # the first close decides
            self._hashed[self._name] = ({"sha256": self._sha.hexdigest(), "bytes": self._bytes}
                                        if self._linear else None)

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def __getattr__(self, attr):
        return getattr(self._raw, attr)


def _hashing_fs(base: type, hashed: dict) -> type:
    """DCP's FileSystem class `base` whose write streams hash as they write (into
    `hashed`, keyed by file name); read streams are untouched."""

    class HashingFileSystem(base):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as raw:
                if "w" not in mode:  # reads, and appends (not written from byte 0)
                    yield raw
                    return
                stream = _HashingStream(raw, Path(path).name, hashed)
                try:
                    yield stream
                except BaseException:
                    stream.spoil()
                    raise
                finally:
                    stream.close()

    return HashingFileSystem


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
    always waits for the previous one to finish writing first (see `_kept_stager`)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    cuda = device.type == "cuda"
    try:
        return _kept_stager(DefaultStager)(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=cuda))
    except (TypeError, AssertionError, RuntimeError):  # an older signature or no accelerator
        return None


def _kept_stager(base):
    """A DefaultStager that keeps its CPU copy between saves. torch 2.11's DefaultStager
    closes its inner StateDictStager after every stage ("release reference cycle"), which
    empties its copy table and cache, so a second save failed with `KeyError: <class
    'type'>` (seen on 2 H200s, torch 2.11; 2.13 does not close it). That inner close is
    made a no-op; `close()` of this stager, at the end of the run, closes it for real."""

    class KeptStager(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner = getattr(self, "_state_dict_stager", None)
            if inner is not None:
                inner.close = lambda: None  # shadows the method on this instance only

        def stage(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().stage(*args, **kwargs)
            finally:
                self.last_stage_s = time.perf_counter() - start  # the CPU copy, for timings

        def close(self) -> None:
            inner = getattr(self, "_state_dict_stager", None)
            if inner is not None and "close" in vars(inner):
                del inner.close
            super().close()

    return KeptStager


def async_save(state, *, writer, process_group, no_dist: bool, stager):
    """`dcp.async_save` with the options this torch version has (2.11 to 2.13 checked by
    signature, not by version number); returns (future of the background write, options).

    `options` says what was used and what fell back, for the benchmark's record:
    `async_stager` (the reused stager, else DCP stages into fresh memory each save) and
    `no_dist` (older versions infer it from the process group). An `AsyncSaveResponse`
    (newer torch) is reduced to its `upload_completion` future.
    """
    import inspect

    import torch.distributed.checkpoint as dcp

    params = inspect.signature(dcp.async_save).parameters
    kwargs = {"storage_writer": writer, "process_group": process_group}
    options = {"stager": "none (DCP default: fresh CPU copy per save)", "fallbacks": []}
    if "no_dist" in params:
        kwargs["no_dist"] = no_dist
    else:
        options["fallbacks"].append("no_dist: not in this torch's async_save (inferred)")
    if stager is not None and "async_stager" in params:
        kwargs["async_stager"] = stager
        options["stager"] = "DefaultStager, reused (pinned on CUDA)"
    elif stager is not None:
        options["fallbacks"].append("async_stager: not in this torch's async_save")
    else:
        options["fallbacks"].append("no reusable stager (DefaultStager missing or refused)")
    future = dcp.async_save(state, **kwargs)
    return getattr(future, "upload_completion", future), options


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
