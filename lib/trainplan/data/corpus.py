"""Documents from a team's files: plain text, JSON lines or parquet, read as a stream.

A `.txt` (or `.md`) file is one document. A `.jsonl` file holds one JSON object a line,
its document under `text_field` ("text" by default). A `.parquet` file holds a string
column `text_field`, one document a row (read in record batches, with pyarrow). Files are
read in the order given; a folder stands for the files in it with those suffixes, sorted.
Empty documents are skipped. Bad input raises one `SpecError` line naming the file and,
for JSON lines, the line.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from trainplan.errors import SpecError

SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
PARQUET_BATCH = 4096  # rows a record batch: a bounded slice of a large file in memory
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The Python standard library's .py files (or those under `root`), sorted by relative
    path, tests and installed packages left out: text every machine with Python has."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP]  # site-packages is not walked
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def expand(paths: list[str | Path]) -> list[Path]:
    """The files `paths` name, folders expanded to their corpus files (sorted); at least one."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise SpecError(f"corpus file {str(p)!r} has suffix {p.suffix!r}; use one of "
                                f"{list(SUFFIXES)}")
            files.append(p)
        else:
            raise SpecError(f"corpus path {str(p)!r} does not exist")
    if not files:
        raise SpecError(f"no corpus files ({', '.join(SUFFIXES)}) under {[str(p) for p in paths]}")
    return files


def _text(path: Path) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"corpus file {str(path)!r} is not UTF-8 text (byte {err.start})") \
            from None


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise SpecError(f"{path}:{n} is not a JSON object (JSON lines: one object a "
                                "line)") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise SpecError(f"{path}:{n} has no string field {field!r}; pass "
                                "--text-field NAME for another field")
            yield obj[field]


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # pyarrow: loaded only for parquet corpora

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own and OSError kinds for a bad file
        raise SpecError(f"corpus file {str(path)!r} is not a readable parquet file "
                        f"({type(err).__name__})") from None
    names = table.schema_arrow.names
    if field not in names:
        raise SpecError(f"corpus file {str(path)!r} has no column {field!r} (columns: "
                        f"{names[:8]}); pass --text-field NAME")
    for batch in table.iter_batches(batch_size=PARQUET_BATCH, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is not None and not isinstance(value, str):
                raise SpecError(f"corpus file {str(path)!r}: column {field!r} holds "
                                f"{type(value).__name__}, not text")
            yield value or ""


def documents(files: list[Path], text_field: str = "text") -> Iterator[tuple[Path, str]]:
    """(file, document) for every non-empty document of `files`, in order."""
    for path in files:
        if path.suffix == ".jsonl":
            docs = _jsonl(path, text_field)
        elif path.suffix == ".parquet":
            docs = _parquet(path, text_field)
        else:
            docs = _text(path)
        for doc in docs:
            if doc.strip():
                yield path, doc
