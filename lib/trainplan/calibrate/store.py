"""A card's calibration file: read, checked and applied to its GPU preset, by identity.

data/hardware/calibration/<gpu preset>.yaml holds the constants `trainplan.calibrate.fit`
derives from microbenchmark records, and names the preset (`gpu`) and the cards (`card`,
as nvidia-smi names them) it was measured on. `load_gpu` applies it to that preset only:
a GPU given as a YAML file of the user's gets its datasheet values whatever the file is
called, unless a calibration is named for it (`load_gpu(..., calibration=FILE)`, the
verbs' `--calibration FILE`, or `explicit(FILE)` around a run, as `validate` does).
$TRAINPLAN_CALIBRATION=off keeps the datasheet values wherever no file is named.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from pathlib import Path

from trainplan.calibrate import pieces as calibrate_pieces
from trainplan.errors import SpecError
from trainplan.loader import load_yaml, quote, shown
from trainplan.specs import DATA_DIR, GPUSpec, load_gpu_preset, preset_of
from trainplan.specs.bounds import FIELDS, LATENCY_US, LINK_GBPS, TABLES
from trainplan.specs.checks import allowed_text, check_value, number

CALIBRATION_DIR = DATA_DIR / "hardware" / "calibration"
RECORDS_DIR = DATA_DIR / "measurements"  # a calibration's `sources` paths are relative to it
OFF_ENV = "TRAINPLAN_CALIBRATION"  # "off": use the datasheet/preset values everywhere
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
CARDS = {"H200": "h200-sxm", "H100": "h100-sxm", "A100": "a100-80gb"}  # nvidia-smi name -> preset
REQUIRED = ("gpu", "label", "matmul_efficiency", "attention_efficiency", "collectives", "card")
NOTES = {"head_modes", "fragmentation_fit"}  # pieces written for the reader; nothing reads them
_EXPLICIT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("calibration",
                                                                        default=None)


class CalibrationError(SpecError):
    """Microbenchmark records that cannot calibrate a card, or a malformed calibration file."""


def card_preset(card: str) -> str | None:
    """The GPU preset a recorded card name (nvidia-smi's) belongs to, e.g. 'NVIDIA H200'."""
    return next((p for key, p in CARDS.items() if key in card), None)


def check(cal, path: Path) -> dict:
    """The calibration mapping of `path` if it is well formed, else one CalibrationError line."""
    path = shown(path)
    if not isinstance(cal, dict):
        raise CalibrationError(f"{path}: expected a mapping, got {type(cal).__name__}")
    for key in REQUIRED:
        if key not in cal:
            raise CalibrationError(f"{path}: missing field {key!r} (required: {list(REQUIRED)})")
    if not isinstance(cal["gpu"], str) or not isinstance(cal["label"], str):
        raise CalibrationError(f"{path}: gpu = {quote(cal['gpu'])} and label = "
                               f"{quote(cal['label'])} must be strings (a GPU preset, a label)")
    cards = cal["card"]
    if not isinstance(cards, list) or not cards or not all(isinstance(c, str) for c in cards):
        raise CalibrationError(f"{path}: card = {quote(cards)} is not valid; list the card "
                               "names (nvidia-smi's) it was measured on")
    for key in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
        if key in REQUIRED or cal.get(key) is not None:  # None: not measured, the preset's
            check_value(f"{path}: {key}", "GPUSpec", key, cal[key], CalibrationError)
    if not isinstance(cal["collectives"], dict):
        raise CalibrationError(f"{path}: collectives = {quote(cal['collectives'])} is not a "
                               "mapping")
    for op, fit in cal["collectives"].items():
        if op not in COLLECTIVES or not isinstance(fit, dict):
            raise CalibrationError(f"{path}: collectives.{str(op)[:40]} = {quote(fit)} is not "
                                   f"valid; use {list(COLLECTIVES)}, each a mapping of "
                                   "latency_us and busbw_gbps")
        for key, allowed in (("latency_us", LATENCY_US), ("busbw_gbps", LINK_GBPS)):
            if not allowed[0] <= number(fit.get(key)) <= allowed[1]:
                raise CalibrationError(f"{path}: collectives.{op}.{key} = {quote(fit.get(key))} "
                                       f"is not valid; use a number from {allowed_text(allowed)}")
    check_pieces(cal.get("pieces"), path)
    return cal


def check_pieces(pieces, path: str) -> None:
    """Raise one CalibrationError naming file `path`, the piece and what is valid unless each
    of a calibration's `pieces` is in range (`specs.bounds`): a GPUSpec field's scale or
    table rows as the spec checks them, or a piece no field holds (`bounds` "pieces")."""
    if not pieces:  # none measured (apply reads it as {})
        return
    if not isinstance(pieces, dict):
        raise CalibrationError(f"{path}: pieces = {quote(pieces)} is not a mapping of scales "
                               "and tables")
    fields = {f.name for f in dataclasses.fields(GPUSpec)}
    known = fields | {name for spec, name in (*FIELDS, *TABLES) if spec == "pieces"} | NOTES
    for key, value in pieces.items():
        if key not in known:  # a misspelt piece would be dropped without a word
            raise CalibrationError(f"{path}: pieces.{quote(key, 40)} is not a piece trainplan "
                                   "reads; see `trainplan calibrate` for the pieces it writes")
        if value is not None:  # not measured: apply passes it over
            check_value(f"{path}: pieces.{str(key)[:40]}",
                        "GPUSpec" if key in fields else "pieces", key, value, CalibrationError)


def path_for(gpu_name: str) -> Path:
    return CALIBRATION_DIR / f"{gpu_name}.yaml"


def source_path(path: str | Path) -> str:
    """How a calibration's `sources` names a record file: relative to data/measurements where
    the file lies under it (so a checkout or a snapshot finds it), else as given."""
    try:
        return str(Path(path).resolve().relative_to(RECORDS_DIR.resolve()))
    except ValueError:
        return str(path)


def listed_sources(gpu_name: str) -> list[tuple[str, Path]]:
    """(name as listed, path under data/measurements) of each record file the committed
    calibration of preset `gpu_name` names in its `sources`; [] where there is none."""
    cal = load(gpu_name) or {}
    return [(src["path"], RECORDS_DIR / src["path"]) for src in cal.get("sources") or ()]


def committed_sources(gpu_name: str) -> list[Path]:
    """The record files the committed calibration of preset `gpu_name` was fitted on, found
    under data/measurements; one CalibrationError where there is no such calibration or a
    file it names is not there."""
    if load(gpu_name) is None:
        raise CalibrationError(f"--committed: no committed calibration of {gpu_name} "
                               f"({shown(path_for(gpu_name))}); give --records")
    listed = listed_sources(gpu_name)
    missing = [name for name, path in listed if not path.is_file()]
    if not listed or missing:
        raise CalibrationError(f"--committed: {shown(path_for(gpu_name))} lists "
                               f"{quote(missing[0]) if missing else 'no record file'}, not "
                               f"found under {shown(RECORDS_DIR)}; give --records")
    return [path for _, path in listed]


def load(gpu_name: str, path: str | Path | None = None) -> dict | None:
    """The calibration of preset `gpu_name` (or the file `path`); None where there is none.

    The committed file of a preset must name that preset as its `gpu`: the file's place
    says where to look, its content which card it is."""
    named = path is not None
    path = Path(path) if named else path_for(gpu_name)
    if not path.is_file():
        return None
    cal = check(load_yaml(path, error=CalibrationError, what="calibration file"), path)
    if not named and cal["gpu"] != gpu_name:
        raise CalibrationError(f"{shown(path)}: gpu = {quote(cal['gpu'])}, but the file stands "
                               f"for preset {gpu_name!r}; fix its gpu or move it")
    return cal


def apply(gpu: GPUSpec, cal: dict | None) -> GPUSpec:
    """`gpu` with the calibrated fractions and collectives, labelled; unchanged if `cal` is None."""
    if cal is None:
        return gpu
    coll = tuple((op, float(f["latency_us"]), float(f["busbw_gbps"]))
                 for op, f in sorted(cal["collectives"].items()))
    try:
        out = dataclasses.replace(
            gpu, matmul_efficiency=float(cal["matmul_efficiency"]),
            attention_efficiency=float(cal["attention_efficiency"]),
            memory_efficiency=float(cal.get("memory_efficiency") or gpu.memory_efficiency),
            calibration=str(cal["label"])[:200], collectives=coll)
    except (SpecError, TypeError, ValueError) as err:
        raise CalibrationError(f"{quote(cal['label'])}: its values do not fit {gpu.name} "
                               f"({' '.join(str(err).split())[:160]})") from None
    try:
        return calibrate_pieces.apply(out, cal.get("pieces") or {})
    except (SpecError, TypeError, ValueError, AttributeError) as err:
        raise CalibrationError(f"{quote(cal['label'])}: pieces = {quote(cal.get('pieces'))} "
                               f"are not valid ({' '.join(str(err).split())[:160]})") from None


def off() -> bool:
    """Whether $TRAINPLAN_CALIBRATION turns the committed calibrations off."""
    return os.environ.get(OFF_ENV, "").lower() in ("off", "0", "no", "datasheet")


@contextlib.contextmanager
def explicit(path: str | Path | None):
    """Within the block, every `load_gpu` applies the calibration file `path` (None: none
    named, the presets' own apply): a run that measured its card's calibration uses it."""
    token = _EXPLICIT.set(Path(path) if path is not None else None)
    try:
        yield
    finally:
        _EXPLICIT.reset(token)


def load_gpu(name: str, calibrated: bool = True,
             calibration: str | Path | None = None) -> GPUSpec:
    """A GPU preset (or YAML file) with the calibration that belongs to it.

    `calibration` (a file) is applied to whatever GPU `name` is; without it, a file named by
    `explicit`; without either, a preset's committed calibration (not a YAML file's, whatever
    its name). `calibrated=False` (or $TRAINPLAN_CALIBRATION=off without a named file) keeps
    the datasheet values; `calibration` on the result says which constants it holds.
    """
    gpu = load_gpu_preset(name)
    if not calibrated:
        return gpu
    named = calibration if calibration is not None else _EXPLICIT.get()
    if named is not None:
        cal = load(gpu.name, named)
        if cal is None:
            raise CalibrationError(f"--calibration {quote(str(named))}: no such file")
        return apply(gpu, cal)
    preset = preset_of(GPUSpec, name)
    if preset is None or off():
        return gpu
    return apply(gpu, load(preset))
