"""Data pipeline of the proxy harness: real text, tokenised, packed, sharded, loaded.

Corpus: the Python standard library's own source files (code, docstrings,
comments) under `sysconfig.get_paths()["stdlib"]`, without tests and
installed packages, read in sorted path order. Every machine that runs the
harness has them and nothing is downloaded; a different Python version gives
a different corpus, which `loader.dataset.info` records.

Pipeline: files -> UTF-8 texts -> a byte-level BPE (`trainplan.data.tokenize.train`,
Hugging Face `tokenizers`) trained on the leading `TRAIN_BYTES` of the corpus -> each
file's ids followed by the end-of-document id (`tokenize.eos_id`) -> token array cached
as .npy under $TRAINPLAN_CACHE (default ~/.cache/trainplan), keyed by a hash of the
corpus and the tokenizer settings, with the tokenizer.json beside it -> fixed-length
sequences, labels = inputs shifted by one -> `DistributedSampler` (seeded, `drop_last`,
so ranks never share a sequence) -> `DataLoader`.

Instruction data (`data="instruct"`): prompt/response records (`trainplan.data.instruct`:
the stdlib's, cached here, or a team's JSON-lines file) as rows with the loss on the
responses only, packed or padded (`trainplan.data.rows`), tokenised by the same tokenizer
in the loader's workers; labels are -100 (no loss) on prompts and padding.

The trainer must not shift labels again: `labels[:, t]` is the token that
follows `input_ids[:, t]`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tokenizers  # the pipeline needs it to build a cache; its version is part of the key
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainplan.data import corpus, instruct, rows, shards, tokenize
from trainplan.errors import SpecError

DEFAULT_VOCAB = 1281  # ids: EOS, the 256 bytes and 1024 merges
MAX_BYTES = 16 * 2**20  # corpus cap; the 3.11/3.12 stdlib without tests is about 12 MiB
TRAIN_BYTES = 2 * 2**20  # the BPE is learnt on the leading files up to this, applied to all
ENCODE_BATCH = 256  # files encoded together (tokenizers encodes a batch in parallel)
SYNTHETIC_SEQUENCES = 1 << 16
_FORMAT = 3  # bump when the cache layout or the tokenizer changes


# ---------------------------------------------------------------- corpus


corpus_files = corpus.stdlib_files  # the stdlib's .py files, sorted, tests and packages left out


def corpus_texts(files: list[Path], max_bytes: int = MAX_BYTES) -> list[str]:
    """The files' texts in order, stopping before their bytes pass `max_bytes`; a file that
    is not UTF-8 is left out (the tokenizer takes text)."""
    texts, total = [], 0
    for path in files:
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        total += len(data)
    return texts


def training_prefix(texts: list[str], train_bytes: int = TRAIN_BYTES) -> list[str]:
    """The leading texts the tokenizer is trained on: up to the first that reaches
    `train_bytes` bytes in all."""
    out, total = [], 0
    for text in texts:
        if total >= train_bytes:
            break
        out.append(text)
        total += len(text.encode("utf-8"))
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINPLAN_CACHE") or Path.home() / ".cache" / "trainplan")


def corpus_tokens(vocab_size: int = DEFAULT_VOCAB, *, root: str | Path | None = None,
                  max_bytes: int = MAX_BYTES) -> tuple[np.ndarray, dict]:
    """Tokenised corpus (read-only ids, uint16 for a vocabulary of at most 65,536) and a
    description of it, with a byte-level BPE of at most `vocab_size` ids; built once, cached.

    `info["tokenizer_file"]` is the tokenizer.json the ids come from (`tokenize.load`; set
    `encode_special_tokens` to encode as here); `info["eos_id"]` follows every file. Ranks
    started together share the build through a file lock; each cache file is written to a
    temporary name and renamed, so a reader never sees half a file. Within one process the
    result is also kept in memory (per cache directory).
    """
    _whole("vocab_size", vocab_size, tokenize.MIN_VOCAB)  # the bytes and the EOS id
    tokens, info = _corpus_tokens(vocab_size, str(root or ""), max_bytes, str(cache_dir()))
    return tokens, json.loads(info)


@functools.lru_cache(maxsize=4)
def _corpus_tokens(vocab_size: int, root: str, max_bytes: int, cache: str) -> tuple:
    root = root or None
    texts = corpus_texts(corpus_files(root), max_bytes)
    size = sum(len(t.encode("utf-8")) for t in texts)
    if size < 4096:
        raise SpecError(f"corpus under {root or 'the Python stdlib'} has {size} bytes; "
                        "need >= 4096 (or use synthetic=True)")
    key = hashlib.sha256(json.dumps([_FORMAT, vocab_size, TRAIN_BYTES,
                                     tokenizers.__version__]).encode())
    for text in texts:
        data = text.encode("utf-8")
        key.update(len(data).to_bytes(8, "little") + data)
    stem = Path(cache) / f"stdlib-bpe{vocab_size}-{key.hexdigest()[:16]}"
    paths = {"tokens": stem.with_suffix(".npy"), "info": stem.with_suffix(".json"),
             "tokenizer": stem.parent / f"{stem.name}.tokenizer.json"}
    _once(stem, paths, lambda tmp: _write(texts, vocab_size, paths, tmp, root))
    tokens = np.load(paths["tokens"])
    tokens.flags.writeable = False  # shared by every caller in this process
    info = json.loads(paths["info"].read_text())
    info["tokenizer_file"] = str(paths["tokenizer"])
    return tokens, json.dumps(info)


def _once(stem: Path, paths: dict[str, Path], write) -> None:
    """Make the cache files `paths` unless all exist, under the stem's file lock (ranks
    started together build once): `write(tmp)` writes each under its temporary name in
    `tmp` and renames it into place, the last one marking a whole cache."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(p.is_file() for p in paths.values()):
            return
        tmp = {k: p.with_name(f".{p.name}.{os.getpid()}.tmp") for k, p in paths.items()}
        try:
            write(tmp)
        finally:
            for p in tmp.values():
                p.unlink(missing_ok=True)


