// OrbitKV segment copy kernel: moves a list of byte ranges between GPU buffers. It gathers an
// engine's KV segments into a contiguous staging buffer before one large DMA to the host
// arena (save), and scatters a staging buffer back into the engine's pages after the DMA
// from the arena (load). Copy engines move the bytes across PCIe; this kernel only touches
// GPU memory, so it runs at HBM speed and occupies the SMs briefly.
//
// Built into copy_segments.ptx by build-ptx.sh (nvcc -ptx); the server embeds the PTX.

struct CopyDesc {
    unsigned long long src;  // device address of the first source byte
    unsigned long long dst;  // device address of the first destination byte
    unsigned long long len;  // bytes
};

// One warp per descriptor: warp w of the grid takes descriptors w, w + warps, ... Its 32 lanes
// copy 16 bytes each per step when every address and the length are 16-byte aligned (the
// common case: KV pages are), byte by byte otherwise. A warp per descriptor keeps thousands
// of small pages (2 KiB: 4 steps per lane) in flight at once; large ones loop.
extern "C" __global__ void orbitkv_copy_segments(const CopyDesc* __restrict__ descs,
                                                 unsigned int count) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warps = (gridDim.x * blockDim.x) >> 5;
    for (unsigned int d = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; d < count; d += warps) {
        const CopyDesc c = descs[d];
        if (((c.src | c.dst | c.len) & 15ull) == 0) {
            const uint4* __restrict__ s = reinterpret_cast<const uint4*>(c.src);
            uint4* __restrict__ t = reinterpret_cast<uint4*>(c.dst);
            const unsigned long long n = c.len >> 4;
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
            const unsigned char* s = reinterpret_cast<const unsigned char*>(c.src);
            unsigned char* t = reinterpret_cast<unsigned char*>(c.dst);
            for (unsigned long long i = lane; i < c.len; i += 32) {
                t[i] = s[i];
            }
        }
    }
}
