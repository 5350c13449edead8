"""Raw sequential write bandwidth of the checkpoint disk, measured as DCP will use it.

`dd if=/dev/zero of=F bs=64M count=N conv=fsync` in Python: every rank writes
its share of the bytes into one file of the folder (as DCP writes one shard
file per rank, concurrently), in blocks of `block` bytes, then fsyncs the file
and the folder; the clock stops at the last fsync, so the figure is bytes made
durable per second, which is what a checkpoint's persist time is compared
with. The blocks are random bytes, not zeros, so a compressing or
deduplicating file system cannot flatter the disk. The files are deleted
afterwards.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.loader import nearest_existing, shown

MiB, GiB = 1 << 20, 1 << 30


def free_bytes(folder: Path) -> int:
    """Free bytes of the file system holding `folder` (or its nearest existing parent,
    `loader.nearest_existing`); TrainplanError where the path cannot be looked at."""
    found, why = nearest_existing(folder)
    if found is None:  # `why` is the OS's reason
        raise TrainplanError(f"{shown(folder)} cannot be used ({why}); name a folder you can "
                             "write to")
    return shutil.disk_usage(found).free


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, nbytes: int, block: int) -> float:
    """Write `nbytes` of random data to `path` in `block`-byte writes, fsync it and its
    folder; return the seconds from open to the last fsync. The file is removed."""
    buf = memoryview(os.urandom(min(block, nbytes) or 1))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(len(buf), left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    took = time.perf_counter() - start
    path.unlink()
    return took


def measure(folder: Path, *, total_bytes: int, block: int, rank: int, world: int,
            barrier) -> dict:
    """Every rank writes total_bytes / world at once (`barrier()` lines them up before
    and after); returns this rank's share and seconds. The caller reduces over ranks:
    bandwidth = total bytes / slowest rank's seconds."""
    share = total_bytes // world
    folder.mkdir(parents=True, exist_ok=True)
    barrier()
    took = write_file(folder / f"raw-write-rank{rank:05d}.bin", share, block)
    barrier()
    return {"bytes": share, "seconds": took}
