"""The sequence sampler: every sequence once an epoch, ranks disjoint, resume exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainplan.data.sampler import SequenceSampler
from trainplan.errors import SpecError


def test_an_epoch_visits_each_sequence_once_and_ranks_share_none():
    n_tokens, seq = 1001, 10  # (1001 - 1) // 10 = 100 sequences
    ranks = [SequenceSampler(n_tokens, seq, seed=3, rank=r, world=3) for r in range(3)]
    seen = [s.next(33) for s in ranks]  # 100 // 3 = 33 each, one dropped
    flat = np.concatenate(seen)
    assert len(set(flat.tolist())) == 99 and flat.max() < 100
    assert all(s.epoch == 1 and s.position == 0 for s in ranks)
    again = SequenceSampler(n_tokens, seq, seed=3, rank=1, world=3).next(33)
    assert np.array_equal(again, seen[1])  # deterministic
    other = SequenceSampler(n_tokens, seq, seed=4, rank=1, world=3).next(33)
    assert not np.array_equal(other, seen[1])
    assert ranks[0].starts([0, 5]).tolist() == [0, 50]  # seq_len + 1 ids from each start


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 60), st.integers(0, 4))
def test_a_resumed_sampler_continues_where_the_saved_one_stopped(before, after, rank):
    whole = SequenceSampler(5000, 64, seed=7, rank=rank, world=5)
    expected = whole.next(before + after)
    first = SequenceSampler(5000, 64, seed=7, rank=rank, world=5)
    head = first.next(before)
    state = first.state_dict()
    resumed = SequenceSampler(5000, 64, seed=7, rank=rank, world=5)
    resumed.load_state_dict(state)
    assert np.array_equal(np.concatenate([head, resumed.next(after)]), expected)


def test_a_state_of_other_data_or_ranks_is_refused():
    s = SequenceSampler(5000, 64, seed=7, world=2)
    state = s.state_dict()
    for key, value in (("seed", 8), ("sequences", 3), ("world", 4), ("seq_len", 32)):
        other = SequenceSampler(5000, 64, seed=7, world=2)
        with pytest.raises(SpecError, match=key):
            other.load_state_dict({**state, key: value})
    with pytest.raises(SpecError, match="out of range"):
        s.load_state_dict({**state, "position": 10**9})
    with pytest.raises(SpecError, match="not one sequence"):
        SequenceSampler(100, 64, world=2)
