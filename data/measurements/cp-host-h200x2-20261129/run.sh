#!/usr/bin/env bash
# Context parallel 2 (ring attention) x FSDP2 ZeRO-3 on the 1.3B proxy, the most
# host-sensitive rows of the 2-GPU suite: the two rows through `trainplan validate`
# (predictions first, three launches each), the busiest threads mid-launch, then one profiled
# launch of p-cp2-z3-mb1-s8k-2gpu (every rank) and one under the collective counter.
set -u
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/cphost; mkdir -p $o
(sleep 45; top -b -n1 -H -w 220 | head -30 > $o/top.txt) &
python3 -m trainplan.cli validate --gpus 2 --out $o/v --budget-s 200 --skip-micro --launches 3 \
  --suite data/suites/cp-4gpu.yaml --only p-cp2-z3-mb1-s8k-2gpu p-cp2-z3-mb2-s4k-2gpu > $o/v.log 2>&1
flags="--model llama-1.3b --seq-len 8192 --cp 2 --zero 3 --micro-batch 1 --compile --warmup 4
  --num-workers 2 --pin-memory --no-progress --tag p-cp2-z3-mb1-s8k-2gpu"
torchrun --standalone --nproc-per-node 2 -m trainplan.bench.observe.profile \
  --profile-out $o/prof.json --active 8 --every-rank $flags --json --steps 16 > $o/prof.log 2>&1
torchrun --standalone --nproc-per-node 2 -m trainplan.bench.observe.comm_report \
  --count-steps 2 $flags --steps 8 > $o/comm.json 2> $o/comm.log
tar czf $OUT/cphost.tgz -C ../out cphost
tail -12 $o/v.log; tail -1 $o/prof.log | cut -c1-600; head -c 1500 $o/comm.json
