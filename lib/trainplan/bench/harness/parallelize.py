"""Apply a `ParallelConfig` to the plain proxy model, in torchtitan's fixed order.

    0. pipeline split  (pp > 1): the model is cut into pp * pp_virtual stages
                       and this rank keeps its own; steps 1-4 run per stage
    1. tensor parallel (tp > 1): DTensor `parallelize_module`, Megatron-style
                       column/row splits, sequence parallel on norms/residual
    2. activation checkpointing: none / selective (op-level) / full (per block)
    3. torch.compile   per block; on one GPU with no wrapper, the whole model
    4. data parallel   DDP (zero 0), FSDP2 `fully_shard` per block then root
                       (zero 3: reshard after forward; zero 1-2: keep the
                       gathered weights until backward), HSDP when dp_shard
                       < dp; with cp > 1 over dp_shard x cp (context.py: a
                       replica's cp ranks hold the same weights)

Why this order: tensor parallel must see plain `nn.Linear` modules by name before wrappers
rename them; checkpointing wraps the (possibly TP) block so its recompute replays the TP
collectives; compile sees the checkpointed block and can fuse the recompute; FSDP goes
last so its all-gather/reduce-scatter hooks sit outside the compiled region, whole blocks.

Not implemented (a `LayoutError` says so): expert parallel, context parallel on CPU or with
learned positions, tied embeddings under pp or tp, learned positions under tp. ZeRO-1 has no
FSDP2 form: it runs as ZeRO-2, and says so. fp8 (float8.py) swaps the linears before step 0.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from trainplan.bench.harness import context
from trainplan.bench.harness.loss import LinearCrossEntropy
from trainplan.bench.harness.model import Transformer
from trainplan.errors import LayoutError
from trainplan.specs import ModelSpec, ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class Parallelized:
    """What a rank trains: its model part(s), and the pipeline schedule if any."""

    parts: list[nn.Module]  # the whole model, or this rank's pipeline stages
    schedule: object | None = None  # torch.distributed.pipelining schedule (pp > 1)
    is_first: bool = True  # holds the first pipeline stage (feeds input ids)
    is_last: bool = True  # holds the last pipeline stage (computes the loss)
    fsdp: bool = False  # parameters are managed by FSDP2 (mixed precision there)
    ddp: bool = False
    pp_group: object | None = None  # process group of this rank's pipeline (pp > 1)
    cp_mesh: object | None = None  # 1-D mesh of this rank's context-parallel group (cp > 1)
    after_optimizer: object | None = None  # called after each optimizer step (fp8's scales)
    notes: list[str] = field(default_factory=list)

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()


# ---------------------------------------------------------------- checks and mesh


def check_layout(cfg: ParallelConfig, spec: ModelSpec, world: int, *,
                 seq_len: int | None = None, device_type: str | None = None) -> None:
    """Raise LayoutError for a layout the harness cannot run, naming the value and the fix;
    `seq_len` and `device_type` add context parallel's checks where the caller knows them."""
    if cfg.cp > 1:
        context.check_cp(cfg, spec, seq_len=seq_len, device_type=device_type)
    if cfg.ep > 1:
        raise LayoutError(f"ep = {cfg.ep}: ep > 1 is not implemented in the harness yet; use ep 1")
    if cfg.world != world:
        raise LayoutError(f"layout needs dp * tp * pp * cp = {cfg.world} ranks but {world} "
                          f"were started; launch with --nproc-per-node {cfg.world} (or change "
                          "the degrees)")
    if cfg.tp > 1:
        for name, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads),
                            ("ffn", spec.ffn), ("vocab", spec.vocab)):
            if value % cfg.tp:
                raise LayoutError(f"tp = {cfg.tp} does not divide {name} = {value} of "
                                  f"{spec.name!r}; use a tp that divides it")
        if spec.positions == "learned" or spec.tied_embeddings:
            raise LayoutError(f"tp = {cfg.tp} with {spec.name!r}: tensor parallel supports "
                              "rotary positions and untied embeddings only; use tp 1")
    stages = cfg.pp * cfg.pp_virtual
    if cfg.pp > 1:
        if stages > spec.n_layers:
            raise LayoutError(f"pp * pp_virtual = {stages} stages but {spec.name!r} has only "
                              f"{spec.n_layers} layers; use at most {spec.n_layers} stages")
        if spec.tied_embeddings:
            raise LayoutError(f"pp = {cfg.pp} with tied embeddings ({spec.name!r}) is not "
                              "supported; use pp 1")
        if cfg.grad_accum < cfg.pp:
            raise LayoutError(f"grad_accum = {cfg.grad_accum} pipeline micro-batches is fewer "
                              f"than pp = {cfg.pp} stages; use grad_accum >= {cfg.pp}")
        if cfg.pp_schedule == "interleaved" and cfg.grad_accum % cfg.pp:
            raise LayoutError(f"interleaved schedule needs grad_accum (= {cfg.grad_accum}) to "
                              f"be a multiple of pp = {cfg.pp}")


