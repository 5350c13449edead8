"""Strategy search: every valid layout for N GPUs and a global batch, ranked.

Valid means: dp x tp x pp x cp = N; tp inside a node and dividing the query
heads, key/value heads and FFN width; pp dividing the layers (pp x v for the
interleaved schedule) with at least p micro-batches per step; cp splitting the
sequence into 2 cp chunks (load-balanced causal ring attention); ep dividing
the experts and dp x cp (MoE only); micro-batch x grad-accum x dp = global
batch in sequences. Every layout is priced by `perf.evaluate` in one
vectorised pass; those that do not fit are kept but ranked last.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainplan.cost.memory_runtime import EXPANDABLE
from trainplan.cost.step_time import evaluate
from trainplan.errors import LayoutError, NoFeasiblePlan, SpecError
from trainplan.specs import ClusterSpec, GPUSpec, ModelSpec
from trainplan.specs.bounds import MAX_GPUS, check_run
from trainplan.specs.checks import check_positions
from trainplan.specs.layouts import RECOMPUTE, SCHEDULES, Layouts

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
VIRTUAL_STAGES = (2, 4)
# Layouts one search prices at most: a few seconds; mixtral-8x7b on 2**20 GPUs has 256,608.
MAX_LAYOUTS = 300_000


@dataclass
class SearchResult:
    table: pd.DataFrame  # one row per layout, best first (fitting before not fitting)
    searched: int  # layouts priced
    elapsed_s: float

    def best(self, k: int = 1) -> pd.DataFrame:
        return self.table[self.table["fits"]].head(k)



def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order, in O(sqrt n)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _choices(name, default, pins):
    return [pins[name]] if name in pins else list(default)


def check_cluster_size(gpus: int, gpus_per_node: int) -> None:
    """Whole nodes, or one partial node whose GPU count divides the node."""
    if gpus <= 0 or gpus > MAX_GPUS:
        raise LayoutError(f"--gpus {gpus} is not valid; use 1 to {MAX_GPUS:,} GPUs")
    if gpus % gpus_per_node and gpus_per_node % gpus:
        raise LayoutError(
            f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}; use whole "
            f"nodes (e.g. {gpus_per_node * max(1, round(gpus / gpus_per_node))}) or a divisor "
            f"of {gpus_per_node} for one partial node")


def check_pins(m: ModelSpec, pins: dict, gpus: int | None, gpn: int, seq_len: int) -> None:
    """Refuse pinned degrees that can never be valid, with the valid values named: each on
    its own, and dp x tp x pp x cp of those pinned against the GPU count; and a sequence
    longer than a learned-positions model's table (max_positions).

    `gpus=None` checks a layout on its own (the `memory` verb), where the GPU
    count follows from the pins instead of bounding them.
    """
    check_run(seq_len=seq_len, micro_batch=pins.get("micro_batch"))
    try:
        check_positions(m, seq_len)
    except SpecError as err:  # a layout of this model at this length cannot run
        raise LayoutError(str(err)) from None
    pool = gpus if gpus is not None else 2**int(math.log2(seq_len)) * m.n_layers * gpn
    fit = f"for {m.name} on {gpus} GPUs" if gpus is not None else f"for {m.name}"
    pp_ok = [d for d in divisors(m.n_layers) if pool % d == 0]
    rules = {
        "tp": [d for d in divisors(gpn) if pool % d == 0 and not (
            m.n_heads % d or m.n_kv_heads % d or m.ffn % d)],
        "pp": pp_ok,
        "cp": [d for d in divisors(pool) if d == 1 or (seq_len % (2 * d) == 0 and d <= 64)],
        "ep": [d for d in divisors(m.n_experts) if pool % d == 0] if m.is_moe else [1],
        "pp_virtual": [1] + [v for v in divisors(m.n_layers)  # a pin may be any count
                             if v > 1 and any(p > 1 and m.n_layers % (p * v) == 0
                                              for p in pp_ok)],
    }
    if gpus is not None:
        rules["dp"] = divisors(gpus)
        rules["dp_shard"] = divisors(gpus)
    for name, valid in rules.items():
        if name in pins and pins[name] not in valid:
            raise LayoutError(f"--{name.replace('_', '-')} {pins[name]} is not valid {fit}; "
                              f"valid: {valid}")
    pp, v = pins.get("pp", 1), pins.get("pp_virtual", 1)
    if m.n_layers % (pp * v):
        raise LayoutError(f"--pp {pp} x --pp-virtual {v} does not divide the {m.n_layers} "
                          f"layers of {m.name}; use pp x pp-virtual dividing {m.n_layers}")
    grid = {k: pins[k] for k in ("dp", "tp", "pp", "cp") if k in pins}
    ranks = math.prod(grid.values())
    named = " x ".join(f"--{k} {v}" for k, v in grid.items())
    if gpus is not None and len(grid) == 4 and ranks != gpus:
        raise LayoutError(f"the pins {named} use {ranks} GPUs, not --gpus {gpus} (dp x tp x "
                          f"pp x cp = --gpus); pin degrees whose product is {gpus}, or use "
                          f"--gpus {ranks}")
    if gpus is not None and gpus % ranks:
        raise LayoutError(f"the pins {named} need {ranks} GPUs, and {ranks} does not "
                          f"divide --gpus {gpus} (dp x tp x pp x cp = --gpus); pin degrees "
                          f"whose product divides {gpus}, or use a multiple of {ranks} GPUs")
    if gpus is not None and "dp" in pins and "dp_shard" in pins and pins["dp"] % pins["dp_shard"]:
        raise LayoutError(f"--dp-shard {pins['dp_shard']} does not divide --dp {pins['dp']}")


def _meshes(m: ModelSpec, gpus: int, gpn: int, seq_len: int, pins: dict):
    """(dp, tp, pp, cp, ep, dp_shard_choices, schedules) for every valid rank grid."""
    for tp, pp, cp in itertools.product(
            _choices("tp", divisors(min(gpn, gpus)), pins), _choices("pp", divisors(gpus), pins),
            _choices("cp", divisors(gpus), pins)):
        if gpus % (tp * pp * cp) or m.n_heads % tp or m.n_kv_heads % tp or m.ffn % tp:
            continue
        if m.n_layers % pp or (cp > 1 and seq_len % (2 * cp)):
            continue
        dp = gpus // (tp * pp * cp)
        if "dp" in pins and pins["dp"] != dp:
            continue
        eps = [e for e in divisors(m.n_experts) if (dp * cp) % e == 0] if m.is_moe else [1]
        node_local = gpn // (tp * cp) if gpn % (tp * cp) == 0 else 0
        shards = [dp] + ([node_local] if 1 < node_local < dp and dp % node_local == 0 else [])
        if pp == 1:
            schedules = [(0, 1)]
        else:
            virtual = {pins["pp_virtual"]} if pins.get("pp_virtual", 1) > 1 else VIRTUAL_STAGES
            schedules = [(0, 1), (2, 1)] + [(1, v) for v in sorted(virtual)
                                            if m.n_layers % (pp * v) == 0]
        for ep in _choices("ep", eps, pins):
            yield dp, tp, pp, cp, ep, shards, schedules


def enumerate_layouts(m: ModelSpec, *, gpus: int, gpus_per_node: int, seq_len: int,
                      global_batch_tokens: int, pins: dict | None = None) -> Layouts:
    """Every valid layout, as arrays; pinned dimensions take only their pinned value."""
    pins = dict(pins or {})
    check_cluster_size(gpus, gpus_per_node)
    check_run(seq_len=seq_len, global_batch_tokens=global_batch_tokens)
    if global_batch_tokens % seq_len:
        raise LayoutError(f"--global-batch-tokens {global_batch_tokens} is not a multiple of "
                          f"--seq-len {seq_len}; use a whole number of sequences")
    check_pins(m, pins, gpus, gpus_per_node, seq_len)
    batch = global_batch_tokens // seq_len
    zeros = _choices("zero", (0, 1, 2, 3), pins)
    recomputes = [RECOMPUTE.index(r) for r in _choices("recompute", RECOMPUTE, pins)]
    mbs = _choices("micro_batch", MICRO_BATCHES, pins)
    sp = pins.get("sequence_parallel", True)
    rows = []
    for dp, tp, pp, cp, ep, shards, schedules in _meshes(m, gpus, gpus_per_node, seq_len, pins):
        for zero, mb in itertools.product(zeros, mbs):
            if batch % (dp * mb):
                continue
            ga = batch // (dp * mb)
            if pins.get("grad_accum", ga) != ga:
                continue
            shard_opts = shards if zero == 3 else ([dp] if zero else [1])  # HSDP: ZeRO-3 only
            if "dp_shard" in pins:  # a pinned shard group must be one this stage allows
                shard_opts = [s for s in shard_opts if s == pins["dp_shard"]]
                if zero == 3 and dp % pins["dp_shard"] == 0:
                    shard_opts = [pins["dp_shard"]]
            for shard, (sched, v), rc in itertools.product(shard_opts, schedules, recomputes):
                if "pp_schedule" in pins and SCHEDULES[sched] != pins["pp_schedule"]:
                    continue
                if pins.get("pp_virtual", v) != v or (pp > 1 and sched != 2 and ga < pp):
                    continue
                rows.append((dp, tp, pp, cp, ep, zero, shard, mb, ga, rc, sp, sched, v))
        if len(rows) > MAX_LAYOUTS:
            raise LayoutError(f"{m.name} on {gpus} GPUs has more than {MAX_LAYOUTS:,} layouts "
                              "to price; pin some of --tp --pp --cp --ep --zero --micro-batch")
    if not rows:
        raise LayoutError(
            f"no layout reaches a global batch of {batch} sequences ({global_batch_tokens} "
            f"tokens) on {gpus} GPUs{' with the pins ' + str(pins) if pins else ''}: the batch "
            "must be a multiple "
            f"of dp x micro-batch (and have at least pp micro-batches); try a global batch that "
            f"is a multiple of {gpus} sequences")
    a = np.array(rows, dtype=np.int64)
    names = ("dp", "tp", "pp", "cp", "ep", "zero", "dp_shard", "micro_batch", "grad_accum",
             "recompute", "sequence_parallel", "pp_schedule", "pp_virtual")
    return Layouts.from_columns(**{n: a[:, i] for i, n in enumerate(names)})


def rank(table: pd.DataFrame) -> pd.DataFrame:
    """Fitting layouts first, then by tokens/s (higher first).

    Exact ties (context parallel with twice the micro-batch prices the same as
    plain data parallel, say) go to the layout with fewer model-parallel
    dimensions, then to the one using less memory: simpler to run, same speed.
    """
    dims = sum((table[d] > 1).to_numpy().astype(int) for d in ("tp", "pp", "cp", "ep"))
    order = np.lexsort((table["total_gib"].to_numpy(), dims,
                        -table["tokens_per_s"].round(6).to_numpy(), ~table["fits"].to_numpy()))
    return table.iloc[order].reset_index(drop=True)


def search(m: ModelSpec, gpu: GPUSpec, cluster: ClusterSpec, *, gpus: int, seq_len: int,
           global_batch_tokens: int, pins: dict | None = None,
           gpus_per_node: int | None = None, require_fit: bool = True,
           compiled: bool = True, precision: str = "bf16",
           fp8_recipe: str = "tensorwise", loss: str = "standard",
           allocator: str = EXPANDABLE) -> SearchResult:
    """Price every valid layout and rank them; refuse when none fits (unless require_fit=False).

    `compiled` prices blocks under torch.compile (the default trainplan runs);
    `precision`, `fp8_recipe`, `loss` and `allocator` as `cost.step_time.evaluate` takes them.
    """
    start = time.perf_counter()
    gpn = gpus_per_node or cluster.gpus_per_node
    layouts = enumerate_layouts(m, gpus=gpus, gpus_per_node=gpn, seq_len=seq_len,
                                global_batch_tokens=global_batch_tokens, pins=pins)
    if gpn != cluster.gpus_per_node:
        from dataclasses import replace
        cluster = replace(cluster, gpus_per_node=gpn)
    table = rank(evaluate(m, gpu, cluster, layouts, seq_len, compiled=compiled,
                          precision=precision, fp8_recipe=fp8_recipe, loss=loss,
                          allocator=allocator))
    if require_fit and not table["fits"].iloc[0]:
        smallest = table.loc[table["total_gib"].idxmin()]
        raise NoFeasiblePlan(
            f"nothing fits: {m.name} on {gpus} x {gpu.name} needs at least "
            f"{smallest['total_gib']:.1f} GiB per GPU ({smallest['strategy']}, micro-batch "
            f"{smallest['micro_batch']}, recompute {smallest['recompute']}) but "
            f"{gpu.memory_gib:g} GiB is the card; use more GPUs or a larger card")
    return SearchResult(table=table, searched=len(layouts),
                        elapsed_s=time.perf_counter() - start)


def best_per_strategy(table: pd.DataFrame) -> pd.DataFrame:
    """The best fitting layout of each strategy family (FSDP, TP + FSDP, TP + PP + DDP, ...)."""
    fitting = table[table["fits"]]
    return fitting.groupby("family", sort=False).head(1).reset_index(drop=True)
