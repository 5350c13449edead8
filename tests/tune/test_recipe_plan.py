"""The recipe against a scenario's plan: advice timed on the study's job does not carry over
to a plan whose memory sets its micro-batch."""

from __future__ import annotations

from trainplan.tune import recipe


def _rep(level="1-2", hi=-0.5):
    return {"model": "llama-1.3b", "knobs": [
        {"knob": "nccl_proto", "effects": [{"level": "LL", "ci_pct": [-40.0, -1.0]}]},
        {"knob": "micro_batch", "effects": [{"level": level, "ci_pct": [-76.6, hi]}]}]}


def test_a_plan_in_the_avoided_range_is_explained():
    note = recipe.plan_against_recipe(_rep(), 2, "llama-13b")
    assert "The plan's micro-batch 2 (llama-13b) is in that range" in note
    assert "`llama-1.3b`" in note and "Memory budget" in note


def test_nothing_to_say_outside_the_range_or_without_an_interval_below_zero():
    assert recipe.plan_against_recipe(_rep(), 4, "llama-13b") == ""
    assert recipe.plan_against_recipe(_rep(hi=3.0), 2, "llama-13b") == ""
    assert recipe.plan_against_recipe(_rep(level="3-8"), 2, "x") == ""
    assert recipe.plan_against_recipe(None, 2, "x") == ""
    paired = {**_rep(), "effects": {"families": {"FSDP": {}}}}  # the paired stage judges it
    assert recipe.plan_against_recipe(paired, 2, "llama-13b") == ""


def test_levels_as_the_report_writes_them():
    assert recipe._in_level(2, "1-2") and recipe._in_level(4, "4")
    assert not recipe._in_level(3, "1-2") and not recipe._in_level(1, "Ring")
