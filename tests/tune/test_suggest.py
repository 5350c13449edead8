"""`trainplan suggest`: the command answers with config and reasons; bad input exits 2."""

from __future__ import annotations

import json
import math

import pytest

from conftest import ROOT, trainplan_cli
from trainplan import cli
from trainplan.calibrate.store import load_gpu
from trainplan.compare import trust
from trainplan.cost import params
from trainplan.plan.planner import plan
from trainplan.specs import load_cluster, load_model
from trainplan.tune import report as tune_report
from trainplan.tune import suggest

from .test_tune import fake_study

DESIGN = ["suggest", "--model-size", "7B", "--gpus", "16", "--dataset-tokens", "2e9"]


@pytest.fixture
def no_study(tmp_path, monkeypatch):
    monkeypatch.setattr(tune_report, "COMMITTED", tmp_path / "no-study.journal")


def _run(capsys, args) -> tuple[int, str, str]:
    rc = cli.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_design_command_answers_with_config_and_reasons():
    proc = trainplan_cli([*DESIGN, "--json"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    c, r, e = out["config"], out["reasons"], out["estimate"]
    assert out["model"]["name"] == "llama-7b"
    assert c["parallel"]["dp"] * c["parallel"]["tp"] * c["parallel"]["pp"] * \
        c["parallel"]["cp"] == 16
    assert c["global_batch_tokens"] == c["global_batch_sequences"] * 4096
    assert c["global_batch_sequences"] == c["parallel"]["dp"] * c["micro_batch"] * c["grad_accum"]
    for key in ("model", "parallel", "micro_batch", "global_batch", "grad_accum", "nccl",
                "data_loader", "time_to_train"):
        assert r[key], key
    assert {"NCCL_ALGO", "NCCL_PROTO"} == set(c["nccl"]) and "num_workers" in c["data_loader"]
    assert e["days"] > 0 and e["gpu_hours"] == pytest.approx(e["hours"] * 16)
    assert e["steps"] == math.ceil(2e9 / c["global_batch_tokens"])


def test_without_a_study_nccl_and_loader_say_defaults(no_study, capsys):
    rc, out, _ = _run(capsys, [*DESIGN, "--json"])
    out = json.loads(out)
    assert rc == 0 and out["study"] is None
    assert out["reasons"]["nccl"].startswith("defaults: no study yet")
    assert out["reasons"]["data_loader"].startswith("defaults: no study yet")
    assert out["config"]["nccl"] == {"NCCL_ALGO": None, "NCCL_PROTO": None}


def test_with_a_study_the_reasons_cite_it_and_a_harmful_level_is_not_taken(tmp_path, capsys):
    fake_study(tmp_path / "fake.journal")  # NCCL_PROTO=LL costs 30% there
    rc, out, _ = _run(capsys, [*DESIGN, "--study", str(tmp_path / "fake.journal"), "--json"])
    out = json.loads(out)
    assert rc == 0 and out["study"]["trials"] == 40
    assert "study fake" in out["reasons"]["nccl"] and "LL vs default -" in out["reasons"]["nccl"]
    assert out["config"]["nccl"]["NCCL_PROTO"] is None
    assert "no measurable effect" in out["reasons"]["data_loader"]


def test_text_form_gives_each_setting_its_reason(no_study, capsys):
    rc, out, _ = _run(capsys, DESIGN)
    assert rc == 0 and out.count("because") == 9
    assert "knob_effects: nccl_algo, nccl_proto" in out  # no study: nothing measured


@pytest.mark.parametrize("text,tokens", [("1T", 1e12), ("500M", 5e8), ("1.5b", 1.5e9),
                                         ("2e9", 2e9), ("2_000_000_000", 2e9), ("750K", 7.5e5)])
def test_dataset_tokens_take_a_unit_as_model_size_does(text, tokens):
    assert suggest.parse_tokens(text) == pytest.approx(tokens)


def test_dataset_tokens_set_the_steps_and_gpu_hours(no_study, capsys):
    outs = []
    for text in ("1T", "2T"):
        rc, out, _ = _run(capsys, ["suggest", "--model-size", "7B", "--gpus", "16",
                                   "--dataset-tokens", text, "--json"])
        outs.append(json.loads(out))
    one, two = (o["estimate"] for o in outs)
    assert one["steps"] == math.ceil(1e12 / outs[0]["config"]["global_batch_tokens"])
    assert two["gpu_hours"] == pytest.approx(2 * one["gpu_hours"])
    assert outs[0]["request"]["dataset_tokens"] == 1e12


def test_dataset_tokens_up_to_the_bound_are_priced(no_study, capsys):
    rc, out, err = _run(capsys, ["suggest", "--model-size", "7B", "--gpus", "16",
                                 "--dataset-tokens", "10000T", "--json"])  # 1e16: the bound
    assert rc == 0, err
    assert json.loads(out)["request"]["dataset_tokens"] == suggest.MAX_TOKENS


@pytest.mark.parametrize("size,preset", [("7B", "llama-7b"), ("13b", "llama-13b"),
                                         ("1.3B", "llama-1.3b"), ("70B", "llama-70b"),
                                         ("8x7B", "mixtral-8x7b")])
def test_sizes_near_a_preset_take_it(size, preset):
    assert suggest.model_for(size)[0].name == preset


@pytest.mark.parametrize("size", ["350M", "3B", "30B", "175B"])
def test_other_sizes_are_built_from_standard_shapes_near_the_size(size):
    m, reason = suggest.model_for(size)
    n, _ = suggest.parse_size(size)
    assert abs(params.total_params(m) / n - 1) < 0.1 and "standard shapes" in reason
    assert m.hidden % 128 == 0 and m.ffn % 256 == 0


def test_the_scenario_spec_can_replace_the_size(no_study):
    out = suggest.suggest(None, gpus=32, dataset_tokens=2.6e11, spec=load_model("llama-13b"))
    assert out["model"]["name"] == "llama-13b" and "scenario" in out["reasons"]["model"]


@pytest.mark.parametrize("args,needle", [
    (["--model-size", "seven"], "'seven' is not a size"),
    (["--model-size", "7Q"], "'7Q' is not a size"),
    (["--model-size", "10M"], "out of range"),
    (["--model-size", "9T"], "out of range"),
    (["--model-size", "8x22B"], "'8x22B'"),
    (["--model-size", "70B", "--gpus", "2"], "nothing fits"),
    (["--gpus", "12"], "--gpus 12 is not a multiple"),
    (["--dataset-tokens", "1e5"], "smaller than one global batch"),
    # below one sequence it advised "--global-batch-tokens <= 0"; 1e30 was priced (1e20 days)
    (["--dataset-tokens", "0.5"], "--dataset-tokens 0.5 is out of range; use one sequence "
     "(--seq-len 4,096 tokens) to 10,000,000,000,000,000 tokens"),
    (["--dataset-tokens", "4095"], "--dataset-tokens 4095 is out of range"),
    (["--dataset-tokens", "1e30"], "--dataset-tokens 1e+30 is out of range"),
    (["--dataset-tokens", "20000T"], "to 10,000,000,000,000,000 tokens"),
    (["--dataset-tokens", "1e5"], "--global-batch-tokens <= 98,304 (whole sequences)"),
    (["--dataset-tokens", "-3"], "'-3'"),
    (["--dataset-tokens", "nan"], "'nan'"),
    (["--dataset-tokens", "1Q"], "--dataset-tokens '1Q' is not a token count"),
    (["--dataset-tokens", "T"], "'T' is not a token count"),
    (["--dataset-tokens", "0M"], "'0M' is not a token count"),
    (["--gpus", "0"], "'0'"),
    (["--gpu", "b200"], "unknown gpu 'b200'"),
    (["--global-batch-tokens", "1000"], "--global-batch-tokens 1000"),
])
def test_impossible_requests_exit_2_with_one_line(args, needle, no_study, capsys):
    base = {"--model-size": "7B", "--gpus": "16", "--dataset-tokens": "2e9"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["suggest", *[x for kv in base.items() for x in kv], "--json"]
    rc, out, err = _run(capsys, argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err



def test_time_to_train_says_what_the_records_say_of_the_family(no_study):
    """The sentence on the planner's accuracy is the plan's family band, not typed words."""
    out = suggest.suggest("13B", gpus=32, dataset_tokens=2.6e11)
    m, gpu = load_model(out["model"]["name"]), load_gpu("h100-sxm")
    planned = plan(m, gpu, load_cluster("dgx-h100"), gpus=32, seq_len=out["request"]["seq_len"],
                   global_batch_tokens=out["config"]["global_batch_tokens"], top=1)
    v = trust.validation(planned, m, gpu)["plans"][0]["validation"]
    assert out["reasons"]["time_to_train"].endswith(suggest._trust_clause(v))
    band = {"validated": True, "family": "HSDP", "low": 0.93, "high": 1.01, "configs": 2,
            "card_class": "Hopper"}
    assert suggest._trust_clause(band) == \
        "HSDP layouts measured 0.93-1.01x these tokens/s (2 configs on Hopper cards, page 4)"
    assert suggest._trust_clause({**band, "validated": False}) == \
        "HSDP is not validated against GPU measurements on Hopper cards (page 4)"
    assert "not validated" in suggest._trust_clause(None)
