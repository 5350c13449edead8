"""Microbenchmarks, recorded as `microbenchmark` records: GEMMs, attention, collectives.

- matmul at the model's own GEMM shapes (`gemm_shapes`): y = x W^T with x
  (M, K) and W (N, K) as `nn.Linear` stores it; FLOPs 2 M N K.
- causal attention through `F.scaled_dot_product_attention`, forward +
  backward; FLOPs by `attention_flops`.
- all-reduce, reduce-scatter, all-gather over message sizes (64 KiB .. 1 GiB
  by default); bus bandwidth as nccl-tests reports it (doc/PERFORMANCE.md):
  algbw = S / t with S the full array in bytes, busbw = algbw x 2(n-1)/n for
  all-reduce and x (n-1)/n for reduce-scatter and all-gather.

Timing: warm-up calls first, then `repeats` timed blocks of `iters` calls
each; on GPU CUDA events around a block, on CPU the wall clock. A record
holds the median block time per call, its rank interval (`stats.median_ci`)
and every block's time. A collective's block time is the slowest rank's.

Run: `torchrun --standalone --nproc-per-node N -m trainplan.bench.micro.run --out
PATH` (NCCL on GPUs, gloo on CPU); `--help` lists the knobs. NCCL settings
are left alone: the launcher keeps NVLink multicast off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainplan.bench.micro import fp8 as micro_fp8
from trainplan.bench.micro import layouts as micro_layouts
from trainplan.bench.micro import memory as micro_memory
from trainplan.bench.micro import model as micro_model
from trainplan.bench.micro import step as micro_step
from trainplan.bench.micro import tp as micro_tp
from trainplan.bench.micro.report import MODEL_BENCHES, print_table
from trainplan.bench.micro.shapes import (
    COLLECTIVES,
    SWEEP_MICRO_BATCHES,  # noqa: F401  (tests read the host sweep's micro-batches here)
    GiB,
    attention_flops,
    bus_factor,
    gemm_shapes,  # noqa: F401  (re-exported: tests and notebooks use micro.gemm_shapes)
    parse_sizes,
    whole,
)
from trainplan.bench.micro.timing import card, dtype_of, time_blocks, timed_results
from trainplan.errors import SpecError, TrainplanError
from trainplan.records.schema import append, microbenchmark_record
from trainplan.specs import ModelSpec, load_model

BENCHES = ("matmul", "attention", *MODEL_BENCHES[:4], "collectives", "overlap", "ddp", "fsdp",
           "tp", "host", "host-step")
# run only when --benches names them
OPT_IN = ("memory-stack", "matmul-fp8", "fp8-linear", "block-fp8")
HOST_SEQ = 64  # tokens of a host-bench block: GPU kernels of microseconds; TP 2 and 4 divide it
HOST_STEP_LAYERS = 4  # the host-step bench's short depth: the step's host time per layer
BLOCK_REPEATS = 15  # tp and host benches: host-bound, 6 repeats spread 9-23 ms on 4 x H100


# ---------------------------------------------------------------- benchmarks


def bench_matmul(m: int, n: int, k: int, *, dtype: str = "bfloat16", device: str | None = None,
                 warmup: int = 10, iters: int = 20, repeats: int = 7, name: str = "",
                 tp: int = 1, base: bool = True, run_id: str | None = None,
                 extra: dict | None = None) -> dict:
    """TFLOP/s of y = x W^T, x (m, k), W (n, k): 2 m n k FLOPs a call.

    `name` and `tp` say which GEMM of the model it is; `base` marks the shapes
    of the launch's own --tp and --tokens, from which `trainplan.calibrate.fit`
    takes the single matmul fraction (the others only feed the size curve).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    whole(m=m, n=n, k=k)
    x = torch.randn(m, k, device=dev, dtype=dtype_of(dtype))
    w = torch.randn(n, k, device=dev, dtype=dtype_of(dtype))
    out = torch.empty(m, n, device=dev, dtype=dtype_of(dtype))
    times = time_blocks(lambda: torch.mm(x, w.t(), out=out), dev, warmup, iters, repeats)
    config = {"name": name, "m": m, "n": n, "k": k, "tp": tp, "base": base, "dtype": dtype,
              "device": dev.type,
              "flops": 2 * m * n * k, "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench="matmul", config=config, gpus=1, card=card(dev),
                                 results=timed_results(times, 2 * m * n * k, "tflops", 1e12),
                                 run_id=run_id, extra=extra)


