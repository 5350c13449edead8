"""Every YAML and JSON file trainplan reads, read one bounded way.

Specs (models, GPUs, clusters, scenarios), suites, calibrations, plan files,
records and study journals all come through here, so that a hostile or careless
file costs bounded time and memory and fails with one line:

- the size is checked before anything is read (`MAX_SPEC_BYTES` for a spec,
  suite or calibration, `MAX_LOG_BYTES` for a record file or journal), and only
  regular files are opened (a FIFO or /dev/zero is refused, not read);
- the bytes must be UTF-8 (a leading byte-order mark is dropped);
- YAML aliases (`*name`, and so `<<: *name`) are refused outright: no committed
  file uses them, and an alias bomb of a few hundred bytes expands to gigabytes;
- nesting, string and number lengths are capped while parsing, duplicate keys
  are refused, and JSON's NaN/Infinity only where a format writes them;
- every message quotes at most `QUOTE` characters of the bad value (`quote`).
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
from pathlib import Path

import yaml

from trainplan.errors import SpecError

MAX_SPEC_BYTES = 2**20  # a spec, suite, calibration or plan file (the largest committed: 7 KB)
MAX_LOG_BYTES = 2**26  # a record file or study journal (the largest committed: 0.4 MB)
MAX_STRING = 2**16  # characters of one string value
MAX_NUMBER = 40  # characters of one number (2**128 has 39 digits)
MAX_DEPTH = 32  # nesting of lists and mappings in a YAML file
QUOTE = 80  # characters of a bad value that a message quotes


class _Repr(reprlib.Repr):
    def repr_int(self, x, level):  # repr() of a 5,000-digit int raises; its size says enough
        return repr(x) if x.bit_length() <= 128 else f"<a {x.bit_length()}-bit integer>"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, QUOTE, QUOTE, QUOTE
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 6


def quote(value, limit: int = QUOTE) -> str:
    """repr(value), cut to at most `limit` characters (nested values and long strings elided)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_CONTROL = {i: f"\\x{i:02x}" for i in (*range(32), 127)}  # a name's newline: not a new line


def shown(path, limit: int = 2 * QUOTE) -> str:
    """A path as a message names it, control characters escaped: whole, or its last
    `limit` characters."""
    text = str(path).translate(_CONTROL)
    return text if len(text) <= limit else "..." + text[-limit + 3:]


