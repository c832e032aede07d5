// OrbitKV chunk checksums on the GPU: XXH3-64 (seed 0, default secret) of chunks whose bytes
// are scattered over an engine's KV pages, the same value `orbitkv_proto::chunk_checksum`
// computes on the CPU, for chunks longer than 240 bytes (XXH3's long-input path).
//
// XXH3 keeps 8 accumulator lanes and walks the input in 1 KiB blocks of 16 stripes of 64
// bytes. Within a block every stripe's effect on a lane is a sum (mod 2^64), so a block's
// contribution can be computed on its own; only the scramble after each full block is
// sequential, and it is per lane. Hence three kernels:
//   orbitkv_xxh3_blocks: eight threads per block of every chunk (one per lane): the lane sums
//     of its stripes (the chunk's last block also takes the final stripe with its own secret);
//   orbitkv_xxh3_fold: eight threads per chunk: each lane from its initial value through "add
//     the block's sum, scramble" for each full block, plus the last block's sum;
//   orbitkv_xxh3_merge: one thread per chunk: the final merge of the lanes and avalanche.
// Chunk bytes are read where they lie: a chunk is a list of segments (logical start, device
// address) in order, each running to the next segment's start (the last to the chunk's length).
//
// Built into chunk_checksum.ptx by build-ptx-nvrtc.py (NVRTC from PyPI; build-ptx.sh does the
// same with nvcc). The file is also valid C (no C++ features): the CPU test of orbitkv-gpu
// compiles it with a C compiler and runs all three kernels thread by thread against
// `orbitkv_proto::chunk_checksum`.

#ifdef __CUDACC__
#define ORBITKV_KERNEL extern "C" __global__
#define ORBITKV_DEVICE __device__ static inline
#define ORBITKV_CONST __constant__ static const
#else
#define ORBITKV_KERNEL
#define ORBITKV_DEVICE static inline
#define ORBITKV_CONST static const
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

// Per chunk (five little-endian u64; see gpu/src/dma/checksum.rs).
typedef struct {
    u64 len;        // bytes (> 240)
    u64 seg_first;  // index of its first segment
    u64 seg_count;  // its segments
    u64 row_first;  // index of its first block row in the scratch rows
    u64 unused;     // keeps the record 40 bytes, as written by the host
} HashChunk;

// Per segment: where in the chunk it starts and its device address.
typedef struct {
    u64 start;
    u64 addr;
} HashSeg;

#define XXH_PRIME32_1 0x9E3779B1ull
#define XXH_PRIME64_1 0x9E3779B185EBCA87ull

// secret[8k..8k+8] as little-endian words, k < 24: stripe s, lane i uses W[s + i]; the
// scramble uses W[16 + i] (the secret's last 64 bytes).
ORBITKV_CONST u64 W[24] = {
    0xbe4ba423396cfeb8ull, 0x1cad21f72c81017cull, 0xdb979083e96dd4deull,
    0x1f67b3b7a4a44072ull, 0x78e5c0cc4ee679cbull, 0x2172ffcc7dd05a82ull,
    0x8e2443f7744608b8ull, 0x4c263a81e69035e0ull, 0xcb00c391bb52283cull,
    0xa32e531b8b65d088ull, 0x4ef90da297486471ull, 0xd8acdea946ef1938ull,
    0x3f349ce33f76faa8ull, 0x1d4f0bc7c7bbdcf9ull, 0x3159b4cd4be0518aull,
    0x647378d9c97e9fc8ull, 0xc3ebd33483acc5eaull, 0xeb6313faffa081c5ull,
    0x49daf0b751dd0d17ull, 0x9e68d429265516d3ull, 0xfca1477d58be162bull,
    0xce31d07ad1b8f88full, 0x280416958f3acb45ull, 0x7e404bbbcafbd7afull,
};
// secret[121 + 8i..]: the final stripe's secret (secret length - 64 - 7).
ORBITKV_CONST u64 L[8] = {
    0xea647378d9c97e9full, 0xc5c3ebd33483acc5ull, 0x17eb6313faffa081ull,
    0xd349daf0b751dd0dull, 0x2b9e68d429265516ull, 0x8ffca1477d58be16ull,
    0x45ce31d07ad1b8f8ull, 0xaf280416958f3acbull,
};
// secret[11 + 8i..]: the merge's secret.
ORBITKV_CONST u64 M[8] = {
    0x6dd4de1cad21f72cull, 0xa44072db979083e9ull, 0xe679cb1f67b3b7a4ull,
    0xd05a8278e5c0cc4eull, 0x4608b82172ffcc7dull, 0x9035e08e2443f774ull,
    0x52283c4c263a81e6ull, 0x65d088cb00c391bbull,
};
ORBITKV_CONST u64 INIT[8] = {
    0x00000000C2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
    0x85EBCA77C2B2AE63ull, 0x0000000085EBCA77ull, 0x27D4EB2F165667C5ull, 0x000000009E3779B1ull,
};

