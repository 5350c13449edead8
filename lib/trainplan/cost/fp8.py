"""fp8 training (`--precision fp8`, torchao float8): what it changes in a step's time and memory.

The harness converts a block's linears to torchao's `Float8Linear` by the rule of
`converts` (`bench.harness.float8`). A converted linear runs its three GEMMs through
`torch._scaled_mm` in fp8 e4m3, each bf16 operand cast with a scale from its absolute
maximum. Recipes (torchao `Float8LinearConfig.from_recipe_name`): tensorwise, one scale per
tensor, weights cast on their FSDP2 shard and all-gathered in fp8; rowwise, a scale per row,
weights gathered in bf16.

Against bf16, per rank, these terms change (each a function below):
1. the converted GEMMs run at the fp8 rate: `fp8_tflops` x the fp8 fraction for the
   shape, from the measured curve (`fp8_matmul_curve`, `fp8_rowwise_matmul_curve`) or else
   the preset's stated `fp8_matmul_efficiency` (`gemm_delta_time`);
2. the casts: a converted linear casts 6 operands a step (forward: input and weight;
   backward: the output gradient twice, along rows and columns, the weight, the input,
   since torchao keeps the bf16 input for backward), each an amax pass and a cast pass over
   bf16, 2 + 2 + 1 = `CAST_BYTES` per element, at the achieved HBM rate times the recipe's
   measured scale (`fp8-linear` microbenchmark); recompute repeats the forward's; under fp8
   all-gather the weight casts move to the shard (`cast_time`);
3. FSDP2's all-gather carries 1 byte per converted parameter instead of 2
   (`gather_params`), and its copy kernels move fewer bytes (`gather_copy_delta_bytes`);
4. memory (`memory_delta`): under fp8 all-gather the unsharded converted weights are fp8;
   the fp8 operand copies of the largest linear, with their scales, live during its
   backward. No amax history: torchao's dynamic scaling keeps none. A compiled block keeps
   less for backward (`kept_scale`, measured by the `block-fp8` microbenchmark), and no
   bf16 casts of its converted weights (`converted_share`).
Not counted: fp8 transposes that compile fuses into the casts, and the one small
all-reduce of weight scales a step.
"""

from __future__ import annotations

import numpy as np

from trainplan.cost import params
from trainplan.cost.compute import NONE, matmul_efficiency_at
from trainplan.errors import SpecError
from trainplan.specs import GPUSpec, ModelSpec

PRECISIONS = ("bf16", "fp8")
RECIPES = ("tensorwise", "rowwise")
CAST_BYTES = 5.0  # per element cast: amax pass reads 2 B, cast pass reads 2 B, writes 1 B
# Rowwise GEMM fraction / tensorwise's where no rowwise curve is measured: an assumption
# (the per-row scales are applied in the GEMM's epilogue; torchao's H100 tables show rowwise
# speed-ups about 0.9 x tensorwise's at large shapes).
ROWWISE_PRESET_FACTOR = 0.9


def check_precision(precision: str, recipe: str = "tensorwise") -> None:
    """Raise SpecError unless `precision` and the fp8 `recipe` are known."""
    if precision not in PRECISIONS:
        raise SpecError(f"--precision {precision!r} is not valid; use one of {list(PRECISIONS)}")
    if recipe not in RECIPES:
        raise SpecError(f"--fp8-recipe {recipe!r} is not valid; use one of {list(RECIPES)}")


def check_gpu(gpu: GPUSpec) -> None:
    """Raise SpecError (one line) where `gpu` has no fp8 matmul rate to price fp8 with."""
    if gpu.fp8_tflops <= 0:
        raise SpecError(f"--precision fp8: {gpu.name} has no fp8 matmul units (fp8_tflops = 0 "
                        "in its spec); use --precision bf16, or an H100 or H200")
    if gpu.fp8_matmul_efficiency <= 0 and not gpu.fp8_matmul_curve:
        raise SpecError(f"--precision fp8: {gpu.name} has fp8_tflops but no "
                        "fp8_matmul_efficiency or measured fp8_matmul_curve; add one")


