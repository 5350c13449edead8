"""GPU loss parity of context parallel: a cp layout against one GPU, same data and seed.

Run on a GPU node (NCCL; ring attention has no CPU path):

    torchrun --standalone --nproc-per-node 2 -m trainplan.bench.cp_parity --out cp_parity_2.json
    torchrun --standalone --nproc-per-node 4 -m trainplan.bench.cp_parity --out cp_parity_4.json
    # more 4-rank layouts: --layouts cp2-x-fsdp2 cp2-x-tp2 cp2-x-pp2 (and --compile)

Each rank first trains the reference, the plain model on its own GPU (no process group
in its step), then the layout: `--model` cut to `--layers` blocks (default the
1.3B's width, 2 blocks), built from `--seed` on the GPU before `parallelize` (so both
start from the same weights), fp32 throughout (no autocast, no FSDP mixed precision;
TF32 off), AdamW as in the harness, on `feed.SyntheticBatches`: the reference reads
grad_accum' = dp x grad_accum micro-batches of the step's global batch, the layout's
replicas their rows, its cp ranks their share of each sequence. Attention runs the
memory-efficient SDPA kernel in both (the fp32 kernel that ring attention wraps).

Rank 0 writes one JSON record: the reference's and every layout's per-step losses and
gradient norms (before clipping), the largest relative difference of each, and `ok`;
the run exits 1 if any difference is above RTOL. Expected: ring attention merges
partial softmaxes by their log-sum-exp in fp32, so differences of ~1e-6 (losses) to
~1e-5 (gradient norms), as for the tensor-parallel layouts on CPU (tests/bench/
test_parity.py); RTOL = 1e-3 leaves room for the summation order over 5 Adam steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from trainplan.bench.harness import feed
from trainplan.bench.harness import parallelize as pz
from trainplan.bench.harness import step as step_mod
from trainplan.bench.harness import train as harness
from trainplan.bench.harness.model import Transformer, slice_spec
from trainplan.specs import ParallelConfig, load_model

RTOL = 1e-3  # fp32; see the module docstring
LAYOUTS = {  # tag -> (world size, layout)
    "cp2": (2, ParallelConfig(cp=2, zero=3)),
    "cp2-x-fsdp2": (4, ParallelConfig(dp=2, cp=2, zero=3)),
    "cp2-x-tp2": (4, ParallelConfig(cp=2, tp=2)),
    "cp2-x-pp2": (4, ParallelConfig(cp=2, pp=2, grad_accum=2, zero=3)),
}
DEFAULT = {2: ["cp2"], 4: ["cp2-x-fsdp2"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m trainplan.bench.cp_parity",
                                description="Context-parallel loss parity against one GPU.")
    a = p.add_argument
    a("--out", required=True, help="JSON record to write (rank 0)")
    a("--model", default="llama-1.3b")
    a("--layers", type=int, default=2, help="keep this many blocks (0 = all)")
    a("--seq-len", type=int, default=2048)
    a("--micro-batch", type=int, default=1)
    a("--steps", type=int, default=5)
    a("--lr", type=float, default=1e-3)
    a("--seed", type=int, default=0)
    a("--layouts", nargs="+", default=None, choices=sorted(LAYOUTS),
      help="default: cp2 on 2 ranks, cp2-x-fsdp2 on 4")
    a("--compile", action="store_true", help="torch.compile each block (both runs)")
    return p.parse_args(argv)


def run_layout(spec, cfg: ParallelConfig | None, args, device, grad_accum: int) -> dict:
    """Losses and gradient norms of `args.steps` steps under `cfg` (None: the plain model,
    reading the whole global batch as `grad_accum` micro-batches)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = pz.build_mesh(cfg, device.type) if cfg is not None else None
    dp_rank, dp = pz.dp_coordinates(cfg, mesh) if cfg is not None else (0, 1)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Transformer.from_spec(spec, max_seq_len=args.seq_len)
    if cfg is None:
        par = pz.Parallelized(parts=[model])
        if args.compile:
            pz.apply_compile(model)
    else:
        par = pz.parallelize(model, cfg, mesh, compile=args.compile, device=device,
                             mixed_precision=False, loss_fn=step_mod.cross_entropy)
    optimizer = harness.make_optimizer(par, args.lr, device)
    source = feed.SyntheticBatches(vocab=spec.vocab, seq_len=args.seq_len,
                                   micro_batch=args.micro_batch, grad_accum=grad_accum,
                                   dp_rank=dp_rank, dp=dp, seed=args.seed)
    losses, norms, times = [], [], []
    for t in range(args.steps):
        micro = feed.to_device(source.step(t), device, non_blocking=False)
        t0 = time.perf_counter()
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            total = step_mod.train_step(par, optimizer, micro, autocast=False,
                                        reshard=cfg is not None and cfg.zero == 3,
                                        max_norm=1.0, loss_fn=step_mod.cross_entropy)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        if cfg is None:  # one process: no all-reduce of the loss
            losses.append((total[0] / total[1]).item())
            norms.append(total[2].item())
        else:
            loss, norm = step_mod.reduce_loss(total)
            losses.append(loss)
            norms.append(norm)
    return {"losses": losses, "grad_norms": norms, "step_times_s": times, "notes": par.notes}


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: cp_parity needs GPUs (ring attention has no CPU path)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = harness.init_distributed(False)
    world, rank = dist.get_world_size(), dist.get_rank()
    tags = args.layouts or DEFAULT.get(world, [])
    bad = [t for t in tags if LAYOUTS[t][0] != world]
    if not tags or bad:
        print(f"error: {world} ranks run {[t for t in LAYOUTS if LAYOUTS[t][0] == world]}; "
              f"not {bad or 'none'}", file=sys.stderr)
        return 2
    spec = load_model(args.model)
    spec = slice_spec(spec, args.layers) if args.layers else spec
    record = {"model": spec.name, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
              "steps": args.steps, "lr": args.lr, "seed": args.seed, "precision": "fp32",
              "compile": args.compile, "rtol": RTOL, "torch": torch.__version__,
              "card": torch.cuda.get_device_name(device), "ranks": world, "layouts": {}}
    ok = True
    for tag in tags:
        cfg = LAYOUTS[tag][1]
        pz.check_layout(cfg, spec, world, seq_len=args.seq_len, device_type=device.type)
        ref = run_layout(spec, None, args, device, grad_accum=cfg.dp * cfg.grad_accum)
        torch.cuda.empty_cache()
        dist.barrier()
        got = run_layout(spec, cfg, args, device, grad_accum=cfg.grad_accum)
        diff = {"loss": max_rel(got["losses"], ref["losses"]),
                "grad_norm": max_rel(got["grad_norms"], ref["grad_norms"])}
        passed = max(diff.values()) <= RTOL
        ok &= passed
        record["layouts"][tag] = {"layout": vars_of(cfg), "reference": ref, "layout_run": got,
                                  "max_rel_diff": diff, "ok": passed}
        torch.cuda.empty_cache()
    record["ok"] = ok
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(json.dumps({t: v["max_rel_diff"] for t, v in record["layouts"].items()}))
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        print(f"error: a layout differs from one GPU by more than rtol {RTOL}; see {args.out}",
              file=sys.stderr)
        return 1
    return 0


def vars_of(cfg: ParallelConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("dp", "cp", "tp", "pp", "zero", "dp_shard",
                                         "grad_accum")}


if __name__ == "__main__":
    sys.exit(main())
