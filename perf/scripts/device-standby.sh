#!/usr/bin/env bash
# perf/scripts/device-standby.py on a CUDA host under MPS (MPS=0 to run without): how long a
# newly launched gather waits for SMs beside the bf16 matmul loop, against a resident kernel
# polling for work. Needs PyTorch with CUDA and nvidia-cuda-mps-control; run from the
# repository root. Arguments (MODE:MIB:GRID:PERIOD_US ...) go to the script; results in
# $OUT/standby.json and $OUT/standby.log (OUT: an existing directory).
MPS=${MPS:-1}
. perf/scripts/mps.sh $OUT/standby.log
python3 perf/scripts/device-standby.py $OUT/standby.json "$@" >> $OUT/standby.log 2>&1
echo "rc=$?" >> $OUT/standby.log