def bench_attention(batch: int, heads: int, seq: int, head_dim: int, *, causal: bool = True,
                    dtype: str = "bfloat16", device: str | None = None, warmup: int = 5,
                    iters: int = 10, repeats: int = 7, run_id: str | None = None,
                    extra: dict | None = None) -> dict:
    """TFLOP/s of SDPA forward + backward at (batch, heads, seq, head_dim); see attention_flops."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = (batch, heads, seq, head_dim)  # (B, nh, S, hd)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype_of(dtype), requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(shape, device=dev, dtype=dtype_of(dtype))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), grad_out)  # no .grad accumulation to time

    times = time_blocks(step, dev, warmup, iters, repeats)
    flops = attention_flops(batch, heads, seq, head_dim, causal)
    results = timed_results(times, flops, "tflops", 1e12)
    results["tflops_dense_equiv"] = results["tflops"] * (2 if causal else 1)
    config = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim,
              "causal": causal, "dtype": dtype, "device": dev.type, "flops": flops,
              "flops_convention": "12 b a s^2 d fwd+bwd, halved when causal",
              "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench="attention", config=config, results=results, gpus=1,
                                 card=card(dev), run_id=run_id, extra=extra)


def bench_collective(op: str, size_bytes: int, *, dtype: str = "bfloat16", warmup: int = 5,
                     iters: int = 20, repeats: int = 7, group=None, run_id: str | None = None,
                     extra: dict | None = None) -> dict:
    """Bus bandwidth of one collective at one size; every rank calls it, all get the record.

    `size_bytes` is S, the full array (nccl-tests): all-reduce reduces S bytes
    on every rank; reduce-scatter reduces S bytes into S/n per rank; all-gather
    gathers S/n per rank into S. S is rounded down to a multiple of n elements.
    """
    n = dist.get_world_size(group)
    factor = bus_factor(op, n)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    elem = torch.tensor([], dtype=dtype_of(dtype)).element_size()
    count = size_bytes // elem // n * n
    if count < n:
        raise SpecError(f"size {size_bytes} B is too small for {n} ranks of {dtype}")
    full = torch.zeros(count, device=dev, dtype=dtype_of(dtype))  # zeros: repeated sums stay finite
    part = torch.zeros(count // n, device=dev, dtype=dtype_of(dtype))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn = {"all_reduce": lambda: dist.all_reduce(full, group=group),
          "reduce_scatter": lambda: scatter(part, full, group=group),
          "all_gather": lambda: gather(full, part, group=group)}[op]
    times = time_blocks(fn, dev, warmup, iters, repeats,
                         before_block=lambda: dist.barrier(group=group))
    slowest = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    times = slowest.tolist()
    size = count * elem
    results = timed_results(times, size, "algbw_gbps", 1e9)
    results["busbw_factor"] = factor
    results["busbw_gbps"] = results["algbw_gbps"] * factor
    results["busbw_gbps_ci"] = [b * factor for b in results["algbw_gbps_ci"]]
    config = {"op": op, "size_bytes": size, "dtype": dtype, "world": n,
              "backend": dist.get_backend(group), "device": dev.type,
              "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench=op, config=config, results=results, gpus=n,
                                 card=card(dev), run_id=run_id, extra=extra)


# ---------------------------------------------------------------- command line


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="torchrun ... -m trainplan.bench.micro.run",
                                description="GEMM, attention and collective microbenchmarks; "
                                "appends microbenchmark records to --out.")
    p.add_argument("--out", required=True, help="records file (JSON lines), appended to")
    p.add_argument("--model", default="llama-1.3b", help="preset or YAML whose GEMMs to time")
    p.add_argument("--benches", default=",".join(BENCHES),
                   help=f"comma list of {', '.join(BENCHES + OPT_IN)} (default: all but "
                   f"{', '.join(OPT_IN)})")
    p.add_argument("--block-modes", default="compiled:none,compiled:selective,eager:none",
                   help="block variants, comma list of compiled|eager:none|selective|full"
                   "[:pure|autocast-fp32] (pure: weights in --dtype, as FSDP2; autocast-fp32: "
                   "fp32 weights under autocast, as DDP, TP, PP and 1 GPU)")
    p.add_argument("--head-modes", default="eager",
                   help="head variants, comma list of compiled|eager[:pure|autocast-fp32] "
                   "(compiled: the loss compiled, as --compile runs do)")
    p.add_argument("--ddp-modes", default="on,off",
                   help="bench ddp: Dynamo's DDPOptimizer (optimize_ddp) on, off, or both")
    p.add_argument("--fsdp-modes", default="z2,z3",
                   help="bench fsdp: FSDP2 ZeRO-2 (z2), ZeRO-3 (z3, reshard after forward) or both")
    p.add_argument("--tp-modes", default="tp2,tp4,tp2-z3",
                   help="bench tp: a block under tensor parallel, tpN, or tpN-z2|z3 with FSDP2 "
                   "on the other mesh dimension; those the ranks cannot lay out are skipped")
    p.add_argument("--block-repeats", type=int, default=BLOCK_REPEATS,
                   help="timed blocks (steps) of the tp, host and host-step benches, whose "
                   "host-bound times spread widely (>= 6 for a 95%% interval)")
    p.add_argument("--host-seq", type=int, default=HOST_SEQ,
                   help="benches host and host-step: the tiny sequence (micro-batch 1) at which a "
                   "block's (step's) time is the host's; the --tp-modes degrees must divide it")
    p.add_argument("--host-step-layers", type=int, default=HOST_STEP_LAYERS,
                   help="bench host-step: also time the step of the model's first N blocks "
                   "(0: the full depth only), for the host's work per layer outside the blocks")
    p.add_argument("--memory-layers", default="2,4", help="bench memory-stack: the depths "
                   "(first N blocks) whose allocator reserve gives its growth per layer")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the GEMM shapes")
    p.add_argument("--tokens", type=int, default=16384, help="GEMM rows: micro-batch x seq")
    p.add_argument("--matmul-tp", default=None,
                   help="more tp degrees whose GEMM shards to time, e.g. 1,2 (default: --tp)")
    p.add_argument("--matmul-tokens", default=None,
                   help="more GEMM row counts to time, e.g. 4096,16384 (default: --tokens)")
    p.add_argument("--curve-only", action="store_true",
                   help="matmul: mark every GEMM `base: false`, so that another model's shapes "
                        "shape the size curve but not the single matmul fraction")
    p.add_argument("--seq-len", type=int, default=2048, help="attention sequence length")
    p.add_argument("--attention-seqs", default=None,
                   help="more attention lengths to time, e.g. 4096,16384 (default: --seq-len)")
    p.add_argument("--sizes", default="64K..1G", help="collective sizes: 64K..1G or 64K,1M")
    p.add_argument("--ops", default=",".join(COLLECTIVES), help="collectives to time")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7, help="timed blocks; >= 6 for a 95%% interval")
    p.add_argument("--run-id", default=None, help="shared by the records of this launch")
    return p


def _tasks(args, spec: ModelSpec, rank: int, world: int) -> list[tuple[str, dict]]:

    benches = {b.strip() for b in args.benches.split(",") if b.strip()}
    unknown = benches - set(BENCHES + OPT_IN)
    if unknown:
        raise SpecError(f"--benches {sorted(unknown)[0]!r} is not valid; "
                        f"use {', '.join(BENCHES + OPT_IN)}")
    modes = micro_layouts.block_modes(args.block_modes)
    heads = micro_layouts.head_modes(args.head_modes)
    ddp, fsdp = micro_layouts.ddp_modes(args.ddp_modes), micro_layouts.fsdp_modes(args.fsdp_modes)
    tps = micro_tp.tp_modes(args.tp_modes)
    whole(block_repeats=args.block_repeats)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for op in ops:
        bus_factor(op, 2)  # validates the name
    # on every rank: all refuse bad input
    matmuls = micro_layouts.matmul_tasks(
        spec, args.tp, args.tokens, micro_layouts.whole_list(args.matmul_tp, "--matmul-tp"),
        micro_layouts.whole_list(args.matmul_tokens, "--matmul-tokens"),
        base=not args.curve_only)
    sizes = parse_sizes(args.sizes)
    tasks = []
    if rank == 0 and "matmul" in benches:
        tasks += matmuls
    for fp8_bench in (micro_fp8.BENCH, micro_fp8.LINEAR_BENCH):  # bench.micro.fp8, each recipe
        if rank == 0 and fp8_bench in benches:
            tasks += micro_fp8.fp8_tasks(
                spec, args.tp, args.tokens,
                micro_layouts.whole_list(args.matmul_tp, "--matmul-tp"),
                micro_layouts.whole_list(args.matmul_tokens, "--matmul-tokens"), bench=fp8_bench)
    seqs = sorted({args.seq_len, *micro_layouts.whole_list(args.attention_seqs,
                                                           "--attention-seqs")})
    if rank == 0 and "attention" in benches:
        tasks += [("attention", {"batch": max(1, args.tokens // s), "seq": s,
                                 "heads": spec.n_heads // args.tp, "head_dim": spec.head_dim})
                  for s in seqs]
    batch = max(1, args.tokens // args.seq_len)
    piece = {"model": args.model, "micro_batch": batch, "seq": args.seq_len}
    if rank == 0 and "hbm" in benches:
        tasks.append(("hbm", {"size_bytes": GiB if torch.cuda.is_available() else 16 * 2**20}))
    if rank == 0 and "head" in benches:
        tasks += [("head", {**piece, "compile": c, "precision": p}) for c, p in heads]
    if rank == 0 and "block" in benches:
        tasks += [("block", {**piece, "compile": c, "recompute": r, "precision": p})
                  for c, r, p in modes]
    if rank == 0 and micro_fp8.BLOCK_BENCH in benches:  # each recipe, in each block precision
        tasks += [(micro_fp8.BLOCK_BENCH, {**piece, "recipe": r, "precision": p})
                  for r in micro_fp8.RECIPES for p in micro_model.PRECISIONS]
    if rank == 0 and "optimizer" in benches:
        tasks.append(("optimizer", {"model": args.model}))
    if world > 1 and "collectives" in benches:
        tasks += [(op, {"size_bytes": s}) for op in ops for s in sizes]
    if world > 1 and "overlap" in benches:
        tasks.append(("overlap", {} if torch.cuda.is_available() else
                      {"gemm": 256, "gemms": 4, "size_bytes": 2**20}))
    if world > 1 and "ddp" in benches:
        tasks += [("ddp", {**piece, "optimize_ddp": on}) for on in ddp]
    if world > 1 and "fsdp" in benches:
        tasks += [("fsdp", {**piece, "zero": z}) for z in fsdp]
    if world > 1 and "tp" in benches:
        tasks += [("tp", {**piece, "tp": t, "zero": z, "repeats": args.block_repeats})
                  for t, z in micro_tp.runnable(tps, world)]
    if benches & {"host", "host-step"}:  # blocks, then whole steps (bench.micro_step)
        tasks += micro_step.host_tasks(args, rank, world, micro_tp.runnable(tps, world),
                                       blocks="host" in benches, steps="host-step" in benches)
    if "memory-stack" in benches:  # the allocator's reserve per layer (bench.micro_memory)
        tasks += micro_memory.stack_tasks(args, rank, world, micro_tp.runnable(tps, world))
    return tasks


def _run(kind: str, kw: dict, common: dict) -> dict:

    if kind in ("host", "interleave", "host-step", "memory-stack"):  # purpose: own fit only
        kw, extra = dict(kw), {**(common.get("extra") or {}), "purpose": kind}
        keep = {k: v for k, v in common.items() if k in ("run_id", "dtype", "warmup")}
        if kind == "memory-stack":  # one depth a task
            return micro_memory.bench_memory_stack(**kw, **keep, extra=extra)[0]
        if kind == "host-step":
            return micro_step.bench_host_step(**kw, **keep, extra=extra)
        return _run(kw.pop("of"), kw, {**common, "extra": extra})
    if kind == "tp":
        keep = {k: v for k, v in common.items() if k in ("run_id", "extra", "dtype")}
        return micro_tp.bench_tp_block(**kw, **keep)
    if kind in ("ddp", "fsdp"):
        keep = {k: v for k, v in common.items() if k in ("run_id", "extra", "dtype")}
        return getattr(micro_layouts, f"bench_{kind}_block")(**kw, **keep)
    if kind in MODEL_BENCHES:
        typed = kind in ("block", "head", "overlap")
        keep = {k: v for k, v in common.items()
                if k in ("run_id", "extra") or (k == "dtype" and typed)}
        return getattr(micro_model, f"bench_{kind}")(**kw, **keep)
    if kind == "matmul":
        return bench_matmul(**kw, **common)
    if kind == micro_fp8.BENCH:  # fp8 in, bf16 out: --dtype does not apply
        return micro_fp8.bench_matmul_fp8(**kw, **common)
    if kind == micro_fp8.LINEAR_BENCH:  # a bf16 linear converted by the harness
        return micro_fp8.bench_fp8_linear(**kw, **common)
    if kind == micro_fp8.BLOCK_BENCH:  # a block converted, beside its bf16 twin
        keep = {k: v for k, v in common.items() if k in ("run_id", "extra")}
        return micro_fp8.bench_block_fp8(**kw, **keep)
    if kind == "attention":
        return bench_attention(**kw, **common)
    return bench_collective(kind, **kw, **common)


def main(argv: list[str] | None = None) -> int:
    """Entry point; rank 0 appends the records and prints a table. Exit 2 on bad input."""
    import sys

    from tqdm import tqdm

    args = _parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        if cuda:
            local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=local)
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    try:
        spec = load_model(args.model)
        tasks = _tasks(args, spec, rank, world)
        common = {"dtype": args.dtype or ("bfloat16" if cuda else "float32"),
                  "warmup": args.warmup, "iters": args.iters, "repeats": args.repeats,
                  "run_id": args.run_id or time.strftime("micro-%Y%m%dT%H%M%SZ", time.gmtime()),
                  "extra": {"model": spec.name, "tp": args.tp}}
        records = []
        for kind, kw in tqdm(tasks, desc="microbenchmarks", disable=rank != 0):
            records.append(_run(kind, kw, common))
            if rank == 0:
                append(args.out, records[-1])
    except TrainplanError as err:
        print(f"trainplan.bench.micro.run: {err}", file=sys.stderr)
        return 2
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:

        print_table(records, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
