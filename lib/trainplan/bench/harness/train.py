"""The proxy training run: `torchrun ... -m trainplan.bench.harness.train --model llama-1.3b
--dp 2 ...`.

One code path for CPU (gloo) and GPU (NCCL). It builds the plain model, applies the layout
(parallelize.py), trains `--steps` steps and measures: whole synchronised steps timed (the
slowest rank's time per step), the first `--warmup` steps (compile, allocator warm-up)
dropped and counted, tokens/s/GPU as total tokens over total time, MFU = tokens/s/GPU x
(6 N + 12 l h s) / bf16 peak (docs/measurement.md, "MFU";
`trainplan.cost.compute.model_flops_per_token`), peak memory allocated and reserved (max over
ranks), and the loss of every step. Rank 0 prints the summary as one JSON line and, with
`--records`, appends a measurement record through `trainplan.records.schema` (GPU only).

Precision: fp32 on CPU (so layouts match a single process closely). On GPU, bf16 compute
with fp32 gradient reduction: inside FSDP2 through its MixedPrecisionPolicy where FSDP is
used, else by autocast; `--precision fp8` adds torchao float8 linears (float8.py). `--loss
fused` applies the output layer chunk by chunk inside the loss (loss.py): no whole logits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from trainplan.bench.ckpt import store as ckpt
from trainplan.bench.harness import context, feed, float8, hf_baseline, host, monitor
from trainplan.bench.harness import loss as loss_mod
from trainplan.bench.harness import parallelize as par_mod
from trainplan.bench.harness import step as step_mod
from trainplan.bench.harness.model import Transformer, count_params, slice_spec
from trainplan.errors import TrainplanError
from trainplan.records import schema as records
from trainplan.specs import ModelSpec, ParallelConfig, load_model, slice_name
from trainplan.specs.bounds import check_run
from trainplan.specs.checks import check_positions

LOOP_IMPLS = ("trainplan", "hf-baseline")  # the models this loop trains (Trainer: hf_trainer)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # bf16 dense, vendor datasheets
LR_RANGE = (1e-10, 1.0)  # AdamW's peak learning rate: an update moves a weight about lr


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.harness.train", description=(
        "Train the proxy model under one parallel layout and measure it (run under torchrun)."))
    a = p.add_argument
    a("--model", default="llama-1.3b", help="model preset or YAML file")
    a("--impl", default="trainplan", choices=list(LOOP_IMPLS),
      help="our plain model, or transformers' LlamaForCausalLM as the baseline")
    a("--layers", type=int, default=0, help="keep only this many blocks (a layer slice); 0 = all")
    a("--seq-len", type=int, default=2048)
    a("--dp", type=int, default=1, help="data-parallel degree")
    a("--tp", type=int, default=1, help="tensor-parallel degree (with sequence parallel)")
    a("--pp", type=int, default=1, help="pipeline stages")
    a("--cp", type=int, default=1, help="context-parallel degree (ring attention, GPU only)")
    a("--ep", type=int, default=1, help="expert parallel (not implemented: must be 1)")
    a("--zero", type=int, default=0, help="0 DDP, 1-2 FSDP2 no reshard, 3 FSDP2 reshard")
    a("--dp-shard", type=int, default=0, help="ranks per FSDP shard group; < dp is HSDP")
    a("--micro-batch", type=int, default=1, help="sequences per micro-batch per dp rank")
    a("--grad-accum", type=int, default=1, help="micro-batches per step (= pipeline micro-batches)")
    a("--recompute", default="none", choices=["none", "selective", "full"])
    a("--no-sequence-parallel", action="store_true", help="with tp > 1, replicate the stream")
    a("--pp-schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"])
    a("--pp-virtual", type=int, default=1, help="stages per rank (interleaved schedule)")
    a("--compile", action="store_true",
      help="torch.compile each block (one GPU: the whole model), and the loss")
    a("--steps", type=int, default=20, help="steps in all, warm-up included")
    a("--warmup", type=int, default=5, help="first steps not timed")
    a("--lr", type=float, default=3e-4)
    a("--max-norm", type=float, default=1.0, help="clip the gradient norm to this; 0 = off")
    a("--seed", type=int, default=0)
    a("--cpu", action="store_true", help="run on CPU with gloo even if a GPU is present")
    a("--records", default=None, help="append a measurement record to this JSON-lines file")
    a("--peak-tflops", type=float, default=None,
      help="peak MFU is quoted against (default: the GPU's bf16 dense peak); on CPU it "
           "allows --records, for tests of the record path")
    a("--run-id", default=None, help="shared by the configs of one launch series")
    a("--tag", default=None, help="the suite config's tag, written into the record (configs "
                                  "of one layout that differ in loader or NCCL settings)")
    a("--no-progress", action="store_true")
    a("--json", action="store_true", help="no progress bar: only the summary JSON line")
    feed.add_arguments(p)  # --synthetic --data --pack/--pad --num-workers --pin-memory ...
    ckpt.add_arguments(p)  # --ckpt-dir --ckpt-every --ckpt-keep --ckpt-async --resume ...
    monitor.add_arguments(p)  # --metrics --straggler-tolerance --alert-tokens-per-s-per-gpu ...
    float8.add_arguments(p)  # --precision bf16|fp8 --fp8-recipe tensorwise|rowwise
    loss_mod.add_arguments(p)  # --loss standard|fused --loss-chunk
    host.add_arguments(p)  # --cpu-affinity --gc python|step --gc-every --gc-full-every
    return p.parse_args(argv)


def layout(args) -> ParallelConfig:
    return ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                          zero=args.zero, dp_shard=args.dp_shard, micro_batch=args.micro_batch,
                          grad_accum=args.grad_accum, recompute=args.recompute,
                          sequence_parallel=not args.no_sequence_parallel,
                          pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual)


def check_args(args) -> None:
    for name in ("seq_len", "steps"):
        if getattr(args, name) < 1:
            raise TrainplanError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    check_run(seq_len=args.seq_len, micro_batch=args.micro_batch)  # the planner's limits
    if not LR_RANGE[0] <= args.lr <= LR_RANGE[1]:
        raise TrainplanError(f"--lr = {args.lr} is not valid; use a learning rate in "
                             f"[{LR_RANGE[0]:g}, {LR_RANGE[1]:g}], e.g. 3e-4")
    if not 0 <= args.warmup < args.steps:
        raise TrainplanError(f"--warmup = {args.warmup} must be >= 0 and < --steps = {args.steps}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise TrainplanError(f"--peak-tflops = {args.peak_tflops} must be > 0")
    if not (math.isfinite(args.max_norm) and args.max_norm >= 0):
        raise TrainplanError(f"--max-norm = {args.max_norm} must be a number >= 0 (0: no "
                             "clipping)")
    cpu = args.cpu or not torch.cuda.is_available()
    if args.records and cpu and args.peak_tflops is None:
        raise TrainplanError(f"--records {args.records}: measurement records are for GPU runs "
                             "(MFU needs a GPU peak); leave --records out on CPU, or give "
                             "--peak-tflops (tests)")
    loss_mod.check(args)  # before cp's device check: one line names --loss fused
    context.check_device(args.cp, "cpu" if args.cpu else None)  # None: may be for a GPU host
    float8.check(args, cpu)
    feed.check_args(args, synthetic_loader=args.impl not in LOOP_IMPLS)  # Trainer: its own
    ckpt.check_args(args)
    monitor.check_args(args)
    host.check_args(args)


def init_distributed(force_cpu: bool, timeout=None, pin: str = "none") -> torch.device:
    """Start the process group (under torchrun with several ranks); pick the device; pin the
    process's threads first where `pin` asks (`harness.host`, said in `host.PINNED`)."""
    host.allocator_env(os.environ)  # before CUDA starts: expandable segments, unless set
    cuda = torch.cuda.is_available() and not force_cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    host.PINNED.update(host.apply(pin, device))  # before NCCL's and the loader's threads start
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                                timeout=timeout)
    return device


