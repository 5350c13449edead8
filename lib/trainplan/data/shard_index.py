"""The index.json of a prepared shard folder (`data.shards`), read and checked.

The index is all a reader knows of the shards before it reads their ids, so each field it
relies on is checked here, and a hand-edited or damaged index is one line naming the field:
`dtype` one of `ID_LIMITS`; `vocab_size` a whole number (JSON's `true` is not one) that
`dtype` holds, `eos_id` and each shard's `max_id` (where recorded) ids below it; each
split's `tokens` and `documents` whole numbers >= 0, its `tokens` the sum of its shards';
each shard's `file` a plain name in the folder (no "/", not ".."), listed once over all
splits, its `tokens` a whole number >= 0 (its file's size is `open_shards`' check). The ids
are not read here: the reader checks each window of ids it reads against the model's
vocabulary (`shards.Shards`), the only check of the ids where an index has no `max_id`.
"""

from __future__ import annotations

from pathlib import Path

from trainplan.errors import SpecError
from trainplan.loader import MAX_LOG_BYTES, load_json, quote, shown

FORMAT, VERSION = "trainplan-token-shards", 1
ID_LIMITS = {"uint16": 2**16, "uint32": 2**32}  # ids each `dtype` holds


def whole(value) -> bool:
    """Whether a JSON value is a whole number (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_index(folder: Path, split: str) -> dict:
    """The index of the prepared `folder`, which has a `split`, every field checked (above).
    One SpecError line naming the index and the first field that is not valid."""
    try:
        index = load_json(folder / "index.json", error=ValueError, max_bytes=MAX_LOG_BYTES)
        ok = index.get("format") == FORMAT and index.get("version") == VERSION and \
            isinstance(index["splits"], dict) and split in index["splits"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise SpecError(f"{str(folder)!r} is not a {FORMAT} folder of version {VERSION} with a "
                        f"{split!r} split; make one with `trainplan data prepare`")
    problem = _problem(index)
    if problem:
        raise SpecError(f"{shown(folder / 'index.json')}: {problem}; the index does not match "
                        "a prepared folder: prepare it again with `trainplan data prepare`")
    return index


def _problem(index: dict) -> str | None:
    """What is first wrong with the fields of `index` (format and version checked), or None."""
    dtype, vocab, eos = index.get("dtype"), index.get("vocab_size"), index.get("eos_id")
    if dtype not in ID_LIMITS:
        return f"dtype {quote(dtype)} is not one of {list(ID_LIMITS)}"
    if not whole(vocab) or not 1 <= vocab <= ID_LIMITS[dtype]:
        return (f"vocab_size {quote(vocab)} is not a whole number in 1..{ID_LIMITS[dtype]:,} "
                f"(the ids {dtype} holds)")
    if not whole(eos) or not 0 <= eos < vocab:
        return f"eos_id {quote(eos)} is not an id of its vocabulary (0..{vocab - 1:,})"
    tok = index.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("sha256"), str):
        return f"tokenizer {quote(tok)} has no sha256"
    files: set[str] = set()
    for name, part in index["splits"].items():
        shards = part.get("shards") if isinstance(part, dict) else None
        if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
            return f"split {quote(name)} has no list of shards"
        for key in ("tokens", "documents"):
            if not whole(part.get(key)) or part[key] < 0:
                return f"split {quote(name)}: {key} {quote(part.get(key))} is not a whole " \
                       "number >= 0"
        for s in shards:
            file, tokens, top = s.get("file"), s.get("tokens"), s.get("max_id", 0)
            if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or \
                    "\\" in file or "\0" in file:
                return f"split {quote(name)} lists shard {quote(file)}, not a file name in " \
                       "the folder"
            if file in files:
                return f"shard {quote(file)} is listed twice; each shard is listed once"
            files.add(file)
            if not whole(tokens) or tokens < 0:
                return f"shard {quote(file)}: tokens {quote(tokens)} is not a whole number >= 0"
            if not whole(top) or not 0 <= top < vocab:
                return (f"shard {quote(file)}: max_id {quote(top)} is not an id of its "
                        f"vocabulary (vocab_size {vocab:,})")
        if part["tokens"] != sum(s["tokens"] for s in shards):
            return (f"split {quote(name)}: tokens {part['tokens']:,} is not the sum of its "
                    f"shards' ({sum(s['tokens'] for s in shards):,})")
    return None
