// OrbitKV chunk checksums on the GPU: XXH3-64 (seed 0, default secret) of chunks whose bytes
// are scattered over an engine's KV pages, the same value `orbitkv_proto::chunk_checksum`
// computes on the CPU, for chunks longer than 240 bytes (XXH3's long-input path).
//
// XXH3 keeps 8 accumulator lanes and walks the input in 1 KiB blocks of 16 stripes of 64
// bytes. Within a block every stripe's effect on a lane is a sum (mod 2^64), so a block's
// contribution can be computed on its own; only the scramble after each full block is
// sequential. Hence two kernels:
//   orbitkv_xxh3_blocks: one thread per block of every chunk: the 8 lane sums of its stripes
//     (the chunk's last block also takes the final stripe with its own secret offset);
//   orbitkv_xxh3_fold: one thread per chunk: accumulators from the initial values through
//     "add the block's sums, scramble" for each full block, the last block's sums, and the
//     final merge and avalanche.
// Chunk bytes are read where they lie: a chunk is a list of segments (logical start, device
// address) in order, each running to the next segment's start (the last to the chunk's length).
//
// Built into chunk_checksum.ptx by build-ptx.sh. The file is also valid C (no C++ features):
// the CPU test of orbitkv-gpu compiles it with a C compiler and runs both kernels thread by
// thread against the Rust implementation.

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

// A cursor over one chunk's segments.
typedef struct {
    const HashSeg* segs;
    u64 count;
    u64 len;  // chunk length: end of the last segment
    u64 at;   // current segment
} Cursor;

ORBITKV_DEVICE u64 seg_end(const Cursor* c, u64 s) {
    return s + 1 < c->count ? c->segs[s + 1].start : c->len;
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
    c->at = lo;
}

// The little-endian word at chunk offset `o` (o + 8 <= len); moves forward only.
ORBITKV_DEVICE u64 word(Cursor* c, u64 o) {
    while (o >= seg_end(c, c->at)) {
        c->at++;
    }
    u64 end = seg_end(c, c->at);
    u64 addr = c->segs[c->at].addr + (o - c->segs[c->at].start);
    if (o + 8 <= end && (addr & 7ull) == 0) {
        return *(const u64*)addr;
    }
    // Straddles a segment boundary or is unaligned: byte by byte.
    u64 v = 0;
    u64 s = c->at;
    for (u32 j = 0; j < 8; j++) {
        u64 p = o + j;
        while (p >= seg_end(c, s)) {
            s++;
        }
        u64 b = *(const unsigned char*)(c->segs[s].addr + (p - c->segs[s].start));
        v |= b << (8 * j);
    }
    return v;
}

// Adds one stripe at chunk offset `o` to the lane sums; lane i's secret word is key[i].
ORBITKV_DEVICE void stripe(Cursor* c, u64 o, const u64* key, u64* sum) {
    u64 v[8];
    for (u32 i = 0; i < 8; i++) {
        v[i] = word(c, o + 8 * i);
    }
    for (u32 i = 0; i < 8; i++) {
        u64 k = v[i] ^ key[i];
        sum[i ^ 1] += v[i];
        sum[i] += (k & 0xffffffffull) * (k >> 32);
    }
}

// Rows of a chunk: one per full block before the last, plus the last (partial) one.
ORBITKV_DEVICE u64 full_blocks(u64 len) {
    return (len - 1) / 1024;
}

// One thread per row: `rows` rows over `nchunks` chunks (row_first ascending); writes 8 lane
// sums (64 bytes) per row into `scratch`.
ORBITKV_KERNEL void orbitkv_xxh3_blocks(const HashChunk* chunks, u32 nchunks,
                                        const HashSeg* segs, u64* scratch, u64 rows) {
    u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x;
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
    seek(&c, base);
    u64 sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    u32 n = b < nb ? 16 : (u32)(((ch.len - 1) - nb * 1024) / 64);
    for (u32 s = 0; s < n; s++) {
        stripe(&c, base + 64ull * s, W + s, sum);
    }
    if (b == nb) {
        // The final stripe: the chunk's last 64 bytes (it may overlap the stripes above).
        seek(&c, ch.len - 64);
        stripe(&c, ch.len - 64, L, sum);
    }
    u64* out = scratch + 8 * r;
    for (u32 i = 0; i < 8; i++) {
        out[i] = sum[i];
    }
}

ORBITKV_DEVICE u64 mul_fold(u64 a, u64 b) {
#ifdef __CUDACC__
    return (a * b) ^ __umul64hi(a, b);
#else
    unsigned __int128 p = (unsigned __int128)a * b;
    return (u64)p ^ (u64)(p >> 64);
#endif
}

// One thread per chunk: folds its rows and writes its checksum to out[chunk].
ORBITKV_KERNEL void orbitkv_xxh3_fold(const HashChunk* chunks, u32 nchunks, const u64* scratch,
                                      u64* out) {
    u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= nchunks) {
        return;
    }
    const HashChunk ch = chunks[k];
    u64 nb = full_blocks(ch.len);
    const u64* row = scratch + 8 * ch.row_first;
    u64 acc[8];
    for (u32 i = 0; i < 8; i++) {
        acc[i] = INIT[i];
    }
    for (u64 b = 0; b < nb; b++, row += 8) {
        for (u32 i = 0; i < 8; i++) {
            u64 a = acc[i] + row[i];
            a ^= a >> 47;
            a ^= W[16 + i];
            acc[i] = a * XXH_PRIME32_1;
        }
    }
    for (u32 i = 0; i < 8; i++) {
        acc[i] += row[i];
    }
    u64 h = ch.len * XXH_PRIME64_1;
    for (u32 i = 0; i < 4; i++) {
        h += mul_fold(acc[2 * i] ^ M[2 * i], acc[2 * i + 1] ^ M[2 * i + 1]);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    out[k] = h;
}
