"""Collectives per optimizer step, and whether the compiled blocks recompile.

    torchrun --standalone --nproc-per-node N -m trainplan.bench.observe.comm_report \
        [--count-steps 2] [--backend inductor|aot_eager|eager] [--detail] [train.py flags]

The run is train.py's own (`train.run`); as bench/profile.py does, this entry
only swaps, for the run, module attributes the loop looks up at call time:
`parallelize.build_mesh` (keep the mesh, to name process groups),
`step.train_step` (count the last `--count-steps` steps under a CommDebugMode)
and `step.reduce_partial_grads` (mark what follows the backward "step": Partial gradients
made whole, clipping, the optimizer).
`--backend` other than inductor swaps `parallelize.apply_compile` for the same
per-block `compile(fullgraph=True)` with that Dynamo backend (no C++ compiler).

Rank 0 prints one JSON line. `collectives_per_step`: "kind dim phase" ->
calls, bytes, dtypes; bytes = the size S that trainplan.cost.comms prices
(all-gather output, reduce-scatter input, all-reduce tensor); dim = the mesh
dimension of the group; phase = fwd, bwd (in autograd's backward, FSDP2's
reduce-scatters included) or step. `dynamo` (with --compile) is read before
the counted steps: graph breaks, recompiles and their first guard failure,
graph variants of the block's forward, recompile-limit hits. Counted steps
run the blocks eager (set_stance force_eager: a dispatch mode stops Dynamo
compiling, and fullgraph would raise); the collectives are the same ops.
`step_s_median`: uncounted steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from trainplan.bench.harness import parallelize as par_mod
from trainplan.bench.harness import step as step_mod
from trainplan.bench.harness import train
from trainplan.bench.harness.model import TransformerBlock
from trainplan.errors import TrainplanError

KINDS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all", "broadcast")


def kind_of(op_name: str) -> str:
    """all_gather for `_allgather_base_` and `all_gather_into_tensor` alike."""
    plain = op_name.replace("_", "")
    return next((k for k in KINDS if k.replace("_", "") in plain), op_name)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_ranks(args) -> tuple[int, ...] | None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, str):  # functional collectives name their group
            try:
                return tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
            except Exception:  # noqa: BLE001 - not a group name
                continue
        if isinstance(a, torch.ScriptObject):  # c10d ops pass the group boxed
            a = dist.ProcessGroup.unbox(a)
        if isinstance(a, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(a))
    return None


def collective_size(kind: str, op_name: str, args) -> tuple[int, str]:
    """(S in bytes, dtype) of one collective call, S as trainplan.cost.comms prices it.

    Functional collectives take (input, ..., group size, group name); c10d ops
    take (output(s), input(s), group, ...).
    """
    if op_name.startswith(("_c10d_functional", "c10d_functional")):
        ts, n = _tensors(args[0]), next((a for a in args[1:] if isinstance(a, int)), 1)
        scale = n if kind == "all_gather" else 1  # input is the shard; S is the output
    else:
        outputs, inputs = _tensors(args[0]), _tensors(args[1]) if len(args) > 1 else []
        ts, scale = (inputs if kind == "reduce_scatter" and inputs else outputs), 1
    if not ts:
        return 0, "?"
    size = scale * sum(t.numel() * t.element_size() for t in ts)
    return size, str(ts[0].dtype).replace("torch.", "")


def _tolerate_open_modules(tracker) -> None:
    """CommDebugMode's module tracker pops a parent at each module's forward end, and raises
    where a module began before the count did (a pipeline schedule's stage runs its forward
    inside a counted step, its root outside): such an end only resets the tracker's state."""
    real = getattr(tracker, "_fw_set_module_hook", None)
    if real is None or not hasattr(tracker, "parent_list"):  # another torch's tracker
        return

    def set_module(mod, inputs, output):
        if tracker.is_bw or len(tracker.parent_list) > 1:
            return real(mod, inputs, output)
        tracker.activation_checkpointing = False
        return None

    tracker._fw_set_module_hook = set_module


class CommCounter(CommDebugMode):
    """CommDebugMode that also keeps, per call, kind, process group, phase, bytes and dtype."""

    def __init__(self, dim_of_ranks: dict):
        super().__init__()
        self.dim_of_ranks, self.phase = dim_of_ranks, "fwd"
        self.calls: dict = defaultdict(lambda: {"calls": 0, "bytes": 0, "dtypes": set()})
        self.shapes: dict = defaultdict(int)  # (key, op, shape of the first tensor): calls
        self.debug_counts: dict = defaultdict(int)  # CommDebugMode's own, over every step
        _tolerate_open_modules(self.advanced_module_tracker)

    def __exit__(self, *args):
        for op, n in self.get_comm_counts().items():  # its __enter__ clears them
            self.debug_counts[str(op)] += n
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # CommDebugMode counted a collective
            name = str(func._overloadpacket)
            kind = kind_of(name.split(".")[-1])
            ranks = _group_ranks(list(args) + list((kwargs or {}).values()))
            dim = self.dim_of_ranks.get(ranks, f"ranks{list(ranks) if ranks else '?'}")
            phase = "bwd" if torch._C._current_graph_task_id() != -1 else self.phase
            size, dtype = collective_size(kind, name, args)
            entry = self.calls[f"{kind} {dim} {phase}"]
            entry["calls"] += 1
            entry["bytes"] += size
            entry["dtypes"].add(dtype)
            shape = next((list(t.shape) for t in _tensors(args[0])), None)
            self.shapes[(f"{kind} {dim} {phase}", name, str(shape))] += 1
        return out


