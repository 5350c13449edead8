"""`trainplan launch` of a scenario whose token budget is too small for the harness's warm-up:
the one line names the scenario's token_budget and the smallest budget that runs, not
flags the user did not give; the budget one token larger is launched."""

from __future__ import annotations

import json

import pytest
from tests.launch.helpers import TINY, TINY_LAYOUT

from trainplan import cli

TOKENS_PER_STEP = 128  # --global-batch-tokens of TINY_LAYOUT: dp 2 x micro-batch 2 x seq 32
PINS = TINY_LAYOUT[:TINY_LAYOUT.index("--synthetic")]  # the harness's flags: per test
HARNESS = ["--synthetic"]


def _scenario(tmp_path, token_budget) -> str:
    (tmp_path / "tiny.yaml").write_text(TINY)
    path = tmp_path / "scenario.yaml"
    path.write_text(f"model: {tmp_path / 'tiny.yaml'}\ngpu: h100-sxm\ncluster: dgx-h100\n"
                    f"gpus: 2\nseq_len: 32\nglobal_batch_tokens: {TOKENS_PER_STEP}\n"
                    f"token_budget: {token_budget}\n")
    return str(path)


def _launch(tmp_path, token_budget, *flags) -> list[str]:
    return ["launch", "--scenario", _scenario(tmp_path, token_budget), *PINS, *flags,
            "--target", "torchrun", "--out", str(tmp_path / "out")]


@pytest.mark.parametrize("token_budget, warmup, smallest", [
    (1, HARNESS, 5 * TOKENS_PER_STEP + 1),  # the default 5 warm-up steps
    (TOKENS_PER_STEP, [*HARNESS, "--warmup", "1"], TOKENS_PER_STEP + 1),
])
def test_a_budget_of_no_more_steps_than_the_warmup_names_the_budget(
        tmp_path, capsys, token_budget, warmup, smallest):
    assert cli.main(_launch(tmp_path, token_budget, *warmup)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"token_budget {token_budget} is 1 step(s) of {TOKENS_PER_STEP} tokens" in err, err
    assert f"at least {smallest:,}" in err, err
    assert "must be < --steps" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_smallest_budget_named_is_launched(tmp_path, capsys):
    argv = _launch(tmp_path, TOKENS_PER_STEP + 1, *HARNESS, "--warmup", "1")
    assert cli.main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and "--warmup" in summary["harness_args"]


def test_the_trainer_has_no_warmup_so_one_step_is_enough(tmp_path, capsys):
    """With --data the trainer runs: every step trains, one step of budget is a run."""
    rc = cli.main([*_launch(tmp_path, 1, "--data", "shards"), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["steps"] == 1
