"""Where a training run's outputs may go, checked before it starts.

Not inside the checkpoint folder: its step folders are replaced and deleted as checkpoints
are saved, and a folder its manifest does not list fails verification (`--log-dir`,
`--metrics`, `--export`; `trainplan export --out` inside `--ckpt`). `--metrics` is a file
that lines are appended to: a regular file this user can write, or a new name under a folder
this user can write in, and none of the run's inputs (inside a `--data` folder, the model,
the tokenizer, the `--init-from` weights). Paths are compared resolved, symlinks followed,
so another name for the same place is the same place. One `UsageError` line each.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainplan.errors import ERROR_PREFIX, MAX_LINE, UsageError
from trainplan.loader import fit_line, nearest_existing, shown

IN_CKPT = ("whose step folders are replaced and deleted as checkpoints are saved; name one "
           "outside it")


def resolved(path: str | Path) -> Path:
    """`path` absolute, its symlinks followed as far as they exist (as it is where the OS will
    not look it up: a loop of links, a NUL byte; the checks that open it say why)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return Path(path).absolute()


def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether `path` is `folder` or under it, both `resolved`."""
    return resolved(path).is_relative_to(resolved(folder))


def check_apart(flag: str, path: str | Path, others: list[tuple[str, str | Path | None, str]]
                ) -> None:
    """UsageError where `flag`'s `path` is inside one of `others`, (flag, path, why) each (a
    None path is not given), naming both flags and why that place is not for it."""
    for other_flag, other, why in others:
        if other is not None and inside(path, other):
            where = "is" if resolved(path) == resolved(other) else "is inside"
            raise UsageError(fit_line([f"{flag} ", (path,), f" {where} {other_flag} ",
                                       (other,), f", {why}"], MAX_LINE - len(ERROR_PREFIX)))


def check_metrics(path: str | Path) -> None:
    """UsageError where --metrics `path` cannot take appended lines: it exists and is not a
    regular file this user can write, or the nearest folder above it that exists (the ones
    between are made) is not a folder this user can write in."""
    found, why = nearest_existing(path)
    use = "name a file for the per-step lines (new, or a metrics file to append to)"
    if found is None:  # `why` is the OS's reason
        raise UsageError(f"--metrics {shown(path)} cannot be used ({why}); {use}")
    if found == Path(path).absolute():
        try:
            mode = os.stat(found).st_mode
        except OSError as err:  # a link to nowhere
            raise UsageError(f"--metrics {shown(path)} cannot be used ({err.strerror}); "
                             f"{use}") from None
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise UsageError(f"--metrics {shown(path)} is {what}; {use}")
        if not os.access(found, os.W_OK):
            raise UsageError(f"--metrics {shown(path)} is not writable here; {use}")
        return
    if why:
        raise UsageError(f"--metrics {shown(path)}: {shown(found)} is {why}; {use}")


def check_outputs(args, data: list[Path]) -> None:
    """The trainer's outputs apart from its checkpoints and inputs (above): --log-dir,
    --metrics and --export not inside --ckpt-dir; --metrics a file to append to, not inside
    `data` (the --data folders), the model, --tokenizer, --init-from or --export."""
    ckpt = [("--ckpt-dir", args.ckpt_dir, IN_CKPT)]
    for flag, path in (("--log-dir", args.log_dir), ("--export", args.export)):
        if path:
            check_apart(flag, path, ckpt)
    if not args.metrics:
        return
    check_metrics(args.metrics)
    read = "one of the run's inputs, which its lines would overwrite; name a file elsewhere"
    inputs = [("--data", str(folder), read) for folder in data]
    inputs += [(flag, path, read) for flag, path in (
        ("--model", args.model), ("--tokenizer", args.tokenizer), ("--init-from", args.init_from))
        if path and os.path.lexists(path)]  # a preset's name is no path
    made = "a new folder that the export makes after training; name a file elsewhere"
    check_apart("--metrics", args.metrics, ckpt + inputs + [("--export", args.export, made)])
