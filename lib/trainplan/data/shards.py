"""Token shards on disk: the format, the writer (`prepare`) and the reader (`open_shards`).

A prepared folder holds:

    index.json          what follows, and how to read it (below)
    tokenizer.json      the tokenizer the ids come from (a copy)
    train-00000.bin ... token ids of the training split, little-endian, `dtype`
    val-00000.bin ...   the held-out split, the same way

Each document's ids are followed by the tokenizer's end-of-document id (`eos_id`), and the
documents of a split follow each other across its shards in corpus order; a shard holds at
most `SHARD_TOKENS` ids. `dtype` is uint16 where the vocabulary fits (at most 65,536 ids),
else uint32. A document goes to the held-out split when a hash of its text falls below
`val_fraction` (BLAKE2b, 64 bits): the split depends on the text only, not on the order or
the number of files. index.json:

    {"format": "trainplan-token-shards", "version": 1, "dtype": "uint16", "vocab_size": V,
     "eos_id": E, "tokenizer": {"file": "tokenizer.json", "sha256": ...},
     "val_fraction": f, "text_field": "text", "sources": [{"path", "documents"}, ...],
     "splits": {"train": {"tokens", "documents", "shards": [{"file", "tokens", "sha256"}]},
                "val": {...}}}

The writer builds the folder beside its destination and renames it into place when done,
so a stopped run leaves nothing half-written, and it refuses a destination that exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainplan.data import corpus, tokenize
from trainplan.errors import SpecError
from trainplan.loader import MAX_LOG_BYTES, load_json

FORMAT, VERSION = "trainplan-token-shards", 1
SPLITS = ("train", "val")
SHARD_TOKENS = 2**26  # 128 MiB of uint16 ids a shard
BATCH_DOCS = 256  # documents encoded together (tokenizers encodes a batch in parallel)


def dtype_for(vocab_size: int) -> str:
    """"uint16" where every id fits in 16 bits, else "uint32"."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def held_out(text: str, val_fraction: float) -> bool:
    """True when the document goes to the held-out split: its 64-bit BLAKE2b hash, as a
    fraction of 2^64, is below `val_fraction`."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


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
        self.shards.append({"file": name, "tokens": 0, "sha256": hashlib.sha256()})

    def write(self, ids: np.ndarray) -> None:
        self.documents += 1
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
            self.tokens += len(part)

    def close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self) -> dict:
        self.close_shard()
        return {"tokens": self.tokens, "documents": self.documents,
                "shards": [{**s, "sha256": s["sha256"].hexdigest()} for s in self.shards]}


def _batches(docs: Iterator[tuple[Path, str]], n: int) -> Iterator[list[tuple[Path, str]]]:
    batch = []
    for item in docs:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare(inputs: list[str | Path], out: str | Path, *, tokenizer: str | Path | None = None,
            vocab_size: int | None = None, val_fraction: float = 0.01,
            text_field: str = "text", progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenise the documents of `inputs` (`corpus`) into a shard folder `out`; its index.

    With `tokenizer` (a tokenizer.json) the ids are that tokenizer's; with `vocab_size` a
    byte-level BPE of that size is trained on the corpus first (a second pass over it).
    `progress(documents, tokens)` is called after each batch of documents."""
    out = Path(out)
    if (tokenizer is None) == (vocab_size is None):
        raise SpecError("give --tokenizer FILE (the model's tokenizer.json) or --vocab-size N "
                        "(train a byte-level BPE on the corpus), not both or neither")
    if not 0.0 <= val_fraction < 1.0:
        raise SpecError(f"--val-fraction {val_fraction} is not valid; use a number in [0, 1)")
    if out.exists():
        raise SpecError(f"--out {str(out)!r} exists; give a new folder (nothing is overwritten)")
    files = corpus.expand(inputs)
    if text_field != "text" and not any(f.suffix in (".jsonl", ".parquet") for f in files):
        raise SpecError(f"--text-field {text_field!r} names a JSONL key or parquet column; "
                        "this corpus is plain text only: leave it out")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        index = _write(files, tmp, tokenizer, vocab_size, val_fraction, text_field, progress)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _write(files, tmp: Path, tokenizer, vocab_size, val_fraction, text_field, progress) -> dict:
    tok_path = tmp / "tokenizer.json"
    if tokenizer is not None:
        tok = tokenize.load(tokenizer)
        shutil.copyfile(tokenizer, tok_path)
    else:
        tok = tokenize.train((d for _, d in corpus.documents(files, text_field)), vocab_size,
                             tok_path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tokenize.eos_id(tok, tok_path)
    tok.encode_special_tokens = True  # a document's own "<|endoftext|>" is text, not a boundary
    dtype = dtype_for(vocab)
    writers = {s: _SplitWriter(tmp, s, dtype) for s in SPLITS}
    per_file: dict[Path, int] = dict.fromkeys(files, 0)
    for batch in _batches(corpus.documents(files, text_field), BATCH_DOCS):
        for (path, text), enc in zip(batch, tok.encode_batch([t for _, t in batch]),
                                     strict=True):
            ids = np.fromiter(enc.ids, dtype=np.int64, count=len(enc.ids))
            writers["val" if held_out(text, val_fraction) else "train"].write(
                np.append(ids, eos))
            per_file[path] += 1
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
    """A prepared folder: its index and one split's ids as read-only memory maps."""

    folder: Path
    index: dict
    split: str
    arrays: list[np.memmap]

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
        return got.astype(np.int64)


def open_shards(folder: str | Path, split: str = "train", tokenizer: str | Path | None = None,
                vocab_size: int | None = None) -> Shards:
    """The `split` of a prepared folder, checked: its format, every shard's size, and where
    given, that it was made with `tokenizer` (by SHA-256) and fits a model of `vocab_size`."""
    folder = Path(folder)
    try:
        index = load_json(folder / "index.json", error=ValueError, max_bytes=MAX_LOG_BYTES)
        ok = index.get("format") == FORMAT and index.get("version") == VERSION
        shards, dtype = index["splits"][split]["shards"], np.dtype(index["dtype"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise SpecError(f"{str(folder)!r} is not a {FORMAT} folder of version {VERSION} with a "
                        f"{split!r} split; make one with `trainplan data prepare`")
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
        arrays.append(np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r"))
    return Shards(folder, index, split, arrays)
