"""Data pipeline: tokenizer, corpus cache, packing, sharding, loader knobs."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from trainplan.bench.harness import data
from trainplan.bench.harness.tokenizer import (
    EOT,
    FIRST_MERGE_ID,
    ByteBPE,
    _merge_pair,
    train_bpe,
    train_bpe_reference,
)
from trainplan.errors import SpecError

VOCAB = 320  # 63 merges: about a second to build, shared by the loader tests
USER_CACHE = os.environ.get("TRAINPLAN_CACHE")


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One cache directory for the whole run, shared by xdist workers (the build is locked)."""
    path = tmp_path_factory.getbasetemp().parent / "trainplan-cache"
    old = os.environ.get("TRAINPLAN_CACHE")
    os.environ["TRAINPLAN_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TRAINPLAN_CACHE", None)
    else:
        os.environ["TRAINPLAN_CACHE"] = old


def loader(**kw):
    args = dict(seq_len=64, micro_batch=4, rank=0, world=1, seed=0, vocab=VOCAB)
    return data.build_loader(**{**args, **kw})


def batches(dl, n):
    it = iter(dl)
    return [next(it) for _ in range(n)]


# ---------------------------------------------------------------- tokenizer


def test_merge_pair_is_left_to_right_and_non_overlapping():
    ids = np.array([5, 5, 5, 5, 5, 7, 5, 5], dtype=np.uint16)
    assert _merge_pair(ids, 5, 5, 300).tolist() == [300, 300, 5, 7, 300]
    assert _merge_pair(ids, 5, 7, 301).tolist() == [5, 5, 5, 5, 301, 5, 5]


@pytest.mark.parametrize("seed", range(12))
def test_incremental_training_equals_full_recount(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 4000))
    ids = rng.integers(0, int(rng.integers(1, 6)), size=n).astype(np.uint16)
    ids[rng.integers(0, n, int(rng.integers(0, 30)))] = EOT
    assert train_bpe(ids, 80) == train_bpe_reference(ids, 80)


def test_tokenizer_round_trip_and_determinism():
    text = ("def f(x):\n    return x + 1\n\n" * 50 + "class A:\n    pass\n" * 30).encode()
    ids = np.frombuffer(text, dtype=np.uint8)
    merges = train_bpe(ids, 40)
    assert merges == train_bpe(ids.copy(), 40)  # same bytes, same merges
    assert len(merges) == 40
    bpe = ByteBPE(merges)
    encoded = bpe.encode(text)
    assert len(encoded) < len(text) / 4  # repetitive text compresses well
    assert int(encoded.max()) < bpe.vocab_size == FIRST_MERGE_ID + 40
    assert bpe.decode(encoded) == text


def test_no_merge_crosses_a_document_boundary():
    ids = np.array(list(b"abab") + [EOT] + list(b"abab") + [EOT], dtype=np.uint16)
    merges = train_bpe(ids, 10)
    assert all(EOT not in pair for pair in merges)
    encoded = ByteBPE(merges).encode_ids(ids)
    assert (encoded == EOT).sum() == 2 and encoded[-1] == EOT


def test_chunked_encoding_equals_whole(tmp_path):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 4, size=20000).astype(np.uint16)
    ids[rng.integers(0, 20000, 40)] = EOT
    bpe = ByteBPE(train_bpe(ids, 30))
    whole = bpe._encode_piece(ids)
    for chunk in (1, 100, 5000, 1 << 20):
        assert np.array_equal(bpe.encode_ids(ids, chunk), whole)


