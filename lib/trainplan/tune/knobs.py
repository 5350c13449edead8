"""The throughput knobs the study tunes, and which combinations are skipped before they run.

Knobs and how each reaches the harness (`trainplan.bench.harness.train`):

| knob | values | reaches the run as |
|---|---|---|
| nccl_algo | default, Ring, Tree | env NCCL_ALGO (unset for default) |
| nccl_proto | default, LL, LL128, Simple | env NCCL_PROTO (unset for default) |
| num_workers | 0-8; not with synthetic tokens | --num-workers |
| prefetch_factor | 1-8, only with num_workers > 0; not with synthetic tokens | --prefetch-factor |
| grad_accum | 1-8 | --grad-accum |
| micro_batch | 1-16 | --micro-batch |
| zero | 2 (keep gathered weights), 3 (reshard after forward) | --zero |
| compile | false, true | --compile |
| recompute | none, selective, full | --recompute |
| pack | true, false; only on a suite with `data: instruct` | --pack / --pad |

NCCL_ALGO=Tree is passed as `allreduce:tree`: all-gather and reduce-scatter (FSDP's
collectives) have no Tree implementation, and from NCCL 2.24 a list that leaves a collective
without a valid algorithm is an error rather than a fallback (NCCL documentation of
NCCL_ALGO: 2.24's per-collective syntax). NCCL knobs are sampled only when the run has more
than one rank; on the CPU proxy (gloo) they are set but have no effect: one code path.

Skipped before any GPU time is spent (`skip_reason`), each with its reason:
prefetch_factor without workers (PyTorch's DataLoader refuses it); a
micro-batch, recompute and ZeRO stage whose memory, by the planner's model
(`trainplan.plan.planner.memory`), does not fit the card; and a config whose
measurement alone would last longer than the suite's `max_measure_s` by the
planner's step time (a large micro-batch times a large accumulation is one
point that would eat a large share of a half-GPU-hour budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainplan.errors import SpecError
from trainplan.loader import quote
from trainplan.specs import ParallelConfig, load_cluster, load_model

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}  # never on this project's GPU machines
NCCL_ALGO_ENV = {"default": None, "Ring": "Ring", "Tree": "allreduce:tree"}
NCCL_PROTO_ENV = {"default": None, "LL": "LL", "LL128": "LL128", "Simple": "Simple"}


@dataclass(frozen=True)
class Knob:
    """One tunable setting: categorical `choices`, or an integer range [low, high]."""

    name: str
    default: object
    choices: tuple = ()
    low: int = 0
    high: int = 0
    help: str = ""

    @property
    def values(self) -> tuple:
        return self.choices if self.choices else tuple(range(self.low, self.high + 1))


SPACE: dict[str, Knob] = {k.name: k for k in (
    Knob("nccl_algo", "default", choices=tuple(NCCL_ALGO_ENV), help="NCCL algorithm"),
    Knob("nccl_proto", "default", choices=tuple(NCCL_PROTO_ENV), help="NCCL protocol"),
    Knob("num_workers", 2, low=0, high=8, help="DataLoader worker processes"),
    Knob("prefetch_factor", 2, low=1, high=8, help="batches each worker loads ahead"),
    Knob("grad_accum", 1, low=1, high=8, help="micro-batches per optimizer step"),
    Knob("micro_batch", 8, low=1, high=16, help="sequences per micro-batch per GPU"),
    Knob("zero", 3, choices=(2, 3), help="2: keep gathered weights; 3: reshard after forward"),
    Knob("compile", True, choices=(False, True), help="torch.compile per block"),
    Knob("recompute", "none", choices=("none", "selective", "full"), help="activation recompute"),
    Knob("pack", True, choices=(True, False),
         help="instruction records packed into full rows (else one padded record a row)"),
)}
NCCL_KNOBS = ("nccl_algo", "nccl_proto")
LOADER_KNOBS = ("num_workers", "prefetch_factor")  # act only where a DataLoader feeds the run
# The knobs the effects stage varies one at a time (`trainplan.tune.effects`)
EFFECT_KNOBS = ("nccl_algo", "nccl_proto", "num_workers", "prefetch_factor", "grad_accum",
                "micro_batch", "pack")
# What an inactive knob is set to, where not its default
INACTIVE = {"zero": 0, "pack": None, "num_workers": None, "prefetch_factor": None}
# Levels the analysis groups integer knobs into (few trials per exact value): upper bounds.
BINS = {"num_workers": (0, 2, 8), "prefetch_factor": (2, 8), "grad_accum": (1, 3, 8),
        "micro_batch": (2, 6, 16)}


def space(overrides: dict | None = None) -> dict[str, Knob]:
    """The search space with a suite's restrictions: `knob: [values]` or `knob: {low, high}`."""
    out = dict(SPACE)
    for name, value in (overrides or {}).items():
        if name not in SPACE:
            raise SpecError(f"space: unknown knob {quote(name)}; knobs: {list(SPACE)}")
        base = SPACE[name]
        if isinstance(value, list) and value and all(v in base.values for v in value):
            out[name] = Knob(name, value[0] if base.default not in value else base.default,
                             choices=tuple(value), help=base.help)
        elif isinstance(value, dict) and set(value) == {"low", "high"} and \
                base.low <= value["low"] <= value["high"] <= base.high and not base.choices:
            out[name] = Knob(name, min(max(base.default, value["low"]), value["high"]),
                             low=value["low"], high=value["high"], help=base.help)
        else:
            raise SpecError(f"space: {name} = {quote(value)} is not valid; use a non-empty list of "
                            f"values from {list(base.values)} or {{low, high}} inside it")
    return out


