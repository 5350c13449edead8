"""A small byte-level BPE tokenizer, trained here, deterministically, with numpy.

Byte-pair encoding (Sennrich, Haddow and Birch 2016, "Neural Machine
Translation of Rare Words with Subword Units"; byte-level as in GPT-2,
Radford et al. 2019): start from the 256 byte values, repeatedly replace the
most frequent adjacent pair of ids by a new id. Ids:

- 0..255: the bytes;
- 256 (`EOT`): end of a document, never merged with a neighbour;
- 257..256 + n_merges: merge i creates id 257 + i.

Unlike most BPE trainers there is no pre-tokenisation into words: merges may
cross spaces. That keeps training one vectorised pass per merge (a few seconds
for ten megabytes) and is good enough to feed a throughput benchmark.
Determinism: pair counts are exact integers, ties go to the smallest
(left, right) pair, so the same bytes always give the same merges and ids.
"""

from __future__ import annotations

import numpy as np

from trainplan.errors import SpecError

EOT = 256  # end-of-document id
FIRST_MERGE_ID = 257
CHUNK = 1 << 18  # ids encoded at a time (512 KiB of uint16)


def _pair_starts(ids: np.ndarray, left: int, right: int) -> np.ndarray:
    """Positions of the non-overlapping (left, right) pairs, found scanning left to right."""
    if len(ids) < 2:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(ids[:-1] == left)
    starts = starts[ids[starts + 1] == right]
    if left == right and len(starts) > 1:
        # In a run like `a a a` the pair starts at 0 and 1; left-to-right BPE merges
        # the first and skips the overlapping second: keep every other start of a run.
        idx = np.arange(len(starts))
        run_first = np.r_[True, np.diff(starts) != 1]
        run_start = np.maximum.accumulate(np.where(run_first, idx, 0))
        starts = starts[(idx - run_start) % 2 == 0]
    return starts


def _replace(ids: np.ndarray, starts: np.ndarray, new: int) -> np.ndarray:
    """`ids` with the pair at each of `starts` replaced by the single id `new`."""
    if not len(starts):
        return ids
    out = ids.copy()
    out[starts] = new
    keep = np.ones(len(out), dtype=bool)
    keep[starts + 1] = False
    return out[keep]


def _merge_pair(ids: np.ndarray, left: int, right: int, new: int) -> np.ndarray:
    return _replace(ids, _pair_starts(ids, left, right), new)


def _pair_codes(ids: np.ndarray, first: np.ndarray, vocab: int) -> np.ndarray:
    """Codes left * vocab + right of the pairs starting at `first`, pairs with EOT left out."""
    left, right = ids[first].astype(np.int64), ids[first + 1].astype(np.int64)
    keep = (left != EOT) & (right != EOT)
    return left[keep] * vocab + right[keep]


def _touching(n: int, positions: np.ndarray) -> np.ndarray:
    """Start indices of the pairs (i, i + 1) of an n-long array that touch any of `positions`."""
    hit = np.zeros(n, dtype=bool)
    hit[positions] = True
    return np.flatnonzero(hit[:-1] | hit[1:])


def train_bpe(ids: np.ndarray, n_merges: int) -> list[tuple[int, int]]:
    """Learn up to `n_merges` merges from a byte-id array (values < 257, EOT allowed).

    Each step takes the most frequent adjacent pair (ties: smallest code
    left * V + right), merges it everywhere, and updates the pair counts only
    where the array changed: minus every old pair touching a merged position,
    plus every new pair touching a new id. The counts stay exactly those a
    full recount would give (`tests/bench/test_data.py` checks this against
    one), at a fraction of the cost. Stops early when no pair occurs twice.
    """
    if isinstance(n_merges, bool) or not isinstance(n_merges, int) or not 0 <= n_merges < 32768:
        raise SpecError(f"n_merges = {n_merges!r} is not valid; use a whole number in 0..32767")
    vocab = FIRST_MERGE_ID + n_merges
    ids = np.asarray(ids, dtype=np.int32)
    counts = np.bincount(_pair_codes(ids, np.arange(max(len(ids) - 1, 0)), vocab),
                         minlength=vocab * vocab)
    merges: list[tuple[int, int]] = []
    for i in range(n_merges):
        best = int(counts.argmax())
        if counts[best] < 2:
            break
        a, b = divmod(best, vocab)
        merges.append((a, b))
        starts = _pair_starts(ids, a, b)
        old = _touching(len(ids), np.concatenate([starts, starts + 1]))
        np.subtract.at(counts, _pair_codes(ids, old, vocab), 1)
        ids = _replace(ids, starts, FIRST_MERGE_ID + i)
        new = _touching(len(ids), starts - np.arange(len(starts)))  # each merge shifts by 1
        np.add.at(counts, _pair_codes(ids, new, vocab), 1)
    return merges


def train_bpe_reference(ids: np.ndarray, n_merges: int) -> list[tuple[int, int]]:
    """The same merges by a full recount at every step: slow, obviously right; for tests."""
    vocab = FIRST_MERGE_ID + n_merges
    ids = np.asarray(ids, dtype=np.int32)
    merges: list[tuple[int, int]] = []
    for i in range(n_merges):
        counts = np.bincount(_pair_codes(ids, np.arange(max(len(ids) - 1, 0)), vocab),
                             minlength=vocab * vocab)
        best = int(counts.argmax())
        if counts[best] < 2:
            break
        merges.append(divmod(best, vocab))
        ids = _merge_pair(ids, *merges[-1], FIRST_MERGE_ID + i)
    return merges


class ByteBPE:
    """Encoder/decoder for a list of merges learnt by `train_bpe`."""

    def __init__(self, merges: list[tuple[int, int]]):
        self.merges = [(int(a), int(b)) for a, b in merges]
        for i, (a, b) in enumerate(self.merges):
            if not (0 <= a < FIRST_MERGE_ID + i and 0 <= b < FIRST_MERGE_ID + i) or EOT in (a, b):
                raise SpecError(f"merge {i} = {(a, b)} refers to an id not yet defined or EOT")

    @property
    def vocab_size(self) -> int:
        """Ids used: bytes, EOT and one per merge."""
        return FIRST_MERGE_ID + len(self.merges)

    def encode_ids(self, ids: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
        """Apply every merge in training order to an array of byte ids (EOT allowed).

        No merge crosses an EOT, so the array is cut just after the first EOT
        past every `chunk` ids and the pieces are encoded one by one: the same
        result, about twice as fast because each piece stays in cache.
        """
        ids = np.asarray(ids, dtype=np.uint16)  # vocab < 65536: half the memory traffic
        eots = np.flatnonzero(ids == EOT)
        cuts = np.unique(eots[np.searchsorted(eots, np.arange(chunk, len(ids), chunk))
                              .clip(max=max(len(eots) - 1, 0))] + 1) if len(eots) else []
        pieces = np.split(ids, [c for c in cuts if c < len(ids)])
        return np.concatenate([self._encode_piece(p) for p in pieces])

    def _encode_piece(self, out: np.ndarray) -> np.ndarray:
        for i, (a, b) in enumerate(self.merges):
            out = _merge_pair(out, a, b, FIRST_MERGE_ID + i)
        return out

    def encode(self, text: bytes | str) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return self.encode_ids(np.frombuffer(data, dtype=np.uint8))

    def decode(self, ids) -> bytes:
        """Bytes of a sequence of ids; EOT decodes to nothing."""
        table: list[bytes] = [bytes([i]) for i in range(256)] + [b""]
        for a, b in self.merges:
            table.append(table[a] + table[b])
        return b"".join(table[int(i)] for i in ids)