# ---------------------------------------------------------------- corpus and cache


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    for rel, text in {"b.py": "print('b')\n" * 300, "a/z.py": "x = 1\n" * 400,
                      "a/y.py": "'''doc'''\n" * 200, "test/t.py": "skip me\n",
                      "site-packages/p.py": "skip me too\n", "notes.txt": "not python\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    return root


def test_corpus_files_sorted_without_tests_and_packages(small_corpus):
    files = data.corpus_files(small_corpus)
    assert [p.relative_to(small_corpus).as_posix() for p in files] == ["a/y.py", "a/z.py", "b.py"]


def test_corpus_tokens_decode_to_the_files_and_are_cached(small_corpus):
    tokens, info = data.corpus_tokens(20, root=small_corpus)
    files = data.corpus_files(small_corpus)
    expected = b"".join(p.read_bytes() for p in files)
    assert ByteBPE(info["merges"]).decode(tokens) == expected
    assert (tokens == EOT).sum() == len(files) == info["files"]
    assert info["vocab_size"] == FIRST_MERGE_ID + 20 and int(tokens.max()) < info["vocab_size"]
    cached = sorted((small_corpus.parent / "cache").glob("*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again, _ = data.corpus_tokens(20, root=small_corpus)
    assert np.array_equal(again, tokens) and cached[0].stat().st_mtime_ns == stamp
    cached[0].unlink()  # a rebuild from scratch gives the same ids
    rebuilt, _ = data.corpus_tokens(20, root=small_corpus)
    assert np.array_equal(rebuilt, tokens)


def test_corpus_stops_at_max_bytes_on_a_file_boundary(small_corpus):
    tokens, info = data.corpus_tokens(20, root=small_corpus, max_bytes=5000)
    assert info["files"] == 2 and info["bytes"] == 2000 + 1 + 2400 + 1  # y.py, z.py, EOTs
    assert ByteBPE(info["merges"]).decode(tokens).endswith(b"x = 1\n")


def test_tiny_corpus_is_refused(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpecError, match="synthetic=True"):
        data.corpus_tokens(10, root=tmp_path)


# ---------------------------------------------------------------- loader


def test_batches_have_shape_dtype_and_shifted_labels(shared_cache):
    dl = loader()
    x, y = next(iter(dl))
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert int(x.max()) < VOCAB and int(x.min()) >= 0
    info = dl.dataset.info
    assert info["vocab_size"] == VOCAB and info["seq_len"] == 64 and info["files"] > 100
    first = next(iter(dl.sampler))  # the batch is the packed corpus at the sampled index
    window = dl.dataset.tokens[first * 64:first * 64 + 65].astype(np.int64)
    assert x[0].tolist() == window[:-1].tolist() and y[0].tolist() == window[1:].tolist()


def test_same_seed_same_batches_other_seed_or_epoch_other_batches(shared_cache):
    a, b, c = batches(loader(), 3), batches(loader(), 3), batches(loader(seed=1), 3)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    dl = loader()
    dl.sampler.set_epoch(1)
    assert not torch.equal(next(iter(dl))[0], a[0][0])


def test_ranks_get_disjoint_shards_covering_the_corpus(shared_cache):
    world = 3
    shards = [list(loader(rank=r, world=world).sampler) for r in range(world)]
    n = len(loader().dataset)
    assert all(len(s) == n // world for s in shards)
    assert len(set().union(*map(set, shards))) == world * (n // world)
    first = [next(iter(loader(rank=r, world=world)))[0] for r in range(world)]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


def test_workers_and_prefetch_give_the_same_batches(shared_cache):
    plain = batches(loader(), 4)
    workers = batches(loader(num_workers=2, prefetch_factor=2, pin_memory=False), 4)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
               for p, q in zip(plain, workers, strict=True))


def test_infinite_runs_past_an_epoch_with_a_new_order(shared_cache):
    dl = loader(seq_len=16384, micro_batch=8, world=8)
    per_epoch = len(dl)
    assert 1 <= per_epoch < 20
    seen = [x for x, _ in itertools.islice(data.infinite(dl), 2 * per_epoch + 1)]
    assert len(seen) == 2 * per_epoch + 1
    assert not torch.equal(seen[0], seen[per_epoch])  # epoch 1 reshuffled


def test_synthetic_tokens_are_seeded_and_sharded():
    a = batches(loader(synthetic=True, vocab=100, seq_len=16), 2)
    b = batches(loader(synthetic=True, vocab=100, seq_len=16), 2)
    other_rank = batches(loader(synthetic=True, vocab=100, seq_len=16, rank=1, world=2), 1)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][1], b[1][1])
    assert not torch.equal(a[0][0], other_rank[0][0])
    x, y = a[0]
    assert x.shape == (4, 16) and int(x.max()) < 100 and torch.equal(y[:, :-1], x[:, 1:])


@pytest.mark.parametrize("kw, name", [
    ({"seq_len": 0}, "seq_len = 0"),
    ({"micro_batch": -1}, "micro_batch = -1"),
    ({"rank": 2, "world": 2}, "rank = 2"),
    ({"world": 0}, "world = 0"),
    ({"prefetch_factor": 2}, "prefetch_factor = 2"),
    ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor = 0"),
    ({"vocab": 100}, "vocab = 100"),
    ({"pin_memory": "yes"}, "pin_memory = 'yes'"),
    ({"seed": 1.5}, "seed = 1.5"),
    ({"seq_len": 10**9}, "seq_len = 1000000000"),
])
def test_bad_arguments_raise_spec_error_naming_the_value(shared_cache, kw, name):
    with pytest.raises(SpecError) as err:
        loader(**kw)
    assert name in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_default_vocab_build_keeps_ids_below_32000(monkeypatch):
    # The user's own cache (as the harness uses it): built once, about 10 s on 2 cores.
    if USER_CACHE is None:
        monkeypatch.delenv("TRAINPLAN_CACHE", raising=False)
    else:
        monkeypatch.setenv("TRAINPLAN_CACHE", USER_CACHE)
    dl = data.build_loader(seq_len=2048, micro_batch=2, rank=0, world=2, seed=0)
    x, _ = next(iter(dl))
    assert x.shape == (2, 2048) and int(x.max()) < dl.dataset.info["vocab_size"] <= 32000
    assert dl.dataset.info["vocab_size"] == FIRST_MERGE_ID + data.DEFAULT_MERGES
