"""Instruction rows: the loss only on responses, packing fills rows and keeps every response
id exactly once, the cut keeps a response, rows are the same in workers and for a seed."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainplan.bench.harness.step import cross_entropy
from trainplan.data import rows, tokenize
from trainplan.data.rows import IGNORE

RECORDS = [
    {"prompt": "Add two numbers.", "response": "def add(a, b):\n    return a + b"},
    {"prompt": "Say hello " * 12, "response": "Hello!"},
    {"prompt": "", "response": "An answer with no question, " * 6},
    {"prompt": "Explain <|endoftext|> in text.", "response": "It is only text here."},
    {"prompt": "Long " * 200, "response": "A response after a long prompt. " * 30},
    {"prompt": "Short.", "response": "x" * 3},
] * 4


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    texts = [r["prompt"] + r["response"] for r in RECORDS] * 5
    tokenize.train(iter(texts), 300, path)
    return str(path)


def expected(tok_file: str, record: dict, budget: int) -> tuple[list[int], list[int]]:
    """(all ids, trained ids) of one record, encoded here independently of `rows`."""
    tok = tokenize.load(tok_file)
    tok.encode_special_tokens = True
    p = tok.encode(rows.PROMPT_TEMPLATE.format(prompt=record["prompt"])).ids
    r = tok.encode(record["response"]).ids + [tokenize.eos_id(tok, tok_file)]
    if len(p) + len(r) > budget:
        p = p[:max(budget - len(r), budget // 2)]
        r = r[:budget - len(p)]
    return p + r, r


@pytest.mark.parametrize("seq_len", [24, 64, 512])
def test_padded_rows_train_on_the_response_only(tok_file, seq_len):
    ds = rows.make_rows(RECORDS, tok_file, seq_len, pack=False)
    assert len(ds) == len(RECORDS)
    for i, rec in enumerate(RECORDS):
        x, y = ds[i]
        ids, response = expected(tok_file, rec, seq_len + 1)
        assert x.shape == y.shape == (seq_len,) and x.dtype == y.dtype == np.int64
        assert x[:len(ids) - 1].tolist() == ids[:-1]
        assert (x[len(ids) - 1:] == ds.encoder.eos).all()  # right padding
        assert y[y != IGNORE].tolist() == response  # exactly the response ids, in order
        first = len(ids) - len(response) - 1  # the position whose next id opens the response
        assert (y[:first] == IGNORE).all() and (y[len(ids) - 1:] == IGNORE).all()
        assert len(response) >= 1


def test_masked_labels_give_no_gradient_to_prompt_and_padding_positions(tok_file):
    """Fails if the masking were off: the loss would reach prompt and pad positions."""
    x, y = rows.make_rows(RECORDS[:2], tok_file, 96, pack=False)[1]
    y = torch.from_numpy(y)[None]
    logits = torch.randn(1, 96, 300, requires_grad=True)
    cross_entropy(logits, y).backward()
    touched = logits.grad.abs().sum(-1)[0] > 0
    assert touched.tolist() == (y[0] != IGNORE).tolist()
    assert 0 < int(touched.sum()) < 96


@pytest.mark.parametrize("seq_len", [16, 48, 200])
def test_packed_rows_are_full_and_keep_every_response_id_exactly_once(tok_file, seq_len):
    ds = rows.make_rows(RECORDS, tok_file, seq_len, pack=True)
    stream, trained = [], []
    for rec in RECORDS:
        ids, response = expected(tok_file, rec, seq_len + 1)
        stream += ids
        trained += [False] * (len(ids) - len(response)) + [True] * len(response)
    assert len(ds) == (len(stream) - 1) // seq_len and ds.info["stream_tokens"] == len(stream)
    got_x, got_y = zip(*(ds[i] for i in range(len(ds))), strict=True)
    covered = len(ds) * seq_len + 1
    assert np.concatenate(got_x).tolist() == stream[:covered - 1]  # no padding: rows are full
    want = [t if keep else IGNORE for t, keep in zip(stream[1:covered], trained[1:covered],
                                                     strict=True)]
    assert np.concatenate(got_y).tolist() == want  # every trained id once, in stream order
    assert all((y != IGNORE).any() for y in got_y)  # no row without a loss
    assert len(stream) - covered < seq_len  # only the last partial row is dropped


def test_the_cut_keeps_at_most_half_a_row_of_prompt_and_a_response(tok_file):
    enc = rows.Encoder(tok_file, 33)
    ids, trained = enc.encode(RECORDS[4])
    assert len(ids) == 33 and (~trained).sum() == 16 and trained.sum() == 17
    ids, trained = enc.encode({"prompt": "p " * 100, "response": "ok"})
    assert len(ids) == 33 and trained.sum() == len(enc.pair({"prompt": "", "response": "ok"})[1])
    assert enc.lengths(RECORDS).tolist() == [len(enc.encode(r)[0]) for r in RECORDS]


@pytest.mark.parametrize("pack", [True, False])
def test_rows_are_the_same_in_loader_workers_and_after_pickling(tok_file, pack):
    ds = rows.make_rows(RECORDS, tok_file, 32, pack=pack)
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives
    assert copy.encoder._tok is None
    main = list(DataLoader(ds, batch_size=4))
    workers = list(DataLoader(ds, batch_size=4, num_workers=2))
    assert len(main) == len(workers) > 0
    for (x0, y0), (x1, y1) in zip(main, workers, strict=True):
        assert x0.dtype == torch.int64 and torch.equal(x0, x1) and torch.equal(y0, y1)
    again = rows.make_rows(RECORDS, tok_file, 32, pack=pack)
    assert all(np.array_equal(a, b) for i in range(len(ds)) for a, b in zip(ds[i], again[i],
                                                                              strict=True))
