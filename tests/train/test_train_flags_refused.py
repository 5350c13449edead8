"""`trainplan train` refuses, before torchrun starts, the flags a run would not use or could
not use: one line naming the value and what is valid, exit 2, nothing on stdout, nothing
written. Each refusal has an accepted neighbour, so a test fails for the right reason."""

from __future__ import annotations

import pytest
from tests.train import test_trainer

from trainplan import cli

work = test_trainer.work  # the shards of `trainplan data prepare` (BPE of 512 ids), reused

MULTI = ["--nnodes", "2", "--dp", "2"]
BAD = {  # case -> (flags, words the one line holds)
    "tokenizer-missing": (["--tokenizer", "{dir}/none.json"],
                          "--tokenizer = '{dir}/none.json' cannot be read"),
    "tokenizer-folder": (["--tokenizer", "{dir}"], "--tokenizer = '{dir}' cannot be read"),
    "seed-negative": (["--seed", "-1"], "--seed = -1 must be >= 0"),
    "rdzv-endpoint-one-node": (["--rdzv-endpoint", "nohost:1", "--rdzv-id", "j"],
                               "--rdzv-endpoint = 'nohost:1' is for multi-node runs"),
    "rdzv-id-one-node": (["--rdzv-id", "j"], "--rdzv-id = 'j' is for multi-node runs"),
    "rdzv-port-too-large": ([*MULTI, "--rdzv-endpoint", "h:99999", "--rdzv-id", "j"],
                            "--rdzv-endpoint = 'h:99999' is not HOST:PORT"),
    "rdzv-port-zero": ([*MULTI, "--rdzv-endpoint", "h:0", "--rdzv-id", "j"], "'h:0'"),
    "rdzv-no-port": ([*MULTI, "--rdzv-endpoint", "h", "--rdzv-id", "j"], "'h' is not HOST:PORT"),
    "rdzv-empty-id": ([*MULTI, "--rdzv-endpoint", "h:29400", "--rdzv-id", ""],
                      "--rdzv-id is empty"),
    "rdzv-blank-id": ([*MULTI, "--rdzv-endpoint", "h:29400", "--rdzv-id", " "],
                      "--rdzv-id is empty"),
    "nnodes-no-endpoint": (MULTI, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    "ckpt-keep-no-dir": (["--ckpt-keep", "3"], "--ckpt-keep 3 needs --ckpt-dir"),
    "ckpt-threads-no-dir": (["--ckpt-threads", "4"], "--ckpt-threads 4 needs --ckpt-dir"),
    "ckpt-hash-no-dir": (["--ckpt-hash", "after-writing"],
                         "--ckpt-hash after-writing needs --ckpt-dir"),
    "ckpt-every-no-dir": (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
    "eval-batches-no-eval": (["--eval-batches", "3"], "--eval-batches 3 needs --eval-every"),
    "eval-too-little-held-out": (["--eval-every", "2", "--micro-batch", "64", "--seq-len",
                                  "4096"], "--eval-every 2: the held-out split"),
    "lr-floor-constant": (["--lr-schedule", "constant", "--lr-floor", "0.2"],
                          "--lr-floor 0.2 is where a decay ends; with --lr-schedule constant"),
    "gc-every-python": (["--gc", "python", "--gc-every", "2"],
                        "--gc-every 2 is --gc step's schedule; with --gc python"),
    "gc-full-every-python": (["--gc", "python", "--gc-full-every", "50"],
                             "--gc-full-every 50 is --gc step's schedule"),
    "max-norm-nan": (["--max-norm", "nan"], "--max-norm = nan must be a finite number >= 0"),
    "max-norm-negative": (["--max-norm", "-1"], "--max-norm = -1.0 must be a finite number"),
    "max-norm-inf": (["--max-norm", "inf"], "--max-norm = inf must be a finite number"),
}
GOOD = {  # case -> (flags, words the printed command holds)
    "tokenizer": (["--tokenizer", "{shards}/tokenizer.json"], "--tokenizer {shards}/tokenizer"),
    "seed": (["--seed", "0"], "--model"),
    "rdzv-default-id": ([*MULTI, "--rdzv-endpoint", "h:29400"],
                        "--rdzv-endpoint h:29400 --rdzv-id trainplan"),
    "rdzv-id": ([*MULTI, "--rdzv-endpoint", "h:65535", "--rdzv-id", "j"], "--rdzv-id j"),
    "eval-batches": (["--eval-every", "2", "--eval-batches", "3"], "--eval-batches 3"),
    "lr-floor": (["--lr-schedule", "linear", "--lr-floor", "0.2"], "--lr-floor 0.2"),
    "gc-every": (["--gc", "step", "--gc-every", "2"], "--gc-every 2"),
    "max-norm-off": (["--max-norm", "0"], "--max-norm 0.0"),
    "ckpt-keep": (["--ckpt-dir", "{dir}/ck", "--ckpt-keep", "3"], "--ckpt-keep 3"),
}


def _train(work, tmp_path, flags: list[str]) -> list[str]:
    fill = {"dir": tmp_path, "shards": work / "shards"}
    return ["train", "--model", "llama-1.3b", "--data", str(work / "shards"), "--steps", "2",
            "--cpu", "--dry-run", *[f.format(**fill) for f in flags]]


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, work, tmp_path, capsys):
    flags, words = BAD[case]
    assert cli.main(_train(work, tmp_path, flags)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error:"), err
    assert words.format(dir=tmp_path) in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("case", list(GOOD), ids=list(GOOD))
def test_the_same_flags_where_they_are_used_pass(case, work, tmp_path, capsys):
    flags, words = GOOD[case]
    rc = cli.main(_train(work, tmp_path, flags))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert words.format(shards=work / "shards") in out, out


@pytest.mark.parametrize("flags, words", [
    (["--seed", "-1"], "--seed = -1 must be >= 0"),
    (["--max-norm", "nan"], "--max-norm = nan must be a finite number >= 0"),
    (["--eval-batches", "3"], "--eval-batches 3 needs --eval-every"),
    (["--lr-schedule", "constant", "--lr-floor", "0"], "--lr-floor 0.0 is where a decay ends"),
])
def test_the_trainers_own_parser_refuses_them_too(work, capsys, flags, words):
    """`python -m trainplan.train` (what torchrun runs): the same checks, before any process
    group starts."""
    from trainplan.train import loop

    assert loop.main(["--model", "llama-1.3b", "--data", str(work / "shards"), "--steps", "2",
                      "--cpu", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err, err
