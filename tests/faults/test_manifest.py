"""The manifest as input: its own checksum, no duplicate keys, every file listed, retention.

On real DCP checkpoints of one process (a small model, two writer threads, so two shard
files), made once per module. Each damaged manifest below is re-sealed with a correct
checksum where the check under test must stand on its own, not behind the checksum.
Every single-bit flip of a manifest is tried (in memory, `verify(raw=...)`): each must be
refused, or leave the parsed manifest as it was (then the very state that was saved loads;
checked by loading it).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys

import pytest
import torch
from torch import nn

from trainplan.bench.ckpt import faults
from trainplan.bench.ckpt import manifest as mf
from trainplan.bench.ckpt import store as ckpt
from trainplan.bench.harness.parallelize import Parallelized

SHARDS = ["__0_0.distcp", "__0_1.distcp"]


def _args(root, *extra) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ckpt.add_arguments(p)
    return p.parse_args(["--ckpt-dir", str(root), "--ckpt-threads", "2", "--ckpt-keep", "50",
                         *extra])


def _model(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _saver(root, seed: int, *extra):
    model, opt = _model(seed)
    return ckpt.Checkpointer(_args(root, *extra), Parallelized(parts=[model]), opt, rank=0,
                             world=1, device=torch.device("cpu"))


def _state(saver) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in saver.model.state_dict().items()}
    for i, st in enumerate(saver.optimizer.state.values()):
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, state) of steps 2, 4, 6, 8 saved by one process; the state is step 8's."""
    root = tmp_path_factory.mktemp("saved")
    mp = pytest.MonkeyPatch()
    mp.setattr(faults.Signals, "install", classmethod(lambda cls: None))
    mp.setattr(sys, "excepthook", sys.excepthook)
    saver = _saver(root, 0)
    for step in (2, 4, 6, 8):
        saver.save(step)
    saver.join_prune()
    mp.undo()
    assert sorted(p.name for p in (root / "step-000008").glob("*.distcp")) == SHARDS
    return root, _state(saver)


def _copy(saved, tmp_path, steps=(8,)):
    for step in steps:
        shutil.copytree(saved[0] / mf.step_name(step), tmp_path / mf.step_name(step))
    return tmp_path / mf.step_name(steps[-1])


def _reseal(folder, change) -> None:
    """Rewrite the manifest after `change(manifest)`, with the checksum that matches."""
    manifest = json.loads((folder / mf.MANIFEST).read_text())
    change(manifest)
    manifest["checksum"] = mf.checksum(manifest)
    (folder / mf.MANIFEST).write_text(json.dumps(manifest))


def _legacy(folder) -> None:
    """The manifest as trainplan 0.1 wrote it: format 1, no checksum of its own."""
    manifest = json.loads((folder / mf.MANIFEST).read_text())
    manifest.pop("checksum")
    (folder / mf.MANIFEST).write_text(json.dumps({**manifest, "format": 1}))


