"""One block under tensor parallel, as the harness lays it out: the TP layouts' block time.

A TP block pays for more than its shard's GEMMs and its sequence-parallel collectives:
DTensor's hooks around the block's input and output, the waits between its collectives and
their consumers, and (with FSDP2 on the other mesh dimension) FSDP2's hooks over DTensor
parameters. At small shards the host work that issues all this can outlast the GPU work,
and the block becomes host-bound (see the committed profiles, data/measurements/profiles/).
No analytic term prices that, so `bench_tp_block` measures it on the block alone (seconds
of fwd + bwd per block, in the layouts `tp_modes` names), and `trainplan.calibrate.tp`
turns it into `tp_block_scales`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from trainplan.bench.harness.model import rope_tables
from trainplan.bench.harness.parallelize import apply_compile, apply_fsdp, apply_tp
from trainplan.bench.micro.layouts import BlockNet, comma_items, kept_and_peak
from trainplan.bench.micro.timing import (
    card,
    per_block,
    slowest,
    time_blocks,
)
from trainplan.cost.params import layer_params
from trainplan.errors import SpecError
from trainplan.records.schema import microbenchmark_record
from trainplan.specs import load_model

TP_ZERO = {"": 0, "z2": 2, "z3": 3}


class TPBlockNet(BlockNet):
    """`n_blocks` blocks run in sequence, with the root modules `apply_tp` looks for, absent."""

    tok_embeddings = None
    output = None


def tp_modes(text: str) -> list[tuple[int, int]]:
    """'tp2,tp4,tp2-z3' -> [(2, 0), (4, 0), (2, 3)]: tensor-parallel degree, and the FSDP2
    stage on the other mesh dimension (0 = none)."""
    out = []
    for item in comma_items(text):
        deg, _, zero = item.partition("-")
        ok = deg.startswith("tp") and deg[2:].isdigit() and int(deg[2:]) >= 2 and zero in TP_ZERO
        if not ok:
            raise SpecError(f"--tp-modes item {item!r} is not valid; use tpN or tpN-z2|z3 "
                            "with N >= 2, e.g. tp2,tp4,tp2-z3")
        out.append((int(deg[2:]), TP_ZERO[zero]))
    if not out:
        raise SpecError(f"--tp-modes {text!r} is not valid; use e.g. tp2,tp4,tp2-z3")
    return out


def runnable(modes: list[tuple[int, int]], world: int) -> list[tuple[int, int]]:
    """The modes a world of `world` ranks can lay out: tp divides it, FSDP needs a second
    data-parallel rank."""
    return [(tp, z) for tp, z in modes
            if world % tp == 0 and (z == 0 or world // tp > 1)]


def bench_tp_block(model: str, micro_batch: int, seq: int, *, tp: int, zero: int = 0,
                   compile: bool = True, dtype: str = "bfloat16", warmup: int = 3,
                   iters: int = 5, repeats: int = 6, run_id: str | None = None,
                   extra: dict | None = None) -> dict:
    """Seconds of one tensor-parallel (compiled) block, fwd + bwd, on a (world / tp, tp) mesh,
    FSDP2-wrapped over the first dimension when `zero` is 2 or 3; all ranks call it.

    The block is the harness's own (`BlockNet`, one `TransformerBlock`), parallelised by the
    harness's functions in its order (`apply_tp` with sequence parallel, `apply_compile`,
    then `apply_fsdp` on the data-parallel mesh dimension). Without FSDP each tp group runs
    its own block (what a TP x DP layout does between its gradient syncs); with it the first
    dimension shards the block's weights. Precision follows the harness: FSDP2 layouts
    compute in bf16 weights, TP alone keeps fp32 weights under bf16 autocast (an fp32
    residual stream). Timed fwd + bwd back to back (CUDA events around `iters` calls), so a
    host-bound block shows its host time.

    Two nets: the net is also the root module, so FSDP2's root work (lazy init checks,
    pre-forward hooks and stream syncs, the post-backward callback that waits for the last
    reduce-scatter) and DTensor's hooks on the net's input and output run once per call:
    once per block here, once per step in the whole model, so one block timed alone comes
    out too slow. The layout is timed with one block and with two in sequence (same
    wrappers, warm-up, iterations and repeats); the per-block time is the difference and
    root_s the rest of the one-block time (`timing.per_block`, which falls back to the
    one-block time, saying so in `per_block_from`, where noise swamps a cheap block). Kept
    and peak bytes are the one-block net's."""
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    if (tp, zero) not in runnable([(tp, zero)], n) or zero not in TP_ZERO.values():
        raise SpecError(f"tp = {tp}, zero = {zero} is not valid on {n} ranks: tp must divide "
                        "the ranks, and FSDP (zero 2 or 3) needs world / tp >= 2")
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    spec = load_model(model)
    if seq % tp:
        raise SpecError(f"seq = {seq} is not valid for tp = {tp}: sequence parallel splits "
                        "the sequence, so tp must divide it")
    low = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype)
    if low is None:
        raise SpecError(f"dtype {dtype!r} is not valid; use bfloat16 or float32")
    fsdp = zero > 0
    autocast = not fsdp and low != torch.float32  # the harness's precision without FSDP2
    mesh = init_device_mesh(dev.type, (n // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    stream = low if fsdp else torch.float32  # what enters a block in the harness
    cos, sin = rope_tables(seq, spec.head_dim, dev, spec.rope_theta)
    x = torch.randn(micro_batch, seq // tp, spec.hidden, device=dev, dtype=stream,
                    requires_grad=True)  # this rank's sequence shard of the residual stream
    grad = torch.randn_like(x)
    amp = (lambda: torch.autocast(dev.type, dtype=low)) if autocast else contextlib.nullcontext

    def build(n_blocks: int):
        torch.manual_seed(0)
        net = TPBlockNet(spec, n_blocks).to(dev, torch.float32)  # fp32, as the harness has
        apply_tp(net, mesh["tp"], sequence_parallel=True)
        if compile:
            torch._dynamo.reset()  # a fresh compile; the blocks of one net share its code
            apply_compile(net)
        if fsdp:
            apply_fsdp(net, mesh["dp_shard"], reshard=zero == 3,
                       mixed_precision=low != torch.float32)
        return net

    def timed(net):
        def step():
            net.zero_grad(set_to_none=True)
            x.grad = None
            with amp():
                out = net(x, cos, sin)
            out.backward(grad)
        return time_blocks(step, dev, warmup, iters, repeats, before_block=dist.barrier)

    net = build(1)
    one = timed(net)
    kept, peak = kept_and_peak(net, x, grad, cos, sin, amp, dev)
    del net
    two = timed(build(2))
    one, two = slowest(one, two, dev=dev)
    kept, peak = (int(v) for v in slowest([kept, peak], dev=dev)[0])
    params = layer_params(spec)  # one block, unsharded
    tokens = micro_batch * seq  # the tokens one tp group's block processes
    results = per_block(one, two, tokens)
    results.update({"activation_bytes": kept, "activation_bytes_per_token": kept / tokens,
                    "peak_bytes": peak})
    config = {"model": spec.name, "model_spec": dataclasses.asdict(spec),
              "micro_batch": micro_batch, "seq": seq, "compile": compile, "recompute": "none",
              "precision": "pure" if fsdp or low == torch.float32 else "autocast-fp32",
              "autocast_dtype": str(low).split(".")[-1] if autocast else None,
              "wrapper": "tp+fsdp2" if fsdp else "tp", "tp": tp, "dp": n // tp, "zero": zero,
              "sequence_parallel": True, "blocks": [1, 2], "world": n,
              "backend": dist.get_backend(),
              "params": params, "dtype": dtype, "device": dev.type, "tokens": tokens,
              "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench="block", config=config, results=results, gpus=n,
                                 card=card(dev), run_id=run_id, extra=extra)
