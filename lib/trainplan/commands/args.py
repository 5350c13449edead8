"""Argument types and the parser class shared by every verb: bad input is one line, exit 2."""

from __future__ import annotations

import argparse
import math

from trainplan.errors import UsageError
from trainplan.loader import quote

MAX_WHOLE = 2**53  # floats stay exact below this; every size flag is far smaller in practice


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage over several lines and exit
        raise UsageError(f"{message} (see '{self.prog} --help')")


def positive_int(text: str) -> int:
    """A whole number > 0; '4e6' and '4_194_304' are accepted when they are whole."""
    try:
        value = float(text.replace("_", "")) if any(c in text for c in "eE.") else int(
            text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a positive whole number") from None
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise argparse.ArgumentTypeError(f"{quote(text)} is not a positive whole number")
        value = int(value)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not valid: it must be > 0")
    if value > MAX_WHOLE:
        raise argparse.ArgumentTypeError(f"{quote(text)} is too large: at most {MAX_WHOLE:,}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (seeds, loader workers, warm-up steps)."""
    return 0 if text.strip() in ("0", "+0", "-0") else positive_int(text)


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