// A cursor over one chunk's segments, moving forward only, with the current segment's bounds
// cached in registers.
typedef struct {
    const HashSeg* segs;
    u64 count;
    u64 len;    // chunk length: end of the last segment
    u64 at;     // current segment
    u64 start;  // its first chunk offset
    u64 end;    // one past its last
    u64 addr;   // its device address
} Cursor;

ORBITKV_DEVICE void enter(Cursor* c, u64 s) {
    c->at = s;
    c->start = c->segs[s].start;
    c->end = s + 1 < c->count ? c->segs[s + 1].start : c->len;
    c->addr = c->segs[s].addr;
}

// Positions the cursor on the segment holding byte `o` (binary search).
ORBITKV_DEVICE void seek(Cursor* c, u64 o) {
    u64 lo = 0, hi = c->count;
    while (hi - lo > 1) {
        u64 mid = (lo + hi) / 2;
        if (c->segs[mid].start <= o) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    enter(c, lo);
}

ORBITKV_DEVICE void reach(Cursor* c, u64 o) {
    while (o >= c->end) {
        enter(c, c->at + 1);
    }
}

// The little-endian word at chunk offset `o` (o + 8 <= len), byte by byte across segments
// (the slow path: unaligned or straddling).
ORBITKV_DEVICE u64 word_slow(Cursor* c, u64 o) {
    u64 v = 0;
    for (u32 j = 0; j < 8; j++) {
        reach(c, o + j);
        v |= (u64)(*(const unsigned char*)(c->addr + (o + j - c->start))) << (8 * j);
    }
    return v;
}

// The 16 bytes at chunk offset `o` (a multiple of 16, o + 16 <= len) as two words.
ORBITKV_DEVICE void pair(Cursor* c, u64 o, u64* lo, u64* hi) {
    reach(c, o);
    u64 a = c->addr + (o - c->start);
    if (o + 16 <= c->end && (a & 15ull) == 0) {
#ifdef __CUDACC__
        ulonglong2 v = *(const ulonglong2*)a;
        *lo = v.x;
        *hi = v.y;
#else
        *lo = ((const u64*)a)[0];
        *hi = ((const u64*)a)[1];
#endif
        return;
    }
    *lo = word_slow(c, o);
    *hi = word_slow(c, o + 8);
}

// Rows of a chunk: one per full block before the last, plus the last (partial) one.
ORBITKV_DEVICE u64 full_blocks(u64 len) {
    return (len - 1) / 1024;
}

// Eight threads per row (thread j: accumulator lane j), `rows` rows over `nchunks` chunks
// (row_first ascending): lane j's sum over the row's stripes of the partner word (j ^ 1) plus
// the 32x32-bit product of its own word mixed with the secret. The eight threads of a row read
// its 64-byte stripes together (16 bytes each, shared by a lane pair), so a warp reads four
// rows' stripes at once. Writes scratch[8 * row + j].
ORBITKV_KERNEL void orbitkv_xxh3_blocks(const HashChunk* chunks, u32 nchunks,
                                        const HashSeg* segs, u64* scratch, u64 rows) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 r = t >> 3;
    u32 j = (u32)(t & 7u);
    if (r >= rows) {
        return;
    }
    // The chunk owning row r: the last one whose row_first <= r.
    u32 lo = 0, hi = nchunks;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (chunks[mid].row_first <= r) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    const HashChunk ch = chunks[lo];
    u64 b = r - ch.row_first;
    u64 nb = full_blocks(ch.len);
    Cursor c;
    c.segs = segs + ch.seg_first;
    c.count = ch.seg_count;
    c.len = ch.len;
    u64 base = b * 1024;
    // This lane's pair of words within a stripe: bytes 16 * (j / 2) .. + 16.
    u64 in_stripe = 16ull * (j >> 1);
    seek(&c, base + in_stripe);
    u64 sum = 0;
    u32 n = b < nb ? 16 : (u32)(((ch.len - 1) - nb * 1024) / 64);
    for (u32 s = 0; s < n; s++) {
        u64 w0, w1;
        pair(&c, base + 64ull * s + in_stripe, &w0, &w1);
        u64 own = (j & 1u) ? w1 : w0;
        u64 partner = (j & 1u) ? w0 : w1;
        u64 k = own ^ W[s + j];
        sum += partner + (k & 0xffffffffull) * (k >> 32);
    }
    if (b == nb) {
        // The final stripe: the chunk's last 64 bytes (it may overlap the stripes above, and
        // need not be 16-byte aligned).
        u64 o = ch.len - 64 + 8ull * (j & ~1u);
        seek(&c, o);
        u64 w0 = word_slow(&c, o);
        u64 w1 = word_slow(&c, o + 8);
        u64 own = (j & 1u) ? w1 : w0;
        u64 partner = (j & 1u) ? w0 : w1;
        u64 k = own ^ L[j];
        sum += partner + (k & 0xffffffffull) * (k >> 32);
    }
    scratch[8 * r + j] = sum;
}

