#!/usr/bin/env bash
# Checksum kernel builds compared on one CUDA host, with one orbitkv-perf binary: each side is a chunk_checksum.ptx loaded through ORBITKV_CHECKSUM_KERNEL_PTX (same
# kernel names and parameters as the embedded one; "-" for the embedded PTX itself).
#   SIDES="new=- old=.device-bin/ptx/old.ptx" (name=path, names of letters, digits, -)
# First ncu (clocks left alone) on a local sglang save of 2 KiB pages, 64 MiB jobs of 2 MiB
# chunks, for each side: the checksum kernels' duration, registers and occupancy. Then the
# local interference run RUN of perf/scripts/device-dma.sh (default intf-sglang-2k)
# under MPS, the sides alternated ROUNDS (2) times, each with INTF_ROUNDS (2) rounds of its
# own measurements. Run from the repository root with the stripped release binaries in
# .device-bin/, orbitkv-perf built with `--features kernel-dev` (other builds load the
# embedded PTX only); needs PyTorch with CUDA and nvidia-cuda-mps-control (ncu optional).
# Everything is packed into $OUT/ptx-ab.tgz (OUT: an existing directory), with the summary
# ($OUT/ptx-ab-summary.txt) beside it. perf/scripts/summarize-gpu.py reads the runs.
set -u
B=.device-bin
SIDES=${SIDES:-"new=-"}
ROUNDS=${ROUNDS:-2}
RUN=${RUN:-intf-sglang-2k}
export INTF_ROUNDS=${INTF_ROUNDS:-2}
W=/tmp/okv-ptx-ab
rm -rf $W && mkdir -p $W/ncu $W/runs
for side in $SIDES; do
  name=${side%%=*} path=${side#*=}
  [[ "$name" =~ ^[A-Za-z0-9-]+$ ]] || { echo "SIDES: '$name' is not a name of letters, digits and -" >&2; exit 2; }
  [ "$path" = - ] || [ -f "$path" ] || { echo "SIDES: $name: no file $path" >&2; exit 2; }
done
# The PTX of a side, exported for what runs in the subshell that calls it.
use() { if [ "$1" != - ]; then export ORBITKV_CHECKSUM_KERNEL_PTX=$1; fi; }
A="dma --json --iterations 1 --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy auto"
if command -v ncu >/dev/null; then
  for side in $SIDES; do
    name=${side%%=*} path=${side#*=}
    # Past the first submissions (module load, first use of each slot).
    ( use "$path"; timeout 90 ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats -k regex:xxh3 --launch-skip 8 --launch-count 6 $B/orbitkv-perf $A ) \
      > $W/ncu/$name.txt 2>&1
    echo "rc=$?" >> $W/ncu/$name.txt
  done
else
  echo "no ncu on this machine" > $W/ncu/none.txt
fi
for round in $(seq "$ROUNDS"); do
  for side in $SIDES; do
    name=${side%%=*} path=${side#*=}
    ( use "$path"; OUT=$W/runs MPS=1 TAG=$name$round- ONLY=$RUN timeout 400 bash perf/scripts/device-dma.sh )
    echo "$name$round rc=$?" >> $W/runs/ab.log
    # By process name, exactly: a pattern over whole command lines would match this shell.
    pkill -x orbitkv-perf
    sleep 1
  done
done
{
  for f in $W/ncu/*.txt; do
    echo "== ncu $(basename "$f" .txt)"
    grep -E "^  orbitkv_|Duration|Registers Per|Achieved Occ" "$f"
  done
  python3 perf/scripts/summarize-gpu.py $W/runs
} > $W/ptx-ab-summary.txt 2>&1
cp $W/ptx-ab-summary.txt "$OUT/"
tar czf "$OUT/ptx-ab.tgz" -C $W .
