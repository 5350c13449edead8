"""Which plan a job runs: page 1's decision, `trainplan plan`'s `decision` and the layout
`trainplan launch` writes, from one rule over the search's ranked table.

The decision is the fastest plan that fits, that the trainer runs (`train.support`), and
that fits with margin: its predicted peak memory times the upper end of its family's
measured memory band on the card class (`compare.trust.memory_band`; every family of the
class pooled where its own has too few runs) stays within what the allocator can use.
Where no plan passes, the decision is the runnable plan with the most headroom under its
band, and `fits_band` is False. Where nothing of the model runs (a mixture of experts),
the rule picks among every fitting plan and the decision cannot be launched yet. A card
class with no memory measured has no band: the prediction alone decides (`fits_band` None).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from trainplan.compare import trust
from trainplan.cost.memory_runtime import EXPANDABLE
from trainplan.plan.planner import answer, ranked, row_to_plan
from trainplan.train.support import not_runnable

MARGIN_KEYS = {"memory_factor": "factor", "memory_source": "source",  # column: margin key
               "memory_configs": "configs", "memory_upper_gib": "upper_gib",
               "memory_card_class": "card_class", "usable_gib": "usable_gib",
               "fits_band": "fits"}


@dataclass(frozen=True)
class Decision:
    """The rule's answer for one ranked table."""

    table: pd.DataFrame  # the search's table, best first, with the `MARGIN_KEYS` columns
    chosen: pd.Series  # the decision
    fastest: pd.Series  # the table's first plan
    not_runnable: str | None  # why the trainer cannot run the fastest plan; None where it can
    passed_over: pd.Series | None  # the fastest candidate, where its band did not fit
    launchable: bool  # the trainer runs the decision

    @property
    def fits_band(self) -> bool | None:
        """Whether the decision fits with its band's margin (None: no band on its card)."""
        return self.chosen["fits_band"]


def with_margins(table: pd.DataFrame, gpu, bands: list[dict]) -> pd.DataFrame:
    """`table` (a ranked search) with each layout's memory margin (`trust.memory_margin` of
    its family's `trust.memory_band` on GPUSpec `gpu`) as the `MARGIN_KEYS` columns."""
    out = table.copy()
    for key in MARGIN_KEYS:
        out[key] = pd.Series([None] * len(out), index=out.index, dtype=object)
    for family, rows in out.groupby("family", sort=False):
        band = trust.memory_band(bands, family, gpu.name)
        margin = trust.memory_margin(band, rows["total_gib"], gpu.memory_gib)
        for column, key in MARGIN_KEYS.items():
            value = margin[key]
            out.loc[rows.index, column] = (list(value) if isinstance(value, pd.Series)
                                           else [value] * len(rows))
    return out


def choose(table: pd.DataFrame, model, gpu, bands: list[dict] | None = None) -> Decision:
    """The decision over `table` (a ranked search for `model` on GPUSpec `gpu`), with the
    memory bands of the suite's records (`trust.suite_bands`) unless `bands` are given."""
    table = with_margins(table, gpu, trust.suite_bands() if bands is None else bands)
    fastest = table.iloc[0]
    why = not_runnable(_degrees(fastest, table), model)
    fitting = table[table["fits"].astype(bool)]
    if fitting.empty:  # an exact layout that does not fit: nothing to choose from
        return Decision(table, fastest, fastest, why, None, why is None)
    keys = ["cp", "ep", "tp"]
    runs = {k for k in fitting[keys].drop_duplicates().itertuples(index=False, name=None)
            if not_runnable(_degrees(dict(zip(keys, k, strict=True)), table), model) is None}
    runnable = [k in runs for k in fitting[keys].itertuples(index=False, name=None)]
    candidates = fitting[runnable] if any(runnable) else fitting
    safe = candidates[candidates["fits_band"].map(lambda f: f is None or bool(f))]
    if len(safe):
        chosen = safe.iloc[0]
    else:  # none fits with margin: the most headroom under the band
        headroom = candidates["usable_gib"] - candidates["memory_upper_gib"]
        chosen = candidates.loc[headroom.astype(float).idxmax()]
    first = candidates.iloc[0]
    return Decision(table, chosen, fastest, why, None if first.name == chosen.name else first,
                    any(runnable))


def _degrees(row, table: pd.DataFrame) -> dict:
    """What `train.support.not_runnable` reads of a row: cp, ep, tp, and the table's
    precision (bf16 where it has no column)."""
    precision = table["precision"].iloc[0] if "precision" in table.columns else "bf16"
    return {"cp": int(row["cp"]), "ep": int(row["ep"]), "tp": int(row["tp"]),
            "precision": precision}


def margin_of(row: pd.Series) -> dict:
    """A plan's memory margin as `plan --json` writes it (`trust.memory_margin`'s keys)."""
    out = {key: row[column] for column, key in MARGIN_KEYS.items()}
    return {k: v.item() if hasattr(v, "item") else v for k, v in out.items()}


def decision_summary(d: Decision) -> dict:
    """`plan --json`'s `decision`: the chosen plan (contract shape, with its memory margin),
    its rank in the search (1 = fastest), and the fastest candidate passed over for its band."""
    plan = {**row_to_plan(d.chosen), "memory_margin": margin_of(d.chosen),
            "memory_fits_band": margin_of(d.chosen)["fits"]}
    out = {"rank": int(d.chosen.name) + 1, "plan": plan, "launchable": d.launchable,
           "passed_over": None}
    if d.passed_over is not None:
        p = d.passed_over
        out["passed_over"] = {"rank": int(p.name) + 1, "strategy": p["strategy"],
                              "tokens_per_s": float(p["tokens_per_s"]),
                              "memory_margin": margin_of(p)}
    return out


def decided(m, gpu, cluster, *, gpus: int, seq_len: int, global_batch_tokens: int,
            pins: dict | None = None, top: int = 5, gpus_per_node: int | None = None,
            precision: str = "bf16", fp8_recipe: str = "tensorwise",
            loss: str = "standard", allocator: str = EXPANDABLE) -> dict:
    """`plan.planner.plan`'s answer with the rule's `decision` (`decision_summary`): what
    `trainplan plan` prints, and whose decision `trainplan launch` runs."""
    result = ranked(m, gpu, cluster, gpus=gpus, seq_len=seq_len,
                    global_batch_tokens=global_batch_tokens, pins=pins,
                    gpus_per_node=gpus_per_node, precision=precision, fp8_recipe=fp8_recipe,
                    loss=loss, allocator=allocator)
    out = answer(m, gpu, cluster, result, gpus=gpus, seq_len=seq_len,
                 global_batch_tokens=global_batch_tokens, top=top)
    out["decision"] = decision_summary(choose(result.table, m, gpu))
    if allocator != EXPANDABLE:  # said where it is not the default
        out["allocator"] = allocator
    return out