def build_mesh(cfg: ParallelConfig, device_type: str, fresh: bool = False):
    """A 5-D DeviceMesh (pp, dp_replicate, dp_shard, cp, tp), every dimension kept so steps
    slice it by name; None on a single rank. Ranks run tp fastest (inside a node, on NVLink),
    then the context-parallel ring, the FSDP shard group, replicas, pipeline stages
    (torchtitan's order); with cp > 1 also dp_shard_cp, the dp_shard x cp FSDP2 shards over.
    `fresh`: each dimension of > 1 rank a process group made now, not the launch's default
    one, so NCCL reads the NCCL_* environment of this moment (a sweep's run sets its own)."""
    if cfg.world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (cfg.pp, cfg.dp // cfg.dp_shard if cfg.zero else cfg.dp,
             cfg.dp_shard if cfg.zero else 1, cfg.cp, cfg.tp)
    new = {n: dist.get_backend() for n, k in zip(MESH_DIMS, shape, strict=True) if k > 1}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS,
                            backend_override=new if fresh else None)
    if cfg.cp > 1:
        context.flatten_shard_cp(mesh)
    return mesh


def dp_coordinates(cfg: ParallelConfig, mesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this rank: which share of the batch it reads;
    the tp, pp and cp ranks of one replica read the same (a cp rank keeps its share)."""
    if mesh is None:
        return 0, 1
    rank = mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size()
    return rank + mesh["dp_shard"].get_local_rank(), cfg.dp


# ---------------------------------------------------------------- 0. pipeline split


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Block indices of each stage: contiguous, as even as possible, extras to early stages
    (the last stage also runs the output layer and loss: it should not be slowest twice)."""
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        bounds.append(list(range(start, start + size)))
        start += size
    return bounds


def split_stage(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """A copy of `model` that keeps only stage `stage`'s blocks (and ends, if first or last)."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in stage_layers(len(model.layers), n_stages)[stage]}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage > 0:
        part.tok_embeddings, part.pos_embeddings = None, None
    if stage < n_stages - 1:
        part.norm, part.output = None, None
    return part


# ---------------------------------------------------------------- 1. tensor parallel


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool) -> None:
    """Megatron column/row splits of every block, vocab-split embedding and output.

    With sequence parallel the residual stream between blocks is sharded along
    the sequence (Shard(1)); norms run on the shard; each block all-gathers
    its input and reduce-scatters its output. Without it the stream is
    replicated and each block all-reduces. Head counts need no patching: the
    attention reads them from the local projection widths.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                      output_layouts=stream)
    if model.output is not None:
        if sequence_parallel:
            root_plan["norm"] = SequenceParallel()
        root_plan["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)


# ---------------------------------------------------------------- 2. activation checkpointing

_SAVE_OPS = (  # outputs selective recompute keeps: matmuls, attention, TP collectives
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default",
)


def save_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if str(op) in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Transformer, mode: str) -> None:
    """Wrap every block in activation checkpointing.

    full: keep only each block's input and rerun its forward in backward
    (one extra forward, about 2 N FLOPs per token). selective: op-level
    selective checkpointing; keep matmul, attention and collective outputs and
    recompute only the cheap element-wise ops (norms, RoPE, SwiGLU), which
    frees their activations at almost no compute cost.
    """
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, save_policy)
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, **kwargs)


# ---------------------------------------------------------------- 3. compile


class _WaitAsync(torch.autograd.Function):
    """Wait for an in-flight collective's result; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x):
        out = x.trigger_wait()  # the plain tensor the collective wrote
        return out.view_as(out)  # a fresh object: autograd writes its history into it

    @staticmethod
    def backward(ctx, grad):
        return grad


def _resolve_async(module, inputs, output):
    """Forward hook: hand an AsyncCollectiveTensor output on as a plain tensor, waited for.

    Under tensor parallel the embedding's output hook redistributes with
    async_op=True and `to_local()`s the result, so the first block receives an
    AsyncCollectiveTensor (ACT) whose autograd history sits on the wrapper
    while its inner tensor has none. AOTAutograd (torch >= 2.12, pytorch PR
    179849) resolves ACT inputs with `trigger_wait()` before tracing, which
    returns that inner tensor: the compiled block is traced as if its input
    needed no gradient and returns none for it. The embedding then gets no
    gradient, and DTensor's redistribute backward, handed a materialised
    plain-tensor zero, fails with "'Tensor' object has no attribute
    '_local_tensor'". Waiting here, in eager code and through autograd, gives
    the compiled block a plain input that requires grad.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor):
        return _WaitAsync.apply(output)
    return output


