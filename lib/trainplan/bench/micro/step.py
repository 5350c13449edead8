"""The host bench's tasks, and its whole-step bench: the host's work outside the blocks.

`--benches host` times one block at micro-batch 1 and `HOST_SEQ` tokens, where forward +
backward is the host's issue time (`host_block_s`). `--benches host-step` times the whole
proxy step built as the harness builds it (wrappers, fused AdamW, compiled loss, clipping,
synthetic feed) at micro-batch 1, at the full depth and at its first --host-step-layers
blocks, per wrapper ("plain" on rank 0, "fsdp2", each runnable tp mode), so that
`trainplan.calibrate.host` splits the host's work outside the blocks into a constant and a
part per layer. `time_s` is the host's time to issue a step (the slowest rank's),
`wall_s` the step to the next synchronise.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch
import torch.distributed as dist

from trainplan.bench.harness import feed
from trainplan.bench.harness import step as step_mod
from trainplan.bench.harness.model import Transformer
from trainplan.bench.harness.parallelize import Parallelized, apply_compile, apply_fsdp, apply_tp
from trainplan.bench.harness.step import loss_function
from trainplan.bench.harness.train import make_optimizer
from trainplan.bench.micro.shapes import SWEEP_MICRO_BATCHES, whole
from trainplan.bench.micro.timing import card, dtype_of, slowest, sync, timed_results
from trainplan.bench.micro.tp import runnable
from trainplan.errors import SpecError
from trainplan.records.schema import microbenchmark_record
from trainplan.records.stats import median_ci
from trainplan.specs import load_model

ZERO = (0, 2, 3)  # no FSDP2, ZeRO-2, ZeRO-3 (ZeRO-1 runs as ZeRO-2 in the harness)


def host_tasks(args, rank: int, world: int, tps: list, *, blocks: bool = True,
               steps: bool = False) -> list[tuple[str, dict]]:
    """The host bench's tasks at micro-batch 1 and --host-seq tokens, where a fwd + bwd is the
    host's issue time (Python, wrapper hooks, launches; `trainplan.calibrate.host`).

    `blocks`: the compiled block alone (rank 0), FSDP2 ZeRO-2 and the runnable TP modes
    `tps` (world > 1); and the plain block at SWEEP_MICRO_BATCHES x --seq-len, where its
    GPU and host times meet. `steps`: the whole model's step under the same wrappers
    (`bench_host_step`): plain (rank 0), fsdp2 ZeRO-2 and the TP modes (world > 1), each at
    the depths of `step_depths` (full, then short)."""
    whole(host_seq=args.host_seq)
    whole(low=0, host_step_layers=args.host_step_layers)
    bad = [t for t, _ in tps if args.host_seq % t]  # none runnable on one rank
    if bad:
        raise SpecError(f"--host-seq {args.host_seq} is not valid: tp = {bad[0]} must divide it")
    tiny = {"model": args.model, "micro_batch": 1, "seq": args.host_seq,
            "repeats": args.block_repeats}
    plain = {**tiny, "of": "block", "compile": True, "recompute": "none", "precision": "pure"}
    out = []
    if blocks:
        sweep = [("interleave", {**plain, "micro_batch": mb, "seq": args.seq_len})
                 for mb in SWEEP_MICRO_BATCHES]
        out += [("host", plain)] + sweep if rank == 0 else []
        if world > 1:
            out.append(("host", {**tiny, "of": "fsdp", "zero": 2, "two_blocks": True}))
            out += [("host", {**tiny, "of": "tp", "tp": t, "zero": z}) for t, z in tps]
    if steps:
        depths = step_depths(load_model(args.model).n_layers, args.host_step_layers)
        pairs = ([(1, 0)] if rank == 0 else []) + ([(1, 2), *tps] if world > 1 else [])
        out += [("host-step", {**tiny, "tp": t, "zero": z, "layers": n})
                for t, z in pairs for n in depths]
    return out


def step_depths(full: int, short: int) -> list[int]:
    """The depths the host-step bench times a wrapper's step at: the model's `full` depth,
    then its first `short` blocks where 0 < short < full (0, or a model no deeper than
    `short`: the full depth alone, and `calibrate_host` keeps everything in host_step_s).
    Two depths give the step's host time as a constant plus a part per layer."""
    return [full] + ([short] if 0 < short < full else [])


