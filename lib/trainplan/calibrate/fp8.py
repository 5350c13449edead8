"""fp8's calibrated terms from the fp8 microbenchmarks (`bench.micro.fp8`).

- `curves`: the fp8 GEMM curves of `matmul-fp8` records, fractions of the fp8 peak by shape
  (`fp8_matmul_curve` tensorwise, `fp8_rowwise_matmul_curve` rowwise), fitted as the bf16
  curve is (`calibrate.pieces.matmul_curve`).
- `cast_scales`: per recipe, the time of torchao's casts measured against `cost.fp8`'s
  analytic cast time. An `fp8-linear` record times one converted linear's forward and
  backward; less its three GEMMs at the recipe's curve, the rest is its casts, scales and
  layout copies, over the time its cast bytes (`cost.fp8.linear_cast_bytes`) take at the
  card's HBM streaming rate. The median over shapes is `fp8_cast_scale` /
  `fp8_rowwise_cast_scale`, which `cost.fp8.cast_time` multiplies in.
- `activation_ratios`: per recipe, the bytes a compiled block keeps for backward with its
  linears in fp8 over the same block's in bf16 (`block-fp8` records), both less the bf16
  weight casts an autocast block keeps (`memory_runtime.weight_copy_bytes`; fp8 casts the
  converted weights itself and keeps none): `fp8_activation_ratio` /
  `fp8_rowwise_activation_ratio`, which `cost.fp8.kept_scale` applies.
"""

from __future__ import annotations

import statistics

from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.calibrate.store import CalibrationError
from trainplan.cost import fp8 as fp8_cost
from trainplan.cost import memory_runtime as rt
from trainplan.cost.compute import NONE
from trainplan.specs import GPUSpec, ModelSpec

KEYS = {"tensorwise": ("fp8_matmul_curve", "fp8_cast_scale"),
        "rowwise": ("fp8_rowwise_matmul_curve", "fp8_rowwise_cast_scale")}
RATIO_KEYS = {"tensorwise": "fp8_activation_ratio", "rowwise": "fp8_rowwise_activation_ratio"}
MIN_CAST_SCALE = 0.05  # a linear no slower than its GEMMs: the casts hidden, not free


def _fp8_card(recs: list[dict], gpu: GPUSpec) -> None:
    if recs and gpu.fp8_tflops <= 0:
        raise CalibrationError(f"{recs[0]['bench']} records for {gpu.name}, whose spec has no "
                               "fp8 peak (fp8_tflops = 0); calibrate them against an fp8 card")


def curves(recs: list[dict], gpu: GPUSpec) -> dict:
    """{curve key: [[tokens, n k, fraction of the fp8 peak], ...]} per recipe with
    `matmul-fp8` records; {} without any."""
    _fp8_card(recs, gpu)
    out = {}
    for recipe, (key, _) in KEYS.items():
        mine = [r for r in recs if r["config"].get("recipe") == recipe]
        if mine:
            out[key] = [[m, w, min(1.0, max(1e-4, f))]  # a curve's fractions lie in (0, 1]
                        for m, w, f in calibrate_pieces.matmul_curve(mine, gpu.fp8_tflops)]
    return out


def linear_cast_ratio(rec: dict, gpu: GPUSpec) -> float:
    """One `fp8-linear` record's (time - its 3 GEMMs at `gpu`'s fp8 curve) / the analytic
    time of its casts (unscaled `cost.fp8.cast_time`); 0 where the GEMMs take it all."""
    c = rec["config"]
    m, n, k, recipe = c["m"], c["n"], c["k"], c["recipe"]
    gemms = 3 * 2.0 * m * n * k / (gpu.fp8_tflops * 1e12 * float(
        fp8_cost.fp8_efficiency_at(gpu, recipe, m, n * k)))
    casts = float(fp8_cost.cast_time(gpu, fp8_cost.linear_cast_bytes(m, n, k)))
    return max(rec["results"]["time_s"] - gemms, 0.0) / casts


def cast_scales(recs: list[dict], gpu: GPUSpec) -> dict:
    """{"fp8_cast_scale": ..., "fp8_rowwise_cast_scale": ...} for the recipes with
    `fp8-linear` records: the median `linear_cast_ratio`, at least MIN_CAST_SCALE. `gpu`
    carries the curves and HBM rate the planner will use with them."""
    _fp8_card(recs, gpu)
    out = {}
    for recipe, (_, key) in KEYS.items():
        ratios = [linear_cast_ratio(r, gpu) for r in recs if r["config"].get("recipe") == recipe]
        if ratios:
            out[key] = round(max(MIN_CAST_SCALE, statistics.median(ratios)), 4)
    return out


def block_kept_ratio(rec: dict) -> float:
    """One `block-fp8` record's kept bytes over its bf16 twin's, each less the bf16 weight
    casts its precision keeps (autocast: all of the bf16 block's, the unconverted linears'
    in fp8; "pure": none)."""
    c = rec["config"]
    m = ModelSpec(**c["model_spec"])
    path = rt.AUTOCAST if c["precision"] == "autocast-fp32" else rt.FSDP
    copies = float(rt.weight_copy_bytes(m, path=path, tp=1, ep=1, recompute=NONE))
    unconverted = 1.0 - float(fp8_cost.converted_share(m, c["recipe"]))
    return (rec["results"]["activation_bytes"] - unconverted * copies) / (
        c["bf16_activation_bytes"] - copies)


def activation_ratios(recs: list[dict]) -> dict:
    """{"fp8_activation_ratio": ..., "fp8_rowwise_activation_ratio": ...} for the recipes with
    `block-fp8` records measured on a GPU (kept bytes > 0): the median `block_kept_ratio`."""
    out = {}
    for recipe, key in RATIO_KEYS.items():
        ratios = [block_kept_ratio(r) for r in recs if r["config"].get("recipe") == recipe
                  and r["results"]["activation_bytes"] > 0
                  and r["config"]["bf16_activation_bytes"] > 0]
        if ratios:
            out[key] = round(statistics.median(ratios), 4)
    return out
