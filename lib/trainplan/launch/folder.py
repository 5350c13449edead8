"""The folder `trainplan launch --out` writes: checked before anything is computed, written at once.

`check_out_dir` refuses, in one line, a folder that would lose files or cannot be made where
it is named (a name the OS cannot look at, too long for the file system, in a folder this
user cannot write in, or "." and ".."); `write` puts the artefacts into a temporary folder
beside it and renames that into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.loader import long_name, nearest_existing, quote

TEMP_EXTRA = len("..old.") + 8  # `write`'s folders beside --out: .NAME.old.XXXXXXXX (mkdtemp)


class OutDirError(TrainplanError):
    """An --out folder that would lose files, or that cannot be made where it is named."""


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse a folder that would lose files, or that cannot be made where it is named
    (`loader.nearest_existing`; ".", ".." and "/" are no folder of its own; names below it
    checked for length, the temporary folders' included; probed with a folder made and
    removed in its nearest existing parent), before anything is computed or written."""
    out = Path(out)
    found, why = nearest_existing(out)
    if found is None:  # `why` is the OS's reason
        raise OutDirError(f"--out {quote(str(out))} cannot be used ({why}); name a folder you "
                          "can write to")
    if out.name in ("", ".."):  # ".", "/", "x/..": `write` cannot rename them
        raise OutDirError(f"--out {quote(str(out))} names no folder of its own; name one, "
                          "e.g. launch/")
    here = found == out.absolute()  # --out exists
    parent = found.parent if here else found
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trainplan-probe.", dir=parent))
    except OSError as err:
        raise OutDirError(f"--out {quote(str(out))}: cannot write in {quote(str(parent))} "
                          f"({err.strerror}); name a folder you can write to") from None
    if too_long := long_name(out, parent, TEMP_EXTRA):  # `write`'s temporary folders counted
        raise OutDirError(f"--out {quote(str(out))}: {too_long}")
    if here and why == "not a folder":
        raise OutDirError(f"--out {quote(str(out))} is a file; name a folder")
    try:
        full = here and any(out.iterdir())
    except OSError as err:  # a folder this user cannot list
        raise OutDirError(f"--out {quote(str(out))} cannot be used ({err.strerror}); name a "
                          "folder you can write to") from None
    if full and not force:
        raise OutDirError(f"--out {quote(str(out))} exists and is not empty; add --force to "
                          "replace it, or name a new folder")


def write(launch, out: Path, force: bool = False) -> Path:
    """Write `launch.files` (file name -> text, an `artefacts.Launch`) into `out` all at once:
    a temporary folder beside it, then a rename."""
    out = Path(out)
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    old = None
    try:
        for fname, text in launch.files.items():
            path = tmp / fname
            path.write_text(text)
            if fname.endswith((".sh", ".sbatch")):
                path.chmod(0o755)
        tmp.chmod(0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.rename(out, old / "d")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if (old / "d").exists() and not out.exists():
                os.rename(old / "d", out)  # the folder it replaced comes back, as it was
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old:
        shutil.rmtree(old)
    return out
