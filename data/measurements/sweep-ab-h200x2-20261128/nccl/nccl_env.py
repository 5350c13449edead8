"""Is NCCL_PROTO read per communicator? Bus time of a 256 MiB all-reduce and all-gather on
groups made after changing os.environ (new_group, and a 5-D device mesh's dim group)."""
import json, os, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

rank = int(os.environ["LOCAL_RANK"]); dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
world = dist.get_world_size()
x = torch.ones(64 * 2**20, device=dev)          # 256 MiB fp32
shard = torch.ones(32 * 2**20 // world, device=dev, dtype=torch.bfloat16)
out = torch.empty(32 * 2**20, device=dev, dtype=torch.bfloat16)

def t(fn, n=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return round((time.perf_counter() - s) / n * 1e3, 3)

res = {"world_default": t(lambda: dist.all_reduce(x))}
for proto in ["LL", "Simple", None, "LL"]:
    if proto: os.environ["NCCL_PROTO"] = proto
    else: os.environ.pop("NCCL_PROTO", None)
    g = dist.new_group(list(range(world)))
    m = init_device_mesh("cuda", (1, 1, world, 1, 1), mesh_dim_names=("pp", "rep", "shard", "cp", "tp"))
    mg = m.get_group("shard")
    res[f"{proto}"] = {"new_group_ar_ms": t(lambda: dist.all_reduce(x, group=g)),
                       "mesh_ar_ms": t(lambda: dist.all_reduce(x, group=mg)),
                       "mesh_ag_ms": t(lambda: dist.all_gather_into_tensor(out, shard, group=mg)),
                       "mesh_is_world": mg is dist.group.WORLD}
res["default_again"] = t(lambda: dist.all_reduce(x))
if rank == 0: print("NCCLENV", json.dumps(res), flush=True)
dist.destroy_process_group()
