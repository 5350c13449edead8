"""The fused loss in the planner: `plan --loss fused`, `cost.step_time.evaluate(loss=...)` and
the suite's predictions price the head as `cost.memory.fused_logits_bytes` where the harness
builds the fused loss (no tp, pp, cp), the standard head elsewhere, and say which."""

from __future__ import annotations

import json

import pytest

from trainplan import cli
from trainplan.bench.series import suite
from trainplan.calibrate.store import load_gpu
from trainplan.cost import memory
from trainplan.errors import SpecError
from trainplan.plan.planner import plan
from trainplan.specs import load_cluster, load_model

CARD = "NVIDIA H100 80GB HBM3"
GiB = 2**30
ROUNDED = 2e-3  # GiB: plans round each memory term to 3 decimals
M = load_model("llama-1.3b")


def _suite(loss: str | None) -> dict:
    cfg = {"tag": "a", "gpus": 2, "layout": {"dp": 2, "zero": 2, "micro_batch": 16}}
    return {"model": "llama-1.3b", "seq_len": 2048,
            "configs": [{**cfg, **({"loss": loss} if loss else {})}]}


def test_suite_prediction_of_a_fused_config_is_priced_with_the_fused_head():
    """Same config, loss fused vs standard: activations differ by the eager head's peak less
    the fused one's; weights, optimizer and every time alike; the layouts differ in loss."""
    fused_s, std_s = _suite("fused"), _suite(None)
    fused = suite.predict(fused_s, fused_s["configs"][0], CARD, "r")
    std = suite.predict(std_s, std_s["configs"][0], CARD, "r")
    gpu = load_gpu(suite.gpu_preset(CARD, std_s))
    kw = dict(seq_len=2048, micro_batch=16, tp=1, cp=1, compiled_loss=False,  # compile: off
              logits_scale=gpu.logits_scale)
    saved = (memory.head_peak_bytes(M, **kw) - memory.head_peak_bytes(M, **kw, fused_loss=True))
    assert saved > GiB
    mf, ms = fused["predicted"]["memory_gib"], std["predicted"]["memory_gib"]
    assert ms["activations"] - mf["activations"] == pytest.approx(saved / GiB, abs=ROUNDED)
    assert mf["total"] < ms["total"]
    assert (mf["params"], mf["optimizer"]) == (ms["params"], ms["optimizer"])
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "time_breakdown_s"):
        assert fused["predicted"][key] == std["predicted"][key], key
    assert fused["layout"] == {**std["layout"], "loss": "fused"}
    assert std["layout"]["loss"] == "standard"


@pytest.fixture(scope="module")
def hardware():
    gpu = load_gpu("h100-sxm")
    return gpu, load_cluster("dgx-h100")


def _plan(hardware, pins=None, **kw) -> dict:
    gpu, cluster = hardware
    return plan(M, gpu, cluster, gpus=8, seq_len=2048, global_batch_tokens=2**19, pins=pins,
                top=40, **kw)


def test_fused_plans_say_their_loss_and_model_parallel_ones_are_priced_standard(hardware):
    out = _plan(hardware, pins={"micro_batch": 4, "recompute": "none"}, loss="fused")
    assert out["loss"] == "fused"
    kinds = {p["loss"]: p for p in out["plans"]}
    assert set(kinds) == {"fused", "standard"}, "the top 40 should hold both kinds"
    for p in out["plans"]:
        par = p["parallel"]
        dp_only = par["tp"] == par["pp"] == par["cp"] == 1
        assert p["loss"] == ("fused" if dp_only else "standard"), par
    pins = {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "zero": 1, "micro_batch": 4, "recompute": "none"}
    tp_fused, tp_std = (_plan(hardware, pins=pins, loss=x)["plans"][0]
                        for x in ("fused", "standard"))
    assert tp_fused["loss"] == "standard" and tp_fused["memory_gib"] == tp_std["memory_gib"]



