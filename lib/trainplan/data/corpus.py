"""Documents from a team's files: plain text, JSON lines or parquet, read as a stream.

A `.txt` (or `.md`) file is one document, whatever its size. A `.jsonl` file holds one JSON
object a line (at most `MAX_LINE_BYTES`), its document under `text_field` ("text" by
default). A `.parquet` file holds a string column `text_field`, one document a row (read in
record batches, with pyarrow). Files are read in the order given; a folder stands for the
files in it with those suffixes, sorted. Empty documents are skipped. A document is handed
on in pieces of at most `CHUNK_CHARS` characters (`Document.pieces`, cut by `cut`), so that
encoding one costs bounded memory, and a text file longer than that is read from disk in
pieces, never held whole. Bad input raises one `SpecError` line naming the file and, for
JSON lines, the line.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainplan.errors import ERROR_PREFIX, MAX_LINE, SpecError
from trainplan.loader import fit_line, quote

SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
CHUNK_CHARS = 2**20  # characters encoded at once: tokenizers takes ~100-200 bytes a character
MAX_LINE_BYTES = 2**26  # 64 MiB: one JSON line is read whole to be parsed
PARQUET_BATCH = 4096  # rows a record batch: a bounded slice of a large file in memory
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_LINE_CUT = re.compile(r"\S\n\S")  # read backwards: a line break between two non-spaces
_WORD_CUT = re.compile(r"\S \S")  # read backwards: a space between two non-spaces


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
    """The files `paths` name, folders expanded to their corpus files (sorted); at least one,
    and each once: a file named twice (the same path resolved, or a file also in a folder
    given, or a folder in another) is refused, as its documents would count twice."""
    files: list[Path] = []
    given: dict[Path, tuple[Path, Path]] = {}  # a file, resolved -> (path given, file)
    for p in map(Path, paths):
        before = len(files)
        try:
            mode = os.stat(p).st_mode
            if stat.S_ISDIR(mode):
                files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
        except (FileNotFoundError, NotADirectoryError):
            raise SpecError(f"corpus path {quote(str(p))} does not exist") from None
        except (OSError, ValueError) as err:  # a name too long, no permission; a NUL byte
            raise SpecError(f"corpus path {quote(str(p))} cannot be read "
                            f"({getattr(err, 'strerror', None) or 'not a path'})") from None
        if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
            raise SpecError(f"corpus path {quote(str(p))} is not a regular file or a folder; "
                            f"give files ({', '.join(SUFFIXES)}) or folders of them")
        if stat.S_ISREG(mode) and p.suffix not in SUFFIXES:
            raise SpecError(f"corpus file {str(p)!r} has suffix {p.suffix!r}; use one of "
                            f"{list(SUFFIXES)}")
        files += [] if stat.S_ISDIR(mode) else [p]
        for f in files[before:]:
            if (first := given.setdefault(f.resolve(), (p, f)))[1] is not f:
                raise SpecError(fit_line(
                    ["corpus file '", (first[1],), "' is given twice (in '", (first[0],),
                     "', then as '", (f,), "' in '", (p,), "'): its documents would count "
                     "twice; give each file once (a folder stands for the files under it)"],
                    MAX_LINE - len(ERROR_PREFIX)))
    if not files:
        raise SpecError(f"no corpus files ({', '.join(SUFFIXES)}) under {[str(p) for p in paths]}")
    return files


def cut(text: str, size: int) -> int:
    """How many characters of `text` the next piece takes: all, where `text` has at most
    `size`; else the most, up to `size`, that end just after a line break between two
    non-spaces, else just before a space between two non-spaces, else `size` (only the first
    `size` + 1 characters are looked at).

    Byte-level BPE pre-tokenizers (GPT-2's and Llama 3's patterns, the one `tokenize.train`
    makes) end a pre-token at the first two kinds of cut with or without the text after it,
    so the pieces encode to the ids of the whole text; a cut at `size` (no such place in a
    piece) may change the ids next to it. A tokenizer that adds a prefix to every text it
    encodes (Metaspace, sentencepiece-style) may differ by a token at the start of a piece."""
    if len(text) <= size:
        return len(text)
    back = text[size::-1]  # the first size + 1 characters, last first
    if m := _LINE_CUT.search(back):
        return size - m.start()  # just after the "\n"
    if m := _WORD_CUT.search(back):
        return size - m.start() - 1  # just before the " "
    return size


def _split(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, cut by `cut`."""
    pos = 0
    while pos < len(text):
        n = cut(text[pos:pos + size + 1], size)
        yield text[pos:pos + n]
        pos += n


def _open(path: Path):
    try:
        return path.open("rb")
    except OSError as err:
        raise SpecError(f"corpus file {quote(str(path))} cannot be read ({err.strerror})") \
            from None


