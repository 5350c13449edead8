"""`launch --plan FILE` against the flags and scenario, a broken plan file, and a Slurm time
limit out of range: each refusal is one line, exit 2, naming the field (or flag) and its value,
with nothing written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainplan import cli
from trainplan.errors import TrainplanError
from trainplan.launch.artefacts import LaunchError, LaunchSettings
from trainplan.launch.job import PLAN_SIZES, PLAN_SPECS, plan_file_pins
from trainplan.launch.render import MAX_TIME_LIMIT_MIN, _slurm_time
from trainplan.specs import PLAN_FIELDS

ROOT = Path(__file__).resolve().parents[2]
PARALLEL = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 2, "micro_batch": 8,
            "grad_accum": 16, "recompute": "none", "dp_shard": 8, "pp_schedule": "1f1b",
            "pp_virtual": 1, "sequence_parallel": True}
PLAN = {"model": "llama-1.3b", "gpu": "h100-sxm", "cluster": "dgx-h100", "gpus": 8,
        "seq_len": 4096, "global_batch_tokens": 4194304,
        "decision": {"plan": {"parallel": PARALLEL}}}
LAUNCH = ["launch", "--target", "torchrun", "--steps", "10", "--cpu"]


def _write(tmp_path, plan) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _one_line_exit_2(argv, capsys, tmp_path, *needles):
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error: "), err
    assert "Traceback" not in err and all(n in err for n in needles), err
    assert not (tmp_path / "out").exists(), "something was written"


# ---------------------------------------------------------------- 1: the plan's model and sizes


def test_the_plan_names_the_model_gpu_and_cluster(tmp_path, capsys):
    """No --model, --gpu or --cluster: the plan file's, and its layout, are launched."""
    assert cli.main(["plan", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--gpus", "8",
                     "--top", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    path = _write(tmp_path, plan)
    assert cli.main([*LAUNCH, "--plan", str(path), "--json", "--out", str(tmp_path / "o")]) == 0
    got = json.loads(capsys.readouterr().out)
    args = got["harness_args"]
    assert args[args.index("--model") + 1] == "llama-1.3b"
    assert got["plan"]["parallel"] == plan["decision"]["plan"]["parallel"]
    assert (tmp_path / "o" / "torchrun.sh").is_file()


@pytest.mark.parametrize("key, value", [("precision", "fp8"), ("loss", "fused")])
def test_a_plan_for_what_launch_does_not_run_is_refused(key, value, tmp_path, capsys):
    """launch prices and writes bf16 with the standard loss: an fp8 or fused-loss plan would
    be launched as something else, so it is refused (a bf16 one, named so, launches)."""
    path = _write(tmp_path, {**PLAN, key: value})
    _one_line_exit_2([*LAUNCH, "--plan", str(path)], capsys, tmp_path,
                     f"was made for {key} '{value}'", f"--{key} {value}")
    path = _write(tmp_path, {**PLAN, "precision": "bf16", "loss": "standard"})
    assert cli.main([*LAUNCH, "--plan", str(path), "--out", str(tmp_path / "o")]) == 0


MISMATCH = {  # flags (or a scenario) that differ from PLAN's: (argv, needles)
    "model": (["--model", "llama-7b"], ["made for model 'llama-1.3b'", "not --model 'llama-7b'",
                                        "leave --model out"]),
    "model-file": (["--model", str(ROOT / "data/models/llama-7b.yaml")],
                   ["made for model 'llama-1.3b'", "(model 'llama-7b')"]),
    "gpu": (["--gpu", "h200-sxm"], ["made for gpu 'h100-sxm'", "not --gpu 'h200-sxm'"]),
    "cluster": (["--cluster", "hgx-h100-4gpu"], ["made for cluster 'dgx-h100'",
                                                 "not --cluster 'hgx-h100-4gpu'"]),
    "gpus": (["--gpus", "16"], ["made for gpus 8", "not --gpus 16"]),
    "seq-len": (["--seq-len", "2048"], ["made for seq_len 4096", "not --seq-len 2048"]),
    "global-batch": (["--global-batch-tokens", "2097152"],
                     ["made for global_batch_tokens 4194304", "not --global-batch-tokens 2097152"]),
    "scenario": (["--scenario", "llama-13b-32xh100"],
                 ["made for model 'llama-1.3b'", "not the --scenario's model 'llama-13b'"]),
}


@pytest.mark.parametrize("case", list(MISMATCH), ids=list(MISMATCH))
def test_a_plan_launched_for_another_model_or_size_is_refused(case, tmp_path, capsys):
    argv, needles = MISMATCH[case]
    path = _write(tmp_path, PLAN)
    _one_line_exit_2([*LAUNCH, "--plan", str(path), *argv], capsys, tmp_path,
                     "plan.json' was made for", *needles)


def test_long_paths_keep_what_the_refusal_is_about(tmp_path, capsys):
    """A plan and a model file deep in long folders (a CI checkout, pytest's tmp folders):
    the line is cut to its limit but keeps both models and the fix."""
    deep = tmp_path / ("p" * 60) / ("q" * 60)
    deep.mkdir(parents=True)
    model = deep / "llama-7b.yaml"
    model.write_text((ROOT / "data/models/llama-7b.yaml").read_text())
    path = _write(deep, PLAN)
    _one_line_exit_2([*LAUNCH, "--plan", str(path), "--model", str(model)], capsys, tmp_path,
                     "was made for model 'llama-1.3b'", "(model 'llama-7b')",
                     "leave --model out, or plan again for it")
    long_name = "llama-2-7b-chat-finetuned-sft-v2-8k-" + "x" * 34  # 70: quoted whole
    model.write_text(f"name: {long_name}\n" + model.read_text())
    _one_line_exit_2([*LAUNCH, "--plan", str(path), "--model", str(model)], capsys, tmp_path,
                     "was made for model 'llama-1.3b'", f"(model '{long_name}')",
                     "leave --model out, or plan again for it")


def test_a_short_plan_path_is_named_whole(tmp_path, capsys):
    path = _write(tmp_path, PLAN)
    _one_line_exit_2([*LAUNCH, "--plan", str(path), "--model", "llama-7b"], capsys, tmp_path,
                     f"--plan '{path}' was made for model 'llama-1.3b'")


def test_a_plan_for_a_model_file_asks_for_the_file(tmp_path, capsys):
    """A plan of a model spec file names the model, not the file: --model must give it."""
    path = _write(tmp_path, dict(PLAN, model="tiny"))
    _one_line_exit_2([*LAUNCH, "--plan", str(path)], capsys, tmp_path,
                     "unknown model 'tiny'", "give --model with the spec it was planned from")


def test_without_a_plan_the_model_is_still_needed(tmp_path, capsys):
    _one_line_exit_2([*LAUNCH, "--gpu", "h100-sxm", "--gpus", "8"], capsys, tmp_path,
                     "launch needs --model")


# ---------------------------------------------------------------- 2: the Slurm time limit

SLURM = ["launch", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--gpus", "8", "--cpu",
         "--steps", "10", "--target", "slurm"]


@pytest.mark.parametrize("text, shown", [("1e11", "100000000000"), ("525601", "525601"),
                                         ("9007199254740992", "9007199254740992")])
def test_a_time_limit_over_a_year_is_refused(text, shown, tmp_path, capsys):
    _one_line_exit_2([*SLURM, f"--time-limit-min={text}"], capsys, tmp_path,
                     f"--time-limit-min {shown} is not valid; use 1-525600")


@pytest.mark.parametrize("text", ["0", "-5", "nan", "inf", "1.5", "abc", "1e400"])
def test_a_time_limit_that_is_no_whole_number_above_0_is_refused(text, tmp_path, capsys):
    _one_line_exit_2([*SLURM, f"--time-limit-min={text}"], capsys, tmp_path,
                     "--time-limit-min", repr(text))


def test_the_time_limit_bound_is_a_year_and_both_ends_are_valid():
    assert MAX_TIME_LIMIT_MIN == 525600 and _slurm_time(MAX_TIME_LIMIT_MIN) == "365-00:00:00"
    for minutes in (1, MAX_TIME_LIMIT_MIN):
        LaunchSettings(target="slurm", time_limit_min=minutes, warn_s=30, save_grace_s=10)
    for minutes in (0, -1, MAX_TIME_LIMIT_MIN + 1):
        with pytest.raises(LaunchError, match=f"--time-limit-min {minutes} is not valid"):
            LaunchSettings(target="k8s", time_limit_min=minutes)


# ---------------------------------------------------------------- 3: a broken plan file


def _edit(field: str, value):
    """PLAN with `field` (dotted; "" for the whole file) set to `value`, or removed (...);
    "plans..." fields edit a file without a decision, whose first plan is launched."""
    plan = copy.deepcopy(PLAN)
    if field.startswith("plans"):
        plan["plans"] = [plan.pop("decision")["plan"]]
    if field == "":
        return value
    *parents, last = field.replace("[0]", ".0").split(".")
    obj = plan
    for key in parents:
        obj = obj[int(key) if key.isdigit() else key]
    last = int(last) if last.isdigit() else last
    if value is ... and isinstance(obj, dict):
        del obj[last]
    elif value is ...:
        obj.clear()  # plans[0] missing: an empty list
    else:
        obj[last] = value
    return plan


P = "decision.plan.parallel"
BROKEN = [  # (field, value or ... for missing, what the line says)
    ("", [], "the top-level value = []"), ("", None, "the top-level value = null"),
    ("", "plan", "the top-level value = 'plan'"), ("", 3, "the top-level value = 3"),
    ("decision", None, "decision = null is not valid; use an object with a plan"),
    ("decision", [], "decision = []"), ("decision", "x", "decision = 'x'"),
    ("decision", 7, "decision = 7"), ("decision", True, "decision = true"),
    ("decision", ..., "decision is missing"),
    ("decision.plan", None, "decision.plan = null"), ("decision.plan", [1], "decision.plan = [1]"),
    ("decision.plan", ..., "decision.plan is missing"),
    (P, ..., f"{P} is missing"), (P, None, f"{P} = null"), (P, "dp=8", f"{P} = 'dp=8'"),
    (P, [8], f"{P} = [8]"),
    (f"{P}.dp", ..., f"{P}.dp is missing"), (f"{P}.dp", "8", f"{P}.dp = '8'"),
    (f"{P}.dp", 8.0, f"{P}.dp = 8.0"), (f"{P}.dp", {"a": 1}, f"{P}.dp = {{'a': 1}}"),
    (f"{P}.dp", True, f"{P}.dp = true"), (f"{P}.dp", None, f"{P}.dp = null"),
    (f"{P}.dp", 2**70, f"{P}.dp = {2**70}"), (f"{P}.tp", None, f"{P}.tp = null"),
    (f"{P}.recompute", ["none"], f"{P}.recompute = ['none']"),
    (f"{P}.recompute", 3, f"{P}.recompute = 3"),
    (f"{P}.sequence_parallel", 1, f"{P}.sequence_parallel = 1 is not valid; use true or false"),
    (f"{P}.sequence_parallel", "yes", f"{P}.sequence_parallel = 'yes'"),
    (f"{P}.zero", "3", f"{P}.zero = '3' is not valid; use one of [0, 1, 2, 3]"),
    (f"{P}.pp_virtual", [[{}]], f"{P}.pp_virtual = [[{{}}]]"),
    ("model", ..., "model is missing"), ("model", None, "model = null is not valid; use a name"),
    ("model", 7, "model = 7"), ("model", "", "model = ''"),
    ("model", ["llama-7b"], "model = ['llama-7b']"),
    ("gpus", "8", "gpus = '8' is not valid; use a whole number >= 1"), ("gpus", 8.5, "gpus = 8.5"),
    ("gpus", ..., "gpus is missing"), ("seq_len", True, "seq_len = true"),
    ("global_batch_tokens", None, "global_batch_tokens = null"),
    ("gpu", None, "gpu = null"), ("cluster", 5, "cluster = 5"),
    ("plans", None, "plans = null is not valid; use a list of plans"), ("plans", {}, "plans = {}"),
    ("plans[0]", ..., "plans[0] is missing"), ("plans[0]", None, "plans[0] = null"),
    ("plans[0].parallel", None, "plans[0].parallel = null"),
    ("plans[0].parallel.micro_batch", -4, "plans[0].parallel.micro_batch = -4"),
]


@pytest.mark.parametrize("field, value, says", BROKEN, ids=[b[2] for b in BROKEN])
def test_a_broken_plan_file_names_the_file_and_the_field(field, value, says, tmp_path, capsys):
    path = _write(tmp_path, _edit(field, value))
    _one_line_exit_2([*LAUNCH, "--plan", str(path)], capsys, tmp_path,
                     f"error: --plan {str(path)!r}: {says}", "trainplan plan --json")


VALUES = [None, True, 0, -1, 1.5, 2**64, "", "x", [], [None], {}, {"dp": []}, [[{"a": None}]]]
FIELDS = ["", "decision", "decision.plan", P, *(f"{P}.{k}" for k in PLAN_FIELDS),
          *PLAN_SPECS, *PLAN_SIZES, "plans", "plans[0]", "plans[0].parallel"]


@pytest.mark.parametrize("field", FIELDS)
def test_any_json_value_anywhere_is_read_or_refused_naming_the_field(field, tmp_path):
    """Every value at every position the reader looks at: read, or one line naming the file
    and the field (`job._refuse`), never another exception."""
    for value in VALUES:
        path = _write(tmp_path, _edit(field, value))
        try:
            plan_file_pins(path)
        except TrainplanError as err:
            text = str(err)
            named = (field.split(".")[-1] if field else  # an object there: its decision
                     "decision" if isinstance(value, dict) else "the top-level value")
            assert "\n" not in text and text.startswith(f"--plan {str(path)!r}: "), text
            assert named in text and "trainplan plan --json" in text, (value, text)