def fit_line(parts: list, limit: int) -> str:
    """`parts` joined into one message: strings as they are, each `(path,)` by `shown`, whole
    (up to `2 * QUOTE` characters) where the text then fits `limit` characters, else cut to
    its tail, the paths sharing equally what the strings leave (at least 12 characters
    each), so that what the message says about them stays in its one line."""
    paths = [p[0] for p in parts if isinstance(p, tuple)]

    def join(width: int) -> str:
        return "".join(shown(p[0], width) if isinstance(p, tuple) else p for p in parts)
    text = join(2 * QUOTE)
    if len(text) <= limit or not paths:
        return text
    fixed = sum(len(p) for p in parts if not isinstance(p, tuple))
    return join(max((limit - fixed) // len(paths), 12))


def nearest_existing(path: str | Path) -> tuple[Path | None, str | None]:
    """Where a folder `path` would be made: the nearest of `path` (made absolute) and its
    parents that exists (a dangling link does), and None where that is a folder this user
    can write in and search (os.access W_OK | X_OK), else "not a folder" or "not writable".
    (None, why) where a name cannot be looked at: the OS's reason ("File name too long",
    "Permission denied" for a folder above that cannot be searched), or "not a path" (a NUL
    byte). Nothing is made."""
    def exists(p: Path) -> bool:
        try:
            p.stat()
        except (FileNotFoundError, NotADirectoryError):  # not there, or under a file
            return p.is_symlink()  # a link to nowhere still takes the name
        return True

    try:
        probe = Path(path).absolute()
        while probe != probe.parent and not exists(probe):
            probe = probe.parent
        if not probe.is_dir():
            return probe, "not a folder"
        return probe, None if os.access(probe, os.W_OK | os.X_OK) else "not writable"
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        return None, getattr(err, "strerror", None) or "not a path"


def long_name(path: str | Path, above: Path, extra: int = 0) -> str | None:
    """Where a name `path` would make below its existing folder `above` is longer than that
    file system takes (PC_NAME_MAX bytes; 255 where it will not say), the last name counted
    `extra` bytes longer (a temporary name made from it): "the name ... (N bytes) is too
    long; at most M bytes here"; else None."""
    try:
        most = os.pathconf(above, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    made = Path(path).absolute().relative_to(above).parts
    for i, name in enumerate(made):
        room, size = most - (extra if i == len(made) - 1 else 0), len(os.fsencode(name))
        if size > room:
            return f"the name {quote(name, 40)} ({size:,} bytes) is too long; at most {room} " \
                   "bytes here"
    return None


def read_text(path: str | Path, *, max_bytes: int = MAX_SPEC_BYTES, error=SpecError,
              what: str = "file") -> str:
    """The UTF-8 text of the regular file `path`, at most `max_bytes` bytes; else one `error`."""
    path = Path(path)
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{shown(path)} is a folder, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{shown(path)} is not a regular file; give a {what}")
        if st.st_size > max_bytes:
            raise error(f"{shown(path)}: {st.st_size:,} bytes is too large for a {what}; "
                        f"at most {max_bytes:,}")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        why = ("no such file" if isinstance(err, FileNotFoundError) else
               getattr(err, "strerror", None) or "not a path")
        raise error(f"{shown(path)}: cannot read ({why})") from None
    if len(data) > max_bytes:  # grew while being read
        raise error(f"{shown(path)}: larger than {max_bytes:,} bytes; too large for a {what}")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        raise error(f"{shown(path)}: not UTF-8 text (byte 0x{data[err.start]:02x} at "
                    f"offset {err.start}); a {what} is UTF-8 text") from None


# ---------------------------------------------------------------- YAML


class _Refused(Exception):
    """A bound crossed while parsing; the message says which, the caller adds the file."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with no aliases, bounded nesting, bounded scalars, unique keys."""

    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        where = f"line {event.start_mark.line + 1}" + (
            f" ({quote(index.value, 40)[1:-1]})" if isinstance(index, yaml.ScalarNode) else "")
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"{where}: an alias (*{quote(event.anchor, 40)[1:-1]}); aliases are "
                           "not read, write the value out")
        if self.depth >= MAX_DEPTH:
            raise _Refused(f"{where}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_STRING:
            raise _Refused(f"{where}: a value of {len(event.value):,} characters; at most "
                           f"{MAX_STRING:,}")
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if isinstance(node, yaml.ScalarNode) and node.tag.endswith((":int", ":float")) \
                and len(node.value) > MAX_NUMBER:
            raise _Refused(f"{where}: a number of {len(node.value)} characters "
                           f"({quote(node.value, 40)}); at most {MAX_NUMBER}")
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise _Refused(f"line {key.start_mark.line + 1}: key "
                                   f"{quote(key.value, 40)} given twice")
                seen.add(key.value)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, source: str, *, error=SpecError):
    """The value of YAML `text` (one document), bounded; `source` names it in messages."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except _Refused as err:
        raise error(f"{source}: refused: {err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(err.problem or err.context or "").split())
        raise error(f"{source}: not valid YAML ({problem[:QUOTE]}{at})") from None
    except (yaml.YAMLError, ValueError, RecursionError) as err:
        raise error(f"{source}: not valid YAML ({quote(' '.join(str(err).split()))})") from None


def load_yaml(path: str | Path, *, max_bytes: int = MAX_SPEC_BYTES, error=SpecError,
              what: str = "YAML file"):
    """The value of the YAML file `path`, read and parsed within the bounds above."""
    text = read_text(path, max_bytes=max_bytes, error=error, what=what)
    return parse_yaml(text, shown(path), error=error)


# ---------------------------------------------------------------- JSON


def _unique(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"key {quote(key, 40)} given twice")
    return out


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER:
        raise _Refused(f"a number of {len(text)} digits; at most {MAX_NUMBER}")
    return int(text)


def _float(text: str) -> float:
    value = float(text[:MAX_NUMBER + 1])
    if len(text) > MAX_NUMBER or not math.isfinite(value):
        raise _Refused(f"number {quote(text, 40)} is not a finite number of at most "
                       f"{MAX_NUMBER} characters")
    return value


def _no_constant(name: str):
    raise _Refused(f"{name} is not a finite number; this file holds finite numbers only")


def _long_string(value) -> bool:
    """Whether any string in the parsed `value` (keys included) is over MAX_STRING."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if len(v) > MAX_STRING:
                return True
        elif isinstance(v, dict):
            stack += list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            stack += v
    return False


def parse_json(text: str, source: str, *, error=SpecError, constants: bool = False):
    """The value of JSON `text`: unique keys, numbers of at most MAX_NUMBER characters, strings
    of at most MAX_STRING; NaN and Infinity only with `constants` (Optuna writes them)."""
    try:
        value = json.loads(text, object_pairs_hook=_unique, parse_int=_int,
                           parse_float=_float, **({} if constants else
                                                  {"parse_constant": _no_constant}))
    except _Refused as err:
        raise error(f"{source}: refused: {err}") from None
    except json.JSONDecodeError as err:
        raise error(f"{source}: not valid JSON ({err.msg} at line {err.lineno} column "
                    f"{err.colno})") from None
    except RecursionError:
        raise error(f"{source}: refused: nested too deeply") from None
    except ValueError as err:
        raise error(f"{source}: not valid JSON ({quote(str(err))})") from None
    if len(text) > MAX_STRING and _long_string(value):
        raise error(f"{source}: refused: a string of more than {MAX_STRING:,} characters")
    return value


def load_json(path: str | Path, *, max_bytes: int = MAX_SPEC_BYTES, error=SpecError,
              what: str = "JSON file", constants: bool = False):
    """The value of the JSON file `path`, read and parsed within the bounds above."""
    text = read_text(path, max_bytes=max_bytes, error=error, what=what)
    return parse_json(text, shown(path), error=error, constants=constants)


def json_lines(path: str | Path, *, error=SpecError, what: str = "JSON-lines file",
               constants: bool = False, max_bytes: int = MAX_LOG_BYTES) -> list:
    """[(line number, value)] of a file of one JSON value a line (blank lines skipped).

    A last line without its newline (a write cut short) is parsed like the others."""
    text = read_text(path, max_bytes=max_bytes, error=error, what=what)
    name = shown(path)
    return [(n, parse_json(line, f"{name}:{n}", error=error, constants=constants))
            for n, line in enumerate(text.split("\n"), start=1) if line.strip()]


def is_file_of(path: str | Path, magic: bytes) -> bool:
    """Whether the regular file `path` starts with `magic` (a format's signature)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False