// One full block's step of lane accumulator `acc`: add the block's sum, scramble.
ORBITKV_DEVICE u64 fold_step(u64 acc, u64 sum, u64 key) {
    u64 a = acc + sum;
    a ^= a >> 47;
    a ^= key;
    return a * XXH_PRIME32_1;
}

// Rows folded per step of the pipeline below; two such groups are in flight.
#define FOLD_GROUP 16

// Eight threads per chunk (thread j: lane j): lane j's accumulator from its initial value
// through "add the row's sum, scramble" for each full block, plus the last row's sum; left in
// the chunk's last row, lane j. The chain is sequential, so what it costs is its length (a
// 2 MiB chunk has 2048 full blocks) times each step, and a step must not wait for memory: the
// next group of row sums is loaded while the current one is folded. Loading a group, then
// folding it, paid a memory round trip per eight steps. Measured on the H200 (perf dma, 2 MiB
// chunks of 2 KiB pages, before / after): alone about the same (155-197 / 191-217 GB/s);
// beside a bf16 matmul loop, where the chain shares its SM, checksummed saves ran at 20 / 23-28
// GB/s under MPS and cost the matmul 17-18.5% / 14-15% without it.
ORBITKV_KERNEL void orbitkv_xxh3_fold(const HashChunk* chunks, u32 nchunks, u64* scratch) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 k = t >> 3;
    u32 j = (u32)(t & 7u);
    if (k >= nchunks) {
        return;
    }
    const HashChunk ch = chunks[k];
    u64 nb = full_blocks(ch.len);
    u64* row = scratch + 8 * ch.row_first + j;
    const u64 key = W[16 + j];
    u64 acc = INIT[j];
    u64 b = 0;
    u64 cur[FOLD_GROUP];
    u64 next[FOLD_GROUP];
    if (nb >= FOLD_GROUP) {
        for (u32 i = 0; i < FOLD_GROUP; i++) {
            cur[i] = row[8 * i];
        }
        for (;;) {
            // cur holds rows b .. b + FOLD_GROUP; load the group after it, if whole, first.
            int more = b + 2 * FOLD_GROUP <= nb;
            if (more) {
                for (u32 i = 0; i < FOLD_GROUP; i++) {
                    next[i] = row[8 * (b + FOLD_GROUP + i)];
                }
            }
            for (u32 i = 0; i < FOLD_GROUP; i++) {
                acc = fold_step(acc, cur[i], key);
            }
            b += FOLD_GROUP;
            if (!more) {
                break;
            }
            for (u32 i = 0; i < FOLD_GROUP; i++) {
                cur[i] = next[i];
            }
        }
    }
    for (; b < nb; b++) {
        acc = fold_step(acc, row[8 * b], key);
    }
    row[8 * nb] = acc + row[8 * nb];
}

ORBITKV_DEVICE u64 mul_fold(u64 a, u64 b) {
#ifdef __CUDACC__
    return (a * b) ^ __umul64hi(a, b);
#else
    unsigned __int128 p = (unsigned __int128)a * b;
    return (u64)p ^ (u64)(p >> 64);
#endif
}

// One thread per chunk: the merge of its 8 lanes (its last row) and the final avalanche;
// writes out[chunk].
ORBITKV_KERNEL void orbitkv_xxh3_merge(const HashChunk* chunks, u32 nchunks, const u64* scratch,
                                       u64* out) {
    u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= nchunks) {
        return;
    }
    const HashChunk ch = chunks[k];
    const u64* acc = scratch + 8 * (ch.row_first + full_blocks(ch.len));
    u64 h = ch.len * XXH_PRIME64_1;
    for (u32 i = 0; i < 4; i++) {
        h += mul_fold(acc[2 * i] ^ M[2 * i], acc[2 * i + 1] ^ M[2 * i + 1]);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    out[k] = h;
}
