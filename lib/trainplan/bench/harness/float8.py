"""fp8 training in the harness (`--precision fp8`): torchao float8 on the block linears.

Applied in torchtitan's order: its model converters swap the linears before the
parallelize function runs, so here `convert` runs on the plain model (`train.build`)
before the pipeline split, activation checkpointing, torch.compile and FSDP2. Compile
then traces each block with its fp8 casts (amax, scale, cast fuse with the element-wise
work), and FSDP2 wraps `Float8Linear` weights, which with tensorwise scaling it gathers in
fp8 (`enable_fsdp_float8_all_gather`).

Which linears: those `cost.fp8.converts` accepts (dims divisible by 16 and large enough
for fp8 to pay, by recipe; the planner prices the same rule), never the output layer.
Recipes: tensorwise (one scale a tensor; fp8 all-gather where FSDP2 runs, its weight
scales precomputed after each optimizer step, as torchtitan does) and rowwise (a scale
per row; weights gathered in bf16). Not with tensor parallel (torchao's float8 TP plans
are not wired in) or the `transformers` baseline: both are refused.

fp8 GEMMs need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper): elsewhere
`check` refuses with one line.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainplan.bench.flags import FP8_RECIPE
from trainplan.bench.flags import add_precision_arguments as add_arguments  # noqa: F401
from trainplan.bench.harness.model import Transformer
from trainplan.cost import fp8 as fp8_cost
from trainplan.cost.compute import fsdp_layout
from trainplan.errors import TrainplanError

MIN_CAPABILITY = (8, 9)  # fp8 e4m3 tensor cores: Ada (8.9) and Hopper (9.0) onwards
SKIP = ("output",)  # module names never converted: the logits' GEMM stays bf16


def device_problem(cpu: bool) -> str | None:
    """Why this process cannot run fp8 matmuls, or None where it can."""
    if cpu or not torch.cuda.is_available():
        return "this run has no CUDA device (CPU)"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name()} has compute capability {cap[0]}.{cap[1]}")
    return None


def check(args, cpu: bool) -> None:
    """Refuse `--precision fp8` (one line) where it cannot run: no GPU of compute capability
    >= 8.9, tensor parallel, the `transformers` baseline, or torchao missing."""
    if getattr(args, "precision", "bf16") != "fp8":
        if getattr(args, "fp8_recipe", FP8_RECIPE) != FP8_RECIPE:
            raise TrainplanError(f"--fp8-recipe {args.fp8_recipe} needs --precision fp8 (bf16 "
                                 "has no scaling recipe); add it or leave the recipe out")
        return
    fp8_cost.check_precision(args.precision, args.fp8_recipe)
    why = device_problem(cpu)
    if why:
        raise TrainplanError(f"--precision fp8 needs a CUDA GPU of compute capability >= "
                             f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (H100, H200); {why}; "
                             "use --precision bf16")
    if args.tp > 1:
        raise TrainplanError(f"--precision fp8 with --tp {args.tp}: fp8 under tensor parallel "
                             "is not in the harness yet; use --tp 1 or --precision bf16")
    if getattr(args, "impl", "trainplan") != "trainplan":
        raise TrainplanError("--precision fp8 runs the harness's own model only; leave out "
                             f"--impl {args.impl} or use --precision bf16")
    _torchao()


def _torchao():
    """torchao.float8, imported quietly (its C++ extensions, unused by float8 training, log a
    warning where they do not load), or one line saying how to install it."""
    quiet = logging.getLogger("torchao")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        import torchao.float8 as float8
    except ImportError:
        raise TrainplanError("--precision fp8 needs torchao (requirements.txt pins it; on the "
                             "GPU machines carry the wheel `make wheels` puts in .whl/ and "
                             "install it as that target's comment says)") from None
    finally:
        quiet.setLevel(level)
    return float8


def module_filter(recipe: str):
    """The filter `convert_to_float8_training` calls with (module, fully qualified name):
    True for an `nn.Linear` that `cost.fp8.converts` accepts and that is not in `SKIP`."""
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in SKIP:
            return False
        return fp8_cost.converts(module.out_features, module.in_features, recipe)
    return keep


def convert(model: Transformer, recipe: str, *, fsdp: bool) -> list[str]:
    """Swap `model`'s block linears for torchao `Float8Linear` in place (before any
    parallelism); return the converted modules' names. `fsdp`: the layout runs FSDP2, so
    tensorwise weights are all-gathered in fp8."""
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp:
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter(recipe))
    return [name for name, mod in model.named_modules()
            if isinstance(mod, float8.float8_linear.Float8Linear)]


def scale_hook(parts: list[nn.Module], recipe: str, *, fsdp: bool):
    """What runs after each optimizer step: with FSDP2's fp8 all-gather, torchao's
    `precompute_float8_dynamic_scale_for_fsdp` on every part (one all-reduce of the weights'
    amax for the next step's casts), as torchtitan calls it; else None."""
    if not (recipe == "tensorwise" and fsdp):
        return None
    precompute = _torchao().precompute_float8_dynamic_scale_for_fsdp

    def hook() -> None:
        for part in parts:
            precompute(part)
    return hook


def convert_for(model: Transformer, cfg, args):
    """`convert` `model` where `args.precision` is fp8 (FSDP2 where layout `cfg` runs it,
    `cost.compute.fsdp_layout`: `parallelize`'s rule); return what finishes the job on the
    parallelised result: its `after_optimizer` hook (`scale_hook`) and a note. For bf16 it
    converts nothing and the returned function does nothing."""
    if getattr(args, "precision", "bf16") != "fp8":
        return lambda result: None
    fsdp = bool(fsdp_layout(cfg.dp, cfg.zero, cfg.tp, cfg.pp, cfg.cp))
    converted = convert(model, args.fp8_recipe, fsdp=fsdp)

    def attach(result) -> None:
        result.after_optimizer = scale_hook(result.parts, args.fp8_recipe, fsdp=fsdp)
        gather = ", weights all-gathered in fp8" if result.after_optimizer else ""
        result.notes.append(f"fp8 {args.fp8_recipe}: {len(converted)} linears in torchao "
                            f"float8{gather}")
    return attach


def layout_fields(args) -> dict:
    """The record's layout fields of precision: `precision`, and `fp8_recipe` for fp8."""
    precision = getattr(args, "precision", "bf16")
    return {"precision": precision,
            **({"fp8_recipe": args.fp8_recipe} if precision == "fp8" else {})}
