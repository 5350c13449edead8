"""Several configs of one world size in one torchrun launch: suite sweeps and CPU tests.

    torchrun --standalone --nproc-per-node N -m trainplan.bench.series.sweep RUNS.json

RUNS.json holds a list of `{"tag": str, "args": [train.py arguments...]}`,
run in that order. Rank 0 prints one JSON line per run:
`{"tag", "position", "summary", "elapsed_s"}` or `{"tag", "position", "error",
"elapsed_s"}`. A run whose arguments hold `--records` gets its measurement
record appended exactly as a launch of train.py writes it (`train.write_record`:
same fields, provenance and `--run-id`), with "sweep launch: position P of N"
added to its `notes` (also in the printed summary).

Why: a GPU launch costs ~25 s, of which 3-6 s are timed steps; the rest is
torchrun, imports, the process group, the loader and compile. A sweep pays
the start once per world size (`python -m trainplan.bench.series.suite --sweep`,
`trainplan validate --sweep`); the loss-parity tests use it for the same reason.

Between runs: train.run keeps the model, optimizer and loader local, so they
are gone when it returns (an exception's frames go when its handler ends);
then a barrier, gc.collect() (loader workers and reference cycles),
torch._dynamo.reset() and, on CUDA, empty_cache() and reset_peak_memory_stats(),
then a barrier. So each run's peak memory is its own, and Dynamo starts as in
a fresh process: without the reset a second layout's new shapes would make
Dynamo recompile the shared block code with dynamic shapes, or pass its
recompile limit and run eager, neither of which a separate launch does.
The on-disk Inductor and Triton caches stay, as between separate launches;
each run's warm-up steps (dropped) absorb its compile. A run that raises
TrainplanError, or torch.OutOfMemoryError, is printed as an error line and the
sweep goes on; an out-of-memory on one rank only leaves the others in a
collective, and the suite stops the launch at its time limit.

Not shown yet: that GPU timings of a sweep equal those of separate launches.
What still differs is the process: a warm CUDA context, cuBLAS handles, the
allocator after empty_cache() rather than new, and the process groups of
earlier runs' device meshes, which stay (DeviceMesh may hand a group to a
later mesh of the same shape, so destroying them breaks it): their NCCL
buffers hold GPU memory outside the caching allocator, so outside the
measured peaks but not outside the card, and a config near the limit may
run out of memory in a sweep that fits alone.
Until a GPU A/B (the same suite, separate launches vs `--sweep`, on one
machine) shows their intervals overlap, separate launches are the default
and the committed figures come from them; the records say which they are.
"""

from __future__ import annotations

import gc
import json
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
    """One run of the sweep: its line (summary or error), its record written on rank 0."""
    start = time.perf_counter()
    line: dict = {"tag": run["tag"], "position": position}
    try:
        try:
            args = train.parse_args([*run["args"], "--json"])
        except SystemExit:  # argparse has said why on stderr
            raise TrainplanError(f"bad train.py arguments {run['args']}") from None
        summary = train.run(args)
        summary["notes"] = [*summary["notes"], note(position, total)]
        if args.records and _rank() == 0:
            train.write_record(args.records, summary, args.run_id)
        line["summary"] = summary
    except TrainplanError as err:
        line["error"] = str(err)
    except torch.OutOfMemoryError as err:  # its frames (the run's tensors) go with the handler
        line["error"] = f"out of memory: {str(err).strip().splitlines()[0][:200]}"
    line["elapsed_s"] = time.perf_counter() - start
    return line


def settle() -> None:
    """Leave nothing of the last run behind: objects, Dynamo state, cached memory."""
    if dist.is_initialized():
        dist.barrier()
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()


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
