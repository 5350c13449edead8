"""The compute stream's reserve per layer: what the caching allocator holds beyond what is
allocated, as a share of the activations, per wrapper.

    memory-stack records (bench.micro --benches memory-stack)
        -> fragmentation_scales -> GPUSpec -> memory_runtime.fragmentation_bytes

The reserve is peak reserved - peak allocated (bytes), the part of
`torch.cuda.max_memory_reserved` no tensor holds, less the side streams' pools
(`reserve_bytes`); it grows with depth, by wrapper. Source: the memory-stack
microbenchmark only (`bench.micro.memory`: the model cut to its first N blocks for two
depths N, the peaks of a few training steps under each wrapper), never the end-to-end runs
the planner is checked against. The scale is the reserve's slope over depth per byte one
block keeps (`fragmentation_scales`); without rows the planner keeps the assumption
`memory_runtime.FRAGMENTATION`. Wrappers: `wrapper_key`.
"""

from __future__ import annotations

import json
import statistics

from trainplan.calibrate import host as calibrate_host
from trainplan.cost import memory
from trainplan.cost import memory_runtime as rt
from trainplan.cost.compute import NONE
from trainplan.cost.measured import activation_scale

PURPOSE = "memory-stack"
GiB = 2**30


def is_stack(record: dict) -> bool:
    """True for a memory-stack record (`bench.micro --benches memory-stack`)."""
    return record.get("purpose") == PURPOSE


def wrapper_key(config: dict) -> str | None:
    """`calibrate_host.wrapper_name` of a memory-stack config ("plain", "fsdp2", "tpN",
    "tpN+fsdp2"), ":z3" appended to an FSDP2 wrapper at ZeRO-3 ("fsdp2:z3", "tp2+fsdp2:z3");
    None for a wrapper with no row. The stages are kept apart because ZeRO-3 re-gathers every
    block in backward, which leaves a much larger compute-stream reserve per layer than
    ZeRO-2's; `memory_runtime._stage_rows` lets a stage with no row take the other's."""
    name = calibrate_host.wrapper_name(config)
    if name is not None and name.endswith("fsdp2") and int(config.get("zero", 0)) == 3:
        return name + ":z3"
    return name


def reserve_bytes(record: dict) -> float | None:
    """Bytes the compute stream held reserved beyond the peak allocation: peak reserved less
    peak allocated less the side streams' pools (0 where not recorded); None without
    bytes (a CPU run). Side pools: the bytes reserved in the pools of streams other than
    the compute stream (FSDP2's all-gather copy-in and reduce-scatter streams; 0 elsewhere).
    `memory_runtime.stream_pool_bytes` prices them already, and the reduce-scatter pool
    (4 bytes a parameter over the shard degree) grows with depth too, so left in the
    reserve it would be counted twice."""
    res = record["results"]
    if res.get("peak_reserved_bytes") is None or res.get("peak_allocated_bytes") is None:
        return None
    return float(res["peak_reserved_bytes"]) - float(res["peak_allocated_bytes"]) \
        - float(res.get("side_pool_bytes") or 0.0)


def kept_bytes(config: dict, spec, gpu) -> float:
    """The planner's bytes one block keeps for a memory-stack config: `memory.layer_kept_bytes`
    at its micro-batch and sequence, tensor parallel with sequence parallel where tp > 1,
    no recompute, on the harness's precision path (FSDP2 where zero > 0, else fp32 weights
    under autocast, as the bench runs TP alone) at `gpu`'s activation scale."""
    tp, compiled = int(config["tp"]), bool(config["compile"])
    return float(memory.layer_kept_bytes(
        spec, seq_len=config["seq"], micro_batch=config["micro_batch"], tp=tp, cp=1,
        recompute=NONE, sequence_parallel=tp > 1, scale=activation_scale(gpu, compiled, NONE),
        path=rt.FSDP if int(config.get("zero", 0)) else rt.AUTOCAST, compiled=compiled))


def _shape(config: dict) -> str:
    """What one line through the depths holds fixed: all but the depth."""
    spec = {k: v for k, v in (config.get("model_spec") or {}).items() if k != "n_layers"}
    keep = ("model", "micro_batch", "seq", "tp", "zero", "compile", "precision")
    return json.dumps([spec, [config.get(k) for k in keep]], sort_keys=True, default=str)


def fragmentation_scales(records: list[dict], gpu, spec_of) -> dict:
    """{"fragmentation_scales": [[wrapper, scale], ...], "fragmentation_fit": [[wrapper,
    reserve GiB a layer, kept GiB a layer], ...]} sorted by wrapper; {} where no wrapper has
    two depths with bytes. Per record (each rank's peaks, max over ranks):

        reserve(N) = `reserve_bytes`, the model cut to its first N blocks
        slope[w]   = least-squares slope of reserve(N) over N (`calibrate_host.step_line`,
                     medians per depth; exact through two depths)
        fragmentation_scales[w] = max(0, slope[w] / kept(w)),  kept(w) = `kept_bytes`

    Records of one wrapper at several shapes (micro-batch, sequence, model width) each give
    a scale; the row is their median. A wrapper measured at one depth gives no row (no
    slope), nor do records without bytes (CPU runs write None). `spec_of(record)` is the
    record's model as built (`calibrate.pieces._spec`); `gpu` carries the activation scales
    the planner prices kept bytes with (the calibration's own)."""
    lines: dict[tuple[str, str], dict[int, list[float]]] = {}
    first: dict[tuple[str, str], dict] = {}
    for r in (r for r in records if is_stack(r)):
        key, reserve = wrapper_key(r["config"]), reserve_bytes(r)
        if key is None or reserve is None:
            continue
        group = (key, _shape(r["config"]))
        lines.setdefault(group, {}).setdefault(int(r["config"]["layers"]), []).append(reserve)
        first.setdefault(group, r)
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for (key, shape), by_depth in sorted(lines.items()):
        if len(by_depth) < 2:
            continue  # one depth: no slope
        _, slope = calibrate_host.step_line(by_depth)
        kept = kept_bytes(first[(key, shape)]["config"], spec_of(first[(key, shape)]), gpu)
        rows.setdefault(key, []).append((slope / kept, slope, kept))
    if not rows:
        return {}
    med = {w: [statistics.median(col) for col in zip(*v, strict=True)] for w, v in rows.items()}
    return {"fragmentation_scales": [[w, round(max(0.0, s), 4)] for w, (s, _, _) in
                                     sorted(med.items())],
            "fragmentation_fit": [[w, round(b / GiB, 4), round(k / GiB, 4)] for w, (_, b, k)
                                  in sorted(med.items())]}
