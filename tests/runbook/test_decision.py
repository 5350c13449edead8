"""Page 1's decision never rests on a plan that its own measured memory band says may not fit:
for every scenario, the decision's predicted peak times the upper end of its family's memory
band (recomputed here from the suite's records, not through the library's band) is within
what the allocator can use, or page 1 says that no plan is; every faster plan the trainer
runs is over, and the fastest of them is named on pages 1 and 2 with what the choice costs."""

from __future__ import annotations

import glob
from collections import defaultdict

import pandas as pd
import pytest

from trainplan.compare import trust
from trainplan.compare.accuracy import compare
from trainplan.cost.memory import NON_ALLOCATOR_GIB
from trainplan.launch import choice
from trainplan.runbook import decision
from trainplan.runbook.pages import DEFAULT_SCENARIO, resolve_inputs
from trainplan.specs import Scenario, preset_names

SCENARIOS = preset_names(Scenario)


@pytest.fixture(scope="module")
def overruns() -> dict:
    """{(card class, family): [measured / predicted peak memory, ...]} of the suite's runs."""
    out = defaultdict(list)
    rows = compare(sorted(glob.glob(trust.SUITE_RECORDS)), repredictions=False)["rows"]
    for r in rows:
        if "superseded_by" in r or r["step_time_error"] is None or r["memory_error"] is None:
            continue
        out[(trust.card_class(r["card"]), trust.family_of(r["layout"]))].append(
            1.0 / (1.0 + r["memory_error"]))
    return out


def upper_factor(overruns: dict, card: str, family: str) -> float | None:
    """The band's upper end as the rule states it: the family's largest overrun where it has
    two configs or more, else the class's largest; never below 1; None with no runs."""
    cls = trust.card_class(card)
    own = overruns.get((cls, family), [])
    pool = own if len(own) >= trust.MIN_CONFIGS else [
        f for (c, _), fs in overruns.items() if c == cls for f in fs]
    return max(1.0, max(pool)) if pool else None


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_decision_fits_with_its_memory_band_or_page_one_says_none_does(name, overruns):
    inputs = resolve_inputs(name)
    usable = inputs.gpu.memory_gib - NON_ALLOCATOR_GIB
    _, chosen, _, _ = decision.decide(inputs)
    factor = upper_factor(overruns, inputs.gpu.name, chosen["family"])
    result, d = decision.decided(inputs)
    assert d.chosen.name == chosen.name
    if factor is None:
        assert "has measured peak memory yet" in decision.memory_check(d)
        return
    upper = chosen["total_gib"] * factor
    assert chosen["memory_upper_gib"] == pytest.approx(upper)
    page = decision.passed_over(d)
    if upper > usable:
        assert "No plan fits with margin" in page and "more than" in decision.memory_check(d)
    else:
        assert "No plan fits" not in page and "more than" not in decision.memory_check(d)
        assert f"up to {upper:.1f} of the {usable:.1f} GiB" in decision.memory_check(d)
    # every faster plan of the same runnability needs more than the allocator has, with its band
    table = result.table
    faster = table[(table.index < chosen.name) & table["fits"]]
    if d.launchable:
        faster = faster[faster["ep"] == 1]
    for _, row in faster.iterrows():
        f = upper_factor(overruns, inputs.gpu.name, row["family"])
        assert row["total_gib"] * f > usable, f"{name}: {row['strategy']} fits and is faster"


def test_the_default_scenarios_fastest_plan_is_passed_over_and_named(overruns):
    """The 13B plan: the fastest layout's band runs past the card, so pages 1 and 2 name it,
    with its band against the usable memory and what the safe choice costs."""
    inputs = resolve_inputs(DEFAULT_SCENARIO)
    result, d = decision.decided(inputs)
    fastest = result.table.iloc[0]
    usable = inputs.gpu.memory_gib - NON_ALLOCATOR_GIB
    upper = fastest["total_gib"] * upper_factor(overruns, inputs.gpu.name, fastest["family"])
    if upper <= usable:
        pytest.skip("the records now say the fastest plan fits with its band")
    assert d.passed_over is not None and d.passed_over.name == fastest.name
    page1 = decision.passed_over(d)
    slower = 1 - d.chosen["tokens_per_s"] / fastest["tokens_per_s"]
    for words in (fastest["strategy"], f"{upper:.1f} GiB", f"{usable:.1f} GiB",
                  f"{slower:.1%} of its throughput", "Passed over for memory"):
        assert words in page1, words
    page2 = decision.memory_decision(d, inputs.gpu.memory_gib)
    assert fastest["strategy"] in page2 and f"{upper:.1f} GiB" in page2
    assert f"{d.chosen['total_gib']:.1f} GiB" in page2
    # `trainplan plan`'s decision is page 1's, and names the same plan passed over
    said = choice.decided(inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus,
                          seq_len=inputs.seq_len,
                          global_batch_tokens=inputs.global_batch_tokens)["decision"]
    assert said["rank"] == d.chosen.name + 1 and said["plan"]["strategy"] == d.chosen["strategy"]
    assert said["passed_over"]["rank"] == 1 and said["plan"]["memory_fits_band"] is True
    assert said["passed_over"]["memory_margin"]["upper_gib"] == pytest.approx(upper)


def _table(totals: list[float], family="FSDP") -> pd.DataFrame:
    n = len(totals)
    return pd.DataFrame({"family": [family] * n, "strategy": [family] * n,
                         "total_gib": totals, "fits": [True] * n, "cp": [1] * n, "tp": [1] * n,
                         "ep": [1] * n, "tokens_per_s": [100.0 - i for i in range(n)],
                         "tokens_per_s_per_gpu": [10.0 - i for i in range(n)],
                         "step_time_s": [1.0 + i for i in range(n)], "micro_batch": [1] * n,
                         "recompute": ["none"] * n})


def test_with_no_plan_inside_its_band_the_decision_has_the_most_headroom():
    inputs = resolve_inputs(DEFAULT_SCENARIO)
    model, gpu = inputs.model, inputs.gpu
    wide = [{"family": "FSDP", "card_class": "Hopper", "configs": 2, "memory_high": 2.0,
             "memory_configs": 2}]
    d = choice.choose(_table([70.0, 50.0, 60.0]), model, gpu, wide)
    assert d.chosen.name == 1 and d.fits_band is False and d.passed_over.name == 0
    assert "No plan fits with margin" in decision.passed_over(d)
    assert "most headroom" in decision.short_note(d)
    d = choice.choose(_table([70.0, 30.0, 60.0]), model, gpu, wide)
    assert d.chosen.name == 1 and d.fits_band is True
    none = choice.choose(_table([70.0, 30.0]), model, gpu, [])  # nothing measured: prediction
    assert none.chosen.name == 0 and none.fits_band is None and none.passed_over is None