def apply_compile(model: Transformer, whole: bool = False) -> None:
    """Compile each block in place (parameter names unchanged); `whole`: the model, one graph.

    Per block where a wrapper needs block boundaries: identical blocks reuse one compiled
    graph (short compile), and FSDP's per-block hooks stay outside the compiled code; on one
    GPU nothing does, and Inductor fuses across blocks. What enters the first block from
    eager code must be a plain tensor (or DTensor), not an in-flight collective: see
    `_resolve_async`, which runs after tensor parallel's own output hook on the embedding
    (hooks run in the order registered).
    """
    if whole:
        return model.compile(fullgraph=True)
    embed = getattr(model, "tok_embeddings", None)  # a microbenchmark's block net has none
    if embed is not None:
        embed.register_forward_hook(_resolve_async)
    for block in model.layers.values():
        block.compile(fullgraph=True)


# ---------------------------------------------------------------- 4. data parallel


def apply_fsdp(model: nn.Module, mesh, *, reshard: bool, mixed_precision: bool) -> None:
    """FSDP2 per block, then the root (embeddings, final norm, output) as one group; the fused
    loss's untied `output`, called after the forward, is a group of its own (its own hooks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision else MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    out = getattr(model, "output", None)
    if isinstance(out, LinearCrossEntropy) and out.weight is not model.tok_embeddings.weight:
        fully_shard(out, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)


def parallelize(model: Transformer, cfg: ParallelConfig, mesh, *, compile: bool = False,
                device: torch.device | None = None, mixed_precision: bool = False,
                loss_fn=None) -> Parallelized:
    """Turn one plain model into what this rank trains under layout `cfg`.

    `model` is the whole model (on the meta device or materialised); with pp > 1 it is split
    and only this rank's stages are kept. `loss_fn(logits, labels)` is needed for pp > 1 (the
    last stage computes the loss). `mixed_precision`: bf16 parameters with fp32 gradient
    reduction inside FSDP2; the caller autocasts where FSDP is not used."""
    device = device or torch.device("cpu")
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_layout(cfg, model.spec, world)
    out = Parallelized(parts=[model])
    if cfg.zero == 1 and cfg.dp > 1:
        out.notes.append("zero 1 runs as FSDP2 without resharding (= ZeRO-2: grads sharded too)")

    single = model.autocast_stream = world == 1  # no wrapper: one graph, a bf16 stream
    stage_ids = [0]
    n_stages = cfg.pp * cfg.pp_virtual
    if cfg.pp > 1:  # 0. loop placement: rank r holds stages r, r + pp, ...
        pp_rank = mesh["pp"].get_local_rank()
        stage_ids = [pp_rank + k * cfg.pp for k in range(cfg.pp_virtual)]
        out.parts = [split_stage(model, s, n_stages) for s in stage_ids]
        out.is_first, out.is_last = 0 in stage_ids, n_stages - 1 in stage_ids
        out.pp_group = mesh["pp"].get_group()

    # Zero 0 beside tp or pp runs as FSDP2 with a shard group of one on the replicate
    # dimension (DDP's all-reduce, composing with DTensor); with cp > 1 FSDP2 spans dp_shard x cp.
    use_fsdp = cfg.cp > 1 or (cfg.dp > 1 and (cfg.zero > 0 or cfg.tp > 1 or cfg.pp > 1))
    use_ddp = cfg.dp > 1 and not use_fsdp  # then tp = pp = cp = 1: one part, the whole model
    if cfg.cp > 1:
        out.cp_mesh = mesh["cp"]
        if cfg.zero == 0:
            out.notes.append("zero 0 with cp > 1 runs as FSDP2 without resharding over cp")
    for i, part in enumerate(out.parts):
        if cfg.tp > 1:  # 1.
            apply_tp(part, mesh["tp"], cfg.sequence_parallel)
        apply_ac(part, cfg.recompute)  # 2.
        if compile:  # 3.
            apply_compile(part, whole=single)
        if use_fsdp:  # 4.
            apply_fsdp(part, context.fsdp_mesh(mesh, cfg), reshard=cfg.zero == 3,
                       mixed_precision=mixed_precision)
        elif use_ddp:
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            out.parts[i] = DistributedDataParallel(part, device_ids=ids)
    out.fsdp, out.ddp = use_fsdp, use_ddp
    if cfg.pp > 1:
        out.schedule = _pipeline_schedule(out.parts, stage_ids, n_stages, cfg, mesh, device,
                                          loss_fn)
    return out


def _pipeline_schedule(parts, stage_ids, n_stages, cfg, mesh, device, loss_fn):
    from torch.distributed import pipelining as pl

    group = mesh["pp"].get_group()
    stages = [pl.PipelineStage(part, s, n_stages, device, group=group)
              for part, s in zip(parts, stage_ids, strict=True)]
    if cfg.pp_schedule == "interleaved":
        return pl.ScheduleInterleaved1F1B(stages, n_microbatches=cfg.grad_accum, loss_fn=loss_fn)
    cls = pl.Schedule1F1B if cfg.pp_schedule == "1f1b" else pl.ScheduleGPipe
    return cls(stages[0], n_microbatches=cfg.grad_accum, loss_fn=loss_fn)
