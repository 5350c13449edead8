#!/usr/bin/env bash
# Where context parallel's host time goes: host-side Chrome traces (CPU operators by thread
# and the kernels) of CP 2 x ZeRO-3 at 8k and, as the control, ZeRO-3 alone at 4k (the same
# tokens a rank), 1.3B proxy, 2 GPUs; three launches of each config unprofiled first.
set -u
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/cptrace; mkdir -p $o
common="--model llama-1.3b --zero 3 --micro-batch 1 --compile --warmup 4 --num-workers 2
  --pin-memory --no-progress --json --steps 12"
for run in cp:--seq-len=8192:--cp=2 z3:--seq-len=4096:--dp=2; do
  name=${run%%:*}; flags=$(echo ${run#*:} | tr ':=' '  ')
  torchrun --standalone --nproc-per-node 2 -m trainplan.bench.observe.profile \
    --profile-out $o/$name.json --active 4 --trace-out $o/$name-trace.json.gz \
    $flags $common --tag $name > $o/$name.log 2>&1
  tail -1 $o/$name.log | cut -c1-400
done
tar czf $OUT/cptrace.tgz -C ../out cptrace
ls -la $o
