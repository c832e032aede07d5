#!/usr/bin/env bash
# Rebuilds a kernel's PTX from its .cu with nvcc (the CUDA toolkit; no GPU needed).
# Usage: gpu/kernels/build-ptx.sh [NAME [OUTPUT]]   NAME: copy_segments (default),
# scatter_uniform or chunk_checksum; OUTPUT defaults to NAME.ptx next to the source.
# Without the toolkit, build-ptx-nvrtc.py does the same with NVRTC from PyPI
# (the embedded PTX files are built that way: their headers say so).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
name=${1:-copy_segments}
out=${2:-$here/$name.ptx}
# compute_75 is the oldest target CUDA 13 builds for; the driver JIT-compiles the PTX for the
# device it runs on.
nvcc --version | tail -1
nvcc -ptx -O3 -arch=compute_75 -o "$out" "$here/$name.cu"
echo "wrote $out"
