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
    "seed-negative": (["--seed", "-1"], "--seed: '-1' is not valid: it must be >= 0"),
    "steps-not-whole": (["--steps", "1.5"], "--steps: '1.5' is not a positive whole number"),
    "steps-zero": (["--steps", "0"], "--steps: '0' is not valid: it must be > 0"),
    "eval-every-word": (["--eval-every", "ten"], "--eval-every: 'ten' is not a whole number >= 0"),
    "lr-overflows": (["--lr", "1e308"], "--lr = 1e+308 is not valid; use a learning rate in "
                                        "[1e-10, 1]"),
    "lr-nan": (["--lr", "nan"], "--lr = nan is not valid"),
    "straggler-tolerance-nan": (["--straggler-tolerance", "nan"],
                                "--straggler-tolerance = nan must be a finite number >= 0"),
    "straggler-tolerance-inf": (["--straggler-tolerance", "inf"],
                                "--straggler-tolerance = inf must be a finite number >= 0"),
    "seq-len-absurd": (["--seq-len", "1e12"], "--seq-len 1000000000000 is not valid; use 1 to "
                                              "16,777,216"),
    "seq-len-past-learned-positions": (["--model", "gpt2-xl", "--seq-len", "1032"],
                                       "--seq-len 1032 is longer than model 'gpt2-xl' has "
                                       "learned positions for (max_positions 1024); use "
                                       "--seq-len 1024 or less"),
    "data-twice": (["--data", "{shards}", "{shards}/"], "names the folder of"),
    "log-dir-in-ckpt-dir": (["--ckpt-dir", "{dir}/ck", "--log-dir", "{dir}/ck/step-000002/logs"],
                            "step-000002/logs is inside --ckpt-dir "),
    "export-in-ckpt-dir": (["--ckpt-dir", "{dir}/ck", "--export", "{dir}/ck/hf"],
                           "ck/hf is inside --ckpt-dir "),
    "metrics-in-ckpt-dir": (["--ckpt-dir", "{dir}/ck", "--metrics", "{dir}/ck/m.jsonl"],
                            "ck/m.jsonl is inside --ckpt-dir "),
    "metrics-a-folder": (["--metrics", "{dir}"], "--metrics {dir} is a folder; name a file"),
    "ckpt-dir-why": (["--ckpt-dir", "{dir}/c", "--log-dir", "{dir}/c/l"],
                     ", whose step folders are replaced and deleted as checkpoints are saved"),
    "metrics-under-a-file": (["--metrics", "{shards}/index.json/m.jsonl"],
                             "index.json is not a folder; name a file"),
    "metrics-the-index": (["--metrics", "{shards}/index.json"],
                          "index.json is inside --data"),
    "metrics-the-model": (["--model", "{shards}/../tiny.yaml", "--metrics",
                           "{shards}/../tiny.yaml"], "tiny.yaml, one of the run's inputs"),
    "metrics-in-export": (["--ckpt-dir", "{dir}/ck", "--export", "{dir}/hf", "--metrics",
                           "{dir}/hf/m.jsonl"], "hf/m.jsonl is inside --export "),
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
    "steps-in-e-notation": (["--steps", "1e3", "--log-every", "2_0"],
                            "--steps 1000 --log-every 20"),
    "seq-len-in-learned-positions": (["--model", "gpt2-xl", "--seq-len", "1024"],
                                     "--seq-len 1024"),
    "lr": (["--lr", "1"], "--lr 1.0"),
    "metrics-new": (["--metrics", "{dir}/m/metrics.jsonl", "--ckpt-dir", "{dir}/ck"],
                    "--metrics {dir}/m/metrics.jsonl"),
    "log-dir-beside-ckpt-dir": (["--ckpt-dir", "{dir}/ck", "--log-dir", "{dir}/logs"],
                                "--log-dir {dir}/logs"),
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
    assert words.format(dir=tmp_path, shards=work / "shards") in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("case", list(GOOD), ids=list(GOOD))
def test_the_same_flags_where_they_are_used_pass(case, work, tmp_path, capsys):
    flags, words = GOOD[case]
    rc = cli.main(_train(work, tmp_path, flags))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert words.format(shards=work / "shards", dir=tmp_path) in out, out


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


@pytest.mark.parametrize("flags, words", [
    (["--lr", "1e308"], "--lr = 1e+308 is not valid; use a learning rate in [1e-10, 1]"),
    (["--straggler-tolerance", "nan"], "--straggler-tolerance = nan must be a finite number"),
    (["--seq-len", "17"], "--seq-len 17 is longer than model 'tiny-train' has learned positions "
                          "for (max_positions 16)"),
])
def test_the_trainer_refuses_what_torch_would_fail_on(work, tmp_path, capsys, flags, words):
    """`python -m trainplan.train` on a tiny model with 16 learned positions: a learning rate
    float32 cannot hold, a nan tolerance, a sequence past the position table are one line
    and exit 2 (not a RuntimeError, a run without straggler detection, an IndexError)."""
    from trainplan.train import loop

    (tmp_path / "learned.yaml").write_text(test_trainer.TINY + "positions: learned\n"
                                                               "max_positions: 16\n")
    assert loop.main(["--model", str(tmp_path / "learned.yaml"), "--data", str(work / "shards"),
                      "--steps", "1", "--seq-len", "16", "--cpu", "--no-progress",
                      *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err, err
