"""`trainplan bench` and the harness it launches refuse sizes the model or the planner cannot
take, before any process starts: a --seq-len past a model's learned positions (GPT-2's 1024),
past the planner's longest sequence (`specs.bounds.MAX_SEQ_LEN`), and a learning rate that
torch cannot hold. One line naming the value and what is valid, exit 2; the accepted
neighbour of each passes (`--dry-run`: checked, nothing started)."""

from __future__ import annotations

import pytest

from trainplan import cli
from trainplan.bench.harness import train

GPT2 = ["--model", "gpt2-xl", "--layers", "1"]
RUN = ["--cpu", "--synthetic", "--steps", "2", "--warmup", "1", "--micro-batch", "1"]


@pytest.mark.parametrize("flags, words", [
    ([*GPT2, "--seq-len", "1032"], "--seq-len 1032 is longer than model 'gpt2-xl' has learned "
                                   "positions for (max_positions 1024); use --seq-len 1024"),
    (["--model", "llama-1.3b", "--layers", "1", "--seq-len", "1e12"],
     "--seq-len 1000000000000 is not valid; use 1 to 16,777,216"),
    (["--model", "llama-1.3b", "--layers", "1", "--lr", "1e308"],
     "--lr = 1e+308 is not valid; use a learning rate in [1e-10, 1]"),
])
def test_bench_refuses_before_torchrun(capsys, flags, words):
    assert cli.main(["bench", *flags, *RUN, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error:"), err
    assert words in err, err


@pytest.mark.parametrize("flags", [[*GPT2, "--seq-len", "1024"],
                                   ["--model", "llama-1.3b", "--layers", "1", "--lr", "1"]])
def test_the_neighbours_pass(capsys, flags):
    assert cli.main(["bench", *flags, *RUN, "--dry-run"]) == 0, capsys.readouterr().err


def test_the_harness_refuses_them_itself(capsys):
    """`python -m trainplan.bench.harness.train`, as a rank runs it: the same line, exit 2,
    before a process group or a model is made."""
    assert train.main([*GPT2, *RUN, "--seq-len", "1032"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "max_positions 1024" in err, err
