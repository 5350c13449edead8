"""Which sequence each rank reads next: deterministic, shared out, resumable.

A split of N ids holds n = (N - 1) // seq_len sequences: sequence i is ids
[i seq_len, (i + 1) seq_len] inclusive, seq_len inputs and the seq_len ids that follow
them as labels. Each epoch visits every sequence once in the order of a permutation drawn
from `seed` and the epoch number (numpy's PCG64), and rank r of w takes the r-th of every w
consecutive entries; the last n mod w entries of an epoch are dropped, so that ranks stay
in step. The state is two integers, the epoch and the entries consumed in it: saved with a
checkpoint and loaded, a resumed run reads the sequence that follows the last one read,
neither replaying nor skipping one.
"""

from __future__ import annotations

import numpy as np

from trainplan.errors import SpecError


class SequenceSampler:
    """Sequence indices for one rank, `next(k)` at a time; `state_dict` / `load_state_dict`."""

    def __init__(self, n_tokens: int, seq_len: int, *, seed: int = 0, rank: int = 0,
                 world: int = 1):
        if seq_len < 1 or not 0 <= rank < world:
            raise SpecError(f"seq_len = {seq_len}, rank {rank} of {world} is not valid")
        self.n = (n_tokens - 1) // seq_len
        self.per_rank = self.n // world
        if self.per_rank < 1:
            raise SpecError(f"the split holds {n_tokens:,} tokens: not one sequence of "
                            f"{seq_len} (+1) for each of {world} ranks; prepare more data or "
                            "shorten the sequence")
        self.seq_len, self.seed, self.rank, self.world = seq_len, seed, rank, world
        self.epoch, self.position = 0, 0  # position: entries of this rank read this epoch
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(self.n)[:self.per_rank * self.world][self.rank::self.world]

    def next(self, k: int) -> np.ndarray:
        """The next `k` sequence indices of this rank (crossing into the next epoch if need be)."""
        out = []
        while k:
            take = min(k, self.per_rank - self.position)
            out.append(self._order[self.position:self.position + take])
            self.position += take
            k -= take
            if self.position == self.per_rank:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def starts(self, indices: np.ndarray) -> np.ndarray:
        """First token position of each sequence index."""
        return np.asarray(indices, dtype=np.int64) * self.seq_len

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "sequences": self.n, "seq_len": self.seq_len, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; one line if it belongs to other data or ranks."""
        mine = self.state_dict()
        for key in ("seed", "sequences", "seq_len", "world"):
            if state.get(key) != mine[key]:
                raise SpecError(f"the checkpoint's data position has {key} = {state.get(key)!r}"
                                f", this run {mine[key]!r}: not the same data or ranks")
        if not 0 <= int(state["position"]) < self.per_rank or int(state["epoch"]) < 0:
            raise SpecError(f"the checkpoint's data position {state!r} is out of range")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