def test_a_data_parallel_plan_is_priced_with_the_fused_head(hardware):
    """Compiled (the planner's default), the standard head holds 4 bytes a logit; at 16 x
    2048 tokens the fused head is a GiB and more below it."""
    pins = {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "zero": 1, "micro_batch": 16,
            "recompute": "none"}
    gpu, cluster = hardware
    fused, std = (plan(M, gpu, cluster, gpus=8, seq_len=2048, global_batch_tokens=2**18,
                       pins=pins, loss=x)["plans"][0] for x in ("fused", "standard"))
    kw = dict(seq_len=2048, micro_batch=16, cp=1)
    saved = memory.compiled_logits_bytes(M, tp=1, **kw) - memory.fused_logits_bytes(M, **kw)
    assert saved > GiB and fused["loss"] == "fused" and "loss" not in std
    drop = std["memory_gib"]["activations"] - fused["memory_gib"]["activations"]
    assert drop == pytest.approx(saved / GiB, abs=ROUNDED)


def test_the_standard_loss_answer_names_no_loss(hardware):
    """The default answer keeps its keys (tests/golden/plan-outputs.json)."""
    out = _plan(hardware, pins={"micro_batch": 4, "recompute": "none"})
    assert "loss" not in out and not any("loss" in p for p in out["plans"])


def test_an_unknown_loss_is_refused_by_the_library(hardware):
    with pytest.raises(SpecError, match=r"loss = 'liger' is not valid; use one of"):
        _plan(hardware, loss="liger")


PLAN = ["plan", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--cluster", "dgx-h100",
        "--gpus", "8", "--seq-len", "2048", "--global-batch-tokens", str(2**19), "--top", "3"]


def test_plan_command_takes_the_loss(capsys):
    assert cli.main([*PLAN, "--loss", "fused", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["loss"] == "fused" and out["decision"]["plan"]["loss"] in ("fused", "standard")
    assert cli.main([*PLAN, "--loss", "fused"]) == 0
    assert "fused loss" in capsys.readouterr().out.splitlines()[0]


def test_plan_command_refuses_a_bogus_loss_in_one_line(capsys):
    assert cli.main([*PLAN, "--loss", "bogus", "--json"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1, err
    assert "--loss" in err and "'bogus'" in err and "'standard', 'fused'" in err


def test_plan_command_takes_the_allocator(capsys):
    """The caching allocator's reserve is priced only where asked; trainplan's runs use
    expandable segments (the default, not named in the answer)."""
    assert cli.main([*PLAN, "--json", "--micro-batch", "4", "--recompute", "none"]) == 0
    dflt = json.loads(capsys.readouterr().out)
    assert "allocator" not in dflt
    assert cli.main([*PLAN, "--json", "--micro-batch", "4", "--recompute", "none",
                     "--allocator", "caching"]) == 0
    cach = json.loads(capsys.readouterr().out)
    assert cach["allocator"] == "caching"
    mem = [o["decision"]["plan"]["memory_gib"] for o in (dflt, cach)]
    assert mem[0]["activations"] == mem[1]["activations"]
    assert mem[0]["other"] < mem[1]["other"] and mem[0]["total"] < mem[1]["total"]
    assert cli.main([*PLAN, "--allocator", "caching"]) == 0
    assert "caching allocator" in capsys.readouterr().out.splitlines()[0]
    assert cli.main([*PLAN, "--allocator", "cudaMalloc"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allocator" in err and "'cudaMalloc'" in err


def test_memory_command_takes_the_allocator(capsys):
    args = ["memory", "--model", "llama-1.3b", "--gpu", "h200-sxm", "--dp", "2", "--zero", "3",
            "--micro-batch", "8", "--seq-len", "2048", "--json"]
    got = {}
    for mode in ("expandable", "caching"):
        assert cli.main([*args, "--allocator", mode]) == 0
        got[mode] = json.loads(capsys.readouterr().out)
        assert got[mode]["allocator"] == mode
    assert got["expandable"]["memory_gib"]["other"] < got["caching"]["memory_gib"]["other"]
    assert cli.main(args[:-1]) == 0
    assert "(allocator: expandable)" in capsys.readouterr().out
