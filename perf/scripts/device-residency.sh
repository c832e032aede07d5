#!/usr/bin/env bash
# perf/scripts/device-residency.py on a CUDA host under MPS (MPS=0 to run without): the
# bf16 matmul loop beside kernels that only wait, by grid, duration and period. Needs PyTorch
# with CUDA and nvidia-cuda-mps-control; run from the repository root. Arguments
# (GRID:DUR_US:PERIOD_US ...) go to the script; results in $OUT/residency.json and
# $OUT/residency.log (OUT: an existing directory).
MPS=${MPS:-1}
. perf/scripts/mps.sh $OUT/residency.log
python3 perf/scripts/device-residency.py $OUT/residency.json "$@" >> $OUT/residency.log 2>&1
echo "rc=$?" >> $OUT/residency.log
