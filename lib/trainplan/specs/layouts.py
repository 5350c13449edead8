"""Many parallel layouts as one struct of numpy arrays, so cost models run vectorised.

A `Layouts` holds the fields of `specs.ParallelConfig`, one array each, with
the two string fields coded as small integers (`RECOMPUTE`, `SCHEDULES`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from trainplan.specs import ParallelConfig

if TYPE_CHECKING:
    import pandas as pd

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "gpipe")
INT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero", "dp_shard", "micro_batch", "grad_accum",
              "pp_virtual")


@dataclass
class Layouts:
    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    zero: np.ndarray
    dp_shard: np.ndarray
    micro_batch: np.ndarray
    grad_accum: np.ndarray
    recompute: np.ndarray  # index into RECOMPUTE
    sequence_parallel: np.ndarray  # bool
    pp_schedule: np.ndarray  # index into SCHEDULES
    pp_virtual: np.ndarray

    def __len__(self) -> int:
        return len(self.dp)

    @property
    def world(self) -> np.ndarray:
        return self.dp * self.tp * self.pp * self.cp

    def select(self, mask) -> Layouts:
        return Layouts(**{f.name: getattr(self, f.name)[mask] for f in fields(self)})

    @classmethod
    def from_columns(cls, **columns) -> Layouts:
        n = max(np.size(v) for v in columns.values())
        out = {}
        for f in fields(cls):
            value = np.broadcast_to(np.asarray(columns[f.name]), (n,))
            dtype = bool if f.name == "sequence_parallel" else np.int64
            out[f.name] = np.ascontiguousarray(value, dtype=dtype)
        return cls(**out)

    @classmethod
    def from_configs(cls, configs: list[ParallelConfig]) -> Layouts:
        cols = {name: [getattr(c, name) for c in configs] for name in INT_FIELDS}
        cols["recompute"] = [RECOMPUTE.index(c.recompute) for c in configs]
        cols["pp_schedule"] = [SCHEDULES.index(c.pp_schedule) for c in configs]
        cols["sequence_parallel"] = [c.sequence_parallel for c in configs]
        return cls.from_columns(**cols)

    def frame(self) -> pd.DataFrame:
        """The layouts as a DataFrame with readable recompute and schedule names."""
        import pandas as pd  # here: the training ranks import this module and need no pandas

        df = pd.DataFrame({name: getattr(self, name) for name in INT_FIELDS})
        df["recompute"] = np.asarray(RECOMPUTE, dtype=object)[self.recompute]
        df["sequence_parallel"] = self.sequence_parallel
        df["pp_schedule"] = np.asarray(SCHEDULES, dtype=object)[self.pp_schedule]
        return df

    def config(self, i: int) -> ParallelConfig:
        """Row i as a validated ParallelConfig."""
        kw = {name: int(getattr(self, name)[i]) for name in INT_FIELDS}
        return ParallelConfig(recompute=RECOMPUTE[self.recompute[i]],
                              pp_schedule=SCHEDULES[self.pp_schedule[i]],
                              sequence_parallel=bool(self.sequence_parallel[i]), **kw)


def data_parallel_kind(zero: int, dp: int, dp_shard: int) -> str:
    """Name of the data-parallel flavour: DDP, ZeRO-1, ZeRO-2, FSDP (ZeRO-3) or HSDP."""
    if zero == 0:
        return "DDP"
    if zero == 3:
        return "HSDP" if dp_shard < dp else "FSDP"
    return f"ZeRO-{zero}"


def strategy_label(tp, pp, cp, ep, zero, dp, dp_shard) -> str:
    """A short readable name of the combination of parallelisms, e.g. 'TP8 x PP2 x FSDP dp2'."""
    parts = [f"{name}{deg}" for name, deg in (("TP", tp), ("PP", pp), ("CP", cp), ("EP", ep))
             if deg > 1]
    if dp > 1:
        parts.append(data_parallel_kind(zero, dp, dp_shard) + (f" dp{dp}" if parts else ""))
    return " x ".join(parts) if parts else "single GPU"


def strategy_family(tp, pp, cp, ep, zero, dp, dp_shard) -> str:
    """The label without degrees, e.g. 'TP + PP + FSDP': what the runbook compares side by side."""
    parts = [name for name, deg in (("TP", tp), ("PP", pp), ("CP", cp), ("EP", ep)) if deg > 1]
    if dp > 1:
        parts.append(data_parallel_kind(zero, dp, dp_shard))
    return " + ".join(parts) if parts else "single GPU"


def labels(layouts: Layouts, fn) -> np.ndarray:
    """Apply a label function over unique degree combinations only (a few hundred, not 30k rows)."""
    keys = np.stack([layouts.tp, layouts.pp, layouts.cp, layouts.ep, layouts.zero, layouts.dp,
                     layouts.dp_shard], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    names = np.array([fn(*map(int, row)) for row in uniq], dtype=object)
    return names[inverse.ravel()]


def shard_degree(zero, dp_shard, cp, active_stage):
    """Ranks one ZeRO shard is spread over: dp_shard x cp once `zero` reaches `active_stage`.

    Context-parallel ranks hold the same weights, so FSDP shards over them too
    (torchtitan's dp_shard x cp mesh).
    """
    return np.where(np.asarray(zero) >= active_stage, np.asarray(dp_shard) * np.asarray(cp), 1)
