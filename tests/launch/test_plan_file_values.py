"""`launch --plan FILE` with a plan file edited by hand, and `--train-arg` values the trainer
refuses: each is one line, exit 2, naming the field (or flag) and its value, nothing written."""

from __future__ import annotations

import json

import pytest

from trainplan import cli
from trainplan.errors import TrainplanError
from trainplan.launch.job import plan_file_pins

PARALLEL = {"dp": 16, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 3, "micro_batch": 4,
            "grad_accum": 16, "recompute": "selective", "dp_shard": 8, "pp_schedule": "1f1b",
            "pp_virtual": 1, "sequence_parallel": True}
PLAN = {"model": "llama-7b", "gpus": 16, "seq_len": 4096, "global_batch_tokens": 4194304,
        "decision": {"plan": {"parallel": PARALLEL}}}


def _plan_file(tmp_path, top=None, parallel=None):
    plan = dict(PLAN, **(top or {}))
    plan["decision"] = {"plan": {"parallel": dict(PARALLEL, **(parallel or {}))}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


BAD = [({}, {"recompute": "bogus"}, "recompute = 'bogus'", "'selective'"),
       ({}, {"pp_schedule": "zigzag"}, "pp_schedule = 'zigzag'", "'interleaved'"),
       ({}, {"zero": 7}, "zero = 7", "[0, 1, 2, 3]"),
       ({}, {"dp": 0}, "dp = 0", ">= 1"),
       ({}, {"micro_batch": -4}, "micro_batch = -4", ">= 1"),
       ({"gpus": 0}, {}, "gpus = 0", ">= 1"),
       ({"seq_len": 0}, {}, "seq_len = 0", ">= 1"),
       ({"global_batch_tokens": -1}, {}, "global_batch_tokens = -1", ">= 1")]


@pytest.mark.parametrize("top, parallel, value, valid", BAD, ids=[b[2] for b in BAD])
def test_a_value_out_of_range_names_the_field(tmp_path, top, parallel, value, valid):
    path = _plan_file(tmp_path, top, parallel)
    with pytest.raises(TrainplanError) as err:
        plan_file_pins(path)
    text = str(err.value)
    assert "\n" not in text and "--plan" in text and value in text and valid in text, text


def test_the_plan_file_as_written_still_reads(tmp_path):
    pins, facts = plan_file_pins(_plan_file(tmp_path))
    assert pins == PARALLEL and facts["gpus"] == 16 and facts["seq_len"] == 4096


LAUNCH = ["launch", "--model", "llama-7b", "--gpu", "h100-sxm", "--target", "torchrun",
          "--steps", "10"]


def _one_line_exit_2(argv, capsys, tmp_path, *needles):
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "out").exists(), "something was written"


def test_a_bad_recompute_in_the_plan_file_is_exit_2(tmp_path, capsys):
    path = _plan_file(tmp_path, parallel={"recompute": "bogus"})
    _one_line_exit_2([*LAUNCH, "--plan", str(path)], capsys, tmp_path, "recompute = 'bogus'")


@pytest.mark.parametrize("arg, needles", [("lr=abc", ("--lr", "'abc'")),
                                          ("bogus-flag=1", ("--bogus-flag",))])
def test_a_train_arg_the_trainer_refuses_is_named(tmp_path, capsys, arg, needles):
    argv = [*LAUNCH, "--gpus", "16", "--data", "shards", "--train-arg", arg]
    _one_line_exit_2(argv, capsys, tmp_path, "trainplan.train refuses", *needles)
