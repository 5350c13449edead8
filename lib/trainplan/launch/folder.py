"""The folder `trainplan launch --out` writes: checked before anything is computed, written at once.

`check_out_dir` refuses, in one line, a folder that would lose files or cannot be made where
it is named (a name the OS cannot look at, too long for the file system, in a folder this
user cannot write in, or "." and ".."); `check_inputs` one that is, holds or would replace
part of what the job reads (its data, specs, plan, or the checkpoints and logs of a run
started in it); `write` puts the artefacts into a temporary folder
beside it and renames that into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from trainplan.errors import ERROR_PREFIX, MAX_LINE, TrainplanError
from trainplan.loader import fit_line, long_name, nearest_existing, quote

TEMP_EXTRA = len("..old.") + 8  # `write`'s folders beside --out: .NAME.old.XXXXXXXX (mkdtemp)
# What the scripts make in the folder they are started from (torchrun.sh: $PWD, Slurm:
# $SLURM_SUBMIT_DIR), and a restarted or resubmitted job reads back: --out keeps them.
RUN_FOLDERS = ("checkpoints", "logs")


class OutDirError(TrainplanError):
    """An --out folder that would lose files, or that cannot be made where it is named."""


def check_out_dir(out: Path, force: bool, inputs: list[tuple[str, str | Path]] = ()) -> None:
    """Refuse a folder that would lose files, or that cannot be made where it is named
    (`loader.nearest_existing`; ".", ".." and "/" are no folder of its own; names below it
    checked for length, the temporary folders' included; probed with a folder made and
    removed in its nearest existing parent), or would replace one of `inputs`
    (`check_inputs`, before --force is asked for), before anything is computed or written."""
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
    check_inputs(out, inputs)
    if full and not force:
        raise OutDirError(f"--out {quote(str(out))} exists and is not empty; add --force to "
                          "replace it, or name a new folder")


def _forms(path) -> set[Path]:
    """`path` made absolute as given ("x/.." folded) and with its links resolved."""
    forms = {Path(os.path.abspath(path))}
    try:
        forms.add(Path(os.path.realpath(path)))
    except (OSError, ValueError):  # a name the OS cannot look at
        pass
    return forms


def check_inputs(out: Path, inputs: list[tuple[str, str | Path]]) -> None:
    """Refuse an --out that is or holds one of `inputs` ((how it was named, path): what the
    job or launch reads), or lies inside one and exists (replacing it deletes part of it),
    compared as given and with links resolved; or one holding `RUN_FOLDERS`."""
    out = Path(out)
    exists = os.path.lexists(out)
    for label, path in inputs:
        for o in _forms(out):
            for p in _forms(path):
                if o == p or o in p.parents:
                    what = "is" if o == p else "holds"
                    harm = "delete it"
                elif exists and p in o.parents:
                    what, harm = "is inside", "delete part of it"
                else:
                    continue
                raise OutDirError(fit_line(
                    ["--out '", (out,), f"' {what} {label} '", (path,), "', an input of "
                     f"this launch: replacing --out would {harm}; name another folder"],
                    MAX_LINE - len(ERROR_PREFIX)))
    for name in RUN_FOLDERS if exists else ():
        if os.path.lexists(out / name):
            raise OutDirError(fit_line(
                ["--out '", (out,), f"' holds {name}/, which the job writes and reads back "
                 "when started there: replacing --out would delete it; move it, or name "
                 "another folder"], MAX_LINE - len(ERROR_PREFIX)))


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
