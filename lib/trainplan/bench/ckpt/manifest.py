"""Checkpoint folders on disk: the manifest, verification, choice, retention, per-rank state.

Plain files and hashes, no process group: `ckpt.py` drives these from rank
0 (manifest, verification, pruning) or from every rank (per-rank state), and
the fault tests call them directly on copies of real checkpoints.

A checkpoint folder `step-NNNNNN` is complete when `manifest.json` is in it;
the manifest lists every other file of the folder with its sha256 and size,
and is written last (temporary name, fsync, rename, directory fsync). A
folder without it is an unfinished save; a folder whose files disagree with
it is corrupt. Either is skipped at resume, and the one before is tried.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d{6,})")


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


def verify(directory: Path) -> tuple[dict | None, str]:
    """(manifest, "") if the checkpoint is complete and intact, else (None, why)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "no manifest (an unfinished save)"
    except (OSError, ValueError) as err:
        return None, f"manifest unreadable ({err})"
    try:
        files = {name: (int(e["bytes"]), str(e["sha256"])) for name, e in manifest["files"].items()}
        step, world = int(manifest["step"]), int(manifest["world_size"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        return None, f"manifest malformed ({type(err).__name__}: {err})"
    if directory.name != step_name(step) or world < 1:
        return None, f"manifest says step {step}, world size {world}: not this folder's"
    if ".metadata" not in files or any(Path(n).name != n for n in files):
        return None, "manifest lists no .metadata, or names outside its folder"
    for name, (want, _) in files.items():
        size = (directory / name).stat().st_size if (directory / name).is_file() else None
        if size is None:
            return None, f"{name} missing"
        if size != want:
            return None, f"{name} is {size} bytes, manifest says {want} (truncated?)"
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:  # hashlib frees the GIL
        got = dict(zip(files, pool.map(lambda n: file_entry(directory / n)["sha256"], files),
                       strict=True))
    for name, (_, want) in files.items():
        if got[name] != want:
            return None, f"{name} sha256 mismatch (corrupted)"
    return manifest, ""


def choose(root: Path) -> tuple[Path | None, dict | None, str]:
    """The newest verified checkpoint under `root`, its manifest, and one line saying why."""
    skipped = []
    for _, directory in step_dirs(root):
        manifest, why = verify(directory)
        if manifest is not None:
            n = len(manifest["files"])
            size = sum(e["bytes"] for e in manifest["files"].values()) / 1e6
            line = (f"resuming from {directory.name} ({n} files, {size:.2f} MB verified, "
                    f"saved by {manifest['world_size']} rank(s))")
            return directory, manifest, line + (f"; skipped {'; '.join(skipped)}" if skipped
                                                 else "")
        skipped.append(f"{directory.name}: {why}")
    line = f"no verified checkpoint in {root}; starting at step 0"
    return None, None, line + (f" (skipped {'; '.join(skipped)})" if skipped else "")


def prunable(root: Path, keep: int) -> list[Path]:
    """Complete checkpoints beyond the newest `keep`, and unfinished ones older than the
    newest complete one (a save in flight is always newer, so it is never chosen)."""
    dirs = step_dirs(root)
    complete = [(s, d) for s, d in dirs if (d / MANIFEST).is_file()]
    if not complete:
        return []
    newest = complete[0][0]
    doomed = [d for s, d in complete[keep:]]
    return doomed + [d for s, d in dirs if s < newest and not (d / MANIFEST).is_file()]


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