def converts(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether the harness converts a block linear of weight (out, in) = (N, K) to fp8.

    The rule (torchao float8's README performance tables, H100, where fp8 gains over bf16):
    both dims divisible by 16 (`torch._scaled_mm` needs it); tensorwise: not (K <= 4096 and
    N <= 1024); rowwise: N > 2048, K > 1024, and not (N <= 4096 and K <= 2048). The
    output layer is never converted (`bench.harness.float8` skips it by name).
    """
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def block_linears(m: ModelSpec, ep=1) -> list[tuple]:
    """(name, GEMMs a token, weights on a rank, out, in, tp split) of each linear of a block.

    Per token each expert linear runs top_k times; a rank holds n_experts / ep of them.
    Column-parallel linears (q, k, v, gate, up) split `out` over tp, row-parallel (o, down)
    split `in`, as `bench.harness.parallelize.apply_tp` lays them out.
    """
    h, kv, f = m.hidden, m.kv_dim, m.ffn
    ups = 2 if m.mlp == "swiglu" else 1
    here = np.maximum(m.n_experts // np.asarray(ep), 1)
    return [("wq", 1, 1, h, h, "out"), ("wk wv", 2, 2, kv, h, "out"), ("wo", 1, 1, h, h, "in"),
            ("w1 w3", ups * m.top_k, ups * here, f, h, "out"),
            ("w2", m.top_k, here, h, f, "in")]


def _converted(m: ModelSpec, recipe: str, tp, ep=1):
    """Each converted linear as (GEMMs a token, weights, n, k) of its shard on one rank."""
    tp = np.asarray(tp, dtype=float)
    for _, per_token, weights, out, inn, split in block_linears(m, ep):
        if converts(out, inn, recipe):
            n, k = (out / tp, inn) if split == "out" else (out, inn / tp)
            yield per_token, weights, n, k


def converted_layer_params(m: ModelSpec, recipe: str, tp=1, ep=1):
    """Weights of one block on one rank that run in fp8 (parameters; no biases)."""
    return sum((w * n * k for _, w, n, k in _converted(m, recipe, tp, ep)),
               start=np.zeros_like(np.asarray(tp, dtype=float)))


def converted_share(m: ModelSpec, recipe: str, tp=1, ep=1):
    """Share of one block's weights on a rank (`params.layer_params_per_rank`) in
    converted linears: the weights whose bf16 casts an fp8 block does not keep."""
    return converted_layer_params(m, recipe, tp, ep) / params.layer_params_per_rank(m, tp, ep)


def kept_scale(gpu: GPUSpec, recipe: str) -> float:
    """A compiled fp8 block's kept bytes over bf16's, bf16 weight casts aside: the card's
    measured ratio for `recipe` (`calibrate.fp8.activation_ratios`); 1 = not measured."""
    return gpu.fp8_rowwise_activation_ratio if recipe == "rowwise" else gpu.fp8_activation_ratio


def fp8_efficiency_at(gpu: GPUSpec, recipe: str, tokens, width):
    """Fraction of the fp8 peak of a (tokens x n k) GEMM: the recipe's measured curve
    (`compute.matmul_efficiency_at`), else `fp8_matmul_efficiency` (x ROWWISE_PRESET_FACTOR
    for rowwise)."""
    if recipe == "rowwise":
        return matmul_efficiency_at(gpu.fp8_rowwise_matmul_curve, tokens, width,
                                    gpu.fp8_matmul_efficiency * ROWWISE_PRESET_FACTOR)
    return matmul_efficiency_at(gpu.fp8_matmul_curve, tokens, width, gpu.fp8_matmul_efficiency)


def gemm_delta_time(m: ModelSpec, gpu: GPUSpec, *, recipe: str, tokens, tp, passes, layers):
    """Seconds one micro-batch's converted GEMMs take in fp8 less what they take in bf16.

    Per converted linear 2 T n k FLOPs a pass (T tokens of this rank, n k its shard),
    `passes` = 3 (+1 with full recompute), at fp8 peak x `fp8_efficiency_at` against bf16
    peak x the bf16 curve's fraction (`compute.matmul_efficiency_at`), over `layers`.
    Negative where fp8 is faster.
    """
    t = np.asarray(tokens, dtype=float)
    fp8, bf16 = gpu.fp8_tflops * 1e12, gpu.bf16_tflops * 1e12
    total = np.zeros_like(t * np.asarray(tp, dtype=float))
    for per_token, _, n, k in _converted(m, recipe, tp):
        flops = per_token * 2.0 * t * n * k
        total = total + flops * (1.0 / (fp8 * fp8_efficiency_at(gpu, recipe, t, n * k))
                                 - 1.0 / (bf16 * matmul_efficiency_at(
                                     gpu.matmul_curve, t, n * k, gpu.matmul_efficiency)))
    return np.asarray(passes) * np.asarray(layers) * total


def linear_cast_bytes(tokens, n, k, *, weights=1.0, per_token=1.0, recompute=False,
                      fp8_gather=False):
    """HBM bytes of one converted (n, k) linear's casts over `tokens` tokens (term 2): the
    input T k twice (forward, and along the other axis in backward) and once more with
    `recompute`, the output gradient T n twice, each of its `weights` n k twice (and once more
    with recompute) unless it arrives in fp8 (`fp8_gather`); each element `CAST_BYTES`."""
    again = np.where(np.asarray(recompute), 1.0, 0.0)
    t = np.asarray(tokens, dtype=float)
    act = per_token * (t * k * (2.0 + again) + 2.0 * t * n)
    return CAST_BYTES * (act + np.where(fp8_gather, 0.0, weights * n * k * (2.0 + again)))


def cast_bytes(m: ModelSpec, *, recipe: str, tokens, tp, recompute, fp8_gather, layers):
    """HBM bytes of one micro-batch's fp8 casts on one rank: `linear_cast_bytes` of each
    converted linear (T tokens, its shard (n, k) on this rank) over `layers`."""
    again = np.asarray(recompute) != NONE
    total = np.zeros_like(np.asarray(tokens, dtype=float) * np.asarray(tp, dtype=float) * again)
    for per_token, weights, n, k in _converted(m, recipe, tp):
        total = total + linear_cast_bytes(tokens, n, k, weights=weights, per_token=per_token,
                                          recompute=again, fp8_gather=fp8_gather)
    return total * np.asarray(layers)


def cast_time(gpu: GPUSpec, nbytes, recipe: str | None = None):
    """Seconds of `nbytes` of casts at the achieved HBM rate (memory-bound element-wise
    passes); torchao's casts of a `recipe` (`cast_bytes`) take the card's measured scale on
    that rate (`fp8_cast_scale`, `fp8_rowwise_cast_scale`; `calibrate.fp8`), FSDP2's copies
    (`recipe` None) none."""
    scale = {"tensorwise": gpu.fp8_cast_scale, "rowwise": gpu.fp8_rowwise_cast_scale}.get(
        recipe, 1.0)
    return scale * np.asarray(nbytes) / (gpu.hbm_tbps * 1e12 * gpu.memory_efficiency)


def gather_params(stage_params, converted_stage_params, fp8_gather):
    """Parameters an all-gather moves, in bf16 (2-byte) units: the converted ones count half
    under fp8 all-gather (1 byte each instead of 2)."""
    return np.asarray(stage_params) - np.where(fp8_gather, 0.5, 0.0) * converted_stage_params


def gather_copy_delta_bytes(converted_stage_params, *, shard_ranks, fp8_gather):
    """HBM bytes one FSDP2 all-gather's copies move under fp8 all-gather, less bf16's
    (`compute.dp_copy_bytes_per_param`), for the converted parameters, n = shard_ranks:
    copy-in casts the fp32 shard to fp8 (read 4, write 1) and copies it into the send buffer
    (read 1, write 1), 7 / n against bf16's 6 / n; copy-out moves 1 + 1 instead of 2 + 2."""
    n = np.maximum(np.asarray(shard_ranks, dtype=float), 1.0)
    p = np.where(fp8_gather & (n > 1), np.asarray(converted_stage_params, dtype=float), 0.0)
    return (1.0 / n - 2.0) * p


def step_copy_delta_bytes(converted_stage_params, *, zero, shard_ranks, fp8_gather):
    """HBM bytes a step's once-a-step FSDP2 copies move under fp8 all-gather, less bf16's:
    ZeRO-1's one gather (`gather_copy_delta_bytes`), and on every sharded layout the
    scales' amax reading the fp32 shard once more (4 / n per converted parameter)."""
    n = np.maximum(np.asarray(shard_ranks, dtype=float), 1.0)
    zero = np.where(n > 1, np.asarray(zero), 0)
    p = np.where(fp8_gather & (zero > 0), np.asarray(converted_stage_params, dtype=float), 0.0)
    gather = gather_copy_delta_bytes(p, shard_ranks=n, fp8_gather=True)
    return np.where(zero == 1, gather, 0.0) + 4.0 / n * p


def memory_delta(m: ModelSpec, *, recipe: str, tokens, tp, pp, ep, zero, fsdp, fp8_gather):
    """(params, other) bytes on one rank that fp8 adds (negative: saves) at the step's peak.

    params: FSDP2 below ZeRO-3 keeps the unsharded weights from forward to backward, in
    fp8 under fp8 all-gather: 1 byte less per converted stage parameter. other: ZeRO-3's
    two gathered blocks likewise (2 x 1 byte per converted block parameter); plus, on every
    fp8 layout, the fp8 copies of the largest converted linear during its backward (input
    T k, output gradient twice 2 T n, weight n k: 1 byte each) and their fp32 scales (4
    bytes a row for rowwise, one per tensor for tensorwise).
    """
    t = np.asarray(tokens, dtype=float)
    block = converted_layer_params(m, recipe, tp, ep)
    stage = block * m.n_layers / np.asarray(pp)
    gathered = np.asarray(fsdp) & np.asarray(fp8_gather)
    params = np.where(gathered & (np.asarray(zero) < 3), -stage, 0.0)
    buffers = np.where(gathered & (np.asarray(zero) == 3), -2.0 * block, 0.0)
    largest = np.zeros_like(t * np.asarray(tp, dtype=float))
    for _, _, n, k in _converted(m, recipe, tp):
        rows = 2.0 * t + n + k if recipe == "rowwise" else 4.0
        largest = np.maximum(largest, t * k + 2.0 * t * n + n * k + 4.0 * rows)
    return params, buffers + largest


def summary(m: ModelSpec, gpu: GPUSpec, recipe: str) -> dict:
    """What `plan --json` says of fp8 (its `fp8`): the recipe, which block linears run in fp8
    (`converts`; the output layer never), and where the fp8 GEMM fraction comes from:
    `validated` only where matmul-fp8 microbenchmarks calibrated it, else the preset's
    stated fraction, priced but not validated."""
    curve = gpu.fp8_rowwise_matmul_curve if recipe == "rowwise" else gpu.fp8_matmul_curve
    preset = gpu.fp8_matmul_efficiency * (ROWWISE_PRESET_FACTOR if recipe == "rowwise" else 1)
    linears = block_linears(m)
    return {
        "recipe": recipe,
        "fsdp_float8_all_gather": recipe == "tensorwise",  # where the layout runs FSDP2
        "converted": [n for n, _, _, o, i, _ in linears if converts(o, i, recipe)],
        "kept_bf16": [n for n, _, _, o, i, _ in linears if not converts(o, i, recipe)]
        + ["output"],
        "fp8_tflops": gpu.fp8_tflops,
        "gemm_fraction": ("measured (fp8 GEMM curve of the card's calibration)" if len(curve)
                          else f"{preset:.3f} of fp8 peak, stated in the GPU preset, not "
                               "measured"),
        "validated": bool(len(curve)),
    }
