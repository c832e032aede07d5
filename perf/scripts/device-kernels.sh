#!/usr/bin/env bash
# The GPU kernels' own numbers on a CUDA host: registers and spills of each embedded PTX
# (ptxas -v, sm_90), then Nsight Compute (ncu, clocks left alone) on a local sglang save of
# 2 KiB pages, 64 MiB jobs of 2 MiB chunks: the checksum kernels and the segment copy kernel,
# their duration, registers and occupancy. Without ncu or ptxas on the machine, says so and
# goes on. Then the host's cores: xxh3-64 of 2 MiB chunks with 1-8 threads (orbitkv-perf
# checksum), what the shards hash with --gpu-checksums cpu. Run from the repository root with
# the stripped release binaries in .device-bin/; results go to $OUT (an existing directory;
# files kernels-$TAG*).
# PTX names another chunk_checksum.ptx to profile instead of the embedded one, PERF another
# orbitkv-perf binary. The PTX must have the same kernels: the same names and parameters (a
# kernel whose parameters change is renamed, so another one fails to load, naming the kernel).
# Exported as ORBITKV_CHECKSUM_KERNEL_PTX for perf/scripts/device-gpu-server.sh it reaches
# orbitkv-server too: that is how to compare checksum kernels through the server with one
# binary. PTX overrides need binaries built with `--features kernel-dev` (orbitkv-perf,
# orbitkv-server); other builds load the embedded PTX only.
B=.device-bin
P=${PERF:-$B/orbitkv-perf}
R=$OUT/kernels-$TAG
if [ -n "$PTX" ]; then export ORBITKV_CHECKSUM_KERNEL_PTX=$PTX; fi
if command -v ptxas >/dev/null; then
  for f in gpu/kernels/*.ptx ${PTX:+$PTX}; do
    echo "== $f" >> $R-ptxas.txt
    ptxas -arch=sm_90 -v "$f" -o /tmp/okv-kernel.cubin >> $R-ptxas.txt 2>&1
  done
else
  echo "no ptxas on this machine" > $R-ptxas.txt
fi
A="dma --json --iterations 1 --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy auto"
if command -v ncu >/dev/null; then
  S="--clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats"
  # Past the first submissions (module load, first use of each slot).
  timeout 120 ncu $S -k regex:xxh3 --launch-skip 8 --launch-count 6 $P $A > $R-checksum.txt 2>&1
  echo "rc=$?" >> $R-checksum.txt
  timeout 120 ncu $S -k regex:copy_segments --launch-skip 8 --launch-count 3 $P $A > $R-copy.txt 2>&1
  echo "rc=$?" >> $R-copy.txt
  grep -hE "^  orbitkv_|Duration|Registers Per|Achieved Occ" $R-checksum.txt $R-copy.txt > $R-summary.txt
else
  echo "no ncu on this machine" > $R-summary.txt
fi
$P checksum --threads 1,2,4,8 --duration 2s --json > $R-cpu-checksum.json 2>&1
