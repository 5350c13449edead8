"""The trainer's data order and optimisation settings, without a training run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainplan.data import shards
from trainplan.errors import SpecError
from trainplan.train import optim
from trainplan.train.batches import ShardBatches, eval_batches, parse_mixture


def make_shards(folder, text: str, docs: int = 60):
    corpus = folder.parent / f"{folder.name}-corpus"
    corpus.mkdir()
    for i in range(docs):
        (corpus / f"{i:03d}.txt").write_text(f"{text} number {i}. " * 40)
    shards.prepare([str(corpus)], str(folder), vocab_size=300, val_fraction=0.1)
    return folder


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    base = tmp_path_factory.mktemp("mix")
    a = make_shards(base / "a", "the quick brown fox jumps over the lazy dog")
    tok = a / "tokenizer.json"
    corpus = base / "b-corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"{i:03d}.txt").write_text(f"lorem ipsum dolor sit amet {i} " * 40)
    shards.prepare([str(corpus)], str(base / "b"), tokenizer=str(tok), val_fraction=0.1)
    return base / "a", base / "b"


def source(two, weights=(3, 1), rank=0, world=1, **kw):
    (a, b) = two
    return ShardBatches([(a, float(weights[0])), (b, float(weights[1]))], split="train",
                        seq_len=16, micro_batch=4, grad_accum=2, dp_rank=rank, dp=world,
                        seed=kw.get("seed", 0), vocab_size=512)


def corpus_of(rows: torch.Tensor, two) -> np.ndarray:
    """Which corpus each sequence came from: every window of a is in a's id array."""
    a = shards.open_shards(two[0]).arrays[0]
    text = a.tobytes()
    return np.array([0 if np.asarray(r, dtype=a.dtype).tobytes() in text else 1 for r in rows])


def test_a_mixture_follows_its_weights_and_is_the_same_on_every_rank_count(two):
    s = source(two)
    rows = torch.cat([x for _ in range(40) for x, _ in s.next_step()])
    share = corpus_of(rows, two).mean()  # share of corpus b
    assert abs(share - 0.25) < 0.06, share
    # the global draw does not depend on how many ranks read it: rank r of 2 reads rows
    # r * 8 .. r * 8 + 7 of the one-rank step's 16 sequences' corpora
    one = ShardBatches([(two[0], 3.0), (two[1], 1.0)], split="train", seq_len=16,
                       micro_batch=4, grad_accum=4, dp_rank=0, dp=1, seed=0, vocab_size=512)
    halves = [source(two, rank=r, world=2) for r in (0, 1)]
    assert (one._corpora(5) == np.concatenate([h._corpora(5) for h in halves])).all()


def test_resume_continues_with_the_next_unseen_sequence(two):
    s = source(two)
    for _ in range(3):
        s.next_step()
    state = s.state_dict()
    expected = s.next_step()
    resumed = source(two)
    resumed.load_state_dict(state)
    got = resumed.next_step()
    for (x, y), (x2, y2) in zip(expected, got, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(got[0][1][:, :-1], got[0][0][:, 1:])  # labels: inputs shifted by one


def test_a_position_of_other_data_is_refused(two):
    state = source(two).state_dict()
    with pytest.raises(SpecError, match="not the same --data"):
        source(two, weights=(1, 1)).load_state_dict(state)


@pytest.mark.parametrize("item", ["a:0", "a:-2", "a:x", "a:nan"])
def test_bad_weights_are_one_line(item):
    with pytest.raises(SpecError, match="weight"):
        parse_mixture([item])


def test_eval_batches_are_fixed_and_shared_out(two):
    r0 = eval_batches(two[0], seq_len=16, micro_batch=2, batches=2, dp_rank=0, dp=2,
                      vocab_size=512)
    r1 = eval_batches(two[0], seq_len=16, micro_batch=2, batches=2, dp_rank=1, dp=2,
                      vocab_size=512)
    assert len(r0) == len(r1) == 2 and not torch.equal(r0[0][0], r1[0][0])
    again = eval_batches(two[0], seq_len=16, micro_batch=2, batches=2, dp_rank=0, dp=2,
                         vocab_size=512)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(r0, again, strict=True))


def test_warmup_then_cosine_to_the_floor():
    f = [optim.lr_factor(s, warmup=10, total=110, schedule="cosine", floor=0.1)
         for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    assert all(b <= a + 1e-12 for a, b in zip(f[10:], f[11:], strict=False))
    lin = optim.lr_factor(59, warmup=10, total=110, schedule="linear", floor=0.0)
    assert lin == pytest.approx(1 - 49 / 99)


def test_no_weight_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = optim.param_groups(model.parameters(), 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model[0].weight)} and groups[0]["weight_decay"] == 0.1
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 3


@pytest.mark.parametrize("kw, flag", [({"lr": 0.0}, "--lr"), ({"warmup": 50}, "--lr-warmup"),
                                      ({"floor": 1.5}, "--lr-floor"),
                                      ({"schedule": "step"}, "--lr-schedule"),
                                      ({"weight_decay": -1.0}, "--weight-decay")])
def test_bad_optimiser_settings_are_one_line(kw, flag):
    args = {"lr": 3e-4, "warmup": 0, "total": 50, "schedule": "cosine", "floor": 0.1,
            "weight_decay": 0.1, **kw}
    with pytest.raises(SpecError, match=flag) as err:
        optim.check(**args)
    assert "\n" not in str(err.value)


def test_plan_json_says_which_plans_the_trainer_runs(capsys):
    """`trainplan plan --json`: runnable per plan, and the reason where it is not."""
    import json

    from trainplan import cli

    assert cli.main(["plan", "--model", "llama-70b", "--gpu", "h100-sxm", "--gpus", "256",
                     "--top", "40", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert any(p["parallel"]["cp"] > 1 and p["runnable"] for p in plans), "cp runs (on GPUs)"
    assert all(p["runnable"] == (p["parallel"]["ep"] == 1) for p in plans)
    assert all("not_runnable_why" not in p for p in plans if p["runnable"])
