"""Microbenchmarks of the model's own pieces, for the terms a GEMM timing cannot see.

- block: one transformer block forward + backward at (micro-batch, seq),
  compiled or eager, with or without recompute (the harness's own `apply_ac`
  / `apply_compile`), in one of two precisions (`PRECISIONS`): "pure", the
  weights and activations in `dtype` as FSDP2's bf16 `MixedPrecisionPolicy`
  computes; "autocast-fp32", fp32 weights and an fp32 residual stream under
  `torch.autocast(dtype)`, as the harness runs DDP, TP, PP and one GPU
  (`step.train_step(autocast=True)`: the embedding's output is fp32, so the
  residual stream is too). Time per call and the activation bytes the block
  keeps for backward (allocated after the forward minus before, the output
  included: it is the next block's saved input).
- head: final norm, output projection and cross-entropy, forward + backward,
  eager or with the loss compiled as `bench.harness.step.loss_function` compiles it,
  in either precision; and the peak bytes above what was allocated before
  (logits, their fp32 copy, their gradients: what `memory.logits_bytes` and,
  compiled, `memory.compiled_logits_bytes` price).
- optimizer: gradient-norm clip and fused AdamW over fp32 parameters with the
  model's own shapes (a slice of its blocks), seconds per parameter.
- hbm: a large device-to-device copy, the streaming bandwidth (read + write).
- overlap: a GEMM loop alone, an all-reduce loop alone and both at once; the
  fraction of the all-reduce time that still shows when it runs under the
  GEMMs (NCCL's kernels take SMs and HBM from compute).

All are recorded as `microbenchmark` records (bench = block, head, optimizer,
hbm, overlap) and read by `trainplan.calibrate.fit`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from trainplan.bench.harness.model import (
    Transformer,
    TransformerBlock,
    norm_layer,
    rope_tables,
    slice_spec,
)
from trainplan.bench.harness.parallelize import apply_ac, apply_compile
from trainplan.bench.harness.step import cross_entropy
from trainplan.bench.micro.timing import card, dtype_of, sync, time_blocks, timed_results
from trainplan.errors import SpecError
from trainplan.records.schema import microbenchmark_record
from trainplan.records.stats import median_ci
from trainplan.specs import load_model

RECOMPUTE_MODES = ("none", "selective", "full")
PRECISIONS = ("pure", "autocast-fp32")  # weights in dtype | fp32 weights under autocast(dtype)


class OneBlock(nn.Module):
    """A model of one block, shaped so the harness's `apply_ac` and `apply_compile` apply."""

    def __init__(self, spec):
        super().__init__()
        self.layers = nn.ModuleDict({"0": TransformerBlock(spec)})


def _device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allocated(dev: torch.device) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def block_precision(precision: str, dt: torch.dtype, dev: torch.device):
    """(parameter and input dtype, autocast context factory, autocast dtype or None)."""
    import contextlib

    if precision not in PRECISIONS:
        raise SpecError(f"precision {precision!r} is not valid; use one of {PRECISIONS}")
    if precision == "pure":
        return dt, contextlib.nullcontext, None
    amp = dt if dt != torch.float32 else torch.bfloat16  # autocast to fp32 is no autocast
    return torch.float32, lambda: torch.autocast(dev.type, dtype=amp), str(amp).split(".")[-1]


def _record(bench, config, results, dev, gpus, run_id, extra):
    return microbenchmark_record(bench=bench, config=config, results=results, gpus=gpus,
                                 card=card(dev), run_id=run_id, extra=extra)