def build(spec: ModelSpec, cfg: ParallelConfig, args, device, mesh):
    """Build the model and apply the layout; return (Parallelized, loss function).

    Where parameters are sharded (FSDP or TP) on GPU, the model is built on the meta device and
    materialised shard by shard after parallelize, so a rank never holds the whole model.
    Elsewhere (CPU, DDP, one rank) it is built from the seed, so every layout starts from the
    same weights as a single process, as the loss-parity tests need."""
    sharded = cfg.world > 1 and (cfg.zero > 0 or cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1)
    meta = device.type == "cuda" and sharded
    torch.manual_seed(args.seed)
    with torch.device("meta" if meta else device):
        model = Transformer.from_spec(spec, max_seq_len=args.seq_len)
    loss_fn = loss_mod.for_model(model, args) or step_mod.loss_function(args.compile)
    n_params = count_params(model)
    attach = float8.convert_for(model, cfg, args)  # fp8 before any parallelism (torchtitan)
    result = par_mod.parallelize(model, cfg, mesh, compile=args.compile, device=device,
                                 mixed_precision=device.type == "cuda", loss_fn=loss_fn)
    attach(result)  # fp8: the weight scales' hook after each optimizer step, a note
    if meta:
        for part in result.parts:
            part.to_empty(device=device)
            part.init_weights(buffer_device=device)
    result.notes.append(f"{n_params} parameters")
    return result, loss_fn


