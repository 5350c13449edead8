"""Several layouts of one world size in one torchrun launch (CPU tests, quick checks).

    torchrun --standalone --nproc-per-node 2 -m trainplan.bench.sweep RUNS.json

RUNS.json holds a list of `{"tag": str, "args": [train.py arguments...]}`.
Rank 0 prints one JSON line per run: `{"tag", "summary", "elapsed_s"}`, or
`{"tag", "error", "elapsed_s"}`.
Starting Python, torch and the process group costs seconds per launch on a
small machine; the loss-parity tests pay it once per world size instead of
once per layout. Timings from a sweep are not measurements: the runs share
a process (allocator, compile caches), so GPU figures come from separate
launches of train.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from trainplan.bench import train
from trainplan.errors import TrainplanError


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runs = json.loads(Path(argv[0]).read_text())
    try:
        for run in runs:
            args = train.parse_args(run["args"] + ["--json"])
            start = time.perf_counter()
            try:
                line = {"tag": run["tag"], "summary": train.run(args)}
            except TrainplanError as err:
                line = {"tag": run["tag"], "error": str(err)}
            line["elapsed_s"] = time.perf_counter() - start
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(json.dumps(line), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
