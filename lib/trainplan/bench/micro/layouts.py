"""Microbenchmarks of a compiled block under a data-parallel wrapper (DDP, FSDP2); variant lists.

- ddp block: one compiled block in `DistributedDataParallel` on every rank (fp32 weights
  under autocast), Dynamo's DDPOptimizer on or off, beside an all-reduce of the block's
  gradient bytes alone: time per call (slowest rank), activation bytes kept, peak bytes.
- fsdp block: the same block wrapped as `parallelize.apply_fsdp` wraps it (ZeRO-2 or 3),
  beside the block alone in bf16 and the all-gather and reduce-scatter of its bytes alone.
- the parsing of `micro.run`'s variant lists (block, head, DDPOptimizer and FSDP2 modes)
  and the extra GEMM shapes (`--matmul-tp`, `--matmul-tokens`).
Gradients are set to None before every call: no accumulating add is timed.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from trainplan.bench.harness.model import TransformerBlock, rope_tables
from trainplan.bench.harness.parallelize import apply_compile, apply_fsdp
from trainplan.bench.micro.model import PRECISIONS, RECOMPUTE_MODES, OneBlock, block_precision
from trainplan.bench.micro.shapes import gemm_shapes
from trainplan.bench.micro.timing import (
    card,
    dtype_of,
    per_block,
    slowest,
    sync,
    time_blocks,
    timed_results,
)
from trainplan.errors import SpecError
from trainplan.records.schema import microbenchmark_record
from trainplan.records.stats import median_ci
from trainplan.specs import ModelSpec, load_model

DDP_MODES = {"on": True, "off": False}
FSDP_MODES = {"z2": 2, "z3": 3}  # FSDP2 without / with resharding after forward


class BlockNet(OneBlock):
    """`n_blocks` blocks (one by default) with a forward, so `DistributedDataParallel` or
    FSDP2 can wrap them: two blocks under one root tell the per-block work from the root's."""

    def __init__(self, spec, n_blocks: int = 1):
        super().__init__(spec)
        for i in range(1, n_blocks):
            self.layers[str(i)] = TransformerBlock(spec)

    def forward(self, x, cos, sin):
        for block in self.layers.values():
            x = block(x, cos, sin)
        return x


def kept_and_peak(net, x, grad, cos, sin, amp, dev: torch.device, *,
                   zero_grad: bool = True) -> tuple[int, int]:
    """Bytes one forward of `net` (under `amp()`) keeps for backward, and the fwd + bwd peak
    above the start (both 0 on CPU). `zero_grad` first frees the gradients (a step's first
    micro-batch); without it those the warm-up left stay allocated and count in neither."""
    cuda = dev.type == "cuda"
    sync(dev)
    if zero_grad:
        net.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    with amp():
        out = net(x, cos, sin)
    sync(dev)
    kept = (torch.cuda.memory_allocated(dev) if cuda else 0) - before
    out.backward(grad)
    del out
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before if cuda else 0
    return kept, peak


