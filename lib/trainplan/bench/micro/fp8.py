"""fp8 microbenchmarks at the model's GEMM shapes: the GEMM alone (`--benches matmul-fp8`,
`torch._scaled_mm`) and the whole converted linear (`--benches fp8-linear`).

The GEMMs a converted linear runs under `--precision fp8` (`bench.harness.float8`): y =
x W^T with x (M, K) and W (N, K) in fp8 e4m3, x row-major and W^T column-major as
`_scaled_mm` takes them, output bf16, scaled per tensor (tensorwise: two fp32 scalars)
or per row (rowwise: x's (M, 1) and W's (1, N) fp32 scales). FLOPs 2 M N K; only the
GEMM is timed, since the planner prices the casts apart (`cost.fp8.cast_bytes`).
Records (`bench: matmul-fp8`) carry the recipe; `trainplan calibrate` fits
`fp8_matmul_curve` / `fp8_rowwise_matmul_curve` from them as fractions of the fp8 peak
(`calibrate.fp8.curves`), as it fits the bf16 curve.

`fp8-linear` times what the harness runs per linear: a bf16 `nn.Linear` converted by
`bench.harness.float8.convert` (the recipe's casts, scales and three fp8 GEMMs), forward and
backward, compiled on a GPU, beside the same linear in bf16. `trainplan calibrate` reads the
fp8 time less its GEMMs (the curves above) as the casts' time, over `cost.fp8`'s analytic
cast time: `fp8_cast_scale` / `fp8_rowwise_cast_scale` (`calibrate.fp8`).

`block-fp8` times one transformer block (`bench.micro.model.bench_block`, compiled, no
recompute) with its linears converted by the recipe, beside the same block in bf16, in the
precision a layout runs ("pure": bf16 weights as under FSDP2; "autocast-fp32": fp32 weights
under autocast, as one GPU, DDP, TP and PP run): the bytes each keeps for backward. Compiled,
the fp8 block keeps less (the partitioner can save a linear's fp8 operands rather than its
bf16 input); their ratio gives `fp8_activation_ratio` (`calibrate.fp8.activation_ratios`).

Shapes: those `bench.micro.layouts.matmul_tasks` lists for bf16 (the launch's --tp and
--tokens, then --matmul-tp x --matmul-tokens), kept where `cost.fp8.converts` would run
them in fp8; the output layer never is. Torch runs `_scaled_mm` on CPU too (tests), but
fp8 tensor cores need a CUDA GPU of compute capability >= 8.9.
"""

from __future__ import annotations

import torch
from torch import nn

from trainplan.bench.micro.layouts import matmul_tasks
from trainplan.bench.micro.shapes import whole
from trainplan.bench.micro.timing import card, time_blocks, timed_results
from trainplan.cost.fp8 import RECIPES, check_precision, converts
from trainplan.errors import SpecError
from trainplan.records.schema import microbenchmark_record
from trainplan.records.stats import median_ci
from trainplan.specs import ModelSpec

BENCH = "matmul-fp8"
LINEAR_BENCH = "fp8-linear"
BLOCK_BENCH = "block-fp8"