def _write(texts, vocab_size, paths: dict[str, Path], tmp: dict[str, Path], root) -> None:
    """Train the tokenizer, encode the texts, write the cache files (`_once`)."""
    start = time.perf_counter()
    prefix = training_prefix(texts)
    tok = tokenize.train(iter(prefix), vocab_size, tmp["tokenizer"])
    vocab = tok.get_vocab_size(with_added_tokens=True)  # fewer than asked on a tiny corpus
    eos = tokenize.eos_id(tok, paths["tokenizer"])
    tok.encode_special_tokens = True  # a file's own "<|endoftext|>" is text, not a boundary
    dtype = np.dtype(shards.dtype_for(vocab))
    parts = []
    for i in range(0, len(texts), ENCODE_BATCH):
        for enc in tok.encode_batch(texts[i:i + ENCODE_BATCH]):
            parts += [np.asarray(enc.ids, dtype=dtype), np.array([eos], dtype=dtype)]
    tokens = np.concatenate(parts)
    info = {
        "source": f"python {sys.version_info.major}.{sys.version_info.minor} stdlib",
        "root": str(root or sysconfig.get_paths()["stdlib"]),
        "files": len(texts), "bytes": sum(len(t.encode("utf-8")) for t in texts),
        "tokens": int(len(tokens)),
        "tokenizer": f"byte-level BPE (tokenizers {tokenizers.__version__}), {vocab} ids, "
                     f"trained on the first {len(prefix)} files, EOS={eos}",
        "vocab_size": vocab, "eos_id": eos, "encode_special_tokens": True,
        "tokenizer_sha256": tokenize.sha256(tmp["tokenizer"]),
        "build_s": round(time.perf_counter() - start, 2),
    }
    with open(tmp["tokens"], "wb") as f:
        np.save(f, tokens)
    tmp["info"].write_text(json.dumps(info))
    for k in ("tokenizer", "tokens", "info"):  # the description last: it marks a whole cache
        os.replace(tmp[k], paths[k])


def instruct_records(seed: int = 0) -> list[dict]:
    """`trainplan.data.instruct.stdlib_records(seed)`, cached as JSON lines under
    `cache_dir()`, keyed by the seed, the Python version and the stdlib files' paths, sizes
    and modification times (made once, as the corpus: `_once`)."""
    _whole("seed", seed, 0)
    key = hashlib.sha256(json.dumps([_FORMAT, seed, sys.version]).encode())
    for f in corpus_files():
        st = f.stat()
        key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    stem = cache_dir() / f"instruct-seed{seed}-{key.hexdigest()[:16]}"
    paths = {"records": stem.with_suffix(".jsonl")}

    def write(tmp: dict[str, Path]) -> None:
        instruct.write_records(instruct.stdlib_records(seed), tmp["records"])
        os.replace(tmp["records"], paths["records"])

    _once(stem, paths, write)
    return instruct.read_records(paths["records"])


# ---------------------------------------------------------------- datasets


