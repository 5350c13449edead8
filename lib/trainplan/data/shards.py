"""Token shards on disk: the format, the writer (`prepare`) and the reader (`open_shards`).

A prepared folder holds:

    index.json          what follows, and how to read it (below)
    tokenizer.json      the tokenizer the ids come from (a copy)
    train-00000.bin ... token ids of the training split, little-endian, `dtype`
    val-00000.bin ...   the held-out split, the same way

Each document's ids are followed by the tokenizer's end-of-document id (`eos_id`), and the
documents of a split follow each other across its shards in corpus order; a shard holds at
most `SHARD_TOKENS` ids. A long document is encoded in pieces (`corpus.cut`), its ids still
one run with one end-of-document id. `dtype` is uint16 where the vocabulary fits (at most
65,536 ids), else uint32. A document goes to the held-out split when a hash of its text
falls below `val_fraction` (BLAKE2b, 64 bits): the split depends on the text only, not on
the order or the number of files. index.json:

    {"format": "trainplan-token-shards", "version": 1, "dtype": "uint16", "vocab_size": V,
     "eos_id": E, "tokenizer": {"file": "tokenizer.json", "sha256": ...},
     "val_fraction": f, "text_field": "text", "sources": [{"path", "documents"}, ...],
     "splits": {"train": {"tokens", "documents", "shards": [{"file", "tokens", "sha256",
                                                             "max_id"}]}, "val": {...}}}

`max_id` is the largest id in the shard (older folders have none). The reader checks the
index (`data.shard_index`) and, against a model's vocabulary, each window of ids it reads.

The writer builds the folder beside its destination and renames it into place when done,
so a stopped run leaves nothing half-written (on an error, Ctrl-C or SIGTERM the partial
folder is removed), and it refuses a destination that exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from trainplan.data import corpus, tokenize
from trainplan.data.shard_index import FORMAT, VERSION, read_index
from trainplan.errors import SpecError
from trainplan.loader import long_name, nearest_existing, quote, shown

SPLITS = ("train", "val")
SHARD_TOKENS = 2**26  # 128 MiB of uint16 ids a shard
BATCH_DOCS = 256  # pieces of documents encoded together (tokenizers encodes a batch in parallel)
BATCH_CHARS = 2**22  # and at most this many characters (but for one longer piece)


def dtype_for(vocab_size: int) -> str:
    """"uint16" where every id fits in 16 bits, else "uint32"."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def held_out(text: str | Iterable[str], val_fraction: float) -> bool:
    """True when the document `text` (or its pieces, in order) goes to the held-out split: the
    64-bit BLAKE2b hash of its UTF-8 text, as a fraction of 2^64, is below `val_fraction`."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(digest_size=8)
    for piece in [text] if isinstance(text, str) else text:
        digest.update(piece.encode("utf-8"))
    return int.from_bytes(digest.digest(), "big") / 2**64 < val_fraction


class _SplitWriter:
    """Appends ids to one split's shards, `SHARD_TOKENS` a shard, hashing as it writes."""

    def __init__(self, folder: Path, split: str, dtype: str):
        self.folder, self.split, self.dtype = folder, split, np.dtype(dtype).newbyteorder("<")
        self.shards: list[dict] = []
        self.documents = self.tokens = 0
        self._file = None

    def _open(self):
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = (self.folder / name).open("wb")
        self.shards.append({"file": name, "tokens": 0, "sha256": hashlib.sha256(), "max_id": 0})

    def write(self, ids: np.ndarray, end_of_document: bool = True) -> None:
        self.documents += end_of_document
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] >= SHARD_TOKENS:
                self.close_shard()
                self._open()
            room = SHARD_TOKENS - self.shards[-1]["tokens"]
            part, ids = ids[:room].astype(self.dtype), ids[room:]
            data = part.tobytes()
            self._file.write(data)
            self.shards[-1]["sha256"].update(data)
            self.shards[-1]["tokens"] += len(part)
            self.shards[-1]["max_id"] = max(self.shards[-1]["max_id"], int(part.max()))
            self.tokens += len(part)

    def close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self) -> dict:
        self.close_shard()
        return {"tokens": self.tokens, "documents": self.documents,
                "shards": [{**s, "sha256": s["sha256"].hexdigest()} for s in self.shards]}


class _Piece(NamedTuple):
    path: Path  # the document's file
    text: str
    split: str  # the document's
    first: bool  # the document's first piece
    last: bool  # and its last


def _pieces(docs: Iterator[corpus.Document], val_fraction: float) -> Iterator[_Piece]:
    """The pieces of `docs` in order, each with its document's split (from a first pass over
    the document: its split is known before its first piece is written)."""
    for doc in docs:
        split = "val" if held_out(doc.pieces(), val_fraction) else "train"
        first, ahead = True, None
        for text in doc.pieces():
            if ahead is not None:
                yield _Piece(doc.path, ahead, split, first, False)
                first = False
            ahead = text
        yield _Piece(doc.path, ahead or "", split, first, True)