def mesh_dims(mesh) -> dict:
    """{ranks of this rank's group along a mesh dimension: its name} for dimensions > 1."""
    if mesh is None:
        return {}
    return {tuple(dist.get_process_group_ranks(mesh[d].get_group())): d
            for d in mesh.mesh_dim_names if mesh[d].size() > 1}


class _Records(logging.Handler):
    def __init__(self, logger: str):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        logging.getLogger(logger).addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


def dynamo_numbers(recompiles: _Records, limits: _Records) -> dict:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    reasons = []  # first line, and the first failed guard, of each recompile
    for message in recompiles.messages:
        lines = [x.strip() for x in message.splitlines()]
        guard = next((x for x in lines if x.startswith("- ") and "/" in x[:8]), "")
        reasons.append(f"{lines[0]} :: {guard[:240]}")
    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"])[:10],
            "recompiles": len(recompiles.messages), "recompile_reasons": reasons[:10],
            "block_graph_variants": len(_debug_get_cache_entry_list(TransformerBlock.forward)),
            "recompile_limit_hits": [m.splitlines()[0] for m in limits.messages
                                     if "hit config" in m][:10]}


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m trainplan.bench.observe.comm_report",
                                add_help=False)
    p.add_argument("--count-steps", type=int, default=2, help="last steps counted")
    p.add_argument("--backend", default="inductor", help="Dynamo backend of the compiled blocks")
    p.add_argument("--detail", action="store_true", help="also list calls by op and shape")
    return p.parse_known_args(argv)


def main(argv=None) -> int:
    mine, rest = parse(list(sys.argv[1:] if argv is None else argv))
    targs = train.parse_args([*rest, "--json"])
    count = max(1, min(mine.count_steps, targs.steps - targs.warmup - 1))
    torch._logging.set_logs(recompiles=True)
    recompiles = _Records("torch._dynamo.guards.__recompiles")
    limits = _Records("torch._dynamo.convert_frame")
    kept: dict = {"dims": {}, "times": [], "dynamo": None, "counter": None}
    real = {"build_mesh": par_mod.build_mesh, "apply_compile": par_mod.apply_compile,
            "train_step": step_mod.train_step, "reduce": step_mod.reduce_partial_grads}

    def build_mesh(*a, **kw):
        mesh = real["build_mesh"](*a, **kw)
        kept["dims"] = mesh_dims(mesh)
        return mesh

    def apply_compile(model, whole=False):
        for part in [model] if whole else model.layers.values():
            part.compile(fullgraph=True, backend=mine.backend)

    def reduce_partial_grads(*a, **kw):
        if kept["counter"]:
            kept["counter"].phase = "step"  # and stays so through clipping and the optimizer
        return real["reduce"](*a, **kw)

    def train_step(*a, **kw):
        if len(kept["times"]) < targs.steps - count:
            t0 = time.perf_counter()
            out = real["train_step"](*a, **kw)
            kept["times"].append(time.perf_counter() - t0)
            return out
        if kept["counter"] is None:
            kept["dynamo"] = dynamo_numbers(recompiles, limits) if targs.compile else None
            kept["counter"] = CommCounter(kept["dims"])
        kept["counter"].phase = "fwd"
        with torch.compiler.set_stance("force_eager"), kept["counter"]:
            return real["train_step"](*a, **kw)

    par_mod.build_mesh, step_mod.train_step = build_mesh, train_step
    step_mod.reduce_partial_grads = reduce_partial_grads
    if mine.backend != "inductor":
        par_mod.apply_compile = apply_compile
    try:
        summary = train.run(targs)
    except TrainplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        par_mod.build_mesh, par_mod.apply_compile = real["build_mesh"], real["apply_compile"]
        step_mod.train_step, step_mod.reduce_partial_grads = real["train_step"], real["reduce"]
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(report(kept, summary, mine, count, targs.warmup)))
    return 0


def report(kept: dict, summary: dict, mine, count: int, warmup: int) -> dict:
    """Rank 0's JSON: the counted steps' collectives divided by their number."""
    calls = kept["counter"].calls
    per_step = {key: {"calls": v["calls"] / count, "bytes": v["bytes"] / count,
                      "dtypes": sorted(v["dtypes"])} for key, v in sorted(calls.items())}
    totals: dict = defaultdict(lambda: {"calls": 0.0, "bytes": 0.0})
    for key, v in per_step.items():  # over the phases
        for field in ("calls", "bytes"):
            totals[key.rsplit(" ", 1)[0]][field] += v[field]
    timed = kept["times"][warmup:]
    out = {"layout": summary["layout"], "model": summary["model"], "seq_len": summary["seq_len"],
           "ranks": summary["ranks"], "card": summary["card"], "backend": mine.backend,
           "counted_steps": count, "mesh_dims": sorted(set(kept["dims"].values())),
           "collectives_per_step": per_step, "totals_per_step": dict(sorted(totals.items())),
           "comm_debug_counts_per_step": {k: v / count for k, v
                                          in kept["counter"].debug_counts.items() if v},
           "dynamo": kept["dynamo"], "losses": summary["losses"],
           "step_s_median": statistics.median(timed) if timed else None}
    if mine.detail:
        out["detail_per_step"] = [[*key, n / count]
                                  for key, n in sorted(kept["counter"].shapes.items())]
    return out


if __name__ == "__main__":
    sys.exit(main())
