"""A card's calibration file: read, checked and applied to its GPU preset.

data/hardware/calibration/<gpu preset>.yaml holds the constants `trainplan.calibrate.fit`
derives from microbenchmark records; `load_gpu` is the preset with them applied, the GPU
every prediction uses. $TRAINPLAN_CALIBRATION=off keeps the datasheet values everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import yaml

from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.errors import SpecError
from trainplan.specs import DATA_DIR, GPUSpec, load_gpu_preset

CALIBRATION_DIR = DATA_DIR / "hardware" / "calibration"
OFF_ENV = "TRAINPLAN_CALIBRATION"  # "off": use the datasheet/preset values everywhere
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
CARDS = {"H200": "h200-sxm", "H100": "h100-sxm", "A100": "a100-80gb"}  # nvidia-smi name -> preset
REQUIRED = ("gpu", "label", "matmul_efficiency", "attention_efficiency", "collectives")


class CalibrationError(SpecError):
    """Microbenchmark records that cannot calibrate a card, or a malformed calibration file."""


def card_preset(card: str) -> str | None:
    """The GPU preset a recorded card name (nvidia-smi's) belongs to, e.g. 'NVIDIA H200'."""
    return next((p for key, p in CARDS.items() if key in card), None)


def check(cal, path: Path) -> dict:
    """The calibration mapping of `path` if it is well formed, else one CalibrationError line."""
    if not isinstance(cal, dict):
        raise CalibrationError(f"{path}: expected a mapping, got {type(cal).__name__}")
    for key in REQUIRED:
        if key not in cal:
            raise CalibrationError(f"{path}: missing field {key!r} (required: {list(REQUIRED)})")
    for key in ("matmul_efficiency", "attention_efficiency"):
        v = cal[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise CalibrationError(f"{path}: {key} = {v!r} is not valid; use a number in (0, 1]")
    if not isinstance(cal["collectives"], dict):
        raise CalibrationError(f"{path}: collectives = {cal['collectives']!r} is not a mapping")
    for op, fit in cal["collectives"].items():
        ok = op in COLLECTIVES and isinstance(fit, dict) and all(
            isinstance(fit.get(k), (int, float)) and not isinstance(fit.get(k), bool)
            and math.isfinite(fit[k]) and fit[k] >= 0 for k in ("latency_us", "busbw_gbps"))
        if not ok or fit["busbw_gbps"] <= 0:
            raise CalibrationError(f"{path}: collectives.{op} = {fit!r} is not valid; use "
                                   f"{list(COLLECTIVES)} with latency_us >= 0, busbw_gbps > 0")
    return cal


def path_for(gpu_name: str) -> Path:
    return CALIBRATION_DIR / f"{gpu_name}.yaml"


def load(gpu_name: str, path: str | Path | None = None) -> dict | None:
    """The calibration of preset `gpu_name` (or the file `path`); None where there is none."""
    path = Path(path) if path else path_for(gpu_name)
    if not path.is_file():
        return None
    try:
        cal = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise CalibrationError(f"{path}: not a readable calibration ({first})") from None
    return check(cal, path)


def apply(gpu: GPUSpec, cal: dict | None) -> GPUSpec:
    """`gpu` with the calibrated fractions and collectives, labelled; unchanged if `cal` is None."""
    if cal is None:
        return gpu
    coll = tuple((op, float(f["latency_us"]), float(f["busbw_gbps"]))
                 for op, f in sorted(cal["collectives"].items()))
    out = dataclasses.replace(
        gpu, matmul_efficiency=float(cal["matmul_efficiency"]),
        attention_efficiency=float(cal["attention_efficiency"]),
        memory_efficiency=float(cal.get("memory_efficiency") or gpu.memory_efficiency),
        calibration=str(cal["label"]), collectives=coll)
    try:
        return calibrate_pieces.apply(out, cal.get("pieces") or {})
    except (SpecError, TypeError, ValueError) as err:
        raise CalibrationError(f"{cal['label']}: pieces = {cal.get('pieces')!r} are not "
                               f"valid ({err})") from None


def with_calibration(gpu: GPUSpec) -> GPUSpec:
    """`gpu` with its file under data/hardware/calibration/ applied, if any (and not off)."""
    if os.environ.get(OFF_ENV, "").lower() in ("off", "0", "no", "datasheet"):
        return gpu
    return apply(gpu, load(gpu.name))



def load_gpu(name: str, calibrated: bool = True) -> GPUSpec:
    """A GPU preset (or YAML file); with its calibration applied when one exists for the card.

    The calibration replaces the efficiency fractions with microbenchmarked ones and sets
    `calibration` to its label; without one `calibration` stays "datasheet".
    """
    gpu = load_gpu_preset(name)
    return with_calibration(gpu) if calibrated else gpu
