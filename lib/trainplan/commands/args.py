"""Argument types and the parser class shared by every verb: bad input is one line, exit 2."""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from pathlib import Path

from trainplan.errors import UsageError
from trainplan.loader import long_name, nearest_existing, quote

MAX_WHOLE = 2**53  # floats stay exact below this; every size flag is far smaller in practice
ENDPOINT = re.compile(r"^[A-Za-z0-9_.:\[\]-]+:(\d{1,5})$")  # a c10d rendezvous's HOST:PORT


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage over several lines and exit
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _whole(text: str, low: int, kind: str) -> int:
    """A whole number >= `low`; '4e6' and '4_194_304' are accepted when they are whole."""
    try:
        value = float(text.replace("_", "")) if any(c in text for c in "eE.") else int(
            text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a {kind}") from None
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise argparse.ArgumentTypeError(f"{quote(text)} is not a {kind}")
        value = int(value)
    if value < low:
        bound = "> 0" if low == 1 else f">= {low}"
        raise argparse.ArgumentTypeError(f"{quote(text)} is not valid: it must be {bound}")
    if value > MAX_WHOLE:
        raise argparse.ArgumentTypeError(f"{quote(text)} is too large: at most {MAX_WHOLE:,}")
    return value


def positive_int(text: str) -> int:
    """A whole number > 0 (`_whole`)."""
    return _whole(text, 1, "positive whole number")


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (seeds, loader workers, warm-up steps)."""
    return _whole(text, 0, "whole number >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not valid: it must be a number > 0")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1): a share of something, e.g. of documents held out."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a fraction in [0, 1)")
    return value


def single_node_flags(args, flags: tuple[str, ...]) -> None:
    """Refuse (one line) any of `flags` (dest names) given to a one-node run: rendezvous
    flags are for --nnodes N > 1."""
    for flag in flags:
        if getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} = {quote(getattr(args, flag))} is "
                             "for multi-node runs; add --nnodes N > 1 or leave it out")


def check_endpoint(text: str) -> None:
    """Refuse (one line) a --rdzv-endpoint that is not HOST:PORT with a port in 1..65535."""
    m = ENDPOINT.match(text)
    if not m or not 1 <= int(m.group(1)) <= 65535:
        raise UsageError(f"--rdzv-endpoint = {quote(text)} is not HOST:PORT with a port in "
                         "1..65535")


def same_file(path) -> tuple:
    """What tells one file from another however it is named: (device, inode) of what `path`
    leads to, links followed; its resolved path where it cannot be looked at."""
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except (OSError, ValueError):  # not there, or a NUL byte
        return (os.path.realpath(path),)


def distinct_files(named) -> None:
    """Refuse (one line) a file given twice among `named`, (flag, path) pairs, however each
    names it (links, "./", hard links): its records would count twice."""
    seen = {}
    for flag, path in named:
        key = same_file(path)
        if key in seen:
            then = seen[key]
            raise UsageError(f"{then[0]} {quote(str(then[1]))} is given twice (then as {flag} "
                             f"{quote(str(path))}): its records would count twice; give each "
                             "file once")
        seen[key] = (flag, path)


def check_out_file(out, inputs=(), flag: str = "--out", extra: int = 0) -> None:
    """Refuse (one line), before any work, an output file that is one of `inputs` ((flag,
    path) pairs; `same_file`), that exists but is not a regular file (a folder, FIFO, device,
    a link to one or to nowhere), whose folder is not one this user can write in or make
    (`loader.nearest_existing`), or whose name, `extra` bytes longer (a temporary name beside
    it), is too long for the file system (`loader.long_name`)."""
    path, shown = Path(out), quote(str(out))
    found, why = nearest_existing(path)
    if found is None:  # `why`: the OS's reason
        raise UsageError(f"{flag} {shown} cannot be used ({why}); name a file in a folder you "
                         "can write to")
    if found == path.absolute():  # it exists, or is a link to nowhere
        try:
            mode = path.stat().st_mode
        except OSError:
            raise UsageError(f"{flag} {shown} is a link to nowhere; name a regular file or a "
                             "new one") from None
        if stat.S_ISDIR(mode):
            raise UsageError(f"{flag} {shown} is a folder; name the file to write in it")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{flag} {shown} is not a regular file (a FIFO, device or "
                             "socket); name a regular file or a new one")
        for given, source in inputs:
            if same_file(source) == same_file(path):
                raise UsageError(f"{flag} {shown} is the input {given} {quote(str(source))}; "
                                 "name another file (writing it would lose the input)")
        path = Path(os.path.realpath(path))  # what is written: the file a link leads to
        found, why = nearest_existing(path.parent)
    if why:
        raise UsageError(f"{flag} {shown}: {quote(str(found))} is {why}; name a file in a "
                         "folder you can write to")
    if too_long := long_name(path, found, extra):
        raise UsageError(f"{flag} {shown}: {too_long}")
