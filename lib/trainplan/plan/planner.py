"""Plans in the command-line contract's shape (README, "Command line").

The library calls behind `trainplan plan` and `trainplan memory`: notebooks
and the harness's prediction records use these same functions, so a number in
the runbook, a CLI answer and a recorded prediction come from one code path.
"""

from __future__ import annotations

import pandas as pd

from trainplan.cost import fp8
from trainplan.cost.memory_runtime import EXPANDABLE
from trainplan.cost.step_time import MEMORY_TERMS, evaluate
from trainplan.plan.search import SearchResult, search
from trainplan.specs import PLAN_FIELDS, ClusterSpec, GPUSpec, ModelSpec, ParallelConfig
from trainplan.specs.layouts import Layouts

PARALLEL_KEYS = PLAN_FIELDS
TIME_KEYS = ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")
COMM_KEYS = ("tp_comm_s", "dp_comm_s", "pp_comm_s", "cp_comm_s", "ep_comm_s")


def _plain(value):
    """numpy scalars to Python scalars, for json.dumps."""
    return value.item() if hasattr(value, "item") else value


def row_to_plan(row: pd.Series) -> dict:
    """One evaluated layout as the contract's plan object (plus the time breakdown, and the
    loss it was priced with where the table was priced for `--loss fused`)."""
    return {
        "parallel": {k: _plain(row[k]) for k in PARALLEL_KEYS},
        "strategy": row["strategy"],
        "memory_gib": {k: round(float(row[f"{k}_gib"]), 3) for k in MEMORY_TERMS},
        "fits": bool(row["fits"]),
        "step_time_s": float(row["step_time_s"]),
        "time_breakdown_s": {k[:-2]: float(row[k]) for k in TIME_KEYS},
        "exposed_comm_breakdown_s": {k[:-2]: float(row[k]) for k in COMM_KEYS},
        "tokens_per_step": int(row["tokens_per_step"]),
        "tokens_per_s": float(row["tokens_per_s"]),
        "tokens_per_s_per_gpu": float(row["tokens_per_s_per_gpu"]),
        "mfu": float(row["mfu"]),
    } | ({"loss": str(row["loss"])} if "loss" in row.index else {})


def fully_pinned(pins: dict) -> bool:
    """Every dimension the search varies is pinned (grad_accum follows from the batch)."""
    return all(k in pins for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch", "recompute"))


def ranked(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, *, gpus: int, seq_len: int,
           global_batch_tokens: int, pins: dict | None = None,
           gpus_per_node: int | None = None, compiled: bool = True, precision: str = "bf16",
           fp8_recipe: str = "tensorwise", loss: str = "standard",
           allocator: str = EXPANDABLE) -> SearchResult:
    """The search behind `plan`: every layout the pins allow, ranked; with every dimension
    pinned, exactly that layout (the unpinned fields at ParallelConfig's defaults), priced
    whether it fits or not.

    `compiled`: blocks under torch.compile (default); False prices eager blocks.
    `precision` "fp8" prices torchao float8 with `fp8_recipe` (`cost.fp8`; refused with
    one line where the card has no fp8 rate). `loss` "fused" prices the fused loss's head
    where the harness builds it (`cost.memory.fused_loss_on`), the standard one elsewhere.
    `allocator`: the CUDA caching allocator's mode (`cost.memory_runtime.ALLOCATORS`).
    """
    if precision == "fp8":
        fp8.check_gpu(gpu)
    pins = dict(pins or {})
    exact = fully_pinned(pins)
    if exact:  # one layout: the unpinned fields take ParallelConfig's defaults
        pins.setdefault("dp_shard", pins["dp"] if pins["zero"] else 1)
        pins.setdefault("pp_schedule", "1f1b")
        pins.setdefault("pp_virtual", 1)
    result = search(m, gpu, cluster, gpus=gpus, seq_len=seq_len,
                    global_batch_tokens=global_batch_tokens, pins=pins,
                    gpus_per_node=gpus_per_node, require_fit=not exact, compiled=compiled,
                    precision=precision, fp8_recipe=fp8_recipe, loss=loss, allocator=allocator)
    if exact:
        result.table = result.table.head(1)
    return result


def answer(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, result: SearchResult, *,
           gpus: int, seq_len: int, global_batch_tokens: int, top: int = 5) -> dict:
    """The `plan` answer of a `ranked` search: its best `top` fitting layouts, best first
    (the one layout of an exact search, whether it fits or not)."""
    first_fits = bool(result.table["fits"].iloc[0])  # False only for an exact search
    rows = result.best(top) if first_fits else result.table.head(1)
    return {
        "model": m.name, "gpu": gpu.name, "calibration": gpu.calibration,
        "cluster": cluster.name, "gpus": gpus,
        "seq_len": seq_len, "global_batch_tokens": global_batch_tokens,
        "plans": [row_to_plan(r) for _, r in rows.iterrows()],
        "searched": result.searched,
        "elapsed_s": round(result.elapsed_s, 4),
    } | fp8_answer(m, gpu, result.table) | loss_answer(result.table)


def fp8_answer(m: ModelSpec, gpu: GPUSpec, table: pd.DataFrame) -> dict:
    """{"precision": "fp8", "fp8": `cost.fp8.summary`} for a table priced in fp8; {} for bf16,
    whose answers name no precision (bf16 is the default, as in records without one)."""
    if "precision" not in table.columns:
        return {}
    return {"precision": "fp8", "fp8": fp8.summary(m, gpu, table["fp8_recipe"].iloc[0])}


def loss_answer(table: pd.DataFrame) -> dict:
    """{"loss": "fused"} for a table priced for the fused loss (each plan then says which loss
    it was priced with); {} for the standard loss, whose answers name none (the default)."""
    return {"loss": "fused"} if "loss" in table.columns else {}


def plan(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, *, gpus: int, seq_len: int,
         global_batch_tokens: int, pins: dict | None = None, top: int = 5,
         gpus_per_node: int | None = None, compiled: bool = True, precision: str = "bf16",
         fp8_recipe: str = "tensorwise", loss: str = "standard",
         allocator: str = EXPANDABLE) -> dict:
    """The best `top` plans, best first; with every dimension pinned, exactly that layout
    (`ranked`, `answer`), so a known configuration can be predicted and checked against a
    measurement."""
    result = ranked(m, gpu, cluster, gpus=gpus, seq_len=seq_len,
                    global_batch_tokens=global_batch_tokens, pins=pins,
                    gpus_per_node=gpus_per_node, compiled=compiled, precision=precision,
                    fp8_recipe=fp8_recipe, loss=loss, allocator=allocator)
    return answer(m, gpu, cluster, result, gpus=gpus, seq_len=seq_len,
                  global_batch_tokens=global_batch_tokens, top=top)


def memory(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, cfg: ParallelConfig,
           seq_len: int, allocator: str = EXPANDABLE) -> dict:
    """Per-GPU memory of one layout: the `trainplan memory` answer."""
    row = evaluate(m, gpu, cluster, Layouts.from_configs([cfg]), seq_len,
                   allocator=allocator).iloc[0]
    return {
        "model": m.name, "gpu": gpu.name, "calibration": gpu.calibration, "allocator": allocator,
        "parallel": {k: _plain(row[k]) for k in PARALLEL_KEYS},
        "memory_gib": {k: round(float(row[f"{k}_gib"]), 3) for k in MEMORY_TERMS},
        "fits": bool(row["fits"]),
        "gpu_memory_gib": gpu.memory_gib,
    }
