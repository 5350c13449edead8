"""Argument types and the parser class shared by every verb: bad input is one line, exit 2."""

from __future__ import annotations

import argparse
import math
import re

from trainplan.errors import UsageError
from trainplan.loader import quote

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
