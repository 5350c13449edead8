"""Field checks shared by the specs: types from the annotations, signs, ranges, tables.

Each check raises `SpecError` naming the field, the bad value (at most `loader.QUOTE`
characters of it) and what is valid; the ranges are `specs.bounds.FIELDS`, and a measured
table's columns `specs.bounds.TABLES` and `specs.bounds.CURVES`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Literal

from trainplan.errors import SpecError
from trainplan.loader import quote
from trainplan.specs.bounds import CURVES, FIELDS, MAX_NAME, TABLES, Names, OneOf, field_range

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
    """Raise SpecError naming the first field of spec `obj` of the wrong type, sign or range
    (`bounds.FIELDS`), or the first row of a table of it out of its columns' ranges
    (`bounds.TABLES`, `bounds.CURVES`)."""
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
        if (spec, f.name) in TABLES or (spec, f.name) in CURVES:
            check_value(f"{spec}.{f.name}", spec, f.name, value)


def number(value) -> float:
    """`value` as a float if it is a finite int or float (not a bool), else NaN, which fails
    every comparison: `number(row[1]) >= 0` is a whole check."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else math.nan


def is_row(row, n: int) -> bool:
    """Whether `row` is a list or tuple of `n` items (a row of a measured table)."""
    return isinstance(row, (tuple, list)) and len(row) == n


def yaml11_float(value):
    """YAML 1.1 reads 2.6e11 (no sign in the exponent) as a string; take it as the number meant."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def allowed_text(allowed) -> str:
    """What a table column allows, as a message says it."""
    if isinstance(allowed, Names):
        return allowed.shown
    if isinstance(allowed, OneOf):
        return "|".join(str(v).lower() if isinstance(v, bool) else str(v) for v in allowed)
    return " to ".join(_number_shown(b) for b in allowed)


def _number_shown(b) -> str:
    """A bound as a message writes it: 2^N for a large power of two, 1,024 or 1e-06."""
    if isinstance(b, int):
        return f"2^{b.bit_length() - 1}" if b >= 2**20 and b & (b - 1) == 0 else f"{b:,}"
    return f"{b:g}"


def _allows(allowed, value) -> bool:
    """Whether a table column that allows `allowed` (`allowed_text`) takes `value`."""
    if isinstance(allowed, Names):
        return isinstance(value, str) and allowed.pattern.fullmatch(value) is not None
    if isinstance(allowed, OneOf):
        return isinstance(value, (bool, int, float, str)) and value in allowed
    return allowed[0] <= number(value) <= allowed[1]


def _bad_column(row, columns) -> str | None:
    """Why `row` does not fit `columns` ((name, allowed) each), or None when it does."""
    if not is_row(row, len(columns)):
        return f"a row has {len(columns)} values"
    for (name, allowed), value in zip(columns, row, strict=True):
        if not _allows(allowed, value):
            return f"{name} = {quote(value, 40)}"
    return None


def check_table(label: str, columns, rows, error=SpecError) -> None:
    """Raise `error` naming the first row of table `label` that is not one value a column
    of `columns` ((name, allowed) each, `specs.bounds.TABLES`), each in its column's range."""
    form = ", ".join(f"{name} {allowed_text(allowed)}" for name, allowed in columns)
    for i, row in enumerate(rows):
        why = _bad_column(row, columns)
        if why:
            raise error(f"{label}[{i}] = {quote(row)} is not valid ({why}); use ({form})")


def check_curve(label: str, columns, rows, error=SpecError) -> None:
    """Raise `error` unless `rows` fit `columns` (`specs.bounds.CURVES`), as `check_table`
    checks them, in strictly increasing order of all columns but the last.

    The form of a measured efficiency table: `GPUSpec.matmul_curve` (rows m, weight size
    n k, fraction of peak reached at that shape) or `GPUSpec.attention_curve` (sequence
    length, dense-equivalent fraction of peak SDPA reaches there).
    """
    keys = [name for name, _ in columns[:-1]]
    last = None
    for i, row in enumerate(rows):
        why = _bad_column(row, columns)
        if why or (last is not None and tuple(row[:-1]) <= last):
            ranges = ", ".join(f"{name} {allowed_text(allowed)}" for name, allowed in columns)
            raise error(f"{label}[{i}] = {quote(row)} is not valid{f' ({why})' if why else ''}; "
                        f"use ({', '.join(f'{k} > 0' for k in keys)}, {columns[-1][0]}) in "
                        f"increasing ({', '.join(keys)}) order: {ranges}")
        last = tuple(row[:-1])


def check_value(label: str, spec: str, name: str, value, error=SpecError) -> None:
    """Raise `error` unless `value` is valid for field `name` of `spec` by `specs.bounds`: a
    curve's or a table's rows, or a number in its `FIELDS` range; `label` names it."""
    if (spec, name) in CURVES:
        check_curve(label, CURVES[(spec, name)], _rows(label, value, error), error)
    elif (spec, name) in TABLES:
        check_table(label, TABLES[(spec, name)], _rows(label, value, error), error)
    elif (spec, name) in FIELDS and not FIELDS[(spec, name)][0] <= number(value) \
            <= FIELDS[(spec, name)][1]:
        raise error(f"{label} = {quote(value)} is not valid; use a number from "
                    f"{allowed_text(FIELDS[(spec, name)])}")


def _rows(label: str, value, error):
    """`value` if it is a list of rows, else one `error`."""
    if not isinstance(value, (list, tuple)):
        raise error(f"{label} = {quote(value)} is not valid; use a list of rows")
    return value


def check_positions(spec, seq_len: int) -> None:
    """SpecError where a model with learned positions (`ModelSpec.positions`) has fewer rows
    in its position table (`max_positions`) than a sequence of `seq_len` tokens needs."""
    if spec.positions == "learned" and seq_len > spec.max_positions:
        raise SpecError(f"--seq-len {seq_len} is longer than model {spec.name!r} has learned "
                        f"positions for (max_positions {spec.max_positions}); use --seq-len "
                        f"{spec.max_positions} or less")