def _batches(pieces: Iterator[tuple]) -> Iterator[list[tuple]]:
    """`pieces` (text second) in lists of at most `BATCH_DOCS` and `BATCH_CHARS` characters."""
    batch, chars = [], 0
    for item in pieces:
        if batch and (len(batch) == BATCH_DOCS or chars + len(item[1]) > BATCH_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(item)
        chars += len(item[1])
    if batch:
        yield batch


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def _raise_terminated(signum, frame):
    raise _Terminated


@contextmanager
def _sigterm_raises():
    """While the block runs, SIGTERM raises `_Terminated` so that the block's cleanup runs;
    the process then ends by SIGTERM all the same. Only in the main thread, and only where
    SIGTERM has its default action (a caller's own handler is left alone)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    try:
        signal.signal(signal.SIGTERM, _raise_terminated)
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _remove(folder: Path) -> None:
    """Remove `folder` and what it holds, SIGTERM and SIGINT held back until it is gone."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def prepare(inputs: list[str | Path], out: str | Path, *, tokenizer: str | Path | None = None,
            vocab_size: int | None = None, val_fraction: float = 0.01,
            text_field: str = "text", progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenise the documents of `inputs` (`corpus`) into a shard folder `out`; its index.

    With `tokenizer` (a tokenizer.json) the ids are that tokenizer's; with `vocab_size` a
    byte-level BPE of that size is trained on the corpus first (a second pass over it).
    `progress(documents, tokens)` is called after each batch of documents (or pieces of one)."""
    out = Path(out)
    if (tokenizer is None) == (vocab_size is None):
        raise SpecError("give --tokenizer FILE (the model's tokenizer.json) or --vocab-size N "
                        "(train a byte-level BPE on the corpus), not both or neither")
    if not 0.0 <= val_fraction < 1.0:
        raise SpecError(f"--val-fraction {val_fraction} is not valid; use a number in [0, 1)")
    _check_out(out)
    files = corpus.expand(inputs)
    if text_field != "text" and not any(f.suffix in (".jsonl", ".parquet") for f in files):
        raise SpecError(f"--text-field {text_field!r} names a JSONL key or parquet column; "
                        "this corpus is plain text only: leave it out")
    if tokenizer is not None:
        tok = tokenize.load(tokenizer)
    else:  # in memory: nothing is on disk while it trains
        tok = tokenize.train((p for d in corpus.documents(files, text_field)
                              for p in d.pieces()), vocab_size)
    tmp = _partial(out)
    with _sigterm_raises():
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            index = _write(files, tmp, tok, tokenizer, val_fraction, text_field, progress)
            tmp.rename(out)
        except OSError as err:  # a folder that cannot be made, a full disk
            _remove(tmp)
            raise SpecError(f"--out {quote(str(out))}: cannot write "
                            f"{quote(str(err.filename or tmp))} ({err.strerror}); nothing was "
                            "written") from None
        except BaseException:
            _remove(tmp)
            raise
    return index


def _check_out(out: Path) -> None:
    """Refuse, before any work, an `out` that exists or cannot be looked at (a name too long,
    a folder above it that cannot be searched), whose nearest folder that exists is not
    one this user can write in, or where a new name (the partial folder's included) is
    longer than the file system takes."""
    above, why = nearest_existing(out)
    if above is None:  # `why` is the OS's reason
        raise SpecError(f"--out {quote(str(out))} cannot be used ({why}); give a new "
                        "folder where one can be made")
    if above == out.absolute():
        raise SpecError(f"--out {quote(str(out))} exists; give a new folder (nothing is "
                        "overwritten)")
    if why:
        raise SpecError(f"--out {quote(str(out))}: {quote(str(above))} is not a folder this "
                        "user can write in; give a new folder where one can be made")
    extra = len(os.fsencode(_partial(out).name)) - len(os.fsencode(out.name))
    if too_long := long_name(out, above, extra):  # the partial folder's name counted
        raise SpecError(f"--out {quote(str(out))}: {too_long}")


def _partial(out: Path) -> Path:
    """The folder the shards are written in before it is renamed `out`."""
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _write(files, tmp: Path, tok, tokenizer, val_fraction, text_field, progress) -> dict:
    tok_path = tmp / "tokenizer.json"
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tok_path)
    else:
        tok.save(str(tok_path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tokenize.eos_id(tok, tok_path)
    tok.encode_special_tokens = True  # a document's own "<|endoftext|>" is text, not a boundary
    lead, trail = tokenize.framing(tok)
    dtype = dtype_for(vocab)
    writers = {s: _SplitWriter(tmp, s, dtype) for s in SPLITS}
    per_file: dict[Path, int] = dict.fromkeys(files, 0)
    for batch in _batches(_pieces(corpus.documents(files, text_field), val_fraction)):
        for piece, enc in zip(batch, tok.encode_batch([p.text for p in batch]), strict=True):
            ids = enc.ids  # what `tok` adds to each text (`framing`): at the document's ends only
            if not (piece.first and piece.last):
                ids = ids[0 if piece.first else lead:len(ids) - (0 if piece.last else trail)]
            ids = np.fromiter(ids, dtype=np.int64, count=len(ids))
            writers[piece.split].write(np.append(ids, eos) if piece.last else ids, piece.last)
            per_file[piece.path] += piece.last
        if progress:
            progress(sum(w.documents for w in writers.values()),
                     sum(w.tokens for w in writers.values()))
    splits = {s: w.summary() for s, w in writers.items()}
    if not splits["train"]["documents"]:
        raise SpecError(f"the corpus {[str(f) for f in files][:3]} holds no document for the "
                        "training split (empty files, or every document held out)")
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": vocab,
             "eos_id": eos, "tokenizer": {"file": tok_path.name,
                                          "sha256": tokenize.sha256(tok_path)},
             "val_fraction": val_fraction, "text_field": text_field,
             "sources": [{"path": str(p), "documents": n} for p, n in per_file.items()],
             "splits": splits}
    (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


# ---------------------------------------------------------------- reading


@dataclass
class Shards:
    """A prepared folder: its index and one split's ids as read-only memory maps; with
    `vocab_size`, the model's, every window's ids are checked to be below it."""

    folder: Path
    index: dict
    split: str
    arrays: list[np.memmap]
    vocab_size: int | None = None

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.arrays)

    def window(self, start: int, length: int) -> np.ndarray:
        """`length` consecutive ids of the split from position `start` (across shards)."""
        out, pos, need = [], start, length
        for a in self.arrays:
            if need == 0:
                break
            if pos >= len(a):
                pos -= len(a)
                continue
            out.append(a[pos:pos + need])
            need -= len(out[-1])
            pos = 0
        got = np.concatenate(out) if out else np.empty(0, dtype=np.int64)
        if need:
            raise IndexError(f"window {start}+{length} is past the split's {self.tokens} ids")
        if self.vocab_size is not None and len(got) and int(got.max()) >= self.vocab_size:
            raise SpecError(f"{shown(self.folder)}: the {self.split} split holds id "
                            f"{int(got.max()):,} (at ids {start:,}..{start + length - 1:,}), "
                            f"outside the model's vocabulary of {self.vocab_size:,} though its "
                            f"index.json says vocab_size {self.index['vocab_size']:,}; prepare "
                            "the folder again with the model's tokenizer")
        return got.astype(np.int64)


def open_shards(folder: str | Path, split: str = "train", tokenizer: str | Path | None = None,
                vocab_size: int | None = None) -> Shards:
    """The `split` of a prepared folder, checked: its index (`shard_index.read_index`), every
    shard's size, and where given, that it was made with `tokenizer` (by SHA-256) and fits a
    model of `vocab_size` (the index's, then the ids of each window read)."""
    folder = Path(folder)
    index = read_index(folder, split)
    shards, dtype = index["splits"][split]["shards"], np.dtype(index["dtype"])
    try:
        digest = None if tokenizer is None else tokenize.sha256(Path(tokenizer))
    except OSError as err:  # missing, a folder, unreadable
        raise SpecError(f"--tokenizer = {str(tokenizer)!r} cannot be read ({err.strerror}); "
                        "name the tokenizer.json the shards were made with") from None
    if digest is not None and digest != index["tokenizer"]["sha256"]:
        raise SpecError(f"the shards in {str(folder)!r} were made with another tokenizer than "
                        f"{str(tokenizer)!r}; prepare them again with it")
    if vocab_size is not None and index["vocab_size"] > vocab_size:
        raise SpecError(f"the shards' tokenizer has {index['vocab_size']:,} ids, more than the "
                        f"model's vocabulary of {vocab_size:,}")
    arrays = []
    for s in shards:
        path = folder / s["file"]
        if not path.is_file() or path.stat().st_size != s["tokens"] * dtype.itemsize:
            raise SpecError(f"shard {str(path)!r} is missing or not {s['tokens']:,} ids long; "
                            "prepare the folder again")
        arrays.append(np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r") if s["tokens"]
                      else np.empty(0, dtype=dtype))  # an empty file cannot be mapped
    return Shards(folder, index, split, arrays, vocab_size)
