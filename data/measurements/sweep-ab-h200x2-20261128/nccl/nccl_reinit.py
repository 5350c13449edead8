"""Does a re-initialised default process group read NCCL_PROTO again? all-reduce of 256 MiB
(fp32) and all-gather of 64 MiB (bf16), init -> destroy -> init under each setting, and a
1-D device mesh's group after each init."""
import json, os, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

rank = int(os.environ["LOCAL_RANK"]); dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
res = {}
for proto in [None, "LL", "Simple", None, "LL"]:
    if proto: os.environ["NCCL_PROTO"] = proto
    else: os.environ.pop("NCCL_PROTO", None)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()
    m = init_device_mesh("cuda", (1, world, 1), mesh_dim_names=("pp", "shard", "tp"))
    g = m.get_group("shard")
    x = torch.ones(64 * 2**20, device=dev)
    shard = torch.ones(32 * 2**20 // world, device=dev, dtype=torch.bfloat16)
    out = torch.empty(32 * 2**20, device=dev, dtype=torch.bfloat16)
    dist.barrier(); init_s = time.perf_counter() - t0
    def t(fn, n=10):
        for _ in range(3): fn()
        torch.cuda.synchronize(); s = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize(); return round((time.perf_counter() - s) / n * 1e3, 3)
    res.setdefault(str(proto), []).append({"init_s": round(init_s, 2),
        "ar_ms": t(lambda: dist.all_reduce(x, group=g)),
        "ag_ms": t(lambda: dist.all_gather_into_tensor(out, shard, group=g))})
    dist.destroy_process_group()
if rank == 0: print("NCCLREINIT", json.dumps(res), flush=True)
