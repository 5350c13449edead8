#!/usr/bin/env bash
# After 4d9db6e (the norms' Partial gradients made whole once a step): the two TP 2 rows of
# the generalisation suite through `trainplan validate` (predictions first, three launches
# each), GPU clocks and power beside them, then one profiled launch of p-tp2-mb8-2gpu.
set -u
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/tpfix; mkdir -p $o
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > $o/smi.csv 2>&1 &
smi=$!
python3 -m trainplan.cli validate --gpus 2 --out $o/v --budget-s 240 --skip-micro --launches 3 \
  --suite data/suites/general-4gpu.yaml --only p-tp2-mb8-2gpu p-tp2-mb2-s8k-2gpu > $o/v.log 2>&1
flags="--model llama-1.3b --seq-len 2048 --tp 2 --micro-batch 8 --compile --warmup 4
  --num-workers 2 --pin-memory --no-progress --json --tag p-tp2-mb8-2gpu"
torchrun --standalone --nproc-per-node 2 -m trainplan.bench.observe.profile \
  --profile-out $o/prof.json --active 8 --every-rank $flags --steps 16 > $o/prof.log 2>&1
kill $smi
tar czf $OUT/tpfix.tgz -C ../out tpfix
tail -25 $o/v.log; tail -2 $o/prof.log
