"""The optimizer and learning-rate schedule of a training run.

AdamW (Loshchilov & Hutter 2019) with two parameter groups: weight decay on the matrices,
none on norms, biases and other one-dimensional parameters (the GPT-2/Llama practice;
embedding tables are matrices and decay). The learning rate rises linearly from zero over
`warmup` steps, then falls to `floor` x the peak by the last step, along a half cosine
(Loshchilov & Hutter 2017) or a straight line; `constant` keeps the peak after warm-up.
"""

from __future__ import annotations

import math

import torch

from trainplan.bench.harness.train import LR_RANGE
from trainplan.errors import SpecError
from trainplan.train.flags import SCHEDULES


def param_groups(params, weight_decay: float) -> list[dict]:
    """[{matrices, weight_decay}, {the rest, 0.0}] of the trainable parameters, in order;
    a group left empty is left out."""
    decay, no_decay = [], []
    for p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(params, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                   fused: bool = False) -> torch.optim.AdamW:
    """AdamW over `param_groups`; fused kernels where the parameters live on a GPU."""
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(param_groups(params, weight_decay), lr=lr, betas=betas, **extra)


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, floor: float) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return floor + (1.0 - floor) * shape


def check(*, lr: float, warmup: int, total: int, schedule: str, floor: float,
          weight_decay: float) -> None:
    """One line naming the first setting that is not valid."""
    if not LR_RANGE[0] <= lr <= LR_RANGE[1]:  # nan too
        raise SpecError(f"--lr = {lr} is not valid; use a learning rate in "
                        f"[{LR_RANGE[0]:g}, {LR_RANGE[1]:g}], e.g. 3e-4")
    if schedule not in SCHEDULES:
        raise SpecError(f"--lr-schedule {schedule!r} is not valid; use one of {SCHEDULES}")
    if not 0 <= warmup < total:
        raise SpecError(f"--lr-warmup = {warmup} is not valid; use 0 .. {total - 1} "
                        f"(fewer than --steps = {total})")
    if not 0.0 <= floor <= 1.0:
        raise SpecError(f"--lr-floor = {floor} is not valid; use a fraction of the peak in [0, 1]")
    if not (0.0 <= weight_decay < 1.0):
        raise SpecError(f"--weight-decay = {weight_decay} is not valid; use [0, 1), e.g. 0.1")


def make_scheduler(optimizer, *, warmup: int, total: int, schedule: str, floor: float):
    """A LambdaLR of `lr_factor`; its state (the step count) goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=warmup, total=total, schedule=schedule,
                                       floor=floor))
