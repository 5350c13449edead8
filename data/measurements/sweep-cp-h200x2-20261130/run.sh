#!/usr/bin/env bash
# Is a host-bound context-parallel config slower late in a sweep launch? One sweep with
# p-cp2-z3-mb1-s8k-2gpu at positions 1, 2, 8 and 11, threads of rank 0 counted every 10 s,
# then two launches of that config alone.
set -u
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/sweepcp; mkdir -p $o/sweep $o/alone
python3 ../data/measurements/sweep-cp-h200x2-20261130/make_runs.py $o/sweep > $o/runs.json
( while sleep 10; do
    for p in $(pgrep -f "trainplan.bench.series.sweep|trainplan.bench.harness.train" | head -8); do
      echo "$(date +%T) pid $p threads $(ls /proc/$p/task 2>/dev/null | wc -l)"; done
    top -b -n1 -H -w 200 | sed -n 7,16p
  done > $o/threads.txt 2>&1 ) &
mon=$!
torchrun --standalone --nproc-per-node 2 -m trainplan.bench.series.sweep $o/runs.json \
  > $o/sweep.log 2>&1
for i in 1 2; do
  torchrun --standalone --nproc-per-node 2 -m trainplan.bench.harness.train \
    $(python3 -c "import json,sys; a=json.load(open('$o/runs.json'))[0]['args']; print(' '.join(a))" \
      | sed "s#$o/sweep#$o/alone#") > $o/alone-$i.log 2>&1
done
kill $mon
tar czf $OUT/sweepcp.tgz -C ../out sweepcp
python3 - <<'PY'
import json
for f in ("../out/sweepcp/sweep/measurements.jsonl", "../out/sweepcp/alone/measurements.jsonl"):
    for line in open(f):
        r = json.loads(line)
        print(f.split("/")[-2], r["tag"], round(r["step_time_s"], 4), r["notes"][-1][:40])
PY
