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

// Each thread block takes descriptors blockIdx.x, blockIdx.x + gridDim.x, ...; its threads
// copy one descriptor together, 16 bytes per thread per step when every address and the
// length are 16-byte aligned (the common case: KV pages are), byte by byte otherwise.
extern "C" __global__ void orbitkv_copy_segments(const CopyDesc* __restrict__ descs,
                                                 unsigned int count) {
    for (unsigned int d = blockIdx.x; d < count; d += gridDim.x) {
        const CopyDesc c = descs[d];
        if (((c.src | c.dst | c.len) & 15ull) == 0) {
            const uint4* __restrict__ s = reinterpret_cast<const uint4*>(c.src);
            uint4* __restrict__ t = reinterpret_cast<uint4*>(c.dst);
            const unsigned long long n = c.len >> 4;
            const unsigned long long step = blockDim.x;
            unsigned long long i = threadIdx.x;
            // Four loads in flight per thread before their stores.
            for (; i + 3 * step < n; i += 4 * step) {
                const uint4 a = s[i];
                const uint4 b = s[i + step];
                const uint4 e = s[i + 2 * step];
                const uint4 f = s[i + 3 * step];
                t[i] = a;
                t[i + step] = b;
                t[i + 2 * step] = e;
                t[i + 3 * step] = f;
            }
            for (; i < n; i += step) {
                t[i] = s[i];
            }
        } else {
            const unsigned char* s = reinterpret_cast<const unsigned char*>(c.src);
            unsigned char* t = reinterpret_cast<unsigned char*>(c.dst);
            for (unsigned long long i = threadIdx.x; i < c.len; i += blockDim.x) {
                t[i] = s[i];
            }
        }
    }
}
