"""`trainplan launch` guarding what the job reads and runs with: an --out that would delete
its data, specs, plan or a run's checkpoints; a --train-arg or --env that sets one thing twice;
a sequence longer than learned positions; a run of absurdly many steps; and plan-file values
named as the file's fields, not as flags the user never typed. Each refusal is one line,
exit 2, with nothing written and nothing deleted."""

from __future__ import annotations

import json
import os

import pytest

from trainplan import cli
from trainplan.errors import TrainplanError
from trainplan.launch import inputs, job
from trainplan.launch.folder import check_inputs

LA = ["launch", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--cluster", "dgx-h100",
      "--gpus", "8", "--cpu", "--steps", "10", "--target", "torchrun"]
PARALLEL = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 2, "micro_batch": 8,
            "grad_accum": 16, "recompute": "none", "dp_shard": 8, "pp_schedule": "1f1b",
            "pp_virtual": 1, "sequence_parallel": True}
PLAN = {"model": "llama-1.3b", "gpu": "h100-sxm", "cluster": "dgx-h100", "gpus": 8,
        "seq_len": 4096, "global_batch_tokens": 4194304}


def _tree(folder) -> dict:
    """Every file under `folder` (links not followed) -> its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _refused(argv, capsys, *needles) -> str:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error: "), err
    assert "Traceback" not in err and len(err.strip()) <= 300, err
    assert all(n in err for n in needles), err
    return err.strip()


@pytest.fixture
def work(tmp_path):
    """tmp_path/par/S: a shards folder (as `data prepare` leaves one), a model file and a plan
    file beside it, and a link to the shards."""
    shards = tmp_path / "par" / "S"
    shards.mkdir(parents=True)
    for name, text in (("index.json", "{}"), ("tokenizer.json", "{}"), ("train-00000.bin", "x")):
        (shards / name).write_text(text)
    (tmp_path / "par" / "tiny.yaml").write_text(
        "n_layers: 2\nhidden: 32\nn_heads: 4\nn_kv_heads: 2\nffn: 64\nvocab: 128\n")
    (tmp_path / "par" / "plan.json").write_text(json.dumps(
        {**PLAN, "decision": {"plan": {"parallel": PARALLEL}}}))
    (tmp_path / "link").symlink_to(shards)
    return tmp_path


# ---------------------------------------------------------------- 1: --out over an input

OVER = {  # case -> (argv after LA but --out, --out under tmp_path, what the line says)
    "data-itself": (["--data", "{t}/par/S"], "par/S", "is --data"),
    "data-itself-no-force": (["--data", "{t}/par/S"], "par/S", "is --data"),
    "data-parent": (["--data", "{t}/par/S"], "par", "holds --data"),
    "data-through-a-link": (["--data", "{t}/link"], "par/S", "is --data"),
    "out-a-link-to-data": (["--data", "{t}/par/S"], "link", "is --data"),
    "out-holds-the-link": (["--data", "{t}/holder/link"], "holder", "holds --data"),
    "inside-data": (["--data", "{t}/par/S"], "par/S/sub", "is inside --data"),
    "model-file": (["--model", "{t}/par/tiny.yaml"], "par", "holds --model"),
    "plan-file": (["--plan", "{t}/par/plan.json"], "par", "holds --plan"),
    "tokenizer": (["--data", "x", "--train-arg", "tokenizer={t}/par/S/tokenizer.json"], "par",
                  "holds --train-arg tokenizer"),
    "init-from": (["--data", "x", "--train-arg", "init_from={t}/par/S"], "par/S",
                  "is --train-arg init-from"),
}


@pytest.mark.parametrize("case", list(OVER), ids=list(OVER))
def test_an_out_over_what_the_job_reads_is_refused_and_nothing_is_deleted(case, work, capsys):
    argv, out, says = OVER[case]
    argv = [a.format(t=work) for a in argv]
    if case == "inside-data":
        (work / "par" / "S" / "sub").mkdir()
    if case == "out-holds-the-link":  # the link lives in --out; the data it names does not
        (work / "holder").mkdir()
        (work / "holder" / "link").symlink_to(work / "par" / "S")
    force = [] if case.endswith("no-force") else ["--force"]
    before = _tree(work)
    _refused([*LA, *argv, *force, "--out", str(work / out)], capsys, says,
             "an input of this launch", "name another folder")
    assert _tree(work) == before, "an input was changed"
    assert (work / "link").resolve() == work / "par" / "S"


def test_an_out_holding_the_preset_the_job_reads_is_refused(capsys, monkeypatch):
    """A preset name reads data/models/NAME.yaml: --out data/models would delete it (refused
    before --force is asked for; checked without --force, so a regression deletes nothing)."""
    from trainplan.specs import DATA_DIR

    preset = DATA_DIR / "models" / "llama-1.3b.yaml"
    assert inputs.spec_file("llama-1.3b", "models") == preset
    assert inputs.spec_file("llama-1.3b:2-layers", "models") == preset
    assert inputs.spec_file("no-such-model", "models") is None
    monkeypatch.chdir(DATA_DIR.parent)
    _refused([*LA, "--out", "data/models"], capsys, f"--out 'data/models' holds --model "
             f"'{preset}'")
    assert preset.is_file()


@pytest.mark.parametrize("run_folder", ["checkpoints", "logs"])
def test_an_out_a_job_ran_in_keeps_its_checkpoints_and_logs(run_folder, tmp_path, capsys):
    out = tmp_path / "job"
    (out / run_folder / "step-10").mkdir(parents=True)
    (out / "torchrun.sh").write_text("old")
    _refused([*LA, "--out", str(out), "--force"], capsys, f"holds {run_folder}/",
             "move it, or name another folder")
    assert (out / run_folder / "step-10").is_dir() and (out / "torchrun.sh").read_text() == "old"


def test_an_out_beside_or_new_inside_the_data_launches(work, capsys):
    """A sibling replaced with --force, or a new folder inside the data: nothing is lost."""
    before = _tree(work / "par" / "S")
    for out in (work / "beside", work / "par" / "S" / "launch"):
        if out.name == "beside":
            out.mkdir()
            (out / "old.txt").write_text("x")
        assert cli.main([*LA, "--data", str(work / "par" / "S"), "--out", str(out),
                         "--force"]) == 0, capsys.readouterr().err
        assert (out / "torchrun.sh").is_file()
    assert {k: v for k, v in _tree(work / "par" / "S").items()
            if not k.startswith("launch")} == before


def test_check_inputs_compares_as_given_and_with_links_resolved(work):
    check_inputs(work / "other", [("--data", work / "link")])
    with pytest.raises(TrainplanError, match="is --data"):
        check_inputs(work / "par" / "S", [("--data", work / "link")])
    with pytest.raises(TrainplanError, match="holds --model"):
        check_inputs(work / "par" / "..", [("--model", work / "par" / "tiny.yaml")])


# ---------------------------------------------------------------- 2: one setting set twice

DATA = [*LA, "--data", "shards"]


@pytest.mark.parametrize("arg, flag, source", [
    ("steps=5", "--steps", "its --steps"), ("data=/x", "--data", "its --data"),
    ("ste=5", "--steps", "its --steps"), ("seq_len=8", "--seq-len", "its --seq-len"),
    ("dp=2", "--dp", "the plan's layout (pin it with its --dp)"),
    ("ckpt-dir=/c", "--ckpt-dir", "the script's CKPT_DIR"),
    ("log-dir=/l", "--log-dir", "the script's LOG_DIR"),
    ("collective-timeout-s=9", "--collective-timeout-s", "its --collective-timeout-s"),
])
def test_a_train_arg_for_a_flag_launch_sets_is_refused_naming_both(arg, flag, source,
                                                                   tmp_path, capsys):
    _refused([*DATA, "--train-arg", "lr=2e-4", "--train-arg", arg, "--out",
              str(tmp_path / "o")], capsys,
             f"--train-arg '{arg}' sets the trainer's {flag}, which launch writes itself from "
             f"{source}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("first, second, flag", [("lr=1e-4", "lr=2e-4", "--lr"),
                                                 ("init_from=a", "init-from=b", "--init-from"),
                                                 ("lr-warm=1", "lr-warmup=2", "--lr-warmup")])
def test_a_train_arg_given_twice_is_refused(first, second, flag, tmp_path, capsys):
    _refused([*DATA, "--train-arg", first, "--train-arg", second, "--out",
              str(tmp_path / "o")], capsys,
             f"--train-arg '{second}' sets the trainer's {flag} again (after --train-arg "
             f"'{first}'); give it once")


def test_an_env_name_given_twice_is_refused(tmp_path, capsys):
    _refused([*LA, "--env", "NCCL_ALGO=Ring", "--env", "NCCL_ALGO=Tree", "--out",
              str(tmp_path / "o")], capsys,
             "--env 'NCCL_ALGO' is given twice ('NCCL_ALGO=Ring' and 'NCCL_ALGO=Tree')")
    assert not (tmp_path / "o").exists()


def test_a_train_arg_is_written_once_in_full(tmp_path, capsys):
    assert cli.main([*DATA, "--train-arg", "lr-warm=2", "--train-arg", "lr=2e-4", "--json",
                     "--out", str(tmp_path / "o")]) == 0
    args = json.loads(capsys.readouterr().out)["harness_args"]
    assert args[args.index("--lr-warmup") + 1] == "2" and args.count("--steps") == 1
    assert "--lr-warm" not in args


def test_every_flag_launch_writes_is_owned(tmp_path, capsys):
    """`inputs.OWNED` against a launched command: every trainer flag launch writes is in it
    (a --train-arg cannot set it again), and each one is a trainer flag."""
    assert cli.main([*DATA, "--pp", "2", "--tp", "2", "--json", "--out",
                     str(tmp_path / "o")]) == 0
    summary = json.loads(capsys.readouterr().out)
    text = (tmp_path / "o" / "torchrun.sh").read_text().split("-m trainplan.train", 1)[1]
    written = {w for w in [*text.split(), *summary["harness_args"]] if w.startswith("--")}
    assert written <= set(inputs.OWNED), written - set(inputs.OWNED)
    assert {"--steps", "--ckpt-dir", "--metrics", "--pp-schedule", "--data"} <= written
    assert all(inputs.trainer_flag(f[2:]) == f for f in inputs.OWNED)


# ---------------------------------------------------------------- 3: learned positions

GPT2 = ["launch", "--model", "gpt2-xl", "--gpu", "h100-sxm", "--gpus", "8", "--target",
        "torchrun", "--steps", "10"]


@pytest.mark.parametrize("extra, says", [
    ([], "the default seq_len 4096 (no --seq-len, --scenario or --plan gives one) is longer "
         "than model 'gpt2-xl' takes: its learned positions end at max_positions 1024; give "
         "--seq-len 1024 or less"),
    (["--seq-len", "2048"], "--seq-len 2048 is longer than model 'gpt2-xl' takes"),
    (["--plan", "PLAN"], "the plan's seq_len 4096 is longer than model 'gpt2-xl' takes: its "
                         "learned positions end at max_positions 1024; plan again with "
                         "--seq-len 1024 or less"),
])
def test_a_sequence_past_learned_positions_is_refused(extra, says, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**PLAN, "model": "gpt2-xl",
                                "decision": {"plan": {"parallel": PARALLEL}}}))
    argv = [*GPT2, *(str(plan) if a == "PLAN" else a for a in extra)]
    _refused([*argv, "--out", str(tmp_path / "o")], capsys, says)
    assert not (tmp_path / "o").exists()


def test_a_sequence_within_learned_positions_launches(tmp_path, capsys):
    assert cli.main([*GPT2, "--seq-len", "1024", "--json", "--out", str(tmp_path / "o")]) == 0
    args = json.loads(capsys.readouterr().out)["harness_args"]
    assert args[args.index("--seq-len") + 1] == "1024"


# ---------------------------------------------------------------- 4: --steps' bound


@pytest.mark.parametrize("steps", ["9007199254740992", "1000000001", "2e9"])
def test_steps_past_a_billion_are_refused(steps, tmp_path, capsys):
    _refused([*LA[:-4], "--steps", steps, *LA[-2:], "--out", str(tmp_path / "o")], capsys,
             f"--steps {int(float(steps))} is not valid; use 0-1000000000", "1e9")
    assert not (tmp_path / "o").exists()


def test_a_token_budget_past_a_billion_steps_is_refused():
    assert inputs.MAX_STEPS == 10**9 and job.steps_for(4096 * 10**9, 4096) == 10**9
    with pytest.raises(TrainplanError, match="is 1,000,000,001 steps of 4,096 tokens, more "
                                             "than launch's 1,000,000,000; give --steps N"):
        job.steps_for(4096 * (10**9 + 1), 4096)


# ---------------------------------------------------------------- 5: the plan file's values

PLANNED = {  # plan edits -> (extra flags, what the line says, what it must not say)
    "dp-shard": ({"dp": 4, "tp": 2, "dp_shard": 8, "zero": 3}, [],
                 "the plan's dp_shard 8 does not divide its dp 4", "--dp"),
    "dp-shard-flag": ({"dp": 4, "tp": 2, "dp_shard": 4, "zero": 3}, ["--dp-shard", "8"],
                      "--dp-shard 8 does not divide the plan's dp 4", "--dp 4"),
    "tp": ({"dp": 2, "tp": 3}, [], "the plan's tp 3 is not valid for llama-1.3b on 8 GPUs",
           "--tp"),
    "gpus": ({"gpus": 7}, [], "the plan's gpus 7 is not a multiple of --gpus-per-node 8",
             "--gpus 7"),
    "seq-len": ({"seq_len": 3000}, [],
                "the plan's global_batch_tokens 4194304 is not a multiple of its seq_len 3000",
                "--seq-len"),
    "cp-cpu": ({"dp": 4, "cp": 2, "dp_shard": 4}, [], "the plan's cp 2 with --cpu", "--cp 2"),
}


@pytest.mark.parametrize("case", list(PLANNED), ids=list(PLANNED))
def test_a_plan_file_s_value_is_named_as_its_field(case, tmp_path, capsys):
    edits, extra, says, not_says = PLANNED[case]
    top = {k: v for k, v in edits.items() if k in PLAN}
    parallel = {**PARALLEL, **{k: v for k, v in edits.items() if k not in PLAN}}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**PLAN, **top, "decision": {"plan": {"parallel": parallel}}}))
    err = _refused(["launch", "--plan", str(plan), "--target", "torchrun", "--steps", "10",
                    "--cpu", *extra, "--out", str(tmp_path / "o")], capsys, says)
    assert not_says not in err, err
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
