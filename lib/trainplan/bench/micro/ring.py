"""Ring attention alone: what torch's context parallel adds to one block's causal SDPA.

Each cp rank holds its head-tail share of q, k and v (b, n_heads, s / cp, head_dim, bf16;
`harness.context.head_tail_positions`) and runs SDPA forward + backward inside
`context_parallel` with the harness's options (all-gather rotater, load balancing), eager
or under `torch.compile`. The same rank also times plain causal SDPA over the whole
sequence, so `ring_s - plain_s / cp` is what the ring costs beyond its rank's share of the
attention: the figure `cost.ring.ring_layer_time` prices (exposed collectives + HBM passes).
`--profile` adds a per-kernel table of one step (the collectives, the fp32 merges).

Run: `torchrun --standalone --nproc-per-node CP -m trainplan.bench.micro.ring --model M
--seq-lens 8192,16384 --out FILE` (GPUs only: ring attention has no gloo path).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainplan.bench.harness.context import head_tail_positions
from trainplan.bench.micro.layouts import comma_items
from trainplan.bench.micro.timing import card, slowest, time_blocks, timed_results
from trainplan.errors import TrainplanError
from trainplan.records.schema import append, microbenchmark_record
from trainplan.records.stats import median_ci
from trainplan.specs import load_model


def _sdpa_step(q, k, v, grad_out, attn):
    out = attn(q, k, v)
    torch.autograd.grad(out, (q, k, v), grad_out)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _shard(full: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's head-tail share of a (b, nh, s, hd) tensor, as a fresh leaf."""
    idx = torch.tensor(head_tail_positions(full.shape[2], cp, rank), device=full.device)
    return full.index_select(2, idx).detach().requires_grad_(True)


def bench_ring(model: str, seq: int, micro_batch: int, *, compiled: bool, warmup: int = 3,
               iters: int = 5, repeats: int = 7, profile: str | None = None) -> dict:
    """Seconds of causal SDPA fwd + bwd on one cp rank: ring (slowest rank) and plain whole-s.

    All ranks of the default group form the cp group and call it; every rank gets the record.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = load_model(model)
    cp, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    shape = (micro_batch, spec.n_heads, seq, spec.head_dim)
    gen = torch.Generator(device=dev).manual_seed(0)
    full = [torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
            for _ in range(4)]
    attn = torch.compile(_sdpa) if compiled else _sdpa
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION]

    q, k, v = (t.detach().requires_grad_(True) for t in full[:3])
    g = full[3]
    with sdpa_kernel(backends):
        plain = time_blocks(lambda: _sdpa_step(q, k, v, g, attn), dev, warmup, iters, repeats)
    del q, k, v
    torch._dynamo.reset()

    mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")
    q, k, v = (_shard(t, cp, rank) for t in full[:3])
    grad_out = _shard(g, cp, rank).detach()
    full = g = None  # free the whole-sequence tensors before the ring's peak is measured
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    dummy = torch.zeros(2 * cp, device=dev)  # context_parallel needs one buffer to shard
    with sdpa_kernel(backends), context_parallel(mesh, buffers=[dummy], buffer_seq_dims=[0]):
        ring = time_blocks(lambda: _sdpa_step(q, k, v, grad_out, attn), dev, warmup, iters,
                           repeats)
        peak = torch.cuda.max_memory_allocated(dev) - base
        if profile:
            _profile(lambda: _sdpa_step(q, k, v, grad_out, attn), profile, rank)
    torch._dynamo.reset()
    ring, plain = slowest(ring, plain, dev=dev)
    results = timed_results(ring, 1.0, "calls_per_s", 1.0)
    iv = median_ci(plain)
    results.update({"plain_s": iv.estimate, "plain_s_ci": iv.as_list(), "plain_times_s": plain,
                    "share_s": iv.estimate / cp,
                    "ring_extra_s": results["time_s"] - iv.estimate / cp,
                    "peak_extra_bytes": int(peak)})
    config = {"model": spec.name, "seq": seq, "micro_batch": micro_batch, "cp": cp,
              "compile": compiled, "heads": spec.n_heads, "head_dim": spec.head_dim,
              "rotate": "allgather", "load_balance": True, "warmup": warmup, "iters": iters,
              "repeats": repeats}
    return microbenchmark_record(bench="ring", config=config, results=results,
                                 gpus=cp, card=card(dev))


def _profile(step, path: str, rank: int) -> None:
    """Append rank 0's per-kernel CUDA times of one step to `path` (text table)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        with open(path, "a", encoding="utf-8") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.micro.ring",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="preset or YAML (repeatable)")
    p.add_argument("--seq-lens", default="8192,16384", help="comma list (multiples of 2 x cp)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--out", required=True, help="JSON-lines file the records are appended to")
    p.add_argument("--profile", default=None, help="text file for per-kernel tables (rank 0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ring attention needs GPUs (no gloo path)", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        for model in args.model:
            for seq in (int(s) for s in comma_items(args.seq_lens)):
                for mode in comma_items(args.modes):
                    rec = bench_ring(model, seq, args.micro_batch, compiled=mode == "compiled",
                                     profile=args.profile)
                    r = rec["results"]
                    if dist.get_rank() == 0:
                        append(args.out, rec)
                        print(f"{model} s={seq} cp={rec['gpus']} {mode}: ring "
                              f"{r['time_s'] * 1e3:.2f} ms, plain/cp {r['share_s'] * 1e3:.2f} ms,"
                              f" extra {r['ring_extra_s'] * 1e3:.2f} ms", flush=True)
    except TrainplanError as e:
        print(e, file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