def data_source(suite: dict) -> str:
    """What feeds a suite's runs: "synthetic" when its harness flags ask for synthetic tokens
    (no DataLoader), else its `data` (the harness's --data: stdlib or instruct)."""
    return "synthetic" if "--synthetic" in suite.get("extra_args", ()) else \
        suite.get("data", "stdlib")


def active(name: str, world: int, dp: int, data: str = "stdlib") -> bool:
    """Whether a knob can matter for a run of `world` ranks with data-parallel degree `dp`
    fed by `data` (`data_source`). `pack` (packed rows or one padded record a row) only on
    instruction records, its trials compared by the tokens that train (`trial.pooled`); the
    loader's knobs not with synthetic tokens, which no DataLoader carries."""
    if name in NCCL_KNOBS:
        return world > 1
    if name == "zero":
        return dp > 1
    if name == "pack":
        return data == "instruct"
    if name in LOADER_KNOBS:
        return data != "synthetic"
    return True


LOADER_FLAGS = {"--pin-memory": 0, "--num-workers": 1, "--prefetch-factor": 1}  # values taken


def without_loader_flags(extra: list) -> tuple[list, list]:
    """(a suite's extra harness arguments without the data loader's flags, those flags): what
    a study on synthetic tokens passes, since the harness refuses them beside --synthetic."""
    kept, dropped, i = [], [], 0
    while i < len(extra):
        n = LOADER_FLAGS.get(str(extra[i]))
        if n is None:
            kept.append(extra[i])
            i += 1
        else:
            dropped += [str(a) for a in extra[i:i + 1 + n]]
            i += 1 + n
    return kept, dropped


def inactive_value(knob: Knob):
    """What a knob that cannot matter is set to: `INACTIVE`'s value, else its default."""
    return INACTIVE.get(knob.name, knob.default)


def settled(cfg: dict, sp: dict[str, Knob], *, world: int, dp: int, data: str) -> dict:
    """`cfg` with every knob `active` says cannot matter here set as `suggest` sets it (a base
    taken from trials of another run, say one that read real data)."""
    out = {k: v if active(k, world, dp, data) else inactive_value(sp[k]) for k, v in cfg.items()}
    if not out.get("num_workers") and "prefetch_factor" in out:
        out["prefetch_factor"] = None
    return out


