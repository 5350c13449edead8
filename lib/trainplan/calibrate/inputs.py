"""What the calibration fits read from a microbenchmark record, checked before any fit.

Each field a fit reads (`NEEDS`, by bench, purpose or block wrapper) must be present and
of its kind and range (`KINDS`); a record that is not is a `RecordError` naming its file
and line, the field, the value and what is valid, so no fit divides by a zero time or
multiplies a string.
"""

from __future__ import annotations

import functools

from trainplan.calibrate.store import COLLECTIVES
from trainplan.errors import RecordError, SpecError
from trainplan.loader import quote
from trainplan.records import schema as records
from trainplan.specs import ModelSpec, from_mapping, load_model


def _within(low: float, high: float):
    return lambda v: type(v) in (int, float) and low <= v <= high  # NaN and inf: never


COUNT = ("a whole number from 1 to 1e12", lambda v: type(v) is int and 1 <= v <= 10**12)
BYTES = ("a byte count from 0 to 1e18", _within(0, 1e18))
KINDS = {  # each config or results field a fit reads, where a record has it: what it must be
    **dict.fromkeys(("m", "n", "k", "seq", "tokens", "micro_batch", "world", "tp", "dp", "cp",
                     "layers", "params", "size_bytes", "grad_bytes"), COUNT),
    **dict.fromkeys(("compile", "base", "causal", "optimize_ddp"),
                    ("true or false", lambda v: type(v) is bool)),
    **dict.fromkeys(("name", "op", "precision", "model"), ("a string", lambda v: type(v) is str)),
    "zero": ("a ZeRO stage: 0, 1, 2 or 3", lambda v: type(v) is int and 0 <= v <= 3),
    "recompute": (f"one of {', '.join(records.RECOMPUTE)}",
                  lambda v: type(v) is str and v in records.RECOMPUTE),
    **dict.fromkeys(("time_s", "plain_s", "allreduce_s"),
                    ("a time from 1e-09 to 1e+06 s", _within(1e-9, 1e6))),
    **dict.fromkeys(("allgather_s", "reduce_scatter_s", "alone_s"),
                    ("a time from 0 to 1e+06 s", _within(0, 1e6))),
    **dict.fromkeys(("tflops", "tflops_dense_equiv", "tbps"),
                    ("a rate from 1e-06 to 1e+06 (TFLOP/s, TB/s)", _within(1e-6, 1e6))),
    **dict.fromkeys(("activation_bytes", "peak_bytes", "bf16_activation_bytes"), BYTES),
    **dict.fromkeys(("peak_reserved_bytes", "peak_allocated_bytes", "side_pool_bytes"),
                    ("null or " + BYTES[0], lambda v: v is None or BYTES[1](v))),
    "exposed_fraction": ("an exposed share from 0 to 100 (above 1, priced as 1)", _within(0, 100))}
NEEDS = {  # by bench, purpose or block wrapper: the fields its fit reads without a default
    **dict.fromkeys(("matmul", "matmul-fp8", "fp8-linear"), "m n k"), "attention": "seq",
    **dict.fromkeys(COLLECTIVES, "op world size_bytes"), "head": "tokens seq micro_batch",
    "optimizer": "params", "ring": "seq cp compile plain_s", "host-step": "layers",
    "block": "tokens seq micro_batch recompute compile", "memory-stack": "tp layers",
    "block-fp8": "model_spec precision recipe bf16_activation_bytes", "tp": "tp",
    "ddp": "precision optimize_ddp grad_bytes allreduce_s", "tp+fsdp2": "tp params dp zero",
    "fsdp2": "precision params zero world allgather_s reduce_scatter_s"}


def check_record(r: dict, where: str) -> dict:
    """The microbenchmark record `r` if it holds the fields its fits read (`NEEDS`; times,
    `_s`, under results), each as `KINDS` says, and a model spec its pieces can build; else
    RecordError naming `where` (file:line), the field, its value and what is valid."""
    c, res = r["config"], r["results"]
    wrapper = c.get("wrapper")  # of a host or stack block, only the tp degree is read
    if "purpose" in r and wrapper not in ("tp", None):
        wrapper = "tp" if wrapper == "tp+fsdp2" else None
    for key in (r["bench"], r.get("purpose"), wrapper):
        for name in NEEDS.get(key, "").split() if type(key) is str else ():
            part = "results" if name.endswith("_s") else "config"
            if name not in r[part]:
                raise RecordError(f"{where}: {r['bench']} record is missing {part}.{name}")
    read = {"exposed_fraction"} if r["bench"] == "overlap" else res.keys()  # its others: lists
    for part, fields in (("config", c), ("results", {k: res[k] for k in read})):
        for name, value in fields.items():
            what, ok = KINDS.get(name, ("", None))
            if ok and not ok(value):
                raise RecordError(f"{where}: field '{part}.{name}' = {quote(value)} is not "
                                  f"valid; use {what}")
    if r["bench"] in COLLECTIVES and c["op"] != r["bench"]:
        raise RecordError(f"{where}: field 'config.op' = {quote(c['op'])}; a {r['bench']} "
                          f"record times {r['bench']}")
    if r["bench"] in ("head", "block", "block-fp8") and not c.keys() & {"model_spec", "model"}:
        raise RecordError(f"{where}: {r['bench']} record names no config.model_spec or model")
    try:
        if "model_spec" in c:
            from_mapping(ModelSpec, c["model_spec"], f"{where}: field 'config.model_spec'")
        elif r["bench"] in ("head", "block", "block-fp8"):  # their pieces build the model
            _preset(c["model"])
    except SpecError as err:
        raise RecordError(f"{where}: {err}" if "model_spec" not in c else str(err)) from None
    return r


@functools.lru_cache(maxsize=64)
def _preset(name: str) -> ModelSpec:
    """The model preset a block or head record names (read once per name)."""
    return load_model(name)
