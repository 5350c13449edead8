"""Checkpoint folders on disk: the manifest, verification, choice, retention, per-rank state.

Plain files and hashes, no process group: `ckpt.py` drives these from rank
0 (manifest, verification, pruning) or from every rank (per-rank state), and
the fault tests call them directly on copies of real checkpoints.

A checkpoint folder `step-NNNNNN` is complete when `manifest.json` is in it;
the manifest lists every other file of the folder with its sha256 and size,
carries a sha256 of its own canonical content (sorted keys, no spaces), and
is written last (temporary name, fsync, rename, directory fsync). A folder
without it is an unfinished save; a folder that does not verify (`verify`:
the manifest's own checksum, no duplicate keys, every file listed and every
listed file present with its size and sha256, every shard DCP's `.metadata`
names listed, the ranks' files agreeing with the world size and step) is
corrupt. Either is skipped at resume, and the one before is tried.
Retention counts only checkpoints that verify.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MANIFEST = "manifest.json"
FORMAT = 2  # of the manifest: 2 carries its own checksum; 1 (trainplan 0.1) did not
MAX_JSON_BYTES = 64 << 20  # a manifest of 100,000 files is about 15 MB
_STEP_DIR = re.compile(r"step-(\d{6,})")
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's FileSystemWriter: __RANK_N.distcp
_RANK_FILE = re.compile(r"rank-(\d{5,})(\.files)?\.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Unverified(Exception):
    """Why a folder is not a verified checkpoint (one short line)."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step folder under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def file_entry(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": path.stat().st_size}


def write_json(path: Path, obj, before_rename=None) -> None:
    """Write JSON durably: temporary name, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, default=str)  # e.g. an optimizer option that is not a number
        f.flush()
        os.fsync(f.fileno())
    if before_rename:
        before_rename()
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:60]!r}")
        out[key] = value
    return out


def read_json(path: Path, limit: int = MAX_JSON_BYTES, raw: bytes | None = None):
    """A checkpoint's JSON file (or its bytes `raw`, already read): at most `limit` bytes,
    UTF-8, no key twice in an object. ValueError (or OSError) says what is wrong."""
    size = path.stat().st_size if raw is None else len(raw)
    if size > limit:
        raise ValueError(f"{size} bytes, over the {limit}-byte cap")
    raw = path.read_bytes() if raw is None else raw
    return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)


def checksum(manifest: dict) -> str:
    """"sha256:HEX" of the manifest's canonical JSON (keys sorted, no spaces, ASCII), without
    its "checksum" field: what a reader recomputes from the parsed file."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def build(path: Path, *, step: int, world: int, **fields) -> dict:
    """The sealed manifest of step folder `path`: format, step, world size, `fields`, and every
    file in it (shards as the ranks' `rank-*.files.json` listed them, the rest hashed here),
    with its own checksum. ValueError if a file would be left out (a shard no rank hashed)."""
    files = {}
    for listing in sorted(path.glob("rank-*.files.json")):
        files.update(read_json(listing))
    present = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    files.update({n: file_entry(path / n) for n in present
                  if n not in files and not _SHARD.fullmatch(n)})
    unlisted = [n for n in present if n not in files]
    if unlisted:
        raise ValueError(f"{path.name}: {_names(unlisted)} hashed by no rank")
    manifest = {"format": FORMAT, "step": step, "world_size": world, **fields,
                "files": {n: files[n] for n in sorted(files)}}
    manifest = json.loads(json.dumps(manifest, default=str))  # as a reader will parse it
    return {**manifest, "checksum": checksum(manifest)}


