#!/usr/bin/env bash
# Rebuilds copy_segments.ptx from copy_segments.cu (needs nvcc; run on a CUDA machine).
# Usage: gpu/kernels/build-ptx.sh [OUTPUT]   (default: next to the source)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/copy_segments.ptx}
# compute_75 is the oldest target CUDA 13 builds for; the driver JIT-compiles the PTX for the
# device it runs on.
nvcc --version | tail -1
nvcc -ptx -O3 -arch=compute_75 -o "$out" "$here/copy_segments.cu"
echo "wrote $out"