def bench_block(model: str, micro_batch: int, seq: int, *, compile: bool, recompute: str = "none",
                precision: str = "pure", dtype: str = "bfloat16", device: str | None = None,
                warmup: int = 3, iters: int = 5, repeats: int = 6, run_id: str | None = None,
                extra: dict | None = None, fp8_recipe: str | None = None) -> dict:
    """Seconds and kept activation bytes of one block, forward + backward; with
    `fp8_recipe`, its linears converted to torchao float8 first, as the harness converts
    them (`bench.harness.float8.convert`, no FSDP2), config["fp8_recipe"] naming it."""
    if recompute not in RECOMPUTE_MODES:
        raise SpecError(f"recompute {recompute!r} is not valid; use one of {RECOMPUTE_MODES}")
    spec, dev = load_model(model), _device(device)
    dt, amp, amp_dtype = block_precision(precision, dtype_of(dtype), dev)
    holder = OneBlock(spec).to(dev, dt)
    if fp8_recipe is not None:
        from trainplan.bench.harness import float8  # torchao: only for fp8

        float8.convert(holder, fp8_recipe, fsdp=False)
    apply_ac(holder, recompute)
    if compile:
        torch._dynamo.reset()  # each variant compiles afresh: no recompile limit reached
        apply_compile(holder)
    block = holder.layers["0"]
    cos, sin = rope_tables(seq, spec.head_dim, dev, spec.rope_theta)
    x = torch.randn(micro_batch, seq, spec.hidden, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        with amp():
            out = block(x, cos, sin)
        out.backward(grad)

    times = time_blocks(step, dev, warmup, iters, repeats)
    sync(dev)
    before = _allocated(dev)
    with amp():  # the autocast weight cache lives until the context exits: measured after it
        out = block(x, cos, sin)
    sync(dev)
    kept = _allocated(dev) - before
    out.backward(grad)
    del out
    tokens = micro_batch * seq
    results = timed_results(times, tokens, "tokens_per_s", 1.0)
    results["activation_bytes"] = kept
    results["activation_bytes_per_token"] = kept / tokens
    config = {"model": spec.name, "model_spec": dataclasses.asdict(spec),
              "micro_batch": micro_batch, "seq": seq, "compile": compile,
              "recompute": recompute, "precision": precision, "autocast_dtype": amp_dtype,
              "dtype": dtype, "device": dev.type, "tokens": tokens,
              "warmup": warmup, "iters": iters, "repeats": repeats,
              **({"fp8_recipe": fp8_recipe} if fp8_recipe else {})}
    return _record("block", config, results, dev, 1, run_id, extra)


def bench_head(model: str, micro_batch: int, seq: int, *, compile: bool = False,
               precision: str = "pure", dtype: str = "bfloat16", device: str | None = None,
               warmup: int = 3, iters: int = 5, repeats: int = 6, run_id: str | None = None,
               extra: dict | None = None) -> dict:
    """Seconds of final norm + output projection + cross-entropy, forward + backward.

    `compile` compiles the loss only, as `bench.harness.step.loss_function` does (the
    norm and output projection stay eager there, outside the compiled blocks).
    """
    spec, dev = load_model(model), _device(device)
    dt, amp, amp_dtype = block_precision(precision, dtype_of(dtype), dev)
    head = nn.Sequential(norm_layer(spec), nn.Linear(spec.hidden, spec.vocab, bias=False))
    head = head.to(dev, dt)
    x = torch.randn(micro_batch, seq, spec.hidden, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, spec.vocab, (micro_batch, seq), device=dev)
    if compile:
        torch._dynamo.reset()
    loss_fn = torch.compile(cross_entropy) if compile else cross_entropy

    def step():
        with amp():
            loss = loss_fn(head(x), labels)
        loss.backward()

    times = time_blocks(step, dev, warmup, iters, repeats)
    x.grad = None
    for p in head.parameters():
        p.grad = None
    sync(dev)
    before = _allocated(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    step()
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before if dev.type == "cuda" else 0
    tokens = micro_batch * seq
    results = timed_results(times, tokens, "tokens_per_s", 1.0)
    results["peak_bytes"] = peak  # logits, their fp32 copy and gradients at the worst moment
    results["peak_bytes_per_token"] = peak / tokens
    config = {"model": spec.name, "model_spec": dataclasses.asdict(spec),
              "micro_batch": micro_batch, "seq": seq, "compile": compile, "precision": precision,
              "autocast_dtype": amp_dtype, "dtype": dtype, "device": dev.type, "tokens": tokens,
              "warmup": warmup, "iters": iters, "repeats": repeats}
    return _record("head", config, results, dev, 1, run_id, extra)


def bench_optimizer(model: str, layers: int = 4, *, device: str | None = None, warmup: int = 2,
                    iters: int = 3, repeats: int = 6, run_id: str | None = None,
                    extra: dict | None = None) -> dict:
    """Seconds per parameter of clip-grad-norm + fused AdamW over fp32 params of `layers` blocks."""
    spec, dev = load_model(model), _device(device)
    spec = slice_spec(spec, min(layers, spec.n_layers))
    net = Transformer.from_spec(spec).to(dev)
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, fused=dev.type == "cuda")
    n = sum(p.numel() for p in params)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    times = time_blocks(step, dev, warmup, iters, repeats)
    results = timed_results(times, n, "params_per_s", 1.0)
    config = {"model": spec.name, "params": n, "tensors": len(params), "device": dev.type,
              "fused": dev.type == "cuda", "warmup": warmup, "iters": iters, "repeats": repeats}
    return _record("optimizer", config, results, dev, 1, run_id, extra)


def bench_hbm(size_bytes: int = 2**30, *, device: str | None = None, warmup: int = 3,
              iters: int = 10, repeats: int = 6, run_id: str | None = None,
              extra: dict | None = None) -> dict:
    """Streaming bandwidth of a device copy: 2 x size bytes moved a call (read + write)."""
    dev = _device(device)
    src = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = time_blocks(lambda: dst.copy_(src), dev, warmup, iters, repeats)
    config = {"size_bytes": size_bytes, "moved_bytes": 2 * size_bytes, "device": dev.type,
              "warmup": warmup, "iters": iters, "repeats": repeats}
    return _record("hbm", config, timed_results(times, 2 * size_bytes, "tbps", 1e12), dev, 1,
                   run_id, extra)


def _events_time(fn, dev: torch.device) -> float:
    if dev.type != "cuda":
        import time
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bench_overlap(gemm: int = 8192, gemms: int = 24, size_bytes: int = 2**28, *,
                  dtype: str = "bfloat16", repeats: int = 6, run_id: str | None = None,
                  extra: dict | None = None) -> dict:
    """Exposed fraction of an all-reduce run under GEMMs: (t_both - t_gemm) / t_allreduce.

    All ranks call it. The all-reduce count is chosen so the collectives take
    about half the GEMM time, as data-parallel traffic does under backward.
    """
    n = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    a = torch.randn(gemm, gemm, device=dev, dtype=dtype_of(dtype))
    b = torch.randn(gemm, gemm, device=dev, dtype=dtype_of(dtype))
    buf = torch.zeros(size_bytes // 4, device=dev, dtype=torch.float32)

    def gemm_loop():
        for _ in range(gemms):
            torch.mm(a, b)

    def reduce_loop(k, under=None):
        works = [dist.all_reduce(buf, async_op=True) for _ in range(k)]
        if under:
            under()
        for w in works:
            w.wait()

    gemm_loop(), reduce_loop(2)  # warm-up
    sync(dev)
    t_gemm = _events_time(gemm_loop, dev)
    t_one = _events_time(lambda: reduce_loop(4), dev) / 4
    k = torch.tensor([max(1, round(0.5 * t_gemm / t_one))], device=dev)
    dist.all_reduce(k, op=dist.ReduceOp.MAX)  # every rank must issue the same collectives
    k = int(k.item())
    rows = []
    for _ in range(repeats):
        dist.barrier()
        tg = _events_time(gemm_loop, dev)
        dist.barrier()
        tr = _events_time(lambda: reduce_loop(k), dev)
        dist.barrier()
        tb = _events_time(lambda: reduce_loop(k, under=gemm_loop), dev)
        rows.append((tg, tr, tb))
    slowest = torch.tensor(rows, dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = slowest.tolist()
    fractions = [max(0.0, (tb - tg) / tr) for tg, tr, tb in rows]
    iv = median_ci(fractions)
    results = {"exposed_fraction": iv.estimate, "exposed_fraction_ci": iv.as_list(),
               "fractions": fractions, "gemm_s": [r[0] for r in rows],
               "allreduce_s": [r[1] for r in rows], "both_s": [r[2] for r in rows],
               "ci_enough_samples": iv.enough}
    config = {"gemm": gemm, "gemms": gemms, "allreduce_bytes": buf.numel() * 4,
              "allreduces": k, "world": n, "dtype": dtype, "device": dev.type,
              "repeats": repeats}
    return _record("overlap", config, results, dev, n, run_id, extra)
