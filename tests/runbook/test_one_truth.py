"""One source of truth from plan to launch: for every scenario, page 6's artefacts carry
page 1's decision and page 5's checkpoint plan, computed the way those pages compute them,
and the interval keeps the worst-case loss under the limit."""

from __future__ import annotations

import math

import pytest

from trainplan.launch import artefacts, job
from trainplan.resilience import checkpoint
from trainplan.runbook import decision
from trainplan.runbook.pages import resolve_inputs
from trainplan.specs import Scenario, preset_names

SCENARIOS = preset_names(Scenario)


def launch(inputs, target="slurm"):
    settings = artefacts.LaunchSettings(target=target, data="shards")
    return artefacts.plan_and_generate(
        inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus, seq_len=inputs.seq_len,
        global_batch_tokens=inputs.global_batch_tokens, settings=settings,
        model_arg=inputs.model.name, token_budget=inputs.token_budget).summary


@pytest.mark.parametrize("name", SCENARIOS)
def test_launch_equals_pages_one_and_five(name):
    inputs = resolve_inputs(name)
    _, chosen, _, why = decision.decide(inputs)
    if why and chosen["ep"] > 1:  # nothing of this model runs in the trainer: no launch
        with pytest.raises(Exception, match="no launch"):
            launch(inputs)
        return
    s = launch(inputs)
    par = s["plan"]["parallel"]
    for key in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "recompute",
                "dp_shard"):
        assert par[key] == chosen[key], f"{name}: {key} {par[key]} != page 1's {chosen[key]}"
    assert s["plan"]["strategy"] == chosen["strategy"]
    args = s["harness_args"]
    for flag, key in (("--micro-batch", "micro_batch"), ("--grad-accum", "grad_accum"),
                      ("--recompute", "recompute")):
        assert args[args.index(flag) + 1] == str(chosen[key])
    # page 5 (notebooks/05): the conservative plan of the chosen layout's sharding
    plans = job.checkpoint_plans(inputs.model, inputs.gpus, inputs.gpus_per_node, par)
    plan = plans[job.CASE]
    assert s["checkpoint_keep"] == plan.keep
    every = max(1, math.floor(plan.interval_min * 60 / chosen["step_time_s"]))
    assert s["checkpoint_every"] == every
    assert s["checkpoint_every_min"] <= plan.interval_min + 1e-9
    lost = s["checkpoint_every_min"] + plan.persist_s / 60 + plan.restart_min
    assert lost < checkpoint.Assumptions().max_lost_minutes, f"{name}: {lost:.1f} min"
    assert s["steps"] == math.ceil(inputs.token_budget / s["plan"]["tokens_per_step"])