def fp8_tasks(spec: ModelSpec, tp: int, tokens: int, tps: list[int], token_counts: list[int],
              recipes=RECIPES, bench: str = BENCH) -> list[tuple[str, dict]]:
    """(bench, kwargs) per recipe and shape of `matmul_tasks` that the recipe converts, whole
    (unsharded) linear (out, in) judged by `converts` as the harness judges it."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise SpecError(f"--benches {bench}: {torch.cuda.get_device_name()} has no fp8 tensor "
                        "cores (compute capability < 8.9); leave it out on this card")
    h, f, kv = spec.hidden, spec.ffn, spec.kv_dim
    whole_dims = {"q": (h, h), "kv": (kv, h), "out": (h, h), "gate_up": (f, h), "up": (f, h),
                  "down": (h, f)}  # (out, in) of the layer's linear before any tp split
    tasks = []
    for recipe in recipes:
        check_precision("fp8", recipe)
        for _, kw in matmul_tasks(spec, tp, tokens, tps, token_counts):
            dims = whole_dims.get(kw["name"])
            if dims and converts(*dims, recipe):
                tasks.append((bench, {**kw, "recipe": recipe}))
    return tasks


def bench_matmul_fp8(m: int, n: int, k: int, *, recipe: str = "tensorwise",
                     device: str | None = None, warmup: int = 10, iters: int = 20,
                     repeats: int = 7, name: str = "", tp: int = 1, base: bool = True,
                     run_id: str | None = None, extra: dict | None = None, **_) -> dict:
    """TFLOP/s of the fp8 GEMM y = x W^T, x (m, k), W (n, k), scaled by `recipe`; 2 m n k
    FLOPs a call. `name`, `tp` and `base` as `run.bench_matmul` records them."""
    check_precision("fp8", recipe)
    whole(m=m, n=n, k=k)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(m, k, device=dev).to(e4m3)  # (M, K) row-major
    w = torch.randn(n, k, device=dev).to(e4m3)  # (N, K) row-major: w.t() is column-major
    if recipe == "rowwise":
        sx, sw = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    else:
        sx, sw = torch.ones((), device=dev), torch.ones((), device=dev)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

    def gemm():
        torch._scaled_mm(x, w.t(), sx, sw, out_dtype=torch.bfloat16, out=out)

    times = time_blocks(gemm, dev, warmup, iters, repeats)
    config = {"name": name, "m": m, "n": n, "k": k, "tp": tp, "base": base, "recipe": recipe,
              "dtype": "float8_e4m3fn", "out_dtype": "bfloat16", "device": dev.type,
              "flops": 2 * m * n * k, "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench=BENCH, config=config, gpus=1, card=card(dev),
                                 results=timed_results(times, 2 * m * n * k, "tflops", 1e12),
                                 run_id=run_id, extra=extra)


def bench_fp8_linear(m: int, n: int, k: int, *, recipe: str = "tensorwise",
                     device: str | None = None, warmup: int = 5, iters: int = 10,
                     repeats: int = 7, name: str = "", tp: int = 1, base: bool = True,
                     run_id: str | None = None, extra: dict | None = None, **_) -> dict:
    """Seconds of forward + backward of one (n, k) linear on m tokens converted to fp8 with
    `recipe` (`bench.harness.float8.convert`, compiled on a GPU), 3 x 2 m n k FLOPs; the same
    bf16 linear's seconds in `config.bf16_time_s`. Refused where the recipe skips the shape."""
    from trainplan.bench.harness import float8 as harness_fp8  # torchao: only this bench

    check_precision("fp8", recipe)
    whole(m=m, n=n, k=k)
    if not converts(n, k, recipe):
        raise SpecError(f"{LINEAR_BENCH}: a ({n}, {k}) linear is not converted under {recipe} "
                        "(cost.fp8.converts); pick a shape the recipe runs in fp8")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    times = {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16))
        if precision == "fp8":
            harness_fp8.convert(module, recipe, fsdp=False)
        if dev.type == "cuda":  # each shape compiles afresh: dynamo's recompile limit (8 per
            torch._dynamo.reset()  # code object) would leave later shapes to run eager
        run = torch.compile(module) if dev.type == "cuda" else module

        def step(run=run):
            run(x).backward(grad)

        times[precision] = time_blocks(step, dev, warmup, iters, repeats)
    flops = 3 * 2 * m * n * k
    config = {"name": name, "m": m, "n": n, "k": k, "tp": tp, "base": base, "recipe": recipe,
              "compiled": dev.type == "cuda", "device": dev.type, "flops": flops,
              "bf16_time_s": median_ci(times["bf16"]).estimate,
              "warmup": warmup, "iters": iters, "repeats": repeats}
    return microbenchmark_record(bench=LINEAR_BENCH, config=config, gpus=1, card=card(dev),
                                 results=timed_results(times["fp8"], flops, "tflops", 1e12),
                                 run_id=run_id, extra=extra)



def bench_block_fp8(model: str, micro_batch: int, seq: int, *, recipe: str = "tensorwise",
                    precision: str = "pure", device: str | None = None, warmup: int = 3,
                    iters: int = 5, repeats: int = 6, run_id: str | None = None,
                    extra: dict | None = None, **_) -> dict:
    """Seconds and kept activation bytes of one compiled block (forward + backward) with its
    linears in fp8 by `recipe`, in `precision` (`bench.micro.model.PRECISIONS`); the same bf16
    block's in `config.bf16_time_s` and `config.bf16_activation_bytes`."""
    from trainplan.bench.micro import model as micro_model  # the block bench proper

    check_precision("fp8", recipe)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kw = {"compile": dev != "cpu", "recompute": "none", "precision": precision,
          "device": dev, "warmup": warmup, "iters": iters, "repeats": repeats}
    bf16 = micro_model.bench_block(model, micro_batch, seq, **kw)
    fp8 = micro_model.bench_block(model, micro_batch, seq, fp8_recipe=recipe, **kw)
    config = {**fp8["config"], "recipe": recipe,
              "bf16_time_s": bf16["results"]["time_s"],
              "bf16_activation_bytes": bf16["results"]["activation_bytes"]}
    return microbenchmark_record(bench=BLOCK_BENCH, config=config, gpus=1, card=fp8["card"],
                                 results=fp8["results"], run_id=run_id, extra=extra)
