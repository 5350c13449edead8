"""The microbenchmarks `trainplan validate` runs on a lent host before it predicts.

Stage 1 of `trainplan.validate`, each under a limit from the run's clock (an object
with `spare()`, the seconds left for measuring, and `say(text)`), all appended to one
DIR/micro.jsonl that `trainplan.calibrate.fit` reads:
- `run_micro`: GEMMs, attention, collectives, blocks, heads and host terms of the
  suite's base model under torchrun (`bench.micro.run`), on GPUs or small on CPU;
- `run_ring_micro`: the host time of ring attention at cp 2 and 4 (`bench.micro.ring`);
- `run_fp8_micro`: fp8 GEMMs and converted linears, where a suite runs fp8;
- `run_gemm_micro`: the GEMMs of the suite's other models, one model a GPU, for the
  size curve the planner reads at each model's own widths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from trainplan.bench.micro.shapes import gemm_shapes
from trainplan.errors import SpecError, TrainplanError
from trainplan.loader import parse_json
from trainplan.specs import load_model

# GEMMs at the token counts and tp shards the suite runs (micro-batch 1-8, pp micro-
# batches of 2, tp 2 and 4), so the planner reads a measured curve, not the 16k point.
MATMUL_TOKENS = "2048,4096,8192,16384"  # GEMM rows of the bf16 and fp8 curves
FP8_LINEAR_TOKENS = "8192"  # the converted linears' rows: one count (each shape compiles)
# The plain block also in DDP's precision (fp32 weights under autocast), so that the DDP
# block records have their unwrapped reference (calibrate_pieces._alone): without it the
# calibration has no ddp_block_scale and DDP is priced as one GPU.
GPU_MICRO = ["--block-modes",
             "compiled:none,eager:none,compiled:selective,compiled:none:autocast-fp32",
             "--head-modes", "eager,compiled",
             "--matmul-tp", "1,2,4", "--matmul-tokens", MATMUL_TOKENS,
             "--attention-seqs", "2048,4096,8192,16384"]
RING_SEQS, RING_LIMIT_S = "256,1024", 120.0  # host-bound lengths; ~40 s a cp on 2 x H200
GEMM_LIMIT_S = 120.0  # a wave of other models' GEMMs (stage 1d); ~20 s a model on an H200
MICRO_LIMIT_S = 360.0  # 4 x H100: about 184 s with the host bench, + ~60-90 s host-step
CPU_MICRO = ["--benches", "matmul,attention,collectives", "--tokens", "64", "--seq-len", "32",
             "--sizes", "4K,1M,16M", "--warmup", "1", "--iters", "3", "--repeats", "6"]  # seconds


def run_micro(out: Path, gpus: int, model: str, cuda: bool, clock) -> Path:
    """Stage 1: microbenchmarks under torchrun with `gpus` processes -> DIR/micro.jsonl."""
    from trainplan.bench.series.suite import NO_MULTICAST, run_group  # pandas: not loaded at import

    path = out / "micro.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={gpus}", "-m", "trainplan.bench.micro.run", "--out", str(path),
           "--model", model, *(GPU_MICRO if cuda else CPU_MICRO)]
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    limit = min(MICRO_LIMIT_S, clock.spare())
    rc, _, _ = run_group(cmd, env, limit, capture=False)
    if rc == 0 and path.is_file():
        return path
    why = "ran past its time limit" if rc is None else f"exited with code {rc}"
    kinds = micro_kinds(path)
    if not {"matmul", "attention"} <= kinds:
        raise TrainplanError(f"microbenchmarks {why} (command: {' '.join(cmd)}); nothing "
                             "calibrated or measured")
    # rank 0 appends each benchmark's record as it finishes: the ones done still calibrate
    text = path.read_text()
    if not text.endswith("\n"):  # stopped while writing a record: drop that part line
        path.write_text(text[:text.rfind("\n") + 1])
    clock.say(f"microbenchmarks {why}; calibrating from the {len(kinds)} kinds recorded "
              f"({', '.join(sorted(kinds))}); the rest keep their defaults")
    return path


def run_ring_micro(path: Path, gpus: int, model: str, clock) -> None:
    """Stage 1b: the host time of torch's ring attention, cp 2 and 4 where the GPUs allow, at
    host-bound lengths (`bench.micro.ring`), appended to `path`; a failure is said, not fatal
    (the planner then prices no ring host time)."""
    from trainplan.bench.series.suite import NO_MULTICAST, run_group  # pandas: not loaded at import

    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    for cp in (c for c in (2, 4) if c <= gpus):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cp}", "-m", "trainplan.bench.micro.ring", "--model", model,
               "--seq-lens", RING_SEQS, "--out", str(path)]
        rc, _, _ = run_group(cmd, env, min(RING_LIMIT_S, clock.spare()),
                             capture=False)
        if rc != 0:
            clock.say(f"ring-attention microbenchmark at cp {cp} failed (exit {rc}); no ring "
                      "host time from it")


def run_fp8_micro(path: Path, model: str, clock) -> None:
    """Stage 1c, where a suite runs fp8: the fp8 GEMMs of both recipes (`bench.micro.fp8`) at
    the bf16 curve's token counts, then the whole converted linears at `FP8_LINEAR_TOKENS`
    (their casts), appended to `path` for `calibrate.fp8`; a failure is said, not fatal (fp8
    is then priced at the preset's stated fraction, its casts at the analytic rate)."""
    from trainplan.bench.series.suite import run_group  # pandas: not loaded at import

    for bench, rows, what in (("matmul-fp8", ["--matmul-tokens", MATMUL_TOKENS], "GEMM"),
                              ("fp8-linear", ["--tokens", FP8_LINEAR_TOKENS], "linear")):
        cmd = [sys.executable, "-m", "trainplan.bench.micro.run", "--out", str(path), "--model",
               model, "--benches", bench, *rows]
        rc, _, _ = run_group(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"},
                             min(RING_LIMIT_S, clock.spare()), capture=False)
        if rc != 0:
            clock.say(f"fp8 {what} microbenchmark failed (exit {rc}); fp8 "
                      + ("priced at the preset's stated fraction" if what == "GEMM" else
                         "casts priced at the analytic rate"))


def run_gemm_micro(path: Path, models: list[str], gpus: int, clock,
                   tokens: str = MATMUL_TOKENS) -> None:
    """Stage 1d: the GEMMs of the suite's other models (`--curve-only`: their own widths at
    `tokens` rows and the tp 1, 2, 4 shards they have shape the size curve, not the single
    matmul fraction, which stays the base model's), one model a GPU at a time, appended to
    `path`; a model whose run fails or ends at the limit keeps the records it finished."""
    from trainplan.bench.series.suite import NO_MULTICAST  # pandas: not loaded at import
    from trainplan.proctree import stop_tree

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
    for wave in range(0, len(models), gpus):
        runs = []
        for i, model in enumerate(models[wave:wave + gpus]):
            part = path.with_name(f"gemm-{wave + i}.jsonl")
            cmd = [sys.executable, "-m", "trainplan.bench.micro.run", "--out", str(part),
                   "--model", model, "--benches", "matmul", "--curve-only", "--matmul-tp",
                   ",".join(map(str, shard_degrees(model))), "--matmul-tokens", tokens,
                   "--tokens", tokens.split(",")[-1]]
            env = {**os.environ, **NO_MULTICAST, "CUDA_VISIBLE_DEVICES": visible[i % len(visible)]}
            runs.append((model, part, subprocess.Popen(cmd, env=env, start_new_session=True,
                                                       stdout=subprocess.DEVNULL)))
        deadline = time.monotonic() + min(GEMM_LIMIT_S, clock.spare())  # the wave's
        for model, part, proc in runs:
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_tree(proc)
                rc = None
            if rc != 0:
                why = "ran past their limit" if rc is None else f"failed (exit {rc})"
                clock.say(f"GEMMs of {model} {why}; the curve keeps the shapes they finished")
            if part.is_file():
                whole = part.read_text()
                with path.open("a") as f:
                    f.write(whole[:whole.rfind("\n") + 1])
                part.unlink()


def shard_degrees(model: str, degrees=(1, 2, 4)) -> list[int]:
    """The tensor-parallel degrees of `degrees` whose GEMM shards `model` has (those
    `shapes.gemm_shapes` does not refuse: each divides its heads, kv heads, ffn, vocabulary)."""
    spec, out = load_model(model), []
    for t in degrees:
        try:
            gemm_shapes(spec, t, 1)
        except SpecError:
            continue
        out.append(t)
    return out


def micro_kinds(path: Path) -> set[str]:
    """The benchmark kinds a (possibly cut) micro.jsonl holds whole records of."""
    kinds = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                kinds.add(parse_json(line, str(path), error=ValueError)["bench"])
            except (ValueError, KeyError, TypeError):
                continue  # the line being written when the run was stopped
    return kinds
