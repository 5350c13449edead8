"""Data pipeline: corpus, tokenizer cache, packing, sharding, loader knobs."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from trainplan.bench.harness import data
from trainplan.data import tokenize
from trainplan.errors import SpecError

VOCAB = 320  # 63 merges: a few seconds to build over the stdlib, shared by the loader tests
USER_CACHE = os.environ.get("TRAINPLAN_CACHE")


def loader(**kw):
    args = dict(seq_len=64, micro_batch=4, rank=0, world=1, seed=0, vocab=VOCAB)
    return data.build_loader(**{**args, **kw})


def batches(dl, n):
    it = iter(dl)
    return [next(it) for _ in range(n)]


def documents(tokens: np.ndarray, eos: int) -> list[list[int]]:
    """The ids of each document: the runs between end-of-document ids (one ends the array)."""
    assert tokens[-1] == eos
    return [d[:-1].tolist() for d in np.split(tokens, np.flatnonzero(tokens == eos)[:-1] + 1)]


def text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- corpus and cache


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    for rel, body in {"b.py": "print('b')  # <|endoftext|>\n" * 150,
                      "a/z.py": "x = 1\n" * 400, "a/y.py": '"""déjà vu → 文"""\n' * 200,
                      "test/t.py": "skip me\n", "site-packages/p.py": "skip me too\n",
                      "notes.txt": "not python\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body, encoding="utf-8")
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    return root


def test_corpus_files_sorted_without_tests_and_packages(small_corpus):
    files = data.corpus_files(small_corpus)
    assert [p.relative_to(small_corpus).as_posix() for p in files] == ["a/y.py", "a/z.py", "b.py"]


def test_corpus_texts_leave_out_files_that_are_not_utf8(small_corpus):
    (small_corpus / "a/x.py").write_bytes(b"caf\xe9 = 1\n")  # Latin-1
    files = data.corpus_files(small_corpus)
    assert len(files) == 4
    assert data.corpus_texts(files) == [p.read_text("utf-8") for p in files[1:]]


def test_training_prefix_stops_at_the_file_that_reaches_the_limit():
    texts = ["a" * 10, "é" * 10, "c" * 10]  # 10, 20 and 10 bytes
    assert data.training_prefix(texts, 10) == texts[:1]
    assert data.training_prefix(texts, 11) == texts[:2]
    assert data.training_prefix(texts, 10**6) == texts


def test_corpus_tokens_decode_to_the_files_with_eos_between(small_corpus):
    tokens, info = data.corpus_tokens(280, root=small_corpus)
    files = data.corpus_files(small_corpus)
    eos = info["eos_id"]
    tok = tokenize.load(info["tokenizer_file"])
    assert tokenize.eos_id(tok, info["tokenizer_file"]) == eos
    docs = documents(tokens, eos)
    assert len(docs) == len(files) == info["files"] == (tokens == eos).sum()
    for ids, path in zip(docs, files, strict=True):  # b.py's "<|endoftext|>" is text
        assert text(tok, ids) == path.read_text("utf-8")
    assert info["vocab_size"] == tok.get_vocab_size() <= 280 and int(tokens.max()) < 280
    assert tokens.dtype == np.uint16 and info["tokens"] == len(tokens)
    assert info["bytes"] == sum(p.stat().st_size for p in files)


def test_cache_hit_returns_the_same_ids_and_a_rebuild_is_deterministic(small_corpus):
    tokens, info = data.corpus_tokens(280, root=small_corpus)
    cache = small_corpus.parent / "cache"
    npy = sorted(cache.glob("*.npy"))
    assert len(npy) == 1 and not list(cache.glob(".*.tmp"))
    tok_file = npy[0].with_name(npy[0].stem + ".tokenizer.json")  # beside the ids
    assert info["tokenizer_file"] == str(tok_file)
    assert tokenize.sha256(tok_file) == info["tokenizer_sha256"]
    stamp = npy[0].stat().st_mtime_ns
    data._corpus_tokens.cache_clear()  # read from disk, not from memory
    again, info_again = data.corpus_tokens(280, root=small_corpus)
    assert np.array_equal(again, tokens) and again.dtype == tokens.dtype
    assert npy[0].stat().st_mtime_ns == stamp and info_again == info
    assert not again.flags.writeable
    npy[0].unlink()  # a rebuild from scratch gives the same tokenizer and ids
    data._corpus_tokens.cache_clear()
    rebuilt, info_rebuilt = data.corpus_tokens(280, root=small_corpus)
    assert np.array_equal(rebuilt, tokens)
    assert info_rebuilt["tokenizer_sha256"] == info["tokenizer_sha256"]
    other, _ = data.corpus_tokens(300, root=small_corpus)  # other settings: another entry
    assert len(list(cache.glob("*.npy"))) == 2 and not np.array_equal(other, tokens)


def test_corpus_stops_at_max_bytes_on_a_file_boundary(small_corpus):
    y, z = (small_corpus / "a/y.py").stat().st_size, (small_corpus / "a/z.py").stat().st_size
    tokens, info = data.corpus_tokens(280, root=small_corpus, max_bytes=y + z + 10)
    assert info["files"] == 2 and info["bytes"] == y + z
    tok = tokenize.load(info["tokenizer_file"])
    assert text(tok, documents(tokens, info["eos_id"])[-1]) == "x = 1\n" * 400


def test_tiny_corpus_and_tiny_vocabulary_are_refused(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpecError, match="synthetic=True"):
        data.corpus_tokens(300, root=tmp_path)
    with pytest.raises(SpecError, match="vocab_size = 256"):
        data.corpus_tokens(256, root=tmp_path)


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


def test_stdlib_tokens_decode_to_the_stdlib_files(shared_cache):
    dl = loader()
    info, tokens = dl.dataset.info, dl.dataset.tokens
    tok = tokenize.load(info["tokenizer_file"])
    texts = data.corpus_texts(data.corpus_files())
    docs = documents(tokens, info["eos_id"])
    assert len(docs) == len(texts) == info["files"]
    assert [text(tok, ids) for ids in docs] == texts  # every file: encode is lossless
    assert info["tokens"] < 0.75 * info["bytes"]  # 63 merges shorten it by a third


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
    assert dl.dataset.info["vocab_size"] == data.DEFAULT_VOCAB
