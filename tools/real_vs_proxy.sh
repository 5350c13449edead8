#!/usr/bin/env bash
# The trainer on real token shards against the harness's proxy path: one model, one layout,
# one host, run one after the other in the same call (issue 21's evidence that the real-data
# path costs no throughput). Run on a GPU host from the repository root or a `make snap` copy:
#   bash tools/real_vs_proxy.sh OUT_DIR [GPUS]
# The corpus is the Python standard library's source (text the OS ships), copied into
# .txt files, one document a module; `trainplan data prepare` trains a 32,000-id byte-level BPE on it
# (`tokenizers`) and writes the shards. Prints one JSON line: both paths' median
# tokens/s/GPU over the steps after warm-up, and their ratio.
set -eu
out=$1; gpus=${2:-2}; steps=24; warmup=4
export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1
mkdir -p "$out/corpus"
stdlib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
for f in "$stdlib"/*.py; do cp "$f" "$out/corpus/$(basename "$f" .py).txt"; done
python3 -m trainplan.cli data prepare "$out/corpus" --vocab-size 32000 --out "$out/shards" \
  --no-progress --json > "$out/prepare.json"
layout="--model llama-1.3b --seq-len 2048 --dp $gpus --zero 2 --micro-batch 8 --compile"
run="python3 -m torch.distributed.run --standalone --nproc-per-node $gpus"
$run -m trainplan.train $layout --data "$out/shards" --steps $steps --log-dir "$out/train-log" \
  --log-every 1 --eval-every 0 --no-progress --json > "$out/train.json" 2> "$out/train.log"
$run -m trainplan.bench.harness.train $layout --steps $steps --warmup $warmup --num-workers 2 \
  --pin-memory --no-progress --json --records "$out/proxy.jsonl" > "$out/proxy.json" 2> "$out/proxy.log"
python3 - "$out" "$warmup" <<'PY'
import json, statistics, sys
from pathlib import Path
out, warmup = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(x) for x in (out / "train-log" / "training.jsonl").read_text().splitlines()]
real = statistics.median(r["tokens_per_s_per_gpu"] for r in rows
                         if "tokens_per_s_per_gpu" in r and r["step"] > warmup)
proxy = json.loads((out / "proxy.jsonl").read_text().splitlines()[-1])["tokens_per_s_per_gpu"]
print(json.dumps({"real_tokens_per_s_per_gpu": real, "proxy_tokens_per_s_per_gpu": proxy,
                  "real_over_proxy": real / proxy, "steps": len(rows), "warmup": warmup}))
PY
