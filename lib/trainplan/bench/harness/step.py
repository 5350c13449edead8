"""One optimizer step: forward, backward over the micro-batches, update; and the step's loss.

Kept apart from the loop so that timing, progress and records (train.py)
stay out of the arithmetic, and so tests can drive a step directly.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainplan.bench.harness import context
from trainplan.bench.harness.feed import Batch
from trainplan.bench.harness.parallelize import Parallelized

# Bumped when the harness changes what it measures for some layout at the same prediction;
# each measurement record carries it, and `compare` starts a new series of a config at a new
# revision. 2: Partial gradients made whole once a step (`reduce_partial_grads`); 3: the
# clipping norm on local shards (`clip_grad_norm`).
HARNESS_REVISION = 3


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over (B, S) positions; logits upcast to fp32 for a stable softmax."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _sync_context(par: Parallelized, model, sync: bool, reshard: bool):
    """Skip the gradient collective on all but the last micro-batch where that is cheaper.

    DDP: no_sync. FSDP2 without resharding (ZeRO-1/2): defer the
    reduce-scatter to the last micro-batch. FSDP2 with resharding (ZeRO-3)
    reduce-scatters every micro-batch, so that unsharded gradients are never
    held for the whole model.
    """
    if par.ddp and not sync:
        return model.no_sync()
    if par.fsdp and not reshard:
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def train_step(par: Parallelized, optimizer, micro: list[Batch], *, autocast: bool,
               reshard: bool, max_norm: float = 1.0, loss_fn=cross_entropy) -> torch.Tensor:
    """Run one optimizer step on this rank; return (loss sum, count, grad norm).

    The loss sum and count are to be added over ranks (`reduce_loss`); the
    gradient norm is already global. `loss_fn` must be the one the pipeline
    schedule was built with, if there is one.

    Without a pipeline, each micro-batch's loss is divided by their number so
    the accumulated gradient is that of the mean loss. With one, the schedule
    splits the concatenated batch into the same micro-batches and scales the
    gradients itself (`scale_grads`); only the last stage sees the loss.

    With context parallel (par.cp_mesh) each forward and backward runs on this
    rank's share of the sequences (`context.shard_sequences`; the batches are
    sharded in place), so the loss is the mean over that share; the shares are
    equal, so the mean over ranks of these (`reduce_loss`, and FSDP2's gradient
    average over dp_shard x cp) is the mean over every token.
    """
    device_type = micro[0][0].device.type
    amp = torch.autocast(device_type, dtype=torch.bfloat16) if autocast \
        else contextlib.nullcontext()
    total = torch.zeros(3, device=micro[0][0].device)  # (loss sum, count, grad norm)
    if par.schedule is None:
        model = par.parts[0]
        for i, (x, y) in enumerate(micro):
            with _sync_context(par, model, i == len(micro) - 1, reshard), \
                    context.shard_sequences(par, x, y):
                with amp:
                    loss = loss_fn(model(x), y)
                (loss / len(micro)).backward()
            total[0] += loss.detach()
        total[1] += len(micro)
    else:
        x = torch.cat([b[0] for b in micro])  # (grad_accum * mb, S): split again by the schedule
        y = torch.cat([b[1] for b in micro])
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if par.is_last else {}
        if "return_outputs" in inspect.signature(par.schedule.step).parameters:
            # older torch lacks it; without it the last stage keeps every micro-batch's logits
            kwargs["return_outputs"] = False
        args = (x,) if par.is_first else ()
        with context.shard_sequences(par, x, y), amp:
            par.schedule.step(*args, **kwargs)
        if par.is_last:
            total[0] += torch.stack([loss.detach().float() for loss in losses]).sum()
            total[1] += len(losses)
    reduce_partial_grads(par.parameters())
    total[2] = clip_grad_norm(par, max_norm)
    optimizer.step()
    if par.after_optimizer is not None:  # fp8: the next step's weight scales
        par.after_optimizer()
    optimizer.zero_grad(set_to_none=True)
    return total


def reduce_partial_grads(params) -> None:
    """Make whole every DTensor gradient the backward left Partial, one all-reduce per group
    (mesh, placements, dtype) through a flat buffer.

    Under tensor parallel with sequence parallel the replicated weights (the norms) get
    Partial(sum) gradients: each rank holds its sequence shard's share. Left Partial, the
    clipping norm and every optimizer op on them would reduce them again, one small
    all-reduce per weight per op: about 150 a step for the 1.3B proxy on TP 2, each with its
    host dispatch, enough to make steps wait on the host
    (data/measurements/tp-noise-h200x2-20261129/). FSDP2 reduces such gradients itself.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((g.device_mesh, tuple(g.placements), g.dtype), []).append(p)
    with torch.no_grad():  # no autograd Function per gradient in to_local / from_local
        for key, ps in groups.items():
            _reduce_group(key, ps)


