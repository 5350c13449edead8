#!/usr/bin/env bash
# Issue 26: loss parity of the DDP levers (bf16 residual stream + whole-model compile) on the
# training path, warm-up and cosine decay, the second seed (1), 2 x H200 (DDP over both GPUs): the
# fp8-parity protocol's corpus, tokenizer and schedule (../fp8-parity/h200x2-20261128b/),
# micro-batch 4 a rank (16,384 tokens a step, as there).
set -u
root=$PWD
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/ddplev; mkdir -p $o
python3 -c "import json, sysconfig; from pathlib import Path; \
from trainplan.data.corpus import stdlib_files; \
site = Path(sysconfig.get_paths()['purelib']); \
[print(json.dumps({'text': p.read_text(errors='replace')})) \
 for p in stdlib_files() + stdlib_files(site / 'sympy')]" > $o/code.jsonl
python3 -m trainplan.cli data prepare $o/code.jsonl --vocab-size 32000 --val-fraction 0.02 \
  --out $o/shards > $o/prepare.log 2>&1
cp $o/shards/index.json $o/shards-index.json 2>/dev/null
args="--model llama-1.3b --data $o/shards --seq-len 2048 --dp 2 --zero 0 --micro-batch 4
  --compile --steps 440 --lr 3e-4 --lr-warmup 40 --lr-schedule cosine --lr-floor 0.1
  --eval-every 40 --eval-batches 8 --seed 1 --log-every 20 --no-progress --json"
torchrun --standalone --nproc-per-node 2 -m trainplan.train $args --log-dir $o/off > $o/off.json 2> $o/off.log
torchrun --standalone --nproc-per-node 2 $root/tools/stacked_levers.py --ddp --module trainplan.train \
  $args --log-dir $o/on > $o/on.json 2> $o/on.log
rm -rf $o/shards $o/code.jsonl
tar czf $OUT/ddplev.tgz -C ../out ddplev
tail -3 $o/prepare.log; tail -c 600 $o/off.json; echo; tail -c 600 $o/on.json; tail -3 $o/on.log
