// OrbitKV block copy kernel: the segment copy kernel (copy_segments.cu) for a batch given as
// block ids instead of one descriptor per page. Every supported KV layout puts part p (one
// layer's K or V slice) of the block with id b at parts[p] + b * stride, so a batch is its
// block ids and the layout's part bases; the host writes 8 bytes per block rather than 24 per
// part (a 2 KiB-page job of 64 MiB: 512 ids against 32,768 descriptors), and the kernel reads
// that much less table. Staging holds the batch's blocks one after another, each part after
// part.
//
// Built into copy_blocks.ptx by build-ptx-nvrtc.py (NVRTC from PyPI, or build-ptx.sh with
// nvcc); the server embeds the PTX. `block_copies` in gpu/src/dma/plan.rs is its CPU model.

// Longest run one warp copies (BLOCK_UNIT in plan.rs): a longer part is several units.
#define UNIT (64ull << 10)
// Most units one warp takes together (their addresses fit the warp's lanes).
#define MAX_GROUP 8u

// Unit u < count is piece s = u % subs of part p = (u / subs) % part_count of the batch's
// block i = u / subs / part_count. Warp w takes units w * group, ... (group at most
// MAX_GROUP), then strides by the grid's warps: its lanes each work out one unit's addresses
// (the block id and part base read once per lane) and hand them round with shuffles; the warp
// copies the units one after the other, 16 bytes per lane per step when every address and
// the length are 16-byte aligned (KV pages are), byte by byte otherwise. `gather`: engine ->
// staging (save), else staging -> engine (load). The parts table is in device memory; the
// block ids are read where the host put them (a save's in mapped pinned memory, a load's
// uploaded with its batch).
extern "C" __global__ void orbitkv_copy_blocks(const unsigned long long* __restrict__ parts,
                                               const unsigned long long* __restrict__ blocks,
                                               unsigned long long stride,
                                               unsigned long long part_len,
                                               unsigned long long staging,
                                               unsigned int part_count, unsigned int subs,
                                               unsigned int count, unsigned int group,
                                               unsigned int gather) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int g = group < 1u ? 1u : (group > MAX_GROUP ? MAX_GROUP : group);
    const unsigned long long warps = (gridDim.x * blockDim.x) >> 5;
    for (unsigned long long first =
             ((unsigned long long)(blockIdx.x * blockDim.x + threadIdx.x) >> 5) * g;
         first < count; first += warps * g) {
        const unsigned int here = count - first < g ? (unsigned int)(count - first) : g;
        unsigned long long src = 0, dst = 0, len = 0;
        if (lane < here) {
            const unsigned int u = (unsigned int)first + lane;
            const unsigned int r = u / subs;  // the part's index in the batch
            const unsigned int p = r % part_count;
            const unsigned int i = r / part_count;
            const unsigned long long skip = (unsigned long long)(u % subs) * UNIT;
            const unsigned long long left = part_len - skip;
            len = left < UNIT ? left : UNIT;
            const unsigned long long engine = parts[p] + blocks[i] * stride + skip;
            const unsigned long long staged = staging + (unsigned long long)r * part_len + skip;
            src = gather ? engine : staged;
            dst = gather ? staged : engine;
        }
        for (unsigned int j = 0; j < here; j++) {
            const unsigned long long s_addr = __shfl_sync(0xffffffffu, src, j);
            const unsigned long long t_addr = __shfl_sync(0xffffffffu, dst, j);
            const unsigned long long n_bytes = __shfl_sync(0xffffffffu, len, j);
            if (((s_addr | t_addr | n_bytes) & 15ull) == 0) {
                const uint4* __restrict__ s = reinterpret_cast<const uint4*>(s_addr);
                uint4* __restrict__ t = reinterpret_cast<uint4*>(t_addr);
                const unsigned long long n = n_bytes >> 4;
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
                const unsigned char* s = reinterpret_cast<const unsigned char*>(s_addr);
                unsigned char* t = reinterpret_cast<unsigned char*>(t_addr);
                for (unsigned long long i = lane; i < n_bytes; i += 32) {
                    t[i] = s[i];
                }
            }
        }
    }
}
