#!/usr/bin/env bash
# One `trainplan validate` call on a lent GPU machine, run from a `make snap` copy
# (`carry: [".snap"]`, command `cd .snap && bash lib/trainplan/bench/snap_validate.sh NAME
# BUDGET_S --suite data/suites/headline-4gpu.yaml [--continue-from ../out/vA] [--only ...]`).
# The machine's .git is stale, so the snapshot's commit is passed on; NCCL multicast stays
# off; the run's folder comes back as one tarball ($OUT returns at most 8 files); ../out
# survives between calls while the machine stays warm, for --continue-from.
set -u
export PYTHONPATH=$PWD/lib${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TRAINPLAN_GIT_COMMIT=$(cat COMMIT)
name=$1; budget=$2; shift 2
gpus=${GPUS:-4}
mkdir -p ../out
python3 -m trainplan.cli validate --gpus "$gpus" --out "../out/$name" --budget-s "$budget" "$@" \
  > "../out/$name.log" 2>&1
rc=$?
mkdir -p "../out/$name" && cp "../out/$name.log" "../out/$name/"
(cd ../out && tar czf "$OUT/$name.tgz" "$name")
tail -45 "../out/$name.log"
exit $rc
