"""Field checks shared by the specs: types from the annotations, signs, ranges, curves.

Each check raises `SpecError` naming the field, the bad value (at most `loader.QUOTE`
characters of it) and what is valid; the ranges are `specs.bounds.FIELDS`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Literal

from trainplan.errors import SpecError
from trainplan.loader import quote
from trainplan.specs.bounds import MAX_NAME, field_range

CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")  # newlines, tabs, escapes, line separators
MAX_INT = 2**40  # any size field above this is a typo, and would overflow int64 arithmetic


def _check_field(spec: str, name: str, value, hint) -> None:
    """Raise SpecError unless `value` has the annotated type (and is positive if numeric)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use one of "
                            f"{list(allowed)}")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use true or false")
        return
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use a whole number")
        if abs(value) > MAX_INT:
            raise SpecError(f"{spec}.{name} = {quote(value)} is too large; use at most {MAX_INT:,}")
        return
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use a finite number")
        return
    if hint is tuple and not isinstance(value, (tuple, list)):
        raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use a list of rows")
    if hint is str and not isinstance(value, str):
        raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use a string")
    if isinstance(value, str) and CONTROL.search(value):  # names reach job scripts' lines
        raise SpecError(f"{spec}.{name} = {quote(value)} is not valid; use one line without "
                        "control characters")
    if name == "name" and len(value) > MAX_NAME:
        raise SpecError(f"{spec}.name = {quote(value)} is {len(value):,} characters; use at "
                        f"most {MAX_NAME}")


def check_fields(obj, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    spec = type(obj).__name__
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_field(spec, f.name, getattr(obj, f.name), hints[f.name])
    for name in positive:
        if getattr(obj, name) <= 0:
            raise SpecError(f"{spec}.{name} = {getattr(obj, name)!r} is not valid; it must be > 0")
    for name in non_negative:
        if getattr(obj, name) < 0:
            raise SpecError(f"{spec}.{name} = {getattr(obj, name)!r} is not valid; it must be >= 0")
    for f in dataclasses.fields(obj):
        bounds = field_range(spec, f.name)
        value = getattr(obj, f.name)
        if bounds and not bounds[0] <= value <= bounds[1]:
            low, high = (f"{b:,}" if isinstance(b, int) else f"{b:g}" for b in bounds)
            raise SpecError(f"{spec}.{f.name} = {value!r} is out of range; use {low} to {high}")


def number(value) -> float:
    """`value` as a float if it is a finite int or float (not a bool), else NaN, which fails
    every comparison: `number(row[1]) >= 0` is a whole check."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else math.nan


def is_row(row, n: int) -> bool:
    """Whether `row` is a list or tuple of `n` items (a row of a measured table)."""
    return isinstance(row, (tuple, list)) and len(row) == n


def check_rows(spec: str, name: str, rows, form: str, ok) -> None:
    """Raise SpecError naming the first row of table `name` for which `ok(row)` is false."""
    for row in rows:
        if not ok(row):
            raise SpecError(f"{spec}.{name} row {quote(row)} is not {form}")


def yaml11_float(value):
    """YAML 1.1 reads 2.6e11 (no sign in the exponent) as a string; take it as the number meant."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value



def check_seq_curve(name: str, rows) -> None:
    """Raise SpecError unless `rows` is ((seq > 0, fraction in (0, 1]), ...), seq increasing.

    The form of a measured attention efficiency table (`GPUSpec.attention_curve`: the
    sequence length and the dense-equivalent fraction of peak SDPA reached there).
    """
    last = 0.0
    for i, row in enumerate(rows):
        ok = isinstance(row, (tuple, list)) and len(row) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in row)
        if not ok or row[0] <= last or not 0 < row[1] <= 1:
            raise SpecError(f"{name}[{i}] = {quote(row)} is not valid; use (seq > 0, fraction of "
                            "peak in (0, 1]) in increasing seq order")
        last = row[0]


def check_curve(name: str, rows) -> None:
    """Raise SpecError unless `rows` is ((tokens > 0, width > 0, fraction in (0, 1]), ...)
    in strictly increasing (tokens, width) order.

    The form of a measured GEMM efficiency table (`GPUSpec.matmul_curve`:
    rows m, weight size n k, and the fraction of peak reached at that shape).
    """
    last = (0.0, 0.0)
    for i, row in enumerate(rows):
        ok = isinstance(row, (tuple, list)) and len(row) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in row)
        if not ok or min(row[0], row[1]) <= 0 or tuple(row[:2]) <= last or not 0 < row[2] <= 1:
            raise SpecError(f"{name}[{i}] = {quote(row)} is not valid; use (tokens > 0, width > 0, "
                            "fraction of peak in (0, 1]) in increasing (tokens, width) order")
        last = tuple(row[:2])
