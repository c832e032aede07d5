#!/usr/bin/env bash
# perf/scripts/device-residency.py on the device machine under MPS (MPS=0 to run without): the
# bf16 matmul loop beside kernels that only wait, by grid, duration and period. Arguments
# (GRID:DUR_US:PERIOD_US ...) go to the script; results in $OUT/residency.json and
# $OUT/residency.log.
MPS=${MPS:-1}
. perf/scripts/mps.sh $OUT/residency.log
python3 perf/scripts/device-residency.py $OUT/residency.json "$@" >> $OUT/residency.log 2>&1
echo "rc=$?" >> $OUT/residency.log
