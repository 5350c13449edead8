#!/usr/bin/env bash
# After 190e9ce (records carry harness_revision 2): the two TP 2 rows of the generalisation
# suite again through `trainplan validate` (predictions first, two launches each), so the
# family bands read series of the fixed harness.
set -u
cd .snap
export PYTHONPATH=$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
o=../out/rev2; mkdir -p $o
python3 -m trainplan.cli validate --gpus 2 --out $o/v --budget-s 190 --skip-micro --launches 2 \
  --suite data/suites/general-4gpu.yaml --only p-tp2-mb8-2gpu p-tp2-mb2-s8k-2gpu > $o/v.log 2>&1
cp $o/v.log $o/v/
tar czf $OUT/rev2.tgz -C $o v
tail -8 $o/v.log
