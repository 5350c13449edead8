"""The range every number trainplan accepts must lie in, in one table.

Spec fields (from YAML, JSON or code) are checked against `FIELDS`, and the rows of
their measured tables column by column against `TABLES` and `CURVES`, by `specs.checks`
(a card's calibration file by `calibrate.store.check` against the same); the run sizes
that verbs take as flags (GPUs, sequence length, micro-batch, tokens a step) by
`check_run`, which `plan`, `memory` and every other verb pricing a layout share. The
ranges reach far past any real model, card or run, and stop where the cost model's
arithmetic would leave exact int64 or finite float64: with at most `MAX_PARAMS`
parameters and `MAX_TOKENS` tokens a micro-batch, no product the cost model forms
overflows, and no time or rate underflows to 0 or overflows to inf.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from trainplan.errors import LayoutError

MAX_GPUS = 2**20  # a million GPUs: beyond any cluster, and keeps divisor lists cheap
MAX_TOKENS = 2**40  # tokens a step (or a micro-batch): far beyond any run
MAX_SEQ_LEN = 2**24  # tokens a sequence
MAX_MICRO_BATCH = 2**20  # sequences a micro-batch
MAX_PARAMS = 2**50  # parameters of a model (about 10^15, 500 x the largest trained)
MAX_NAME = 200  # characters of a spec's name
MAX_WIDTH = 2**48  # n k of one GEMM's weight (the widest: vocab 2**26 x hidden 2**20)
EFFICIENCY = (1e-4, 1.0)  # fraction of a datasheet peak that kernels reach
LATENCY_US = (0.0, 1e6)  # one collective's or ring step's latency, us (1 s)
LINK_GBPS = (1e-6, 1e15)  # bandwidth per GPU, one direction, GB/s
HOST_S = (0.0, 10.0)  # host seconds: a block's issue, a step's work outside its blocks

# (spec, field) -> (lowest, highest), both allowed. Floats that divide (peaks,
# bandwidths, efficiencies) start well above 0 so that no time becomes inf.
FIELDS = {
    ("ModelSpec", "n_layers"): (1, 2**14),
    ("ModelSpec", "hidden"): (1, 2**20),
    ("ModelSpec", "n_heads"): (1, 2**16),
    ("ModelSpec", "n_kv_heads"): (1, 2**16),
    ("ModelSpec", "ffn"): (1, 2**22),
    ("ModelSpec", "vocab"): (1, 2**26),
    ("ModelSpec", "max_positions"): (0, MAX_SEQ_LEN),
    ("ModelSpec", "n_experts"): (1, 2**12),
    ("ModelSpec", "top_k"): (1, 2**12),
    ("ModelSpec", "rope_theta"): (1e-3, 1e15),
    ("ModelSpec", "norm_eps"): (1e-30, 1.0),
    ("GPUSpec", "bf16_tflops"): (1e-6, 1e6),
    ("GPUSpec", "fp8_tflops"): (0.0, 1e7),
    ("GPUSpec", "fp8_matmul_efficiency"): (0.0, 1.0),
    ("GPUSpec", "memory_gib"): (1e-6, 1e7),
    ("GPUSpec", "hbm_tbps"): (1e-6, 1e4),
    ("GPUSpec", "matmul_efficiency"): EFFICIENCY,
    ("GPUSpec", "attention_efficiency"): EFFICIENCY,
    ("GPUSpec", "memory_efficiency"): EFFICIENCY,
    ("ClusterSpec", "gpus_per_node"): (1, 2**12),
    ("ClusterSpec", "intra_node_gbps"): LINK_GBPS,
    ("ClusterSpec", "inter_node_gbps"): LINK_GBPS,
    ("ClusterSpec", "intra_node_latency_us"): LATENCY_US,
    ("ClusterSpec", "inter_node_latency_us"): LATENCY_US,
    ("ClusterSpec", "intra_node_efficiency"): EFFICIENCY,
    ("ClusterSpec", "inter_node_efficiency"): EFFICIENCY,
    ("Scenario", "gpus"): (1, MAX_GPUS),
    ("Scenario", "seq_len"): (1, MAX_SEQ_LEN),
    ("Scenario", "global_batch_tokens"): (1, MAX_TOKENS),
    ("Scenario", "token_budget"): (1.0, 1e18),
}
for _f in ("dp", "tp", "pp", "cp", "ep", "dp_shard"):
    FIELDS[("ParallelConfig", _f)] = (1, MAX_GPUS)
FIELDS[("ParallelConfig", "micro_batch")] = (1, MAX_MICRO_BATCH)
FIELDS[("ParallelConfig", "grad_accum")] = (1, MAX_TOKENS)
FIELDS[("ParallelConfig", "pp_virtual")] = (1, 2**14)
# Calibrated scales and host times (GPUSpec): ratios to the analytic model, seconds.
SCALE = (1e-4, 1e4)
for _f in ("elementwise_scale", "eager_elementwise_scale", "head_scale", "optimizer_scale",
           "logits_scale", "ddp_block_scale", "fsdp_block_scale", "fp8_cast_scale",
           "fp8_rowwise_cast_scale", "fp8_activation_ratio", "fp8_rowwise_activation_ratio"):
    FIELDS[("GPUSpec", _f)] = SCALE
for _f in ("autocast_elementwise_scale", "eager_autocast_elementwise_scale",
           "compiled_head_scale"):
    FIELDS[("GPUSpec", _f)] = (0.0, SCALE[1])
FIELDS[("GPUSpec", "overlap_exposed")] = (0.0, 1.0)
FIELDS[("GPUSpec", "host_overlap_k")] = (0.0, 1e3)
# Calibration pieces that no GPUSpec field holds (`calibrate.store.check`).
FIELDS[("pieces", "compiled_logits_scale")] = SCALE
FIELDS[("pieces", "ddp_exposed")] = FIELDS[("pieces", "ddp_exposed_unsplit")] = (0.0, 1.0)


class OneOf(tuple):
    """The values a table column takes (a column of numbers is a (lowest, highest) range)."""


class Names(NamedTuple):
    """A table column of names: those `pattern` matches whole, as `shown` lists them."""

    pattern: re.Pattern
    shown: str


BOOL = OneOf((False, True))  # also 0 and 1, as the calibrations write some flags
_WRAPPER = r"plain|tp[1-9]\d{0,6}|(tp[1-9]\d{0,6}\+)?fsdp2"  # `calibrate.host.wrapper_name`
WRAPPERS = Names(re.compile(_WRAPPER), "plain|fsdp2|tpN|tpN+fsdp2")
STAGE_WRAPPERS = Names(re.compile(rf"{_WRAPPER}|(tp[1-9]\d{{0,6}}\+)?fsdp2:z3"),
                       "plain|fsdp2|tpN|tpN+fsdp2, :z3 after fsdp2")
COLLECTIVE_ROW = (("op", OneOf(("all_reduce", "reduce_scatter", "all_gather", "all_to_all"))),
                  ("latency_us", LATENCY_US), ("busbw_gbps", LINK_GBPS))
ACTIVATION_ROW = (("compiled", BOOL), ("recompute", OneOf(("none", "selective", "full"))),
                  ("scale", SCALE))
GEMM_CURVE = (("tokens", (1, MAX_TOKENS)), ("width", (1, MAX_WIDTH)),
              ("fraction of peak", EFFICIENCY))

# (spec, table field) -> its columns, (name, allowed) each: a (lowest, highest) range, a
# `OneOf` or `Names`. A curve's rows also increase in all columns but the last (`CURVES`).
TABLES = {
    ("GPUSpec", "collectives"): COLLECTIVE_ROW,
    ("ClusterSpec", "collectives"): COLLECTIVE_ROW,
    ("GPUSpec", "activation_scales"): ACTIVATION_ROW,
    ("GPUSpec", "tp_block_scales"): (("tp", (1, MAX_GPUS)), ("with FSDP2", BOOL),
                                     ("scale", SCALE)),
    ("GPUSpec", "ring_host_s"): (("cp", (2, MAX_GPUS)), ("compiled", BOOL), ("seconds", HOST_S)),
    ("GPUSpec", "fragmentation_scales"): (("wrapper", STAGE_WRAPPERS), ("scale", (0.0, SCALE[1]))),
    ("pieces", "autocast_activation_scales"): ACTIVATION_ROW,
    ("pieces", "ddp_activation_scales"): (("compiled", BOOL), ("scale", SCALE)),
    ("pieces", "fsdp_block_scales"): (("zero", OneOf((1, 2, 3))), ("scale", SCALE)),
}
for _f in ("host_block_s", "host_step_s", "host_step_layer_s"):
    TABLES[("GPUSpec", _f)] = (("wrapper", WRAPPERS), ("seconds", HOST_S))
CURVES = {("GPUSpec", "attention_curve"): (("seq", (1, MAX_SEQ_LEN)),
                                           ("fraction of peak", EFFICIENCY))}
for _f in ("matmul_curve", "head_matmul_curve", "fp8_matmul_curve", "fp8_rowwise_matmul_curve"):
    CURVES[("GPUSpec", _f)] = GEMM_CURVE


def field_range(spec: str, name: str) -> tuple | None:
    """(lowest, highest) allowed for field `name` of spec class `spec`, or None: unbounded."""
    return FIELDS.get((spec, name))


def check_run(*, seq_len: int | None = None, micro_batch: int | None = None,
              gpus: int | None = None, global_batch_tokens: int | None = None) -> None:
    """Raise LayoutError naming the first run size out of range (flags' names and units)."""
    for flag, value, high in (("--seq-len", seq_len, MAX_SEQ_LEN),
                              ("--micro-batch", micro_batch, MAX_MICRO_BATCH),
                              ("--gpus", gpus, MAX_GPUS),
                              ("--global-batch-tokens", global_batch_tokens, MAX_TOKENS)):
        if value is not None and not 1 <= value <= high:
            raise LayoutError(f"{flag} {value} is not valid; use 1 to {high:,}")
    if seq_len is not None and micro_batch is not None and seq_len * micro_batch > MAX_TOKENS:
        raise LayoutError(f"--micro-batch {micro_batch} x --seq-len {seq_len} = "
                          f"{seq_len * micro_batch:,} tokens a micro-batch; use at most "
                          f"{MAX_TOKENS:,}")