def _flip(path, at=None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_single_bit_flip_of_a_manifest_is_refused_or_loads_the_saved_state(
        saved, tmp_path, monkeypatch):
    folder = _copy(saved, tmp_path)
    good = (folder / mf.MANIFEST).read_bytes()
    original, why = mf.verify(folder)
    assert why == "" and original["files"].keys() == {
        ".metadata", "rank-00000.json", "rank-00000.files.json", *SHARDS}
    reasons, accepted, changed = collections.Counter(), 0, []
    for bit in range(len(good) * 8):
        flipped = bytearray(good)
        flipped[bit // 8] ^= 1 << (bit % 8)
        manifest, why = mf.verify(folder, raw=bytes(flipped))  # as if read from the folder
        if manifest is None:
            reasons[why.split(" (")[0][:40]] += 1
            continue
        accepted, accepted_bytes = accepted + 1, flipped
        if manifest != original:
            changed.append(f"bit {bit}: {flipped[max(0, bit // 8 - 20):bit // 8 + 20]!r}")
    print(f"{len(good) * 8} single-bit flips: {accepted} accepted, refused: {dict(reasons)}")
    assert not changed, f"{len(changed)} flips were accepted as another manifest: {changed[:3]}"
    if accepted:  # the same manifest (1e-08 as 1E-08): what loads must be what was saved
        (folder / mf.MANIFEST).write_bytes(bytes(accepted_bytes))
        monkeypatch.setattr(faults.Signals, "install", classmethod(lambda cls: None))
        monkeypatch.setattr(sys, "excepthook", sys.excepthook)
        loader = _saver(tmp_path, 1, "--resume")
        assert loader.resume() == 8
        got = _state(loader)
        assert got.keys() == saved[1].keys()
        assert all(torch.equal(got[k], saved[1][k]) for k in got)


def test_a_duplicate_key_is_refused_even_where_the_checksum_matches(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    text = (folder / mf.MANIFEST).read_text()
    assert text.startswith("{") and '"step": 8' in text
    (folder / mf.MANIFEST).write_text('{"step": 8, ' + text[1:])  # parses to the same dict
    manifest, why = mf.verify(folder)
    assert manifest is None and why == "manifest unreadable (duplicate key 'step')", why


def _drop_entry(name):
    return lambda m: m["files"].pop(name)


DAMAGE = {  # name: (damage to a copy of a good folder, words of the reason)
    "a shard not listed": (lambda f: _reseal(f, _drop_entry("__0_1.distcp")),
                           "__0_1.distcp in the folder but not in the manifest"),
    "a stray file": (lambda f: (f / "notes.txt").write_text("hello"),
                     "notes.txt in the folder but not in the manifest"),
    "a listed shard absent": (lambda f: (f / "__0_1.distcp").unlink(), "__0_1.distcp missing"),
    "a shard of .metadata neither there nor listed": (
        lambda f: ((f / "__0_1.distcp").unlink(), _reseal(f, _drop_entry("__0_1.distcp"))),
        "shard(s) __0_1.distcp named by .metadata not in the manifest"),
    "world size 1 -> 2": (lambda f: _reseal(f, lambda m: m.update(world_size=2)),
                          "manifest says world size 2, its files are of ranks [0]"),
    "a size as a string": (
        lambda f: _reseal(f, lambda m: m["files"]["__0_0.distcp"].update(bytes="12")),
        "manifest malformed (bytes of __0_0.distcp = '12')"),
    "another format": (lambda f: _reseal(f, lambda m: m.update(format=3)),
                       "manifest format '3' is not 2"),
    "a 0.1 manifest": (lambda f: _legacy(f),
                       "manifest of format 1 (trainplan 0.1) has no checksum of its own"),
    "not UTF-8": (lambda f: (f / mf.MANIFEST).write_bytes(b"\xff" * 9), "manifest unreadable ("),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_every_file_of_the_folder_must_be_listed_and_every_listed_file_there(
        saved, tmp_path, kind):
    folder = _copy(saved, tmp_path)
    damage, words = DAMAGE[kind]
    damage(folder)
    manifest, why = mf.verify(folder)
    assert manifest is None and words in why, why
    assert len(why) < 200 and "\n" not in why


def test_retention_counts_only_verified_checkpoints(saved, tmp_path):
    _copy(saved, tmp_path, steps=(2, 4, 6, 8))
    for step in (6, 8):  # the newest two are corrupt
        _flip(tmp_path / mf.step_name(step) / SHARDS[0])
    (tmp_path / mf.step_name(3)).mkdir()  # an unfinished save older than the newest verified
    (tmp_path / mf.step_name(9)).mkdir()  # a save in flight
    assert [d.name for d in mf.prunable(tmp_path, keep=2)] == ["step-000003"]
    assert [d.name for d in mf.prunable(tmp_path, keep=1)] == ["step-000003", "step-000002"]
    mf.prune(tmp_path, keep=2)
    left = [d.name for _, d in mf.step_dirs(tmp_path)]
    assert left == ["step-000009", "step-000008", "step-000006", "step-000004", "step-000002"]
    assert mf.choose(tmp_path)[0].name == "step-000004"


class _Opens:
    """Unpickled, opens (creates) a file: what a crafted `.metadata` could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _stack_global(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling `module`.`name`(arg), the name resolved by find_class."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


def test_a_resealed_metadata_that_calls_code_is_refused_before_it_runs(saved, tmp_path):
    """DCP's index is a pickle and a manifest can be resealed by anyone: verify unpickles it
    with DCP's own types only, so a crafted one is refused and what it names never runs."""
    import hashlib
    import pickle

    from trainplan.bench.ckpt import safe_index

    folder = _copy(saved, tmp_path / "ck")
    safe_index.check(folder / ".metadata")  # the real index reads
    pwned = tmp_path / "PWNED"
    evil = pickle.dumps(_Opens(pwned))
    (folder / ".metadata").write_bytes(evil)
    _reseal(folder, lambda m: m["files"][".metadata"].update(
        bytes=len(evil), sha256=hashlib.sha256(evil).hexdigest()))
    manifest, why = mf.verify(folder)
    assert manifest is None and ".metadata names io.open" in why, why
    assert not pwned.exists()
    dotted = tmp_path / "dotted.pkl"  # through a module of DCP's, by a dotted name
    dotted.write_bytes(_stack_global("torch.distributed.checkpoint.metadata", "os.system",
                                     f"touch {pwned}"))
    with pytest.raises(safe_index.Refused, match="os.system"):
        safe_index.check(dotted)
    assert not pwned.exists()
