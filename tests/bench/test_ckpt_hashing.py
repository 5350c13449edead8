"""The shards' checksums are taken while DCP writes them (`dcp_io.shard_writer`), in one
process (seconds, no torchrun).

The hash of each shard must equal a read-back hash of the file on disk, with several
writer threads as with one; a stream that was not written front to back, or a count
that disagrees with the file's size, falls back to reading the file back; and the
manifest built from these hashes still catches a truncated shard and a flipped byte.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest
import torch
from torch import nn

from trainplan.bench.ckpt import dcp_io, faults
from trainplan.bench.ckpt import manifest as mf

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return {"model": model.state_dict(), "extra": {"w": torch.randn(1000, 37)}}


def _save(folder, threads: int, hash_while_writing: bool) -> dict:
    """One-rank DCP save through the shard writer; the timings it reports."""
    import torch.distributed.checkpoint as dcp

    timings: dict = {}
    writer = dcp_io.shard_writer(folder, rank=0, step=1, faults=faults.Faults(0, 1, spec=""),
                                 threads=threads, timings=timings,
                                 hash_while_writing=hash_while_writing)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    return timings


@pytest.mark.parametrize("threads", [1, 3])
def test_hashes_taken_while_writing_equal_the_files_read_back(tmp_path, threads):
    folder = tmp_path / "step-000001"
    timings = _save(folder, threads, hash_while_writing=True)
    listed = json.loads((folder / "rank-00000.files.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert sorted(listed) == shards and len(shards) == threads
    assert timings["hashed_while_writing"] == len(shards)  # none read back
    assert listed == {n: mf.file_entry(folder / n) for n in shards}
    again = tmp_path / "again" / "step-000001"
    assert _save(again, threads, hash_while_writing=False)["hashed_while_writing"] == 0
    assert json.loads((again / "rank-00000.files.json").read_text()) == listed


def test_a_seek_or_a_wrong_count_falls_back_to_reading_the_file(tmp_path):
    hashed: dict = {}
    for name, seek in (("a.distcp", False), ("b.distcp", True)):
        raw = open(tmp_path / name, "wb")  # noqa: SIM115 (closed by the stream)
        stream = dcp_io._HashingStream(raw, name, hashed)
        stream.write(b"x" * 100)
        if seek:
            stream.seek(10)
            stream.write(b"y")
        stream.close()
    assert hashed["a.distcp"] == mf.file_entry(tmp_path / "a.distcp")
    assert hashed["b.distcp"] is None  # rewritten in place: not trusted
    (tmp_path / "c.distcp").write_bytes(b"z" * 7)
    hashed["c.distcp"] = {"sha256": "0" * 64, "bytes": 6}  # disagrees with the file's size
    names = ["a.distcp", "b.distcp", "c.distcp"]
    assert dcp_io.shard_entries(tmp_path, names, hashed) == {
        n: mf.file_entry(tmp_path / n) for n in names}


def test_a_failed_write_leaves_no_hash(tmp_path):
    from torch.distributed.checkpoint.filesystem import FileSystem

    hashed: dict = {}
    fs = dcp_io._hashing_fs(FileSystem, hashed)()
    with pytest.raises(OSError, match="injected"), fs.create_stream(tmp_path / "d.distcp",
                                                                     "wb") as stream:
        stream.write(b"part of a shard")
        raise OSError("injected")
    assert hashed == {"d.distcp": None}
    with fs.create_stream(tmp_path / "d.distcp", "rb") as stream:  # reads: not wrapped
        assert isinstance(stream, io.BufferedReader)


def test_the_manifest_from_hashes_taken_while_writing_catches_damage(tmp_path):
    folder = tmp_path / "step-000001"
    _save(folder, threads=2, hash_while_writing=True)
    mf.write_json(folder / "rank-00000.json", mf.rank_state(1, 0, 1, torch.device("cpu")))
    mf.write_json(folder / mf.MANIFEST, mf.build(folder, step=1, world=1))
    assert mf.verify(folder)[0] is not None
    shard = sorted(folder.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert mf.verify(folder)[1] == f"{shard.name} sha256 mismatch (corrupted)"
    shard.write_bytes(bytes(data[:-5]))
    assert "(truncated?)" in mf.verify(folder)[1]


def test_the_checkpointer_passes_the_hash_flag_to_the_writer(tmp_path, monkeypatch):
    from trainplan.bench.ckpt import save as ckpt_save
    from trainplan.bench.ckpt import store as ckpt
    from trainplan.bench.harness.parallelize import Parallelized

    monkeypatch.setattr(faults.Signals, "install", classmethod(lambda cls: None))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # as test_units does
    seen = []
    real = ckpt_save.shard_writer
    monkeypatch.setattr(ckpt_save, "shard_writer", lambda *a, **kw: seen.append(
        kw["hash_while_writing"]) or real(*a, **kw))
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    for when, expected in (("after-writing", False), ("while-writing", True)):
        p = argparse.ArgumentParser()
        ckpt.add_arguments(p)
        args = p.parse_args([f"--ckpt-dir={tmp_path / when}", f"--ckpt-hash={when}"])
        saver = ckpt.Checkpointer(args, Parallelized(parts=[model]), opt, rank=0, world=1,
                                  device=torch.device("cpu"))
        saver.save(1)
        saver.join_prune()
        assert mf.verify(tmp_path / when / "step-000001")[0] is not None
        assert seen[-1] is expected and saver.timings[1]["hashed_while_writing"] == int(expected)
