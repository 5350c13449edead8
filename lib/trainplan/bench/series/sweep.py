"""Several configs of one world size in one torchrun launch: suite sweeps and CPU tests.

    torchrun --standalone --nproc-per-node N -m trainplan.bench.series.sweep RUNS.json

RUNS.json lists the runs, `{"tag": str, "args": [train.py arguments...]}`, done in that
order; rank 0 prints one JSON line per run (`run_one`), and a run with `--records` appends
train.py's own measurement record, marked in its `notes` (`note`). Formats:
`lib/trainplan/bench/README.md`, "Formats". A run may add `"env": {NAME: value or null}`,
set (null: unset) for that run only; it then builds its device mesh from new process
groups (`parallelize.build_mesh(fresh=True)`), so that NCCL, which reads NCCL_ALGO and
NCCL_PROTO when it makes a communicator, sees the run's values. FSDP2, DDP and pipeline
sends take the run's group objects; tensor parallel's DTensor ops do once `settle` has
emptied DTensor's sharding caches, which would otherwise hand a later run the first run's
mesh; context parallel may not (`own_env_refused`).

Why: a GPU launch costs ~25 s, of which 3-6 s are timed steps; the rest is torchrun,
imports, the process group, the loader and compile. A sweep pays the start once per world
size (`python -m trainplan.bench.series.suite --sweep`, `trainplan validate --sweep`); the
loss-parity tests use it for the same reason. Between runs `settle` clears what the last
run left. On a GPU a sweep's run times as a launch of its own where the step is GPU-bound
(docs/measurement.md, "Several configs in one launch"); the knob study's rounds use it too
(`trainplan.tune.batch`, `trainplan.tune.pairs`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainplan.bench.harness import train
from trainplan.errors import TrainplanError


def note(position: int, total: int) -> str:
    """The mark a sweep's run leaves in its summary's and record's `notes`."""
    return f"sweep launch: position {position} of {total}"


def run_one(run: dict, position: int, total: int) -> dict:
    """One run of the sweep: its line (summary or error), its record written on rank 0.

    The record is the one a launch of train.py writes (`train.write_record`: same fields,
    provenance and `--run-id`), with `note` added to `notes`. A run that raises
    TrainplanError or torch.OutOfMemoryError gives an error line and the sweep goes on; an
    out-of-memory on one rank only leaves the others in a collective, and the suite stops
    the launch at its time limit."""
    start = time.perf_counter()
    line: dict = {"tag": run["tag"], "position": position}
    try:
        try:
            args = train.parse_args([*run["args"], "--json"])
        except SystemExit:  # argparse has said why on stderr
            raise TrainplanError(f"bad train.py arguments {run['args']}") from None
        args.fresh_groups = run.get("env") is not None
        if args.fresh_groups and (why := own_env_refused(args)):
            raise TrainplanError(why)
        with environment(run.get("env") or {}):
            summary = train.run(args)
            summary["notes"] = [*summary["notes"], note(position, total)]
            if args.records and _rank() == 0:  # its provenance names the run's environment
                train.write_record(args.records, summary, args.run_id)
        line["summary"] = summary
    except TrainplanError as err:
        line["error"] = str(err)
    except torch.OutOfMemoryError as err:  # its frames (the run's tensors) go with the handler
        line["error"] = f"out of memory: {str(err).strip().splitlines()[0][:200]}"
    line["elapsed_s"] = time.perf_counter() - start
    return line


def own_env_refused(args) -> str | None:
    """Why a run of these train.py arguments cannot carry its own NCCL_* inside a sweep, or
    None. Tensor parallel can where this torch lets `clear_dtensor_caches` empty DTensor's
    sharding caches between runs (2 x H200, TP 2: NCCL_PROTO=LL -12.7% inside one sweep,
    -11.9% in launches of their own, data/measurements/tune-effects-h200x2-20261128b/
    tp-env-sweep/; +0.2% inside a sweep before the clearing). Context parallel's ring has
    not been shown to follow a run's groups, so it is refused."""
    if getattr(args, "cp", 1) > 1:
        return (f"a sweep run with its own environment needs --cp 1, not --cp {args.cp}: "
                "the ring's collectives are not shown to use the run's process groups; run "
                "it in a launch of its own")
    if getattr(args, "tp", 1) > 1 and not dtensor_caches_clearable():
        return (f"a sweep run with its own environment under --tp {args.tp} needs a torch "
                f"whose DTensor sharding caches can be emptied (this is {torch.__version__}); "
                "run it in a launch of its own")
    return None


@contextlib.contextmanager
def environment(env: dict):
    """Set (a None value: unset) these environment variables for the block, then restore."""
    before = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, str(v))
        yield
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def settle() -> None:
    """Leave nothing of the last run behind: objects, Dynamo state, cached memory.

    train.run keeps the model, optimizer and loader local, so they are gone when it returns
    (an exception's frames go when its handler ends); then a barrier, gc.collect() (loader
    workers and reference cycles), torch._dynamo.reset(), DTensor's sharding caches
    (`clear_dtensor_caches`), on CUDA empty_cache() and
    reset_peak_memory_stats(), and a barrier. So each run's peak memory is its own, and
    Dynamo starts as in a fresh process: without the reset a second layout's new shapes
    would make Dynamo recompile the shared block code with dynamic shapes, or pass its
    recompile limit and run eager, neither of which a separate launch does. The on-disk
    Inductor and Triton caches stay, as between separate launches; each run's warm-up steps
    (dropped) absorb its compile."""
    if dist.is_initialized():
        dist.barrier()
    gc.collect()
    torch._dynamo.reset()
    clear_dtensor_caches()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()


def _dtensor_caches():
    """DTensor's sharding-propagation caches as (Python's lru_cache, the C++ fast path's clear
    function); None for one this torch lacks. Both are private to torch."""
    from torch.distributed.tensor import DTensor

    cached = getattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None),
                     "propagate_op_sharding", None)
    return (cached if hasattr(cached, "cache_clear") else None,
            getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None))


def dtensor_caches_clearable() -> bool:
    """Whether this torch has both of DTensor's sharding caches where
    `clear_dtensor_caches` empties them."""
    return all(c is not None for c in _dtensor_caches())


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches (Python's, on this thread, and the C++
    fast path's), which hold the last run's device meshes, so a new run's ops give outputs on
    its own mesh; where a version lacks one, there is nothing of it to clear."""
    cached, native = _dtensor_caches()
    if cached is not None:
        cached.cache_clear()
    if native is not None:
        native()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runs = json.loads(Path(argv[0]).read_text())
    try:
        for position, run in enumerate(runs, 1):
            line = run_one(run, position, len(runs))
            if _rank() == 0:
                print(json.dumps(line), flush=True)
            settle()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