def make_optimizer(par, lr: float, device) -> torch.optim.AdamW:
    """The harness's optimizer: AdamW (betas 0.9, 0.95, weight decay 0.1), fused on GPU."""
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(list(par.parameters()), lr=lr, betas=(0.9, 0.95),
                             weight_decay=0.1, **fused)


def peak_flops(device) -> float | None:
    """bf16 dense peak of the device (FLOP/s), or None where MFU means nothing (CPU, unknown)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for key, t in PEAK_TFLOPS.items() if key in name), None)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_spec(args) -> ModelSpec:
    """The --model spec, cut to its first --layers blocks when asked (a layer slice), with
    the positions --seq-len needs (`specs.checks.check_positions`)."""
    spec = load_model(args.model)
    check_positions(spec, args.seq_len)
    if not args.layers:
        return spec
    if args.layers > spec.n_layers:
        raise TrainplanError(f"--layers = {args.layers}: {spec.name!r} has only "
                             f"{spec.n_layers} layers; use 1..{spec.n_layers}")
    return slice_spec(spec, args.layers)


def run(args) -> dict:
    began = time.perf_counter()  # setup_s: mesh, model, wrappers, loader, up to the first step
    check_args(args)
    spec = load_spec(args)
    cfg = layout(args)
    device = init_distributed(args.cpu, ckpt.timeout(args), args.cpu_affinity)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    par_mod.check_layout(cfg, spec, world, seq_len=args.seq_len, device_type=device.type)
    mesh = par_mod.build_mesh(cfg, device.type, getattr(args, "fresh_groups", False))
    dp_rank, dp = par_mod.dp_coordinates(cfg, mesh)
    builder = hf_baseline.build if args.impl == "hf-baseline" else build
    par, loss_fn = builder(spec, cfg, args, device, mesh)
    optimizer = make_optimizer(par, args.lr, device)
    saver = ckpt.Checkpointer(args, par, optimizer, rank=rank, world=world, device=device,
                              total_steps=args.steps)
    start = saver.resume()  # 0, or the step of the checkpoint loaded
    source = feed.make_batches(args, cfg, spec, dp_rank, dp, start)
    autocast = device.type == "cuda" and not par.fsdp

    from tqdm import tqdm

    from trainplan.cost.compute import model_flops_per_token  # pandas: not loaded at harness start

    mon = monitor.Monitor(args, tokens_per_step=_tokens_per_step(cfg, args),
                          flops_per_token=model_flops_per_token(spec, args.seq_len),
                          peak=peak_flops(device), device=device, rank=rank, world=world)
    show = rank == 0 and not args.no_progress and not args.json
    bar = tqdm(range(start, args.steps), disable=not show, desc=f"{spec.name} {_layout_name(cfg)}",
               file=sys.stderr)
    times, losses, norms, shares = [], [], [], []
    batches = iter(source)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    done, setup_s = start, time.perf_counter() - began
    with host.watch(args) as gcw:  # --gc: the collector's policy, and its time per step
        for step in bar:
            saver.before_step(step + 1)
            sync(device)
            t0 = time.perf_counter()
            gcw.boundary(step)
            group = next(batches)
            shares.append(feed.trained_share(group))  # < 1 where labels are masked (instruct)
            micro = feed.to_device(group, device, non_blocking=args.pin_memory)
            total = step_mod.train_step(par, optimizer, micro, autocast=autocast,
                                        reshard=cfg.zero == 3, max_norm=args.max_norm,
                                        loss_fn=loss_fn)
            sync(device)
            times.append(time.perf_counter() - t0)
            gcw.end_step()
            mon.step(step + 1, times[-1])  # every rank: one small all_gather, if monitoring
            loss, norm = step_mod.reduce_loss(total)  # outside the timed region
            losses.append(loss)
            norms.append(norm)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", step_s=f"{times[-1]:.3f}")
            done = step + 1
            if saver.after_step(done):  # SIGTERM: emergency checkpoint taken, stop
                break
    summary = summarise(args, spec, cfg, device, world, times, losses, par, shares)
    summary["grad_norms"] = norms
    summary.update(host.summary(args, gcw, lambda v: over_ranks(v, device)))  # affinity, gc
    summary["setup_s"] = round(setup_s, 3)  # rank 0's; the first warm-up step holds the compile
    summary["first_step"] = start + 1
    summary["checkpoint"] = saver.finish(done)
    summary["monitor"] = mon.finish()
    summary["preempted"] = done < args.steps  # stopped by SIGTERM after its checkpoint
    if dist.is_initialized():
        dist.barrier()
    return summary


def _tokens_per_step(cfg: ParallelConfig, args) -> int:
    return cfg.dp * cfg.grad_accum * cfg.micro_batch * args.seq_len


def _layout_name(cfg: ParallelConfig) -> str:
    cp = f" cp{cfg.cp}" if cfg.cp > 1 else ""
    return (f"dp{cfg.dp} z{cfg.zero} tp{cfg.tp} pp{cfg.pp}{cp} mb{cfg.micro_batch} "
            f"ga{cfg.grad_accum}")


def over_ranks(values: list[float], device, op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def summarise(args, spec, cfg, device, world, times, losses, par, shares=()) -> dict:
    """The numbers of one run; rates as total tokens over total measured time. `shares`: each
    step's share of label positions with a loss (`feed.trained_share`), averaged over ranks;
    the trained rate counts only those (it differs where instruction labels are masked)."""
    from trainplan.cost.compute import model_flops_per_token  # pandas: not loaded at harness start

    times = over_ranks(times, device)  # a step ends when its slowest rank does
    measured = times[min(args.warmup, len(times) - 1):] if times else []  # resumed: >= 1 kept
    summed = over_ranks(list(shares) or [1.0] * len(times), device, dist.ReduceOp.SUM)
    shares = [v / world for v in summed[len(times) - len(measured):]]  # kept steps, rank mean
    tokens_per_step = _tokens_per_step(cfg, args)
    rate = tokens_per_step * len(measured) / sum(measured) / world if measured else 0.0
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
    flops_per_token = model_flops_per_token(spec, args.seq_len)
    mfu = rate * flops_per_token / peak if peak else None
    return {
        "model": args.model if not args.layers else slice_name(args.model, args.layers),
        "impl": args.impl,
        "layout": {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "ep": cfg.ep,
                   "zero": cfg.zero, "dp_shard": cfg.dp_shard, "micro_batch": cfg.micro_batch,
                   "grad_accum": cfg.grad_accum, "recompute": cfg.recompute,
                   "compile": args.compile, "sequence_parallel": cfg.sequence_parallel,
                   "pp_schedule": cfg.pp_schedule, "pp_virtual": cfg.pp_virtual,
                   **float8.layout_fields(args), **loss_mod.layout_fields(args)},
        "gpus": world if device.type == "cuda" else 0,
        "ranks": world,
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seq_len": args.seq_len,
        "synthetic": args.synthetic,
        "steps": args.steps,
        "warmup_steps_dropped": len(times) - len(measured),
        "step_times_s": measured,
        "warmup_step_times_s": times[:len(times) - len(measured)],  # the compile is in these
        "step_time_s": statistics.median(measured) if measured else None,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s_per_gpu": rate,
        "trained_share": shares,  # per kept step
        "trained_tokens_per_s_per_gpu": rate * statistics.fmean(shares) if shares else 0.0,
        "mfu": mfu,
        "flops_per_token": flops_per_token,
        "peak_tflops": peak / 1e12 if peak else None,
        **monitor.peak_memory(device),  # the largest over ranks, each rank's, rank 0's pools
        "losses": losses,
        "notes": par.notes,
        "tag": args.tag,
        "loader": {"synthetic": True} if args.synthetic and args.impl in LOOP_IMPLS else {
            # no DataLoader in this loop's synthetic runs; Trainer feeds its rows through one
            "synthetic": args.synthetic, "num_workers": args.num_workers,
            "prefetch_factor": args.prefetch_factor, "pin_memory": args.pin_memory,
            "data": args.data, "pack": args.pack is not False if args.data == "instruct" else None},
    }


def write_record(path: str, summary: dict, run_id: str | None) -> None:
    """Append the run as a measurement record (`trainplan.records.schema`, which derives the
    median step time, the rate with its interval and MFU from the kept step times)."""
    extra = {k: summary[k] for k in ("seq_len", "synthetic", "ranks", "losses", "grad_norms",
                                     "notes")}
    extra.update({k: summary[k] for k in ("tag", "loader", "memory_pools", "peak_mem_by_rank_gib",
                                          "cpu_affinity", "setup_s", "warmup_step_times_s",
                                          "trained_share", "trained_tokens_per_s_per_gpu", "gc")
                  if summary.get(k) is not None})
    extra["harness_revision"] = step_mod.HARNESS_REVISION
    record = records.measurement_record(
        model=summary["model"], impl=summary["impl"], layout=summary["layout"],
        gpus=summary["gpus"] or summary["ranks"], card=summary["card"],
        run_id=run_id or "adhoc",
        step_times_s=summary["step_times_s"], tokens_per_step=summary["tokens_per_step"],
        flops_per_token=summary["flops_per_token"], peak_tflops=summary["peak_tflops"],
        peak_mem_reserved_gib=summary["peak_mem_reserved_gib"],
        peak_mem_allocated_gib=summary["peak_mem_allocated_gib"],
        warmup_steps_dropped=summary["warmup_steps_dropped"], extra=extra)
    records.append(path, record)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
        failed = ckpt.final_failure(summary)  # the last steps are not on disk: exit 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            if args.records:
                write_record(args.records, summary, args.run_id)
            print(json.dumps(summary))
            if failed:
                print(f"error: {failed}", file=sys.stderr)
    except TrainplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 1 if failed else 143 if summary["preempted"] else 0  # 143: SIGTERM, resume me


if __name__ == "__main__":
    from trainplan.proctree import survive_closed_output

    survive_closed_output()  # a progress line must not fail a run whose reader has died
    sys.exit(main())
