"""Training the team's model on the team's data: `torchrun ... -m trainplan.train ...`.

The proxy harness's parts, not copies: its model (`bench.harness.model`, or a Hugging Face
Llama `config.json`), its layouts (`bench.harness.parallelize`: FSDP2, HSDP, TP with
sequence parallel, pipelining), its step (`bench.harness.step`: micro-batches, gradient
sync, clipping) and its checkpoints (`bench.ckpt`: DCP, verified manifests, keep k,
SIGTERM saves), with what a real job adds: token shards with a resumable sampler and a
weighted mixture (`train.batches`), AdamW with parameter groups and a warm-up + decay
schedule (`train.optim`), a held-out loss every N steps, logs (`train.logs`), weights
loaded from and exported to safetensors (`train.export`).

A checkpoint holds the model, Adam's state, every rank's RNG, the data position and the
schedule's step: a killed run resumed with --resume continues with the next unseen
sequence and ends bit-identical to one that was never stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainplan.bench.ckpt import store as ckpt
from trainplan.bench.harness import context, feed, float8, host, monitor
from trainplan.bench.harness import loss as loss_mod
from trainplan.bench.harness import parallelize as par_mod
from trainplan.bench.harness import step as step_mod
from trainplan.bench.harness import train as harness
from trainplan.errors import TrainplanError
from trainplan.specs import load_model
from trainplan.specs.checks import check_positions
from trainplan.train import batches as batches_mod
from trainplan.train import logs, optim, paths
from trainplan.train.flags import EVAL_BATCHES, LR_FLOOR, add_arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainplan.train",
                                description="Train a Llama-family model on prepared token "
                                            "shards under one parallel layout (under torchrun).")
    add_arguments(p)
    args = p.parse_args(argv)
    args.warmup, args.synthetic, args.impl = 0, False, "trainplan"  # harness.build reads these
    return args


def layout_name(cfg) -> str:
    """'dp2 z3 tp1 pp1 mb2 ga4': the layout in one word per degree."""
    return (f"dp{cfg.dp} z{cfg.zero} tp{cfg.tp} pp{cfg.pp} cp{cfg.cp} mb{cfg.micro_batch} "
            f"ga{cfg.grad_accum}")


def check_args(args) -> None:
    for name in ("seq_len", "steps", "micro_batch", "grad_accum", "log_every", "eval_batches"):
        if getattr(args, name) < 1:
            raise TrainplanError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    if args.eval_every < 0:
        raise TrainplanError(f"--eval-every = {args.eval_every} must be >= 0 (0 = off)")
    if not args.eval_every and args.eval_batches != EVAL_BATCHES:
        raise TrainplanError(f"--eval-batches {args.eval_batches} needs --eval-every N (a "
                             "held-out loss every N steps); without it nothing is evaluated")
    if args.lr_schedule == "constant" and args.lr_floor != LR_FLOOR:
        raise TrainplanError(f"--lr-floor {args.lr_floor} is where a decay ends; with "
                             "--lr-schedule constant leave it out, or use cosine or linear")
    if args.seed < 0:
        raise TrainplanError(f"--seed = {args.seed} must be >= 0")
    if not (math.isfinite(args.max_norm) and args.max_norm >= 0):
        raise TrainplanError(f"--max-norm = {args.max_norm} must be a finite number >= 0 "
                             "(0: no clipping)")
    if args.export and not args.ckpt_dir:
        raise TrainplanError(f"--export {args.export} needs --ckpt-dir: the export is made "
                             "from the final checkpoint")
    if args.export and os.path.lexists(args.export):
        raise TrainplanError(f"--export {args.export} exists; name a new folder")
    for flag, folder in (("--log-dir", args.log_dir), ("--export", args.export)):
        if folder:  # where it can be made (a long name, a file in the way): before training
            ckpt.check_root(Path(folder), flag=flag)
    paths.check_outputs(args, [folder for folder, _ in batches_mod.parse_mixture(args.data)])
    loss_mod.check(args)  # --loss fused: one process, DDP, FSDP2 (not tp, pp, cp)
    context.check_device(args.cp, "cpu" if args.cpu else None)  # None: may be for a GPU host
    float8.check(args, args.cpu)  # fp8: a GPU of compute capability >= 8.9, else one line
    optim.check(lr=args.lr, warmup=args.lr_warmup, total=args.steps, schedule=args.lr_schedule,
                floor=args.lr_floor, weight_decay=args.weight_decay)
    ckpt.check_args(args)
    monitor.check_args(args)
    host.check_args(args)


def rates(step_s: list[float], tokens_per_step: int, world: int) -> dict:
    """`step_time_s`: the median of this rank's step times (s) after the first (compile,
    warm-up); `tokens_per_s_per_gpu` from it; both None where fewer than two steps ran."""
    if len(step_s) < 2:
        return {"step_time_s": None, "tokens_per_s_per_gpu": None}
    median = statistics.median(step_s[1:])
    return {"step_time_s": median, "tokens_per_s_per_gpu": tokens_per_step / median / world}


def evaluate(par, groups, *, autocast: bool, loss_fn) -> tuple[float, int]:
    """Mean next-token loss over the held-out micro-batches of every rank, and their tokens."""
    device = groups[0][0][0].device if groups else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss x tokens, tokens
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast \
        else contextlib.nullcontext()
    with torch.no_grad(), amp:
        for group in groups:
            if par.schedule is None:
                for x, y in group:  # with cp: this rank's share, restored after (reused)
                    with context.shard_sequences(par, x, y, restore=True):
                        total += torch.stack([loss_fn(par.parts[0](x), y).double() * y.numel(),
                                              torch.tensor(float(y.numel()), device=device)])
            else:
                x = torch.cat([b[0] for b in group])
                y = torch.cat([b[1] for b in group])
                losses: list[torch.Tensor] = []
                kwargs = {"target": y, "losses": losses} if par.is_last else {}
                with context.shard_sequences(par, x, y):
                    par.schedule.eval(*((x,) if par.is_first else ()), **kwargs)
                if par.is_last:  # y is this rank's share under cp
                    per = y.numel() / len(losses)
                    total += torch.tensor([sum(float(v) for v in losses) * per, float(y.numel())],
                                          dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item() if total[1] else float("nan"), int(total[1].item())


def eval_groups(args, cfg, spec, dp_rank, dp, device) -> list:
    """Held-out micro-batches on the device, in groups of grad_accum for a pipeline."""
    if not args.eval_every:
        return []
    first = batches_mod.parse_mixture(args.data)[0][0]
    micro = batches_mod.eval_batches(first, seq_len=args.seq_len, micro_batch=cfg.micro_batch,
                                     batches=args.eval_batches, dp_rank=dp_rank, dp=dp,
                                     vocab_size=spec.vocab)
    size = cfg.grad_accum if cfg.pp > 1 else 1
    groups = [micro[i:i + size] for i in range(0, len(micro) - size + 1, size)]
    if not groups:
        raise TrainplanError(f"--eval-every {args.eval_every}: the held-out split of {first} "
                             f"has too few sequences of {args.seq_len} for {dp} ranks; prepare "
                             "with a larger --val-fraction or turn evaluation off")
    return [feed.to_device(g, device, non_blocking=False) for g in groups]


def run(args) -> dict:
    check_args(args)
    spec = load_model(args.model)
    check_positions(spec, args.seq_len)
    cfg = harness.layout(args)
    device = harness.init_distributed(args.cpu, ckpt.timeout(args))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    par_mod.check_layout(cfg, spec, world, seq_len=args.seq_len, device_type=device.type)
    mesh = par_mod.build_mesh(cfg, device.type)
    dp_rank, dp = par_mod.dp_coordinates(cfg, mesh)
    source = batches_mod.ShardBatches(
        batches_mod.parse_mixture(args.data), split="train", seq_len=args.seq_len,
        micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, dp_rank=dp_rank, dp=dp,
        seed=args.seed, vocab_size=spec.vocab, tokenizer=args.tokenizer)
    held_out = eval_groups(args, cfg, spec, dp_rank, dp, device)
    par, loss_fn = harness.build(spec, cfg, args, device, mesh)
    if args.init_from:
        from trainplan.train import export  # safetensors: only when loading weights

        export.load_into_parts(par.parts, spec, args.init_from)
    optimizer = optim.make_optimizer(par.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                     fused=device.type == "cuda")
    scheduler = optim.make_scheduler(optimizer, warmup=args.lr_warmup, total=args.steps,
                                     schedule=args.lr_schedule, floor=args.lr_floor)
    saver = ckpt.Checkpointer(args, par, optimizer, rank=rank, world=world, device=device,
                              stateful={"data": source, "lr_schedule": scheduler},
                              total_steps=args.steps)
    start = saver.resume()
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # the checkpoint holds Adam's moments, the schedule its step
    from trainplan.cost.compute import model_flops_per_token  # pandas: not at process start

    tokens_per_step = cfg.dp * cfg.grad_accum * cfg.micro_batch * args.seq_len
    log = logs.RunLog(args.log_dir, total_steps=args.steps, tokens_per_step=tokens_per_step,
                      world=world, flops_per_token=model_flops_per_token(spec, args.seq_len),
                      peak_flops=harness.peak_flops(device), every=args.log_every,
                      enabled=rank == 0, progress=not args.no_progress)
    mon = monitor.Monitor(args, tokens_per_step=tokens_per_step,
                          flops_per_token=model_flops_per_token(spec, args.seq_len),
                          peak=harness.peak_flops(device), device=device, rank=rank, world=world)
    autocast = device.type == "cuda" and not par.fsdp
    losses, evals, step_s, done = [], [], [], start
    log.start(start)
    with host.watch(args) as gcw:  # --gc: young collections at step starts, on every rank
        for step in range(start, args.steps):
            saver.before_step(step + 1)
            harness.sync(device)
            t0 = time.perf_counter()
            gcw.boundary(step)
            micro = feed.to_device(source.next_step(), device, non_blocking=False)
            lr = scheduler.get_last_lr()[0]
            total = step_mod.train_step(par, optimizer, micro, autocast=autocast,
                                        reshard=cfg.zero == 3, max_norm=args.max_norm,
                                        loss_fn=loss_fn)
            scheduler.step()
            harness.sync(device)
            step_s.append(time.perf_counter() - t0)
            gcw.end_step()
            mon.step(step + 1, step_s[-1])  # every rank: one small all_gather
            loss, norm = step_mod.reduce_loss(total)
            losses.append(loss)
            done = step + 1
            log.step(done, loss, lr, norm)
            if args.eval_every and (done % args.eval_every == 0 or done == args.steps):
                ev, n_tok = evaluate(par, held_out, autocast=autocast, loss_fn=loss_fn)
                evals.append({"step": done, "eval_loss": ev})
                log.evaluation(done, ev, n_tok)
            if saver.after_step(done):  # SIGTERM: emergency checkpoint taken, stop
                break
    summary = {"model": spec.name, "steps": args.steps, "first_step": start + 1, "last_step": done,
               "losses": losses, "evals": evals, "tokens_per_step": tokens_per_step,
               **rates(step_s, tokens_per_step, world), "seq_len": args.seq_len,
               "seed": args.seed,
               "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "lr": {"peak": args.lr, "schedule": args.lr_schedule, "warmup": args.lr_warmup,
                      "floor": args.lr_floor},
               "layout": layout_name(cfg), **float8.layout_fields(args),
               **loss_mod.layout_fields(args),
               "checkpoint": saver.finish(done),
               "monitor": mon.finish(),
               "gc": gcw.summary(lambda v: harness.over_ranks(v, device), 0),
               "preempted": done < args.steps}
    log.close()
    if dist.is_initialized():
        dist.barrier()
    if args.export and not summary["preempted"] and rank == 0:
        from trainplan.train import export

        export.export_checkpoint(Path(args.ckpt_dir), spec, Path(args.export),
                                 max_positions=args.seq_len)
        summary["export"] = args.export
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    summary = None
    try:
        summary = run(args)
        failed = ckpt.final_failure(summary)  # the last steps are not on disk: exit 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            if args.json:
                print(json.dumps(summary))
            if failed:  # not `error: `, a refusal's (`proctree.own_error`)
                print(f"failed: {failed}", file=sys.stderr)
    except TrainplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 1 if failed else 143 if summary["preempted"] else 0  # 143: SIGTERM, resume me