class PackedDataset(Dataset):
    """Consecutive windows of `seq_len + 1` tokens: (inputs, labels shifted by one).

    Sequence i covers tokens [i * seq_len, (i + 1) * seq_len]; neighbours share
    one boundary token (the last label of one is the first input of the next).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, info: dict | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        self.info = dict(info or {}, sequences=len(self), seq_len=seq_len)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class SyntheticDataset(Dataset):
    """Uniform random tokens; item i depends only on (seed, i), whichever worker makes it."""

    def __init__(self, seq_len: int, vocab: int, seed: int, n: int = SYNTHETIC_SEQUENCES):
        self.seq_len, self.vocab, self.seed, self.n = seq_len, vocab, seed, n
        self.info = {"source": "synthetic", "vocab_size": vocab, "sequences": n,
                     "seq_len": seq_len}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + i) % 2**63)
        window = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
        return window[:-1], window[1:]


# ---------------------------------------------------------------- loader


def _whole(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name} = {value!r} is not valid; use a whole number >= {minimum}")


def _check(seq_len, micro_batch, rank, world, seed, num_workers, prefetch_factor,
           pin_memory, vocab, synthetic) -> None:
    for name, value, minimum in (("seq_len", seq_len, 1), ("micro_batch", micro_batch, 1),
                                 ("world", world, 1), ("rank", rank, 0), ("seed", seed, 0),
                                 ("num_workers", num_workers, 0)):
        _whole(name, value, minimum)
    if rank >= world:
        raise SpecError(f"rank = {rank} is not valid for world = {world}; use 0..{world - 1}")
    if prefetch_factor is not None:
        _whole("prefetch_factor", prefetch_factor, 1)
        if num_workers == 0:
            raise SpecError(f"prefetch_factor = {prefetch_factor} needs num_workers >= 1 "
                            "(with num_workers = 0 there is nothing to prefetch); pass None")
    for name, value in (("pin_memory", pin_memory), ("synthetic", synthetic)):
        if not isinstance(value, bool):
            raise SpecError(f"{name} = {value!r} is not valid; use True or False")
    _whole("vocab", vocab, 2)
    if not synthetic and vocab < tokenize.MIN_VOCAB:
        raise SpecError(f"vocab = {vocab} is too small for the byte-level tokenizer (256 bytes "
                        f"and the end-of-document id); use vocab >= {tokenize.MIN_VOCAB} or "
                        "synthetic=True")


DATA = ("stdlib", "instruct")  # packed stdlib text (pretraining); prompt/response records


def _check_data(data, pack, records, synthetic) -> None:
    if data not in DATA:
        raise SpecError(f"data = {data!r} is not valid; use one of {list(DATA)}")
    if not isinstance(pack, bool):
        raise SpecError(f"pack = {pack!r} is not valid; use True or False")
    if data != "instruct" and (records is not None or not pack):
        raise SpecError("records and pack=False are for data = 'instruct' only")
    if synthetic and data != "stdlib":
        raise SpecError(f"synthetic=True makes its own tokens; it cannot read data = {data!r}")


def build_dataset(*, seq_len: int, vocab: int = 32000, seed: int = 0, synthetic: bool = False,
                  data: str = "stdlib", pack: bool = True, records: str | None = None):
    """The packed stdlib corpus (a tokenizer of at most `vocab` ids), random tokens, or
    instruction rows (`trainplan.data.rows`, `pack` or padded) of the records file
    `records`, else of the stdlib's records for `seed` (`instruct_records`), tokenised by
    the stdlib corpus's tokenizer."""
    if synthetic:
        return SyntheticDataset(seq_len, vocab, seed)
    tokens, info = corpus_tokens(min(DEFAULT_VOCAB, vocab))
    if data == "stdlib":
        return PackedDataset(tokens, seq_len, info)
    recs = instruct.read_records(records) if records else instruct_records(seed)
    ds = rows.make_rows(recs, info["tokenizer_file"], seq_len, pack=pack)
    ds.info = {**ds.info, "seq_len": seq_len, "tokenizer": info["tokenizer"],
               "tokenizer_sha256": info["tokenizer_sha256"], "vocab_size": info["vocab_size"],
               "source": str(records) if records else f"stdlib instruction records, seed {seed}"}
    return ds


def build_loader(*, seq_len: int, micro_batch: int, rank: int, world: int, seed: int,
                 num_workers: int = 0, prefetch_factor: int | None = None,
                 pin_memory: bool = False, vocab: int = 32000, synthetic: bool = False,
                 data: str = "stdlib", pack: bool = True,
                 records: str | None = None) -> DataLoader:
    """DataLoader of (input_ids, labels), int64 tensors of shape (micro_batch, seq_len).

    Rank `rank` of `world` sees a disjoint shard, reshuffled per epoch with
    `seed + epoch` (`loader.sampler.set_epoch(e)`, or iterate `infinite(loader)`).
    Incomplete batches are dropped, so every batch is full. `loader.dataset.info`
    describes the corpus and tokenizer for records. With instruction data the workers
    tokenise; a `tokenizers` thread pool used in this process before they fork is not
    carried into them (TOKENIZERS_PARALLELISM is set to false unless set already).
    """
    _check(seq_len, micro_batch, rank, world, seed, num_workers, prefetch_factor,
           pin_memory, vocab, synthetic)
    _check_data(data, pack, records, synthetic)
    dataset = build_dataset(seq_len=seq_len, vocab=vocab, seed=seed, synthetic=synthetic,
                            data=data, pack=pack, records=records)
    if len(dataset) < world * micro_batch:
        raise SpecError(
            f"seq_len = {seq_len}: the corpus gives {len(dataset)} sequences, fewer than "
            f"world * micro_batch = {world * micro_batch}; use shorter sequences or synthetic=True"
        )
    if num_workers:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                      num_workers=num_workers, prefetch_factor=prefetch_factor,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0)


def infinite(loader: DataLoader, start_epoch: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """Batches forever: epoch after epoch, calling `sampler.set_epoch` before each."""
    epoch = start_epoch
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
