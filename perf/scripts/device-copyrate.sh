#!/usr/bin/env bash
# perf/scripts/device-copyrate.py on a CUDA host under MPS (MPS=0 to run without):
# device-to-host copies shaped as the server issues them, alone and beside the bf16 matmul
# loop. Needs PyTorch with CUDA and nvidia-cuda-mps-control; run from the repository root.
# Arguments (shapes) go to the script; results in $OUT/copyrate.json and $OUT/copyrate.log
# (OUT: an existing directory).
MPS=${MPS:-1}
. perf/scripts/mps.sh $OUT/copyrate.log
python3 perf/scripts/device-copyrate.py $OUT/copyrate.json "$@" >> $OUT/copyrate.log 2>&1
echo "rc=$?" >> $OUT/copyrate.log
