"""Does NCCL read NCCL_PROTO per run of a sweep? The check before `tune --effects-pairing
sweep-nccl` on a machine.

For NCCL_PROTO unset, then LL (the protocol whose large-message bandwidth is a fraction of
the default's), each set for the run as a sweep sets it (`series.sweep.environment`), the
harness's mesh is built as a sweep's run builds it (`parallelize.build_mesh(fresh=True)`)
and a 256 MiB fp32 all-reduce over its FSDP group is timed (median of 10 after 3). NCCL
honours the per-run setting when LL takes at least `MIN_RATIO` times the default's time;
rank 0 prints one JSON line, and the exit status is 0 when it does, 1 when it does not.

Run: `torchrun --standalone --nproc-per-node N -m trainplan.bench.micro.nccl_env` (GPUs).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from trainplan.bench.harness.parallelize import build_mesh
from trainplan.bench.series.sweep import environment
from trainplan.specs import ParallelConfig

MIN_RATIO = 1.5  # LL against the default, 256 MiB on NVLink: ~2.5 where the variable is read


def _median_ms(fn, n: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> int:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        print("trainplan: error: nccl_env needs GPUs (NCCL); none is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    x = torch.ones(64 * 2**20, device=device)
    out = {"world": world, "gpu": torch.cuda.get_device_name(device)}
    for proto in (None, "LL"):
        with environment({"NCCL_PROTO": proto}):
            mesh = build_mesh(ParallelConfig(dp=world, zero=3), "cuda", fresh=True)
            group = mesh["dp_shard"].get_group()
            out[f"{proto or 'default'}_ms"] = round(_median_ms(
                lambda g=group: dist.all_reduce(x, group=g)), 3)
            out[f"{proto or 'default'}_is_default_group"] = group is dist.group.WORLD
    out["ratio"] = round(out["LL_ms"] / out["default_ms"], 2)
    out["honoured"] = out["ratio"] >= MIN_RATIO
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0 if out["honoured"] else 1


if __name__ == "__main__":
    sys.exit(main())
