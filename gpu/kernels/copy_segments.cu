// OrbitKV segment copy kernel: moves a list of byte ranges between GPU buffers. It gathers an
// engine's KV segments into a contiguous staging buffer before one large DMA to the host
// arena (save), and scatters a staging buffer back into the engine's pages after the DMA
// from the arena (load). Copy engines move the bytes across PCIe; this kernel only touches
// GPU memory, so it runs at HBM speed and occupies the SMs briefly.
//
// Built into copy_segments.ptx by build-ptx-nvrtc.py (NVRTC from PyPI, or build-ptx.sh with
// nvcc); the server embeds the PTX.

struct CopyDesc {
    unsigned long long src;  // device address of the first source byte
    unsigned long long dst;  // device address of the first destination byte
    unsigned long long len;  // bytes
};

// Most descriptors one warp reads together (their 24 words fit the warp's lanes).
#define MAX_GROUP 8u

// Warp w of the grid takes descriptor groups w, w + warps, ... (`group` descriptors each, 1 to
// MAX_GROUP). The group's table entries are read by the warp's lanes together, one 8-byte word
// per lane, and handed round with shuffles; the warp then copies them one after the other. A
// save's table is read in place from mapped host memory, across PCIe, and a read per
// descriptor (three words, every lane asking for the same ones) sent read requests upstream
// per page beside the save's data; a group of eight's 192 contiguous bytes go in two or three.
// Measured on the H200 (perf dma, 2 KiB pages, groups of eight): saves 0.970-0.972 of the
// contiguous ceiling before, 0.975-0.976 after. Long descriptors go in groups of one: a warp
// keeps only 2 KiB of loads in flight, and a batch of few long pieces needs many warps.
// Its 32 lanes copy 16 bytes each per step when every address and the length are 16-byte
// aligned (the common case: KV pages are), byte by byte otherwise.
extern "C" __global__ void orbitkv_copy_segments(const CopyDesc* __restrict__ descs,
                                                 unsigned int count, unsigned int group) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int g = group < 1u ? 1u : (group > MAX_GROUP ? MAX_GROUP : group);
    const unsigned long long warps = (gridDim.x * blockDim.x) >> 5;
    const unsigned long long* __restrict__ words =
        reinterpret_cast<const unsigned long long*>(descs);
    for (unsigned long long first =
             ((unsigned long long)(blockIdx.x * blockDim.x + threadIdx.x) >> 5) * g;
         first < count; first += warps * g) {
        const unsigned int here = count - first < g ? (unsigned int)(count - first) : g;
        // Lane l holds word l of the group: descriptor l / 3, field l % 3.
        unsigned long long w = 0;
        if (lane < here * 3u) {
            w = words[first * 3u + lane];
        }
        for (unsigned int j = 0; j < here; j++) {
            const unsigned long long src = __shfl_sync(0xffffffffu, w, 3u * j);
            const unsigned long long dst = __shfl_sync(0xffffffffu, w, 3u * j + 1u);
            const unsigned long long len = __shfl_sync(0xffffffffu, w, 3u * j + 2u);
            if (((src | dst | len) & 15ull) == 0) {
                const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src);
                uint4* __restrict__ t = reinterpret_cast<uint4*>(dst);
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
                const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
                unsigned char* t = reinterpret_cast<unsigned char*>(dst);
                for (unsigned long long i = lane; i < len; i += 32) {
                    t[i] = s[i];
                }
            }
        }
    }
}