def _names(names, most: int = 3) -> str:
    shown = ", ".join(list(names)[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _int(value, name: str, least: int) -> int:
    if type(value) is not int or value < least:  # noqa: E721 (bool and float are not ints here)
        raise Unverified(f"manifest malformed ({name} = {str(value)[:40]!r})")
    return value


def read_manifest(directory: Path, raw: bytes | None = None) -> dict:
    """The manifest of `directory` (or `raw`, its bytes already read), parsed, its checksum
    and fields checked; Unverified says why not. The folder's files are not read."""
    try:
        manifest = read_json(directory / MANIFEST, raw=raw)
    except FileNotFoundError:
        raise Unverified("no manifest (an unfinished save)") from None
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError included
        raise Unverified(f"manifest unreadable ({str(err)[:80]})") from None
    except RecursionError:  # [[[[...: json's decoder recurses once a level
        raise Unverified("manifest unreadable (nested too deeply)") from None
    if not isinstance(manifest, dict):
        raise Unverified("manifest malformed (not a JSON object)")
    if "checksum" not in manifest:
        if manifest.get("format") == 1:
            raise Unverified("manifest of format 1 (trainplan 0.1) has no checksum of its own: "
                             "not trusted")
        raise Unverified("manifest has no checksum")
    if manifest["checksum"] != checksum(manifest):
        raise Unverified("manifest checksum mismatch (corrupted or edited)")
    if manifest.get("format") != FORMAT:
        raise Unverified(f"manifest format {str(manifest.get('format'))[:20]!r} is not "
                         f"{FORMAT} (another trainplan)")
    step = _int(manifest.get("step"), "step", 0)
    _int(manifest.get("world_size"), "world_size", 1)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise Unverified("manifest malformed (no files)")
    for name, entry in files.items():
        if (not isinstance(entry, dict) or set(entry) != {"sha256", "bytes"}
                or not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"])):
            raise Unverified(f"manifest malformed (entry of {name[:40]!r})")
        _int(entry["bytes"], f"bytes of {name[:40]}", 0)
        if Path(name).name != name or name in (MANIFEST, ".", ".."):
            raise Unverified(f"manifest names {name[:40]!r}, not a file of its folder")
    if directory.name != step_name(step):
        raise Unverified(f"manifest says step {step}: not this folder's")
    return manifest


def _check_listing(directory: Path, files: dict, world: int) -> None:
    """Every file of the folder listed, every listed file there at its size, and the ranks'
    files those of `world` ranks."""
    present = {p.name: p for p in directory.iterdir() if p.name != MANIFEST}
    unlisted, missing = set(present) - set(files), set(files) - set(present)
    if unlisted:
        raise Unverified(f"{_names(sorted(unlisted))} in the folder but not in the manifest")
    if missing:
        raise Unverified(f"{_names(sorted(missing))} missing")
    for name, entry in files.items():
        if not present[name].is_file():
            raise Unverified(f"{name} is not a file")
        size = present[name].stat().st_size
        if size != entry["bytes"]:
            raise Unverified(f"{name} is {size} bytes, manifest says {entry['bytes']} "
                             "(truncated?)")
    ranks = {int(m.group(1)) for n in files if (m := _RANK_FILE.fullmatch(n))}
    shards = {int(m.group(1)) for n in files if (m := _SHARD.fullmatch(n))}
    need = {f"rank-{r:05d}.json" for r in range(world)} | {".metadata"}
    if need - set(files) or max(ranks | shards, default=0) >= world:
        raise Unverified(f"manifest says world size {world}, its files are of ranks "
                         f"{sorted(ranks | shards)[:8]}")


def _check_hashes(directory: Path, files: dict) -> None:
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:  # hashlib frees the GIL
        got = dict(zip(files, pool.map(lambda n: file_entry(directory / n)["sha256"], files),
                       strict=True))
    for name, entry in files.items():
        if got[name] != entry["sha256"]:
            raise Unverified(f"{name} sha256 mismatch (corrupted)")


def _check_contents(directory: Path, manifest: dict) -> None:
    """The ranks' own files agree with the manifest's step and world size, and every shard
    DCP's index (`.metadata`, read only now that its sha256 matched) names is listed and
    long enough."""
    step, world, files = manifest["step"], manifest["world_size"], manifest["files"]
    for r in range(world):
        try:
            own = read_json(directory / f"rank-{r:05d}.json")
            agree = (own.get("step"), own.get("rank"), own.get("world_size")) == (step, r, world)
        except (OSError, ValueError, AttributeError) as err:
            raise Unverified(f"rank-{r:05d}.json unreadable ({str(err)[:60]})") from None
        if not agree:
            raise Unverified(f"rank-{r:05d}.json is not of rank {r} of {world} at step {step}")
    from torch.distributed.checkpoint import FileSystemReader

    from trainplan.bench.ckpt import safe_index

    try:
        safe_index.check(directory / ".metadata")  # before DCP's own pickle.load
    except safe_index.Refused as err:
        raise Unverified(f".metadata names {str(err)[:80]}, not one of DCP's types: "
                         "not read") from None
    except Exception as err:  # noqa: BLE001 (whatever unpickling a bad file raises)
        raise Unverified(f".metadata unreadable ({type(err).__name__})") from None
    try:
        index = FileSystemReader(str(directory)).read_metadata().storage_data
        ends = [(info.relative_path, info.offset + info.length) for info in index.values()]
    except Exception as err:  # noqa: BLE001 (whatever DCP's unpickling raises: not loadable)
        raise Unverified(f".metadata unreadable ({type(err).__name__})") from None
    unlisted = {path for path, _ in ends if path not in files}
    if unlisted:
        raise Unverified(f"shard(s) {_names(sorted(unlisted))} named by .metadata not in "
                         "the manifest")
    short = {path for path, end in ends if end > files[path]["bytes"]}
    if short:
        raise Unverified(f".metadata reads past the end of {_names(sorted(short))}")


def verify(directory: Path, raw: bytes | None = None,
           contents: bool = True) -> tuple[dict | None, str]:
    """(manifest, "") if the checkpoint is complete and intact, else (None, why): the checks
    of the module docstring, cheapest first, so a damaged manifest costs no file reads.
    `raw`: the manifest's bytes where the caller has read them already. `contents=False`
    stops before the checks that read the files (sha256, the ranks' files, `.metadata`):
    the manifest and the folder's listing and sizes only, so a folder it refuses `verify`
    refuses too, with the same reason, and one it passes may still fail them."""
    try:
        manifest = read_manifest(directory, raw)
        _check_listing(directory, manifest["files"], manifest["world_size"])
        if contents:
            _check_hashes(directory, manifest["files"])
            _check_contents(directory, manifest)
    except Unverified as why:
        return None, str(why)
    except OSError as err:  # the folder changed or vanished while being read
        return None, f"unreadable ({str(err)[:80]})"
    return manifest, ""


def skipped_line(skipped: list[tuple[str, str]], budget: int = 160) -> str:
    """"step-A, step-B: why; step-C: why" (folders with the same reason together), within
    about `budget` characters, then "and N more folder(s)"."""
    groups: dict[str, list[str]] = {}
    for name, why in skipped:
        groups.setdefault(why[:70], []).append(name)
    parts, shown = [], 0
    for why, names in groups.items():
        part = f"{_names(names, most=4)}: {why}"
        if parts and sum(len(p) + 2 for p in parts) + len(part) > budget:
            break
        parts.append(part)
        shown += len(names)
    rest = len(skipped) - shown
    return "; ".join(parts) + (f"; and {rest} more folder(s)" if rest else "")


def _short(root: Path, most: int = 60) -> str:
    text = str(root)
    return text if len(text) <= most else "..." + text[-most + 3:]


def newest(root: Path, contents: bool = True) -> tuple[Path | None, dict | None, list]:
    """The newest verified checkpoint under `root` (or None), its manifest, and [(name, why)]
    of the newer step folders that do not verify; `contents`: as `verify`'s."""
    skipped = []
    for _, directory in step_dirs(root):
        manifest, why = verify(directory, contents=contents)
        if manifest is not None:
            return directory, manifest, skipped
        skipped.append((directory.name, why))
    return None, None, skipped


def choose(root: Path, contents: bool = True) -> tuple[Path | None, dict | None, str]:
    """`newest`'s checkpoint and manifest, and one line saying why (at most about 300
    characters, however many folders were skipped)."""
    directory, manifest, skipped = newest(root, contents)
    if manifest is not None:
        n = len(manifest["files"])
        size = sum(e["bytes"] for e in manifest["files"].values()) / 1e6
        line = (f"resuming from {directory.name} ({n} files, {size:.2f} MB verified, "
                f"saved by {manifest['world_size']} rank(s))")
        return directory, manifest, line + (f"; skipped {skipped_line(skipped)}"
                                             if skipped else "")
    line = f"no verified checkpoint in {_short(root)}"
    return None, None, line + (f" ({skipped_line(skipped)})" if skipped else "")


def committed(root: Path) -> list[str]:
    """Names of the step folders under `root` that hold a manifest (claim to be complete),
    newest first, whether or not they verify."""
    return [d.name for _, d in step_dirs(root) if (d / MANIFEST).exists()]


def prunable(root: Path, keep: int,
             verified: Callable[[Path], bool] | None = None) -> list[Path]:
    """The folders retention deletes: everything older than the `keep`-th newest checkpoint
    that verifies, and unfinished saves older than the newest that verifies. Only verified
    checkpoints count, so the newest verified one is never chosen; a corrupt folder newer
    than the kept ones stays, and a save in flight (always newer than every verified one)
    too. `verified(dir)`: `verify` by default; the checkpointer passes one that remembers
    the folders it committed or already verified."""
    verified = verified or (lambda d: verify(d)[0] is not None)
    dirs = step_dirs(root)
    good = []
    for i, (_, d) in enumerate(dirs):
        if (d / MANIFEST).exists() and verified(d):
            good.append(i)
            if len(good) == keep:
                break
    if not good:
        return []
    older = [d for _, d in dirs[good[-1] + 1:]] if len(good) == keep else []
    return older + [d for _, d in dirs[good[0] + 1:]
                    if not (d / MANIFEST).exists() and d not in older]


def remove(dirs: list[Path]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def prune(root: Path, keep: int) -> list[str]:
    """Delete what `prunable` names, now; return the names."""
    doomed = prunable(root, keep)
    remove(doomed)
    return [d.name for d in doomed]


# ---------------------------------------------------------------- per-rank state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rank_state(step: int, rank: int, world: int, device) -> dict:
    """This rank's RNG states and data position, as JSON (no pickle)."""
    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, pygauss = random.getstate()
    rng = {"torch": _b64(torch.get_rng_state()),
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
           "python": [version, list(mt), pygauss]}
    if device.type == "cuda":
        rng["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return {"step": step, "rank": rank, "world_size": world, "rng": rng,
            "data": {"steps_consumed": step}}


def restore_rank_state(state: dict, device) -> None:
    import numpy as np

    rng = state["rng"]
    torch.set_rng_state(_unb64(rng["torch"]))
    name, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, mt, pygauss = rng["python"]
    random.setstate((version, tuple(mt), pygauss))
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(_unb64(rng["cuda"]), device)
