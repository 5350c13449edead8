"""Page 3's bf16 and fp8 side by side: the decided plan in each precision, in plain words.

The fp8 plan is the one `launch.choice`'s rule picks over the search priced in fp8 with the
default tensorwise recipe: what `trainplan plan --precision fp8` answers as its `decision`,
beside page 1's bf16 decision. MFU of both is quoted against the card's bf16 dense peak,
as `cost.step_time.evaluate` computes it, so the two compare. Whether fp8's rate is
measured on the card is `plan --json`'s `fp8.validated` (`cost.fp8.summary`); whether whole
fp8 runs of the plan's layout family are, its trust band's (`compare.trust.band_for`).
Where the card has no fp8 (`cost.fp8.check_gpu`), the page says so in one sentence. Whether
fp8 trains as bf16 does is measured, not predicted: `runbook.parity`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from trainplan.compare import trust
from trainplan.cost import fp8 as fp8_cost
from trainplan.cost.step_time import time_to_train
from trainplan.errors import SpecError
from trainplan.launch.choice import Decision, choose
from trainplan.plan.planner import fp8_answer
from trainplan.plan.search import search

RECIPE = "tensorwise"  # `plan --fp8-recipe`'s default: the fp8 plan the page shows
COLUMNS = ["strategy", "micro_batch", "recompute", "step_time_s", "tokens_per_s_per_gpu",
           "mfu", "total_gib"]


@dataclass(frozen=True)
class Fp8Plan:
    """The fp8 decision for a scenario and what `plan --json` says of fp8."""

    decision: Decision  # `launch.choice.choose` over the fp8 search
    summary: dict  # `plan --json`'s `fp8` object (`cost.fp8.summary`): recipe, validated...
    family_measured: bool  # whole fp8 runs of the chosen plan's family are in its trust band

    @property
    def chosen(self) -> pd.Series:
        return self.decision.chosen


def unavailable(gpu) -> str | None:
    """Why the scenario's GPUSpec `gpu` has no fp8 plan, in one sentence (markdown); None
    where it has an fp8 rate to price fp8 with (`cost.fp8.check_gpu`'s rule)."""
    try:
        fp8_cost.check_gpu(gpu)
    except SpecError:
        if gpu.fp8_tflops <= 0:
            return (f"This scenario's GPU, {gpu.name}, has no fp8 arithmetic, so it trains in "
                    "bf16 only: there is no fp8 plan to set beside the bf16 one.")
        return (f"This scenario's GPU, {gpu.name}, has an fp8 rate but no fp8 efficiency "
                "in its spec to price it with, so the page shows the bf16 plan only.")
    return None


def decided(inputs) -> Fp8Plan | None:
    """The fp8 plan that the decision rule picks for `inputs` (`pages.Inputs`), with
    `plan --json`'s `fp8` object; None where the GPU has no fp8 (`unavailable`)."""
    if unavailable(inputs.gpu) is not None:
        return None
    result = search(inputs.model, inputs.gpu, inputs.cluster, gpus=inputs.gpus,
                    seq_len=inputs.seq_len, global_batch_tokens=inputs.global_batch_tokens,
                    precision="fp8", fp8_recipe=RECIPE)
    d = choose(result.table, inputs.model, inputs.gpu)
    band = trust.band_for(trust.suite_bands(), d.chosen["family"], inputs.gpu.name)
    return Fp8Plan(d, fp8_answer(inputs.model, inputs.gpu, result.table)["fp8"],
                   bool(band["validated"]))


def side_by_side(inputs, chosen: pd.Series, fp8: Fp8Plan | None) -> pd.DataFrame:
    """One row per precision (index "bf16", then "fp8" where there is one): the plan's
    strategy, micro-batch, recompute, step time (s), tokens/s per GPU, MFU on the bf16
    peak, memory per GPU (GiB), and days and GPU-hours for the token budget
    (`time_to_train`, steady state)."""
    rows = {"bf16": chosen} | ({"fp8": fp8.chosen} if fp8 is not None else {})
    out = pd.DataFrame({name: row[COLUMNS] for name, row in rows.items()}).T
    train = [time_to_train(inputs.token_budget, float(row["tokens_per_s"]), inputs.gpus)
             for row in rows.values()]
    out["days"] = [t["days"] for t in train]
    out["gpu_hours"] = [t["gpu_hours"] for t in train]
    return out


def _layout(row) -> str:
    mb = int(row["micro_batch"])
    recompute = "no recompute" if row["recompute"] == "none" else f"{row['recompute']} recompute"
    return f"**{row['strategy']}**, micro-batches of {mb} sequence{'s' if mb > 1 else ''} and " \
           f"{recompute}"


def status(gpu, fp8: Fp8Plan) -> str:
    """fp8's validation status in plain words (markdown), from `plan --json`'s
    `fp8.validated` and whether whole fp8 runs of the plan's family were measured."""
    if not fp8.summary["validated"]:
        return (f"**Not measured yet.** fp8 is priced from the datasheet and an assumed "
                f"efficiency ({gpu.fp8_matmul_efficiency:.0%} of the card's "
                f"{gpu.fp8_tflops:,.0f} TFLOP/s fp8 peak on matrix multiplies); not measured "
                f"on this card ({gpu.name}) yet. Read the fp8 column as an estimate, less "
                "certain than the bf16 one.")
    if fp8.family_measured:
        return ("**Measured.** fp8's matrix-multiply speed is measured on this card by "
                "microbenchmarks, and whole fp8 training runs of this layout family are "
                "measured too (page 4).")
    return ("**Partly measured.** fp8's matrix-multiply speed is measured on this card by "
            "microbenchmarks; no whole fp8 training run of this layout family has been "
            "measured yet, so the rest of its step is still a prediction.")


def note(inputs, rows: pd.DataFrame, fp8: Fp8Plan | None) -> str:
    """The section's paragraph (markdown): the fp8 plan against the bf16 one and how far to
    trust it, or why there is no fp8 plan (`unavailable`)."""
    if fp8 is None:
        return unavailable(inputs.gpu)
    b, f = rows.loc["bf16"], rows.loc["fp8"]
    same = all(b[k] == f[k] for k in ("strategy", "micro_batch", "recompute"))
    where = (f"the same layout as bf16, {_layout(f)}" if same else
             f"{_layout(f)}, where bf16 runs {_layout(b)}")
    speed = f["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
    return (f"In fp8 the same rule picks {where}. It is predicted at "
            f"{f['tokens_per_s_per_gpu']:,.0f} tokens per second per GPU against "
            f"{b['tokens_per_s_per_gpu']:,.0f} ({speed:.2f} times), so the token budget takes "
            f"{f['days']:.1f} days instead of {b['days']:.1f}. " + status(inputs.gpu, fp8))
