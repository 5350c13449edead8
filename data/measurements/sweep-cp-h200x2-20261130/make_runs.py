"""RUNS.json for one sweep launch that repeats the host-bound context-parallel config at
positions 1, 2, 8 and 11 between other 2-GPU configs (run from the snapshot's root)."""
import json
import sys
from pathlib import Path

from trainplan.bench.series import suite as S

out = Path(sys.argv[1])
configs = {}
for f in ("data/suites/general-4gpu.yaml", "data/suites/cp-4gpu.yaml"):
    s = S.load_suite(f)
    configs.update({c["tag"]: (s, c) for c in s["configs"]})
order = ["p-cp2-z3-mb1-s8k-2gpu", "p-cp2-z3-mb1-s8k-2gpu", "g8-z3-mb4-2gpu", "p-tp2-mb8-2gpu",
         "g13-z3-mb1-s16k-sel-2gpu", "p-z2-mb8-2gpu", "g70-cp2-z3-mb1-s8k-2gpu",
         "p-cp2-z3-mb1-s8k-2gpu", "g8-cp2-z3-mb1-s16k-2gpu", "p-tp2-mb2-s8k-2gpu",
         "p-cp2-z3-mb1-s8k-2gpu"]
runs = [{"tag": f"{t}@{i + 1}", "args": S.train_args(*configs[t], out, "sweep-cp")}
        for i, t in enumerate(order)]
print(json.dumps(runs, indent=1))
