"""Data pipeline of the proxy harness: real text, tokenised, packed, sharded, loaded.

Corpus: the Python standard library's own source files (code, docstrings,
comments) under `sysconfig.get_paths()["stdlib"]`, without tests and
installed packages, read in sorted path order. Every machine that runs the
harness has them and nothing is downloaded; a different Python version gives
a different corpus, which `corpus_info` records.

Pipeline: files -> bytes (one EOT id between documents) -> byte-level BPE
trained on the first `TRAIN_BYTES` of the corpus (`tokenizer.py`) -> token
array cached as .npy under $TRAINPLAN_CACHE (default ~/.cache/trainplan),
keyed by a hash of the corpus and the tokenizer settings -> fixed-length
sequences, labels = inputs shifted by one -> `DistributedSampler` (seeded,
`drop_last`, so ranks never share a sequence) -> `DataLoader`.

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
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainplan.bench.harness.tokenizer import EOT, FIRST_MERGE_ID, ByteBPE, train_bpe
from trainplan.errors import SpecError

DEFAULT_MERGES = 1024  # vocabulary 1281 ids: bytes, EOT, merges
MAX_BYTES = 16 * 2**20  # corpus cap; the 3.11/3.12 stdlib without tests is about 12 MiB
TRAIN_BYTES = 2 * 2**20  # merges are learnt on this prefix, applied to all of it
SYNTHETIC_SEQUENCES = 1 << 16
_FORMAT = 1  # bump when the cache layout or the tokenizer changes
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---------------------------------------------------------------- corpus


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The stdlib's .py files, sorted by path relative to `root`, tests and packages left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not _SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_ids(files: list[Path], max_bytes: int = MAX_BYTES) -> np.ndarray:
    """Byte ids of the files in order, EOT after each, stopping before `max_bytes`."""
    parts, total = [], 0
    for path in files:
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        parts.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([EOT], dtype=np.uint16))
        total += len(data) + 1
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINPLAN_CACHE") or Path.home() / ".cache" / "trainplan")


def corpus_tokens(n_merges: int = DEFAULT_MERGES, *, root: str | Path | None = None,
                  max_bytes: int = MAX_BYTES) -> tuple[np.ndarray, dict]:
    """Tokenised corpus (read-only uint16 ids) and a description of it, built once and cached.

    Ranks started together share the build through a file lock; the cache is
    written to a temporary name and renamed, so a reader never sees half a file.
    Within one process the result is also kept in memory (per cache directory).
    """
    tokens, info = _corpus_tokens(n_merges, str(root or ""), max_bytes, str(cache_dir()))
    return tokens, json.loads(info)


@functools.lru_cache(maxsize=4)
def _corpus_tokens(n_merges: int, root: str, max_bytes: int, cache: str) -> tuple:
    root = root or None
    files = corpus_files(root)
    raw = corpus_ids(files, max_bytes)
    if len(raw) < 4096:
        raise SpecError(f"corpus under {root or 'the Python stdlib'} has {len(raw)} bytes; "
                        "need >= 4096 (or use synthetic=True)")
    key = hashlib.sha256(json.dumps([_FORMAT, n_merges, TRAIN_BYTES]).encode())
    key.update(raw.tobytes())
    stem = Path(cache) / f"stdlib-bpe{n_merges}-{key.hexdigest()[:16]}"
    tokens_path, info_path = stem.with_suffix(".npy"), stem.with_suffix(".json")
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tokens_path.is_file() and info_path.is_file()):
            _build(raw, n_merges, tokens_path, info_path, root)
    tokens = np.load(tokens_path)
    tokens.flags.writeable = False  # shared by every caller in this process
    return tokens, info_path.read_text()


def _build(raw, n_merges, tokens_path: Path, info_path: Path, root) -> None:
    start = time.perf_counter()
    merges = train_bpe(raw[:TRAIN_BYTES], n_merges)
    tokens = ByteBPE(merges).encode_ids(raw)
    info = {
        "source": f"python {sys.version_info.major}.{sys.version_info.minor} stdlib",
        "root": str(root or sysconfig.get_paths()["stdlib"]),
        "files": int((raw == EOT).sum()), "bytes": int(len(raw)), "tokens": int(len(tokens)),
        "tokenizer": f"byte-bpe, {len(merges)} merges, EOT={EOT}",
        "vocab_size": FIRST_MERGE_ID + len(merges), "merges": merges,
        "build_s": round(time.perf_counter() - start, 2),
    }
    for path, write in ((tokens_path, lambda f: np.save(f, tokens)),
                        (info_path, lambda f: f.write(json.dumps(info).encode()))):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)


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
    if not synthetic and vocab <= FIRST_MERGE_ID:
        raise SpecError(f"vocab = {vocab} is too small for the byte-level tokenizer (256 bytes, "
                        f"EOT, merges); use vocab >= {FIRST_MERGE_ID + 1} or synthetic=True")


def build_dataset(*, seq_len: int, vocab: int = 32000, seed: int = 0,
                  synthetic: bool = False) -> PackedDataset | SyntheticDataset:
    """The packed stdlib corpus (merges capped so ids stay below `vocab`), or random tokens."""
    if synthetic:
        return SyntheticDataset(seq_len, vocab, seed)
    tokens, info = corpus_tokens(min(DEFAULT_MERGES, vocab - FIRST_MERGE_ID))
    info.pop("merges", None)
    return PackedDataset(tokens, seq_len, info)


def build_loader(*, seq_len: int, micro_batch: int, rank: int, world: int, seed: int,
                 num_workers: int = 0, prefetch_factor: int | None = None,
                 pin_memory: bool = False, vocab: int = 32000,
                 synthetic: bool = False) -> DataLoader:
    """DataLoader of (input_ids, labels), int64 tensors of shape (micro_batch, seq_len).

    Rank `rank` of `world` sees a disjoint shard, reshuffled per epoch with
    `seed + epoch` (`loader.sampler.set_epoch(e)`, or iterate `infinite(loader)`).
    Incomplete batches are dropped, so every batch is full. `loader.dataset.info`
    describes the corpus and tokenizer for records.
    """
    _check(seq_len, micro_batch, rank, world, seed, num_workers, prefetch_factor,
           pin_memory, vocab, synthetic)
    dataset = build_dataset(seq_len=seq_len, vocab=vocab, seed=seed, synthetic=synthetic)
    if len(dataset) < world * micro_batch:
        raise SpecError(
            f"seq_len = {seq_len}: the corpus gives {len(dataset)} sequences, fewer than "
            f"world * micro_batch = {world * micro_batch}; use shorter sequences or synthetic=True"
        )
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