def inactive_why(name: str) -> str:
    """Why `active` says a knob cannot matter, as the effects stage lists it (one phrase)."""
    if name in NCCL_KNOBS:
        return "one rank: no collective to tune"
    if name in LOADER_KNOBS:
        return "synthetic tokens: no data loader"
    return "not instruction data"


def suggest(trial, sp: dict[str, Knob], *, world: int, dp: int, data: str = "stdlib") -> dict:
    """Sample one config from an Optuna trial; inactive knobs take their defaults.

    prefetch_factor is conditional (sampled only with workers), which
    TPESampler(group=True) models as its own subspace.
    """
    cfg = {}
    for name, knob in sp.items():
        if name == "prefetch_factor" and cfg.get("num_workers", 1) == 0:
            cfg[name] = None
        elif not active(name, world, dp, data):
            cfg[name] = inactive_value(knob)
        elif knob.choices:
            cfg[name] = knob.choices[0] if len(knob.choices) == 1 else \
                trial.suggest_categorical(name, list(knob.choices))
        else:
            cfg[name] = knob.low if knob.low == knob.high else \
                trial.suggest_int(name, knob.low, knob.high)
    return cfg


class _AtDefaults:
    """Stands in for an Optuna trial in `suggest`: every knob answers with its default."""

    def __init__(self, sp: dict[str, Knob]):
        self.sp = sp

    def suggest_categorical(self, name, choices):
        return self.sp[name].default

    def suggest_int(self, name, low, high):
        return self.sp[name].default


def defaults(sp: dict[str, Knob], *, world: int, dp: int, data: str = "stdlib") -> dict:
    """Every knob at its default in the space `sp`, inactive ones as `suggest` sets them."""
    return suggest(_AtDefaults(sp), sp, world=world, dp=dp, data=data)


def env(cfg: dict) -> dict[str, str | None]:
    """Environment of one run: the NCCL knobs (None = unset it), multicast always off."""
    return {"NCCL_ALGO": NCCL_ALGO_ENV[cfg["nccl_algo"]],
            "NCCL_PROTO": NCCL_PROTO_ENV[cfg["nccl_proto"]], **NO_MULTICAST}


def harness_args(cfg: dict) -> list[str]:
    """Flags of `trainplan.bench.harness.train` for the non-environment knobs."""
    args = ["--zero", str(cfg["zero"]), "--micro-batch", str(cfg["micro_batch"]),
            "--grad-accum", str(cfg["grad_accum"]), "--recompute", cfg["recompute"]]
    if cfg.get("num_workers") is not None:  # None: no loader (synthetic tokens)
        args += ["--num-workers", str(cfg["num_workers"])]
    if cfg.get("prefetch_factor") is not None:
        args += ["--prefetch-factor", str(cfg["prefetch_factor"])]
    if cfg.get("pack") is not None:
        args.append("--pack" if cfg["pack"] else "--pad")
    return args + (["--compile"] if cfg["compile"] else [])


def windows(cfg: dict, suite: dict) -> int:
    """Measured steps of one launch: enough sequences per rank, at least `windows`, at most 60."""
    per_step = cfg["micro_batch"] * cfg["grad_accum"]
    return min(60, max(suite["windows"], math.ceil(suite["target_sequences"] / per_step)))


def predicted(cfgs: list[dict], suite: dict, gpu) -> list[dict]:
    """The planner's memory and step time of each config on the suite's base layout (one pass)."""
    from trainplan.cost.step_time import evaluate  # pandas: not loaded at import
    from trainplan.specs.layouts import Layouts  # pandas: not loaded at import

    lays = [ParallelConfig(**{**suite["layout"], "zero": c["zero"],
                              "micro_batch": c["micro_batch"], "grad_accum": c["grad_accum"],
                              "recompute": c["recompute"]}) for c in cfgs]
    m, cluster = load_model(suite["model"]), load_cluster(suite["cluster"])
    table = evaluate(m, gpu, cluster, Layouts.from_configs(lays), suite["seq_len"])
    return [{"memory_gib": float(r.total_gib), "fits": bool(r.fits),
             "step_time_s": float(r.step_time_s)} for r in table.itertuples()]


