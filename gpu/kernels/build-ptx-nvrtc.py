#!/usr/bin/env python3
"""Builds a kernel's PTX with NVRTC, without the CUDA toolkit or a GPU: the runtime compiler
comes from PyPI (`pip install nvidia-cuda-nvrtc-cu12`). Same target as build-ptx.sh
(compute_75, -O3 is NVRTC's default); the PTX ISA is the wheel's (CUDA 12.x: loads on CUDA 12
and later drivers).

Usage: gpu/kernels/build-ptx-nvrtc.py SOURCE.cu [OUTPUT.ptx]
"""
import ctypes
import glob
import os
import sys
import zlib


def nvrtc():
    import nvidia.cuda_nvrtc  # the wheel's package

    base = list(nvidia.cuda_nvrtc.__path__)[0]
    libs = sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so*")))
    if not libs:
        sys.exit("libnvrtc not found in " + base)
    return ctypes.CDLL(libs[0])


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(src)[0] + ".ptx"
    lib = nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    prog = ctypes.c_void_p()
    text = open(src, "rb").read()
    name = os.path.basename(src).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text, name, 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_75", b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        sys.stderr.write(log.value.decode(errors="replace") + "\n")
    if rc != 0:
        sys.exit(f"NVRTC failed to compile {src} (status {rc})")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    # The source's CRC-32: a test (gpu/tests/ptx_matches_source.rs) fails when the source
    # changed and its PTX was not rebuilt.
    header = (
        f"// Built from {os.path.basename(src)} by build-ptx-nvrtc.py (NVRTC {major.value}.{minor.value}, compute_75)\n"
        f"// Source crc32 {zlib.crc32(text):08x}\n"
    )
    with open(out, "w") as f:
        f.write(header + ptx.value.decode())
    print(f"wrote {out} (NVRTC {major.value}.{minor.value})")


if __name__ == "__main__":
    main()