def wrapper_of(tp: int, zero: int) -> str:
    """The config's `wrapper` (as the block benches write it): plain, fsdp2, tp, tp+fsdp2."""
    if tp > 1:
        return "tp+fsdp2" if zero else "tp"
    return "fsdp2" if zero else "plain"


def _build(spec, seq: int, *, tp: int, zero: int, dev, low: bool, compile: bool, mesh):
    """The whole model wrapped as `parallelize` wraps it (steps 1, 3, 4; no pipeline, no
    recompute), materialised after wrapping where parameters are sharded on GPU (as
    `train.build`); a `Parallelized` of it."""
    meta = dev.type == "cuda" and mesh is not None
    torch._dynamo.reset()  # a fresh compile per wrapper: no recompile limit reached
    torch.manual_seed(0)
    with torch.device("meta" if meta else dev):
        net = Transformer.from_spec(spec, max_seq_len=seq)
    if tp > 1:  # 1.
        apply_tp(net, mesh["tp"], sequence_parallel=True)
    if compile:  # 3.
        apply_compile(net)
    if zero:  # 4.
        apply_fsdp(net, mesh["dp_shard"], reshard=zero == 3, mixed_precision=low)
    if meta:
        net.to_empty(device=dev)
        net.init_weights(buffer_device=dev)
    return Parallelized(parts=[net], fsdp=bool(zero))


def harness_step(spec, micro_batch: int, seq: int, *, tp: int, zero: int, dev, low: bool,
                 compile: bool, mesh, max_norm: float):
    """A function running one training step as train.run builds and runs it: the model
    (`_build`), AdamW (fused on GPU), the loss (`step.loss_function`), synthetic
    micro-batches moved to the device, `train_step`. The host-step and memory-stack
    benches time and measure it."""
    par = _build(spec, seq, tp=tp, zero=zero, dev=dev, low=low, compile=compile, mesh=mesh)
    optimizer = make_optimizer(par, 3e-4, dev)  # as train.run builds it
    loss_fn = loss_function(compile)
    autocast = low and not par.fsdp  # train.run: autocast where FSDP2 does not cast
    dp_rank, dp = (mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()) if zero \
        else (0, 1)  # TP alone: every tp group reads the same batches
    batches = iter(feed.SyntheticBatches(vocab=spec.vocab, seq_len=seq, micro_batch=micro_batch,
                                         grad_accum=1, dp_rank=dp_rank, dp=dp, seed=0))

    def step():
        micro = feed.to_device(next(batches), dev, non_blocking=False)
        step_mod.train_step(par, optimizer, micro, autocast=autocast, reshard=zero == 3,
                            max_norm=max_norm, loss_fn=loss_fn)
    return step


def _timed_steps(spec, micro_batch: int, seq: int, *, tp: int, zero: int, dev, low: bool,
                 compile: bool, mesh, warmup: int, repeats: int, max_norm: float):
    """(host seconds, wall seconds) of each of `repeats` steps of `harness_step` after
    `warmup`."""
    step = harness_step(spec, micro_batch, seq, tp=tp, zero=zero, dev=dev, low=low,
                        compile=compile, mesh=mesh, max_norm=max_norm)
    for _ in range(warmup):
        step()
    host, wall = [], []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)  # issued: train_step has returned
        sync(dev)
        wall.append(time.perf_counter() - t0)
    return host, wall