def bench_ddp_block(model: str, micro_batch: int, seq: int, *, optimize_ddp: bool,
                    compile: bool = True, precision: str = "autocast-fp32",
                    dtype: str = "bfloat16", warmup: int = 3, iters: int = 5, repeats: int = 6,
                    run_id: str | None = None, extra: dict | None = None) -> dict:
    """Seconds and bytes of one DDP-wrapped (compiled) block, fwd + bwd; all ranks call it."""
    from torch.nn.parallel import DistributedDataParallel

    n = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    spec = load_model(model)
    dt, amp, amp_dtype = block_precision(precision, dtype_of(dtype), dev)
    torch.manual_seed(0)
    net = BlockNet(spec).to(dev, dt)
    if compile:
        torch._dynamo.reset()  # a fresh compile under this optimize_ddp setting
        apply_compile(net)
    ddp = DistributedDataParallel(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    cos, sin = rope_tables(seq, spec.head_dim, dev, spec.rope_theta)
    x = torch.randn(micro_batch, seq, spec.hidden, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        with amp():
            out = ddp(x, cos, sin)
        out.backward(grad)

    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):  # read when the frame compiles
        times = time_blocks(step, dev, warmup, iters, repeats, before_block=dist.barrier)
        kept, peak = kept_and_peak(ddp, x, grad, cos, sin, amp, dev, zero_grad=False)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    flat = torch.zeros(grad_bytes // 4, device=dev, dtype=torch.float32)  # DDP reduces in fp32
    reduce_times = time_blocks(lambda: dist.all_reduce(flat), dev, warmup, iters, repeats,
                                before_block=dist.barrier)
    rows = torch.tensor([times, reduce_times], dtype=torch.float64, device=dev)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)  # the slowest rank's block times
    times, reduce_times = rows.tolist()
    worst = torch.tensor([kept, peak], dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    kept, peak = (int(v) for v in worst.tolist())
    tokens = micro_batch * seq
    results = timed_results(times, tokens, "tokens_per_s", 1.0)
    results.update({"activation_bytes": kept, "activation_bytes_per_token": kept / tokens,
                    "peak_bytes": peak, "allreduce_s": median_ci(reduce_times).estimate,
                    "allreduce_times_s": reduce_times})
    config = {"model": spec.name, "model_spec": dataclasses.asdict(spec),
              "micro_batch": micro_batch, "seq": seq, "compile": compile, "recompute": "none",
              "precision": precision, "autocast_dtype": amp_dtype, "wrapper": "ddp",
              "optimize_ddp": optimize_ddp, "world": n, "backend": dist.get_backend(),
              "bucket_cap_bytes": int(ddp.bucket_bytes_cap), "grad_bytes": grad_bytes,
              "dtype": dtype, "device": dev.type, "tokens": tokens, "warmup": warmup,
              "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench="block", config=config, results=results, gpus=n,
                                 card=card(dev), run_id=run_id, extra=extra)


def bench_fsdp_block(model: str, micro_batch: int, seq: int, *, zero: int, compile: bool = True,
                     dtype: str = "bfloat16", warmup: int = 3, iters: int = 5, repeats: int = 6,
                     two_blocks: bool = False, run_id: str | None = None,
                     extra: dict | None = None) -> dict:
    """Seconds and bytes of one FSDP2-wrapped (compiled) block, fwd + bwd, beside the same
    block alone and its collectives alone; all ranks call it.

    `two_blocks`: also time two blocks under one root and report the difference as the
    block's time (`micro_tp.per_block`): alone, the block is FSDP2's root as well, whose
    per-call work runs once per step in the model. The host bench asks for it; the
    `fsdp_block_scale` records keep the one-block time that `_fsdp_scales` reads."""
    from torch.distributed.device_mesh import init_device_mesh

    if zero not in FSDP_MODES.values():
        raise SpecError(f"zero = {zero!r} is not valid for the fsdp block; use 2 or 3")
    n = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    spec = load_model(model)
    mixed = dtype_of(dtype) != torch.float32  # the harness's bf16 policy wherever it computes low
    compute_dt = torch.bfloat16 if mixed else torch.float32
    reduce_dt = torch.float32
    cos, sin = rope_tables(seq, spec.head_dim, dev, spec.rope_theta)
    x = torch.randn(micro_batch, seq, spec.hidden, device=dev, dtype=compute_dt,
                    requires_grad=True)
    grad = torch.randn_like(x)

    def timed(net, *tables):
        def step():
            net.zero_grad(set_to_none=True)
            x.grad = None
            net(x, *tables).backward(grad)
        return time_blocks(step, dev, warmup, iters, repeats, before_block=dist.barrier)

    torch.manual_seed(0)
    alone = BlockNet(spec).to(dev, compute_dt)  # the block as FSDP2 computes it, unwrapped
    if compile:
        torch._dynamo.reset()
        apply_compile(alone)
    alone_times = timed(alone, cos.to(compute_dt), sin.to(compute_dt))  # as FSDP2 casts them
    params = sum(p.numel() for p in alone.parameters())
    del alone
    torch.manual_seed(0)
    net = BlockNet(spec).to(dev, torch.float32)  # fp32 master weights, sharded below
    if compile:
        torch._dynamo.reset()  # a fresh compile with FSDP2's hooks around the block
        apply_compile(net)
    reshard = zero == 3  # ZeRO-3 frees the gathered weights after forward, ZeRO-2 keeps them
    mesh = init_device_mesh(dev.type, (n,))
    apply_fsdp(net, mesh, reshard=reshard, mixed_precision=mixed)
    times = timed(net, cos, sin)
    # kept: with ZeRO-2 also the gathered bf16 weights, held until backward
    kept, peak = kept_and_peak(net, x, grad, cos, sin, contextlib.nullcontext, dev)
    del net
    two_times = None
    if two_blocks:
        torch.manual_seed(0)
        net = BlockNet(spec, n_blocks=2).to(dev, torch.float32)
        if compile:
            torch._dynamo.reset()
            apply_compile(net)
        apply_fsdp(net, mesh, reshard=reshard, mixed_precision=mixed)
        (two_times,) = slowest(timed(net, cos, sin), dev=dev)
        del net
    shard = -(-params // n)  # one flat buffer per group, as FSDP2 gathers and reduces
    part, full = (torch.zeros(k * shard, device=dev, dtype=compute_dt) for k in (1, n))
    r_part, r_full = (torch.zeros(k * shard, device=dev, dtype=reduce_dt) for k in (1, n))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather_times = time_blocks(lambda: gather(full, part), dev, warmup, iters, repeats,
                                before_block=dist.barrier)
    scatter_times = time_blocks(lambda: scatter(r_part, r_full), dev, warmup, iters, repeats,
                                 before_block=dist.barrier)
    times, alone_times, gather_times, scatter_times = slowest(
        times, alone_times, gather_times, scatter_times, dev=dev)
    kept, peak = (int(v) for v in slowest([kept, peak], dev=dev)[0])
    tokens = micro_batch * seq
    if two_times is None:
        results = timed_results(times, tokens, "tokens_per_s", 1.0)
    else:

        results = per_block(times, two_times, tokens)
    results.update({"activation_bytes": kept, "activation_bytes_per_token": kept / tokens,
                    "peak_bytes": peak, "alone_s": median_ci(alone_times).estimate,
                    "alone_times_s": alone_times,
                    "allgather_s": median_ci(gather_times).estimate,
                    "allgather_times_s": gather_times,
                    "reduce_scatter_s": median_ci(scatter_times).estimate,
                    "reduce_scatter_times_s": scatter_times})
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    config = {"model": spec.name, "model_spec": dataclasses.asdict(spec),
              "micro_batch": micro_batch, "seq": seq, "compile": compile, "recompute": "none",
              "precision": "pure", "autocast_dtype": None, "wrapper": "fsdp2", "zero": zero,
              "blocks": [1, 2] if two_blocks else [1],
              "reshard_after_forward": reshard, "world": n, "backend": dist.get_backend(),
              "params": params, "param_bytes": 4 * params,
              "gather_bytes": params * compute_dt.itemsize,
              "reduce_bytes": params * reduce_dt.itemsize, "param_dtype": name[compute_dt],
              "reduce_dtype": name[reduce_dt], "dtype": dtype, "device": dev.type,
              "tokens": tokens, "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench="block", config=config, results=results, gpus=n,
                                 card=card(dev), run_id=run_id, extra=extra)


# ---------------------------------------------------------------- variant lists


def comma_items(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def block_modes(text: str) -> list[tuple[bool, str, str]]:
    """'compiled:none,eager:none:autocast-fp32' -> [(True, 'none', 'pure'), (False, 'none',
    'autocast-fp32')]; bad items refused."""
    out = []
    for item in comma_items(text):
        parts = item.split(":") + (["pure"] if item.count(":") == 1 else [])
        mode, rc, precision = (parts + ["", "", ""])[:3]
        if len(parts) != 3 or mode not in ("compiled", "eager") \
                or rc not in RECOMPUTE_MODES or precision not in PRECISIONS:
            raise SpecError(f"--block-modes item {item!r} is not valid; use compiled|eager:"
                            f"{'|'.join(RECOMPUTE_MODES)}[:{'|'.join(PRECISIONS)}]")
        out.append((mode == "compiled", rc, precision))
    return out


def head_modes(text: str) -> list[tuple[bool, str]]:
    """'eager,compiled:autocast-fp32' -> [(False, 'pure'), (True, 'autocast-fp32')]."""
    out = []
    for item in comma_items(text):
        mode, _, precision = item.partition(":")
        precision = precision or "pure"
        if mode not in ("compiled", "eager") or precision not in PRECISIONS:
            raise SpecError(f"--head-modes item {item!r} is not valid; use compiled|eager"
                            f"[:{'|'.join(PRECISIONS)}]")
        out.append((mode == "compiled", precision))
    return out


def ddp_modes(text: str) -> list[bool]:
    """'on,off' -> [True, False]: Dynamo's DDPOptimizer on or off."""
    items = comma_items(text)
    if not items or any(i not in DDP_MODES for i in items):
        raise SpecError(f"--ddp-modes {text!r} is not valid; use a comma list of on, off")
    return [DDP_MODES[i] for i in items]


def fsdp_modes(text: str) -> list[int]:
    """'z2,z3' -> [2, 3]: FSDP2 ZeRO-2 (weights kept until backward) and ZeRO-3 (resharded)."""
    items = comma_items(text)
    if not items or any(i not in FSDP_MODES for i in items):
        raise SpecError(f"--fsdp-modes {text!r} is not valid; use a comma list of z2, z3")
    return [FSDP_MODES[i] for i in items]


def whole_list(text: str | None, name: str) -> list[int]:
    """'4096,16384' -> [4096, 16384]; None or '' -> []."""
    try:
        values = [int(t) for t in comma_items(text or "")]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        raise SpecError(f"{name} {text!r} is not valid; use a comma list of whole numbers >= 1")
    return values


def matmul_tasks(spec: ModelSpec, tp: int, tokens: int, tps: list[int],
                 token_counts: list[int], base: bool = True) -> list[tuple[str, dict]]:
    """The model's GEMMs at (tp, tokens), marked `base` (every one, as `calibrate` weighs
    them; `base=False` for a model whose GEMMs only shape the size curve), then those at
    every other (tp, tokens) pair of `tps` x `token_counts` whose (m, n, k) is not listed yet."""
    tasks = [("matmul", {"m": g.m, "n": g.n, "k": g.k, "name": g.name, "tp": tp, "base": base})
             for g in gemm_shapes(spec, tp, tokens)]
    seen = {(kw["m"], kw["n"], kw["k"]) for _, kw in tasks}
    for t, m in ((t, m) for t in (tps or [tp]) for m in (token_counts or [tokens])):
        for g in gemm_shapes(spec, t, m):
            if (g.m, g.n, g.k) not in seen:
                seen.add((g.m, g.n, g.k))
                tasks.append(("matmul", {"m": g.m, "n": g.n, "k": g.k, "name": g.name, "tp": t,
                                         "base": False}))
    return tasks
