"""The CPU half of a context-parallel layout, on 4 gloo ranks: `torchrun --nproc-per-node 4
tests/bench/cp_ranks.py OUT_DIR` (driven by tests/bench/test_context_parallel.py).

Ring attention cannot run on CPU, but the rest of a cp layout can: the mesh (cp between
dp_shard and tp, dp_shard x cp flattened for FSDP2), which data each rank reads, and the
sharded state a checkpoint holds. Each rank writes `rank{r}.json` with what it saw:

- its data-parallel coordinates and its cp group under dp 2 x cp 2 (ZeRO-3);
- the FSDP2 mesh its parameters live on;
- whether a DCP checkpoint of that layout's model loads into dp 4 (no cp) and back into a
  fresh cp layout with every tensor equal to the single-process model's;
- what `context.shard_sequences` leaves in the buffers: inside, each rank's head-tail share
  of the ids, labels and rotary tables; after, the tables restored and the batch not
  (entering and leaving the context runs on gloo; only the attention inside would not).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from trainplan.bench.harness import context
from trainplan.bench.harness import parallelize as pz
from trainplan.bench.harness.model import Transformer
from trainplan.specs import ModelSpec, ParallelConfig

TINY = ModelSpec(name="tiny", n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn=64, vocab=128)
CP_LAYOUT = ParallelConfig(dp=2, cp=2, zero=3)
DP_LAYOUT = ParallelConfig(dp=4, zero=3)


def layout_model(cfg: ParallelConfig, seed: int):
    """(Parallelized, mesh) of the tiny model built from `seed` under `cfg` on CPU."""
    mesh = pz.build_mesh(cfg, "cpu")
    torch.manual_seed(seed)
    model = Transformer.from_spec(TINY, max_seq_len=32)
    return pz.parallelize(model, cfg, mesh), mesh


def full_state(part) -> dict:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().clone() for k, v in get_model_state_dict(part, options=opts).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def buffer_shards(par, cp_rank: int) -> dict:
    """Enter and leave the step's context without a forward; say what the buffers held."""
    model = par.parts[0]
    x = torch.arange(2 * 32).reshape(2, 32)  # (B, S): position s of row b holds 32 b + s
    y = x + 1000
    cos_full = model.rope_cos.clone()
    pos = torch.tensor(context.head_tail_positions(32, 2, cp_rank))
    with context.shard_sequences(par, x, y):
        inside = {"ids_are_share": torch.equal(x, (torch.arange(2)[:, None] * 32 + pos)),
                  "labels_are_share": torch.equal(y, x + 1000),
                  "rope_is_share": torch.equal(model.rope_cos, cos_full[pos])}
    return {**inside, "rope_restored": torch.equal(model.rope_cos, cos_full),
            "batch_left_sharded": tuple(x.shape) == (2, 16)}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pz.check_layout(CP_LAYOUT, TINY, 4, seq_len=32)  # device unknown: the CPU refusal is off
    par, mesh = layout_model(CP_LAYOUT, seed=0)
    first = next(par.parameters())
    torch.manual_seed(0)
    reference = Transformer.from_spec(TINY, max_seq_len=32).state_dict()
    seen = {
        "dp": list(pz.dp_coordinates(CP_LAYOUT, mesh)),
        "cp_group": dist.get_process_group_ranks(mesh["cp"].get_group()),
        "cp_rank": mesh["cp"].get_local_rank(),
        "fsdp_mesh_ranks": first.device_mesh.mesh.flatten().tolist(),
        "fsdp_mesh_dims": list(first.device_mesh.mesh_dim_names),
        "fsdp": par.fsdp, "has_cp_mesh": par.cp_mesh is not None,
        "cp_state_is_reference": same(full_state(par.parts[0]), reference),
    }
    seen.update(buffer_shards(par, mesh["cp"].get_local_rank()))
    ckpt = out / "ckpt"
    dcp.save(get_model_state_dict(par.parts[0]), checkpoint_id=str(ckpt))
    for name, cfg in (("dp4", DP_LAYOUT), ("cp2_again", CP_LAYOUT)):
        other, _ = layout_model(cfg, seed=1)  # other weights, overwritten by the load
        state = get_model_state_dict(other.parts[0])
        dcp.load(state, checkpoint_id=str(ckpt))
        set_model_state_dict(other.parts[0], state)
        seen[f"loads_into_{name}"] = same(full_state(other.parts[0]), reference)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
