"""Batches of token ids from prepared shards, for one data-parallel rank, resumable.

A step reads `grad_accum` micro-batches of (input_ids, labels), each (micro_batch, seq_len),
like the harness's sources (`bench.harness.feed`). The sequences come from the shards of
`trainplan data prepare` (`data.shards`) in the order of `data.sampler.SequenceSampler`;
labels are the inputs shifted by one (the sampler's windows are seq_len + 1 ids long).
With several corpora the step's sequences are drawn from a weighted mixture: each corpus
has its own sampler, and the corpus of every sequence slot of the whole run is a fixed
function of the seed and the slot's number (numpy's PCG64), so the mixture is the same on
every rank count and its state is the samplers' positions.

The state (`state_dict`) is every sampler's epoch and position: saved with a checkpoint,
loaded, the run reads the sequence that follows the last one it read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainplan.data.sampler import SequenceSampler
from trainplan.data.shards import Shards, open_shards
from trainplan.errors import SpecError
from trainplan.train.paths import resolved

Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids, labels: (micro_batch, seq_len) each


def parse_mixture(items: list[str]) -> list[tuple[Path, float]]:
    """['a', 'b:3'] -> [(a, 1.0), (b, 3.0)]: shard folders with their relative weights; a
    folder named twice (the same folder resolved) is refused: its weight would count twice."""
    out, seen = [], {}
    for i, item in enumerate(items):
        path, sep, weight = item.rpartition(":")
        if not sep:
            path, weight = item, "1"
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not (w > 0 and np.isfinite(w)):
            raise SpecError(f"--data {item!r}: the weight {weight!r} is not valid; use "
                            "FOLDER or FOLDER:WEIGHT with a weight > 0")
        out.append((Path(path), w))
        if (first := seen.setdefault(resolved(path), i)) != i:
            raise SpecError(f"--data {item!r} names the folder of {items[first]!r} again; give "
                            "each folder once, with FOLDER:WEIGHT for a larger share")
    if not out:
        raise SpecError("--data: name at least one folder made by `trainplan data prepare`")
    return out


class ShardBatches:
    """Step after step of (input_ids, labels) micro-batches from one or more shard folders."""

    def __init__(self, sources: list[tuple[Path, float]], *, split: str, seq_len: int,
                 micro_batch: int, grad_accum: int, dp_rank: int, dp: int, seed: int,
                 vocab_size: int, tokenizer: str | Path | None = None):
        self.shards: list[Shards] = [open_shards(p, split, tokenizer, vocab_size)
                                     for p, _ in sources]
        eos = {s.index["tokenizer"]["sha256"] for s in self.shards}
        if len(eos) > 1:
            raise SpecError(f"--data folders {[str(p) for p, _ in sources]} were made with "
                            "different tokenizers; prepare every corpus with one tokenizer")
        self.samplers = [SequenceSampler(s.tokens, seq_len, seed=seed + i, rank=dp_rank,
                                         world=dp) for i, s in enumerate(self.shards)]
        weights = np.array([w for _, w in sources], dtype=np.float64)
        self.weights = weights / weights.sum()
        self.seq_len, self.micro_batch, self.grad_accum = seq_len, micro_batch, grad_accum
        self.dp_rank, self.dp, self.seed = dp_rank, dp, seed
        self.step_index = 0  # steps read so far: where the mixture's draw continues

    def _corpora(self, step: int) -> np.ndarray:
        """The corpus of each of this rank's sequences in `step`: drawn for the whole step's
        global batch from (seed, step), then this rank's rows, so every rank agrees."""
        n = self.dp * self.grad_accum * self.micro_batch
        if len(self.shards) == 1:
            return np.zeros(n // self.dp, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64([self.seed, 7919, step]))
        draws = rng.choice(len(self.shards), size=n, p=self.weights)
        per = self.grad_accum * self.micro_batch
        return draws[self.dp_rank * per:(self.dp_rank + 1) * per]

    def next_step(self) -> list[Batch]:
        """The next step's `grad_accum` micro-batches for this rank."""
        corpora = self._corpora(self.step_index)
        rows = np.empty((len(corpora), self.seq_len + 1), dtype=np.int64)
        for c in np.unique(corpora):
            slots = np.flatnonzero(corpora == c)
            sampler = self.samplers[c]
            for slot, start in zip(slots, sampler.starts(sampler.next(len(slots))), strict=True):
                rows[slot] = self.shards[c].window(int(start), self.seq_len + 1)
        self.step_index += 1
        t = torch.from_numpy(rows)
        mb = self.micro_batch
        return [(t[i:i + mb, :-1].contiguous(), t[i:i + mb, 1:].contiguous())
                for i in range(0, len(t), mb)]

    def __iter__(self) -> Iterator[list[Batch]]:
        while True:
            yield self.next_step()

    def state_dict(self) -> dict:
        return {"step_index": self.step_index, "weights": self.weights.round(12).tolist(),
                "samplers": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; one line if it belongs to other data or ranks."""
        saved = state.get("samplers") or []
        if len(saved) != len(self.samplers) or \
                state.get("weights") != self.weights.round(12).tolist():
            raise SpecError(f"the checkpoint's data position is of {len(saved)} corpora with "
                            f"weights {state.get('weights')}, this run has {len(self.samplers)} "
                            f"with {self.weights.round(12).tolist()}: not the same --data")
        for sampler, s in zip(self.samplers, saved, strict=True):
            sampler.load_state_dict(s)
        self.step_index = int(state["step_index"])


def eval_batches(source: Path, *, seq_len: int, micro_batch: int, batches: int, dp_rank: int,
                 dp: int, vocab_size: int) -> list[Batch]:
    """The held-out split's first `batches` x dp micro-batches (in sequence order, no
    shuffle), this rank's share: the same sequences at every evaluation, so losses compare.
    Fewer where the split is short; [] where it holds no whole sequence for every rank."""
    shards = open_shards(source, "val", vocab_size=vocab_size)
    n = (shards.tokens - 1) // seq_len
    per_rank = min(batches * micro_batch, n // dp)
    out = []
    idx = np.arange(per_rank * dp)[dp_rank::dp]
    for i in range(0, per_rank - micro_batch + 1, micro_batch):
        rows = np.stack([shards.window(int(j) * seq_len, seq_len + 1)
                         for j in idx[i:i + micro_batch]])
        t = torch.from_numpy(rows)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out
