#!/usr/bin/env bash
# Why launches of one host-sensitive layout (TP 2, micro-batch 8, the 1.3B proxy) spread in
# step time: per launch, the host's CPU accounting (/proc/stat before and after: user, system,
# idle, steal), the busiest threads mid-run (top -H), GPU clocks, power and throttle reasons
# (nvidia-smi every 250 ms), launches alternating --cpu-affinity none / gpu-local; then one
# launch under the profiler (observe.profile, every rank). Run from the repository root of a
# device call that carries .snap; the folder comes back as $OUT/tpnoise.tgz.
set -u
root=$PWD
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/tpnoise; mkdir -p $o
{ date -u; nproc; lscpu; cat /proc/loadavg; nvidia-smi; nvidia-smi topo -m;
  ps aux --sort=-%cpu | head -25; } > $o/host.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > $o/smi.csv 2>&1 &
smi=$!
flags="--model llama-1.3b --seq-len 2048 --tp 2 --micro-batch 8 --compile --warmup 4
  --num-workers 2 --pin-memory --no-progress --json --tag p-tp2-mb8-2gpu"
for i in ${LAUNCHES:-1 2 3 4 5 6}; do
  aff=none; [ $((i % 2)) = 0 ] && aff=gpu-local
  { echo "start $i $aff $(date +%s.%N)"; head -1 /proc/stat; cat /proc/loadavg; } >> $o/stat.txt
  (sleep 22; top -b -n1 -H -w 220 | head -40 > $o/top$i.txt) &
  torchrun --standalone --nproc-per-node 2 -m trainplan.bench.harness.train $flags --steps 34 \
    --cpu-affinity $aff --run-id tpnoise-$i --records $o/m.jsonl > $o/l$i.log 2>&1
  { echo "end $i $(date +%s.%N) rc $?"; head -1 /proc/stat; } >> $o/stat.txt
done
torchrun --standalone --nproc-per-node 2 -m trainplan.bench.observe.profile \
  --profile-out $o/prof.json --active 8 --every-rank $flags --steps 16 > $o/prof.log 2>&1
kill $smi
cp $root/data/measurements/tp-noise-h200x2-20261129/run.sh $o/ 2>/dev/null
tar czf $OUT/tpnoise.tgz -C ../out tpnoise
grep -h '"step_time_s"' $o/l*.log | cut -c1-300
tail -3 $o/prof.log