def _reduce_group(key: tuple, ps: list) -> None:
    """One group of `reduce_partial_grads`: its gradients flattened, all-reduced over each
    Partial mesh dimension, set back as views of the result with Replicate there."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements, _ = key
    local = [p.grad.to_local() for p in ps]
    flat = torch.cat([t.reshape(-1) for t in local])
    for dim, pl in enumerate(placements):
        if pl.is_partial():
            group = mesh.get_group(dim)
            dist.all_reduce(flat, group=group)  # Partial(sum); avg divides after
            if pl.reduce_op == "avg":
                flat /= dist.get_world_size(group)
            elif pl.reduce_op != "sum":
                raise ValueError(f"a Partial({pl.reduce_op}) gradient: only sum and avg "
                                 "are reduced here")
    whole = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
    offset = 0
    for p, t in zip(ps, local, strict=True):
        view = flat[offset:offset + t.numel()].view_as(t)
        p.grad = DTensor.from_local(view, mesh, whole, run_check=False,
                                    shape=p.grad.shape, stride=p.grad.stride())
        offset += t.numel()


def clip_grad_norm(par: Parallelized, max_norm: float) -> torch.Tensor:
    """Global gradient 2-norm over every rank's parameters; clip to `max_norm` if it is > 0.

    Computed on each rank's local shards, with no DTensor dispatch per gradient (host time
    that host-bound steps pay): the squared norm of the gradients sharded over the same
    process groups (mesh dimensions of more than one rank) is summed over those groups (each
    element lives on one rank of them; replicated elements count once), and pipeline stages
    add theirs. The gradients
    must be whole (`reduce_partial_grads` first). The norm is also a check: a layout that
    scaled gradients wrongly would still match the single process's loss under Adam, not
    its gradient norm.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}  # process groups a gradient is sharded over (() if none) -> local grads
    with torch.no_grad():
        for p in par.parameters():
            g = p.grad
            if g is None:
                continue
            if not isinstance(g, DTensor):
                groups.setdefault((), []).append(g)
                continue
            if any(pl.is_partial() for pl in g.placements):
                raise ValueError("clip_grad_norm needs whole gradients: a Partial one is left "
                                 "(reduce_partial_grads runs first)")
            # the process groups it is sharded over: Shard and FSDP2's _StridedShard (whose
            # is_shard() is False), on mesh dimensions of more than one rank
            mesh = g.device_mesh
            over = tuple(mesh.get_group(i) for i, pl in enumerate(g.placements)
                         if not pl.is_replicate() and mesh.size(i) > 1)
            groups.setdefault(over, []).append(g.to_local())
        device = next((grads[0].device for grads in groups.values()), torch.device("cpu"))
        squared = torch.zeros((), dtype=torch.float32, device=device)
        for over, grads in groups.items():  # one all-reduce per process group a key spans
            square = torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2
            for group in over:
                dist.all_reduce(square, group=group)
            squared += square
        if par.pp_group is not None:
            dist.all_reduce(squared, group=par.pp_group)
        norm = squared.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grads_with_norm_
            torch._foreach_mul_([g for grads in groups.values() for g in grads], coef)
    return norm


def reduce_loss(total: torch.Tensor) -> tuple[float, float]:
    """(mean loss over every rank that computed one, gradient norm) of one step.

    Losses come from all ranks, or only from the last pipeline stage's.
    """
    sums = total[:2].clone()
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item(), total[2].item()


def loss_function(compile: bool):
    """The loss; compiled with the blocks, so the fp32 upcast of the (B, S, V)
    logits, the softmax and its gradient fuse instead of round-tripping HBM."""
    return torch.compile(cross_entropy) if compile else cross_entropy
