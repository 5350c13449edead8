"""The control: Hugging Face `LlamaForCausalLM` trained by our own loop, configured at its best.

Beside transformers' own Trainer (`hf_trainer`, the stack a team would otherwise
run), this baseline tells the model code apart: it gets everything a careful user
could write by hand around transformers' model, and nothing of ours that they
could not have:

- the same model, built from the same `ModelSpec` (hidden, layers, heads, key/
  value heads, FFN, vocabulary, the spec's RoPE base and RMSNorm eps, untied;
  `specs.hf.hf_config` is the config):
  exactly `trainplan.cost.params.total_params` parameters, like ours;
- `use_cache=False` (with the cache on, per-layer compile recompiles until it
  gives up) and `attn_implementation="sdpa"`;
- the same layout code: `parallelize.apply_compile` (per decoder layer,
  fullgraph) and `parallelize.apply_fsdp` (FSDP2 per decoder layer then the
  root, bf16 parameters with fp32 reduction, ZeRO-2 or ZeRO-3), DDP with
  autocast for zero 0, the same activation checkpointing;
- the same loop, data, loss, optimizer (fused AdamW), timing and records:
  train.py runs it; only `build` differs and the record says
  `impl: "hf-baseline"`.

The loss is ours (`step.cross_entropy` on the logits, compiled with --compile
as for our model), not HF's `labels=`: our loader's labels are already the
next tokens, and HF would shift them once more.

One loop: `python -m trainplan.bench.harness.train --impl hf-baseline` builds the model
with `build` below (same signature as train.build).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from trainplan.bench.harness import parallelize as par_mod
from trainplan.bench.harness.model import count_params, init_normal
from trainplan.bench.harness.step import loss_function
from trainplan.errors import LayoutError, SpecError
from trainplan.specs import ModelSpec, ParallelConfig
from trainplan.specs import hf as hf_spec

IMPL = "hf-baseline"


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise SpecError("--impl hf-baseline needs the package 'transformers' "
                        "(pip install transformers); or use --impl trainplan") from None
    return transformers


def check(spec: ModelSpec, cfg: ParallelConfig) -> None:
    """Refuse what LlamaForCausalLM or this baseline cannot run, naming the value."""
    for field, want in (("mlp", "swiglu"), ("positions", "rope"), ("norm", "rmsnorm")):
        if getattr(spec, field) != want:
            raise SpecError(f"--impl hf-baseline: model {spec.name!r} has {field} = "
                            f"{getattr(spec, field)!r}; LlamaForCausalLM needs {want!r} "
                            "(use --impl trainplan)")
    if spec.tied_embeddings or spec.is_moe:
        raise SpecError(f"--impl hf-baseline: model {spec.name!r} is tied or MoE; the baseline "
                        "is an untied dense Llama (use --impl trainplan)")
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(cfg, name) > 1:
            raise LayoutError(f"--impl hf-baseline with {name} = {getattr(cfg, name)}: the "
                              "baseline runs data-parallel layouts only (1 GPU, DDP, FSDP2 "
                              f"ZeRO-1/2/3, HSDP); use {name} 1 or --impl trainplan")


def hf_config(spec: ModelSpec, seq_len: int):
    """The `LlamaConfig` of `spec`: the same function as `model.Transformer` computes
    (`specs.hf.hf_config`), without the KV cache and with SDPA attention."""
    tf = require_transformers()
    fields = {k: v for k, v in hf_spec.hf_config(spec, seq_len).items()
              if k not in ("architectures", "model_type", "dtype", "rope_theta")}
    return tf.LlamaConfig(**dict(fields, use_cache=False, attn_implementation="sdpa"))


class HFCausalLM(nn.Module):
    """LlamaForCausalLM seen as our model is: token ids (B, S) in, logits (B, S, V) out.

    `layers` maps "0", "1", ... to the decoder layers, as `Transformer.layers`
    does to our blocks, so `parallelize.apply_compile` and `apply_fsdp` treat
    both models with the same calls.
    """

    def __init__(self, spec: ModelSpec, seq_len: int):
        super().__init__()
        self.spec = spec
        self.hf = require_transformers().LlamaForCausalLM(hf_config(spec, seq_len))

    @property
    def layers(self) -> dict[str, nn.Module]:
        return {str(i): layer for i, layer in enumerate(self.hf.model.layers)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, V)
        return self.hf(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Our initialisation (model.Transformer.init_weights) under HF's names.

        Also after a meta-device build has been materialised by `to_empty`
        (parameters possibly sharded DTensors), where the rotary inverse
        frequencies are garbage and must be recomputed.
        """
        init_like_ours(self, self.spec)
        rotary = self.hf.model.rotary_emb
        hd = self.spec.head_dim
        device = buffer_device or rotary.inv_freq.device
        theta = self.spec.rope_theta
        inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, device=device).float() / hd)
        rotary.inv_freq = inv_freq
        rotary.original_inv_freq = inv_freq.clone()


@torch.no_grad()
def init_like_ours(model: nn.Module, spec: ModelSpec) -> None:
    """`model.Transformer.init_weights` on a LlamaForCausalLM (or a wrapper of one): GPT-2's
    normal initialisation under HF's names (`init_normal`), RMSNorm weights one."""
    init_normal(model, spec.n_layers, residual=("o_proj", "down_proj"))
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            nn.init.ones_(module.weight)


def hf_state_from_trainplan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our `Transformer.state_dict()` under `HFCausalLM`'s names: the same weights, renamed
    (`specs.hf.to_hf_names`, under this wrapper's `hf.`)."""
    return {f"hf.{k}": v for k, v in hf_spec.to_hf_names(state).items()}


def apply_ac(model: HFCausalLM, mode: str) -> None:
    """Activation checkpointing of every decoder layer, as `parallelize.apply_ac` does ours."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts,
                                       par_mod.save_policy)
    layers = model.hf.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, **kwargs)


def build(spec: ModelSpec, cfg: ParallelConfig, args, device: torch.device, mesh):
    """train.build for the baseline: (Parallelized, loss function); same order of steps.

    Checkpointing, compile, then FSDP2 or DDP; on GPU with sharded parameters
    the model is built on the meta device and materialised shard by shard.
    """

    check(spec, cfg)
    sharded = cfg.world > 1 and cfg.zero > 0
    meta = device.type == "cuda" and sharded
    torch.manual_seed(args.seed)
    with torch.device("meta" if meta else device):
        model = HFCausalLM(spec, args.seq_len)
    if not meta:
        model.init_weights()
    out = par_mod.Parallelized(parts=[model], notes=[
        f"{IMPL}: transformers {require_transformers().__version__} LlamaForCausalLM, sdpa, "
        f"use_cache=False", f"{count_params(model)} parameters"])
    if cfg.zero == 1 and cfg.dp > 1:
        out.notes.append("zero 1 runs as FSDP2 without resharding (= ZeRO-2: grads sharded too)")
    apply_ac(model, cfg.recompute)
    if args.compile:
        par_mod.apply_compile(model)
    out.fsdp, out.ddp = cfg.dp > 1 and cfg.zero > 0, cfg.dp > 1 and cfg.zero == 0
    if out.fsdp:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if cfg.dp_shard < cfg.dp else mesh["dp_shard"]
        par_mod.apply_fsdp(model, dp_mesh, reshard=cfg.zero == 3,
                           mixed_precision=device.type == "cuda")
    elif out.ddp:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        out.parts = [DistributedDataParallel(model, device_ids=ids)]
    if meta:
        model.to_empty(device=device)
        model.init_weights(buffer_device=device)
    return out, loss_function(args.compile)
