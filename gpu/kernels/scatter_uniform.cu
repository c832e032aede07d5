// OrbitKV uniform scatter kernel: the load side of the segment copy kernel
// (copy_segments.cu) for a staging batch whose segments all have one length, the common case
// (every page of a layout is as long as the others). Segment d is the `len` staging bytes at
// `src + d * len`, and goes to `dsts[d]`. Its table is 8 bytes per segment instead of 24: a
// load's table crosses the bus in the same direction as the load's data, so on 2 KiB pages
// the full table would take about 1.2% of the bus, this one 0.4%.
//
// Built into scatter_uniform.ptx by build-ptx-nvrtc.py (NVRTC from PyPI, or build-ptx.sh
// with nvcc).

// One warp per segment: 16 bytes per lane per step when the addresses and the length are
// 16-byte aligned, byte by byte otherwise, as orbitkv_copy_segments copies each of its
// descriptors. The table lies in device memory (it came up with the batch), so each warp
// reads its own 8 bytes rather than a group's. The copy loop is repeated rather than shared:
// each kernel is one self-contained source, built and measured as it stands.
extern "C" __global__ void orbitkv_scatter_uniform(const unsigned long long* __restrict__ dsts,
                                                   unsigned int count,
                                                   unsigned long long src,
                                                   unsigned long long len) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warps = (gridDim.x * blockDim.x) >> 5;
    for (unsigned int d = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; d < count; d += warps) {
        const unsigned long long from = src + (unsigned long long)d * len;
        const unsigned long long to = dsts[d];
        if (((from | to | len) & 15ull) == 0) {
            const uint4* __restrict__ s = reinterpret_cast<const uint4*>(from);
            uint4* __restrict__ t = reinterpret_cast<uint4*>(to);
            const unsigned long long n = len >> 4;
            unsigned long long i = lane;
            // Four loads in flight per lane before their stores.
            for (; i + 96 < n; i += 128) {
                const uint4 a = s[i];
                const uint4 b = s[i + 32];
                const uint4 e = s[i + 64];
                const uint4 f = s[i + 96];
                t[i] = a;
                t[i + 32] = b;
                t[i + 64] = e;
                t[i + 96] = f;
            }
            for (; i < n; i += 32) {
                t[i] = s[i];
            }
        } else {
            const unsigned char* s = reinterpret_cast<const unsigned char*>(from);
            unsigned char* t = reinterpret_cast<unsigned char*>(to);
            for (unsigned long long i = lane; i < len; i += 32) {
                t[i] = s[i];
            }
        }
    }
}
