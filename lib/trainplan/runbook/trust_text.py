"""How far to trust the plan, in words generated from one band (`compare.trust.plan_band`):
the front page's sentence, page 1's flag in the decision box, page 3's paragraph and page
4's table of families. Every number comes from the band; nothing here is typed."""

from __future__ import annotations

import pandas as pd

from trainplan.compare import trust
from trainplan.cost.compute import matmul_ceiling_tokens_per_s


def chosen_band(chosen, inputs, paths=None) -> dict:
    """The band of the chosen plan (a row of the search's table) for the scenario `inputs`:
    its family's, or the card class's pooled where the family is not validated, with the
    plan's rates capped at the card's dense-matmul ceiling."""
    bands = trust.suite_bands(paths)
    ceiling = matmul_ceiling_tokens_per_s(inputs.model, inputs.gpu, inputs.seq_len)
    return trust.plan_band(bands, chosen["family"], inputs.gpu,
                           float(chosen["tokens_per_s_per_gpu"]), ceiling)


def _direction(median: float) -> str:
    if abs(median - 1.0) < 0.02:
        return "on the prediction at the median"
    if median < 1.0:
        return f"optimistic by about {1.0 - median:.0%} at the median"
    return f"pessimistic by about {median - 1.0:.0%} at the median"


def _cards(band: dict) -> str:
    cards = band.get("cards") or []
    return " and ".join(c.replace("NVIDIA ", "") for c in cards) or f"{band['card_class']} GPUs"


def front_sentence(band: dict) -> str:
    """The front page's "how far to trust it" (plain text, for `{glue:text}`)."""
    fam, cls = band["family"], band["card_class"]
    if band["low"] is None:
        return (f"No layout has been measured on {cls} GPUs yet, so every figure is "
                "unconfirmed until a short trial run on the cluster measures it.")
    if band["validated"]:
        return (f"The plan's layout family, {fam}, was measured on {band['configs']} "
                f"configurations on {_cards(band)}: throughput came out {band['low']:.2f} to "
                f"{band['high']:.2f} times the prediction, {_direction(band['median'])}. Page 3 "
                "carries that range over to this plan.")
    return (f"The plan's layout family, {fam}, is not validated: {band['why']}. Every family "
            f"measured on {cls} GPUs, pooled, ran {band['low']:.2f} to {band['high']:.2f} times "
            "its prediction, so treat the predicted throughput as unconfirmed until a short "
            "trial run on the cluster measures it.")


def decision_flag(band: dict) -> str:
    """Page 1's line in the decision box on the plan's validation (markdown)."""
    if band["validated"]:
        return (f"Its layout family ({band['family']}) was measured at {band['low']:.2f} to "
                f"{band['high']:.2f} times its predicted throughput on {band['configs']} "
                f"configurations ({_cards(band)}).")
    return (f"**Not validated.** {band['why'][0].upper() + band['why'][1:]}: run a short trial "
            "before committing the budget.")


def throughput_paragraph(band: dict, days_low: float, days_high: float,
                         gpu_hours_high: float) -> str:
    """Page 3's "how far to trust it": the range, where it comes from, the ceiling (markdown)."""
    if band["low"] is None:
        return front_sentence(band)
    if band["validated"]:
        basis = (f"On the {band['configs']} measured configurations of this plan's layout "
                 f"family ({band['family']}, on {_cards(band)})")
    else:
        basis = (f"This plan's layout family ({band['family']}) is not validated "
                 f"({band['why']}). On every family measured on {band['card_class']} GPUs "
                 f"pooled ({band['configs_pooled']} configurations of "
                 f"{band['families_pooled']} families)")
    text = (f"**How far to trust it.** {basis}, measured throughput was {band['low']:.2f} to "
            f"{band['high']:.2f} times the predicted. Carried over to this plan, that is "
            f"{band['rate_low']:,.0f} to {band['rate_high']:,.0f} tokens per second per GPU, "
            f"{days_low:.1f} to {days_high:.1f} days and up to {gpu_hours_high:,.0f} GPU-hours: "
            "budget for the slow end.")
    if band["capped"]:
        text += (f" The fast end is capped at {band['ceiling']:,.0f} tokens per second per "
                 "GPU, every model operation at the card's measured dense-matmul rate, which "
                 "no run reaches.")
    return text + (" The range comes from runs within one machine, not from the target "
                   "cluster: its inter-node traffic is untested.")


def _misses(band: dict) -> str:
    """The measures of a family that miss the 10% bar, with their worst error."""
    worst = {"step time": band["step_time_error"]["max"], "memory": band["memory_error"]["max"]}
    return ", ".join(f"{k} {v:.0%}" for k, v in worst.items() if v is not None and v > 0.10)


def families_sentence(bands: list[dict], card_class: str) -> str:
    """Page 4's risk, short enough for its box (the table below it gives each family): which
    layout families measured on `card_class` are within the 10% bar on step time and memory,
    how many miss it and the worst of them, how many have too few configurations to be
    validated (markdown)."""
    own = [b for b in bands if b["card_class"] == card_class]
    if not own:
        return f"No layout family has been measured on {card_class} GPUs yet."
    within = [b["family"] for b in own if b["validated"] and b["within_targets"]]
    outside = [b for b in own if b["validated"] and not b["within_targets"]]
    single = [b["family"] for b in own if not b["validated"]]
    text = (f"Of the {len(own)} layout families measured on {card_class} GPUs, "
            + (f"{len(within)} {'is' if len(within) == 1 else 'are'} within 10% on step time and "
               f"memory ({', '.join(within)})"
               if within else "none is within 10% on step time and memory yet"))
    if outside:
        worst = max(outside, key=lambda b: max(v or 0.0 for v in (
            b["step_time_error"]["max"], b["memory_error"]["max"])))
        text += (f"; {worst['family']} misses it ({_misses(worst)})" if len(outside) == 1 else
                 f"; {len(outside)} miss it, worst {worst['family']} ({_misses(worst)})")
    if single:
        text += f"; {len(single)} measured only once, so not validated"
    return text + ". The table below gives each family."


def family_table(bands: list[dict]) -> pd.DataFrame:
    """Page 4's table: one row per card class and layout family measured."""
    rows = [{"card class": b["card_class"], "layout family": b["family"],
             "configs": b["configs"],
             "measured / predicted": f"{b['low']:.2f}-{b['high']:.2f} (median {b['median']:.2f})",
             "step time |error| max": f"{b['step_time_error']['max']:.1%}",
             "memory |error| max": "-" if b["memory_error"]["max"] is None
             else f"{b['memory_error']['max']:.1%}",
             "status": ("within 10%" if b["within_targets"] else "outside 10%")
             if b["validated"] else "not validated (1 config)"} for b in bands]
    return pd.DataFrame(rows).set_index(["card class", "layout family"]) if rows else \
        pd.DataFrame()


def factors(band: dict, tokens_per_s_per_gpu: float) -> tuple[float, float]:
    """(low, high) measured-over-predicted factors of the plan's capped rates; (1, 1) where
    nothing was measured on the card class."""
    if band["rate_low"] is None:
        return 1.0, 1.0
    return band["rate_low"] / tokens_per_s_per_gpu, band["rate_high"] / tokens_per_s_per_gpu