def _rules(cfg: dict, suite: dict, gpu, pred: dict) -> str | None:
    if cfg.get("prefetch_factor") is not None and cfg["num_workers"] == 0:
        return (f"prefetch_factor {cfg['prefetch_factor']} without loader workers: "
                "DataLoader refuses it (nothing prefetches)")
    if not pred["fits"]:
        return (f"micro-batch {cfg['micro_batch']}, zero {cfg['zero']}, recompute "
                f"{cfg['recompute']}: {pred['memory_gib']:.1f} GiB by the planner's memory "
                f"model, more than the {gpu.memory_gib:g} GiB card")
    seconds = pred["step_time_s"] * (suite["warmup"] + windows(cfg, suite))
    if seconds > suite["max_measure_s"]:
        return (f"micro-batch {cfg['micro_batch']} x grad-accum {cfg['grad_accum']}: "
                f"{seconds:.0f} s of steps by the planner, over max_measure_s "
                f"{suite['max_measure_s']:g} s")
    return None


def skip_reason(cfg: dict, suite: dict, gpu) -> str | None:
    """Why this config is not worth GPU time (one line), or None to run it."""
    return _rules(cfg, suite, gpu, predicted([cfg], suite, gpu)[0])


def verdicts(cfgs: list[dict], suite: dict, gpu) -> list[tuple[dict, str | None]]:
    """(the planner's prediction, `skip_reason`) of each config, in one planner pass."""
    preds = predicted(cfgs, suite, gpu)
    return [(p, _rules(c, suite, gpu, p)) for c, p in zip(cfgs, preds, strict=True)]


def level(name: str, value) -> str:
    """The analysis level of a knob value: itself, or its bin for the integer knobs."""
    if name not in BINS:
        return str(value)
    if value is None:
        return "none"
    lower = 0 if name == "num_workers" else 1
    for upper in BINS[name]:
        if value <= upper:
            return str(upper) if lower == upper else f"{lower}-{upper}"
        lower = upper + 1
    return str(value)


def describe(sp: dict[str, Knob] | None = None):
    """The space as a table for the book: knob, values, default, what it changes."""
    import pandas as pd

    sp = sp or SPACE
    rows = [{"knob": k.name,
             "values": ", ".join(map(str, k.choices)) if k.choices else f"{k.low}-{k.high}",
             "default": str(k.default), "what it sets": k.help} for k in sp.values()]
    return pd.DataFrame(rows).set_index("knob")


def skip_table(suite: dict, gpu, grad_accum: int = 1):
    """Run or skip, and why, for every micro-batch x ZeRO x recompute at one accumulation.

    The layout knobs are the only ones the planner can rule out; the rest
    (NCCL, loader) are always run. A table for the book, from `skip_reason`.
    """
    import pandas as pd

    sp = space(suite.get("space"))
    cfgs = [{"nccl_algo": "default", "nccl_proto": "default", "num_workers": 2,
             "prefetch_factor": None, "grad_accum": grad_accum, "micro_batch": mb,
             "zero": zero, "compile": True, "recompute": rc}
            for zero in (sp["zero"].values if suite["layout"].get("dp", 1) > 1 else (0,))
            for rc in sp["recompute"].values for mb in sp["micro_batch"].values]
    rows = []
    for cfg, pred in zip(cfgs, predicted(cfgs, suite, gpu), strict=True):
        reason = _rules(cfg, suite, gpu, pred)
        rows.append({"zero": cfg["zero"], "recompute": cfg["recompute"],
                     "micro_batch": cfg["micro_batch"], "grad_accum": grad_accum,
                     "memory_gib": pred["memory_gib"], "step_time_s": pred["step_time_s"],
                     "verdict": "run" if reason is None else (
                         "skip: memory" if "GiB" in reason else "skip: time"),
                     "reason": reason or ""})
    return pd.DataFrame(rows)