def _file_pieces(path: Path, size: int) -> Iterator[str]:
    """The UTF-8 text of the file `path`, newlines made "\\n", in pieces of at most `size`
    characters cut by `cut`; read `size` bytes at a time, so at most ~2 `size` in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, held, offset = "", "", 0  # held: a "\r" at the end of a read, maybe half of "\r\n"
    try:
        with _open(path) as f:
            while True:
                data, pending = f.read(size), len(decoder.getstate()[0])
                try:
                    new = held + decoder.decode(data, final=not data)
                except UnicodeDecodeError as err:
                    raise SpecError(f"corpus file {quote(str(path))} is not UTF-8 text (byte "
                                    f"{offset - pending + err.start})") from None
                held = "\r" if data and new.endswith("\r") else ""
                buf += new[:len(new) - len(held)].replace("\r\n", "\n").replace("\r", "\n")
                while len(buf) > size or (buf and not data):
                    n = cut(buf[:size + 1], size)
                    yield buf[:n]
                    buf = buf[n:]
                if not data:
                    return
                offset += len(data)
    except OSError as err:  # a read error part way
        raise SpecError(f"corpus file {quote(str(path))} cannot be read ({err.strerror})") \
            from None


@dataclass(frozen=True, repr=False)  # no repr of megabytes of text
class Document:
    """A document of the file `path`: its `text`, or None for a text file too long to hold
    (more than `CHUNK_CHARS` bytes), read from `path` again each time its pieces are asked."""

    path: Path
    text: str | None = None

    def pieces(self) -> Iterator[str]:
        """The document's text, in order, in pieces of at most `CHUNK_CHARS` characters (`cut`):
        joined, they are the whole text."""
        if self.text is None:
            return _file_pieces(self.path, CHUNK_CHARS)
        return _split(self.text, CHUNK_CHARS)


def _checked(doc: str, where: str) -> str:
    """`doc`, if it is Unicode text (no lone surrogate, as JSON's "\\ud800" makes); else one
    line naming `where`."""
    try:
        doc.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SpecError(f"{where} holds {doc[err.start]!r} at character {err.start:,}, half of "
                        "a surrogate pair, not a character; give valid Unicode text") from None
    return doc


def _text(path: Path) -> Iterator[Document]:
    """The one document of a text file: held whole (its newlines made "\\n") where it has at
    most `CHUNK_CHARS` bytes, else left on disk to be read in pieces."""
    with _open(path) as f:
        try:
            data = f.read(CHUNK_CHARS + 1)
        except OSError as err:
            raise SpecError(f"corpus file {quote(str(path))} cannot be read ({err.strerror})") \
                from None
    if len(data) > CHUNK_CHARS:  # a long file: read in pieces when its text is asked for
        yield Document(path)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"corpus file {quote(str(path))} is not UTF-8 text (byte {err.start})") \
            from None
    yield Document(path, text.replace("\r\n", "\n").replace("\r", "\n"))  # universal newlines


class _TwiceKey(ValueError):
    """A JSON object that gives one key twice (json.loads would keep the last silently)."""


def _unique_keys(pairs: list[tuple]) -> dict:
    """An object's pairs as a dict, where no key comes twice; else `_TwiceKey` naming it."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        raise _TwiceKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _jsonl(path: Path, field: str) -> Iterator[Document]:
    with _open(path) as f:
        n = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            n += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise SpecError(f"{path}:{n} is a line of more than {MAX_LINE_BYTES:,} bytes, "
                                "the most one JSON line can be; give a longer document as a "
                                ".txt file of its own")
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw, object_pairs_hook=_unique_keys)
            except _TwiceKey as err:
                raise SpecError(f"{path}:{n} refused: key {quote(err.args[0], 40)} given twice; "
                                "a line holds one object, each key once") from None
            except RecursionError:
                raise SpecError(f"{path}:{n} is nested too deeply to read; a line holds one "
                                f"object with a string field {field!r}") from None
            except (ValueError, UnicodeDecodeError):
                raise SpecError(f"{path}:{n} is not a JSON object (JSON lines: one object a "
                                "line)") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise SpecError(f"{path}:{n} has no string field {field!r}; pass "
                                "--text-field NAME for another field")
            yield Document(path, _checked(obj[field], f"{path}:{n}"))


def _parquet(path: Path, field: str) -> Iterator[Document]:
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
    row, batches = 0, table.iter_batches(batch_size=PARQUET_BATCH, columns=[field])
    while True:
        try:
            batch = next(batches, None)
        except Exception as err:  # a damaged page part way through
            raise SpecError(f"corpus file {str(path)!r} is not a readable parquet file after "
                            f"row {row:,} ({type(err).__name__}: {quote(str(err), 60)})") \
                from None
        if batch is None:
            break
        for value in batch.column(0).to_pylist():
            if value is not None and not isinstance(value, str):
                raise SpecError(f"corpus file {str(path)!r}: column {field!r} holds "
                                f"{type(value).__name__}, not text")
            row += 1
            yield Document(path, _checked(value or "", f"corpus file {str(path)!r}, row {row},"))


def documents(files: list[Path], text_field: str = "text") -> Iterator[Document]:
    """Every document of `files` that holds more than whitespace, in order."""
    for path in files:
        if path.suffix == ".jsonl":
            docs = _jsonl(path, text_field)
        elif path.suffix == ".parquet":
            docs = _parquet(path, text_field)
        else:
            docs = _text(path)
        for doc in docs:
            if any(not piece.isspace() for piece in doc.pieces()):
                yield doc