def wrapper_setup(tp: int, zero: int, seq: int, dtype: str, bench: str):
    """(alone, ranks, low precision, device, mesh) for a whole-model bench under the wrapper
    (tp, zero): "plain" (tp 1, zero 0) is this rank's own model and no mesh; else a
    (world / tp, tp) mesh over every rank. Bad (tp, zero, seq) raise one SpecError line."""
    alone = tp == 1 and zero == 0
    n = dist.get_world_size() if dist.is_initialized() else 1
    if zero not in ZERO or not (alone or (tp, zero) in runnable([(tp, zero)], n)):
        raise SpecError(f"tp = {tp}, zero = {zero} is not valid for {bench} on {n} "
                        "ranks: zero is 0, 2 or 3, tp must divide the ranks, and FSDP needs "
                        "world / tp >= 2")
    if seq % tp:
        raise SpecError(f"seq = {seq} is not valid for tp = {tp}: sequence parallel splits "
                        "the sequence, so tp must divide it")
    low = dtype_of(dtype) != torch.float32  # the harness: bf16 on GPU, fp32 on CPU
    nccl = torch.cuda.is_available() if alone else dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mesh = None
    if not alone:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (n // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    return alone, n, low, dev, mesh


def step_config(spec, *, setup, tp: int, zero: int, micro_batch: int, seq: int,
                compile: bool, max_norm: float, dtype: str, warmup: int) -> dict:
    """The config of a whole-model step record (host-step, memory-stack): the model as built
    (`spec`, its depth as config["layers"]), the wrapper and the harness's step settings;
    `setup` is `wrapper_setup`'s (alone, ranks, low, device, mesh)."""
    alone, n, low, dev, mesh = setup
    return {"model": spec.name, "model_spec": dataclasses.asdict(spec),
            "wrapper": wrapper_of(tp, zero), "tp": tp, "dp": 1 if alone else n // tp,
            "zero": zero, "layers": spec.n_layers, "micro_batch": micro_batch, "seq": seq,
            "compile": compile, "recompute": "none", "sequence_parallel": tp > 1,
            "precision": "autocast-fp32" if low and not zero else "pure", "max_norm": max_norm,
            "optimizer": "adamw" + (" fused" if dev.type == "cuda" else ""),
            "feed": "synthetic", "world": 1 if alone else n,
            "backend": dist.get_backend() if mesh else None, "dtype": dtype,
            "device": dev.type, "tokens": micro_batch * seq, "warmup": warmup}


def bench_host_step(model: str, micro_batch: int, seq: int, *, tp: int = 1, zero: int = 0,
                    layers: int | None = None, compile: bool = True, dtype: str = "bfloat16",
                    warmup: int = 3, repeats: int = 6, max_norm: float = 1.0,
                    run_id: str | None = None, extra: dict | None = None) -> dict:
    """Seconds of one training step of the whole model under a host-bench wrapper.

    tp = 1, zero = 0: "plain", this rank's own model (the caller's rank alone); else every
    rank calls it: a (world / tp, tp) mesh, tensor parallel with sequence parallel where
    tp > 1, FSDP2 over the first dimension where zero is 2 or 3 (ZeRO-2 / ZeRO-3).
    `layers`: the model's first `layers` blocks (None: all), recorded as config["layers"];
    config["model"] stays the model's name and model_spec is the model as built."""

    whole(micro_batch=micro_batch, seq=seq, repeats=repeats, tp=tp)
    whole(low=0, warmup=warmup)
    spec = load_model(model)
    if layers is not None:
        whole(layers=layers)
        if layers > spec.n_layers:
            raise SpecError(f"layers = {layers} is not valid: {spec.name!r} has "
                            f"{spec.n_layers} layers")
        spec = dataclasses.replace(spec, n_layers=layers)
    alone, n, low, dev, mesh = wrapper_setup(tp, zero, seq, dtype, "the host step")
    warmup = max(1, warmup)  # the first step compiles: never timed
    host, wall = _timed_steps(spec, micro_batch, seq, tp=tp, zero=zero, dev=dev, low=low,
                              compile=compile, mesh=mesh, warmup=warmup, repeats=repeats,
                              max_norm=max_norm)
    gc.collect()  # the model and optimizer state went with _timed_steps
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the next wrapper's model, not this one's, on the card
    if not alone:
        host, wall = slowest(host, wall, dev=dev)
    tokens = micro_batch * seq
    results = timed_results(host, tokens, "tokens_per_s", 1.0)
    iv = median_ci(wall)
    results.update({"wall_s": iv.estimate, "wall_s_ci": iv.as_list(), "wall_times_s": wall,
                    "activation_bytes": 0})  # not measured here; a block record carries it
    config = {**step_config(spec, setup=(alone, n, low, dev, mesh), tp=tp, zero=zero,
                            micro_batch=micro_batch, seq=seq, compile=compile,
                            max_norm=max_norm, dtype=dtype, warmup=warmup), "repeats": repeats}
    return microbenchmark_record(bench="block", config=config, results=results,
                                 gpus=1 if alone else n, card=card(dev), run_id=run_id,
                                 extra=extra)
