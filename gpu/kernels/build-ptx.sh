#!/usr/bin/env bash
# Rebuilds a kernel's PTX from its .cu with nvcc (the CUDA toolkit; no GPU needed).
# Usage: gpu/kernels/build-ptx.sh [NAME [OUTPUT]]   NAME: copy_segments (default),
# copy_blocks, scatter_uniform or chunk_checksum; OUTPUT defaults to NAME.ptx next to the source.
# Without the toolkit, build-ptx-nvrtc.py does the same with NVRTC from PyPI
# (the embedded PTX files are built that way: their headers say so).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
name=${1:-copy_segments}
out=${2:-$here/$name.ptx}
# compute_75 is the oldest target CUDA 13 builds for; the driver JIT-compiles the PTX for the
# device it runs on.
nvcc --version | tail -1
nvcc -ptx -O3 -arch=compute_75 -o "$out.tmp" "$here/$name.cu"
# The source's CRC-32 (zlib's): gpu/tests/ptx_matches_source.rs fails when the source changed
# and its PTX was not rebuilt.
crc=$(python3 -c 'import sys, zlib; print("%08x" % zlib.crc32(open(sys.argv[1], "rb").read()))' "$here/$name.cu")
{ echo "// Built from $name.cu by build-ptx.sh (nvcc, compute_75)"; echo "// Source crc32 $crc"; cat "$out.tmp"; } > "$out"
rm -f "$out.tmp"
echo "wrote $out"
