// OrbitKV chunk checksums on the GPU: XXH3-64 (seed 0, default secret) of chunks whose bytes
// are scattered over an engine's KV pages, the same value `orbitkv_proto::chunk_checksum`
// computes on the CPU, for chunks longer than 240 bytes (XXH3's long-input path).
//
// XXH3 keeps 8 accumulator lanes and walks the input in 1 KiB blocks of 16 stripes of 64
// bytes. Within a block every stripe's effect on a lane is a sum (mod 2^64), so a block's
// contribution can be computed on its own; only the scramble after each full block is
// sequential, and it is per lane. Hence two kernels:
//   orbitkv_xxh3_row_runs: eight threads (one per lane) per run of consecutive blocks
//     ("rows") of the chunks: each row's lane sums of its stripes (a chunk's last row also
//     takes the final stripe with its own secret) into the scratch rows;
//   orbitkv_xxh3_fold_merge: eight threads per chunk: each lane from its initial value through
//     "add the row's sum, scramble" for each full block, plus the last row's sum; the last of
//     the chunk's lanes to finish (a counter per chunk) merges the eight (final avalanche)
//     into the chunk's checksum.
// A kernel whose parameters change gets a new name: the server can load another PTX of these
// kernels (ORBITKV_CHECKSUM_KERNEL_PTX), and one with other parameters must fail to load
// rather than run on the wrong arguments.
// Beside an engine's kernels (MPS) every launch waits for SMs to free up, and a block that
// stays resident keeps an SM from the engine: the fold (a sequential chain, tens of
// microseconds) runs in as few blocks as possible, the merge inside it rather than as a
// launch of its own, and the sums' kernel has no chain. (One kernel doing all three held up
// to a block per chunk resident through its chain: beside a bf16 matmul loop on the H200
// under MPS its saves cost the matmul 8.0%; two kernels, at the same 48-50 GB/s, 2.9-3.5%.)
// The row sums likewise hold few blocks: a run of rows per eight threads (see
// orbitkv_xxh3_row_runs) rather than one row, an eighth of the blocks: sglang's 2 KiB saves
// cost the matmul 3.0-3.2% instead of 3.8-4.0%, measured on other machines of the same kind.
// A thread per row summing all eight lanes (each byte loaded once, the secret as immediates,
// 64 registers) lost in one call beside these kernels: alone 60-61 us against 40-43 (ncu,
// 64 MiB of 2 KiB pages), beside the matmul 5.4-6.0% (sglang 2 KiB) and 4.3-4.7% (nhd 32 KiB)
// against 3.6-3.9% and 3.1-3.7%.
// A block-form save whose parts are whole 1 KiB rows goes instead by orbitkv_xxh3_block_rows
// (below: the block gather's walk over the job's units, a warp per unit, no tables) and
// orbitkv_xxh3_fold_uniform.
// Chunk bytes are read where they lie: a chunk is a list of segments (logical start, device
// address) in order, each running to the next segment's start (the last to the chunk's
// length); a row table names the segment holding each row's first byte.
//
// Built into chunk_checksum.ptx by build-ptx-nvrtc.py (NVRTC from PyPI; build-ptx.sh does the
// same with nvcc). The file is also valid C (no C++ features): the CPU test of orbitkv-gpu
// compiles it with a C compiler and runs the kernels thread by thread against
// `orbitkv_proto::chunk_checksum` (their threads never wait for each other, so running them one
// after another is a valid execution).

#ifdef __CUDACC__
#define ORBITKV_KERNEL extern "C" __global__
#define ORBITKV_DEVICE __device__ static inline
#define ORBITKV_CONST __constant__ static const
// A rare path called from an unrolled loop: one copy of it, not one per iteration.
#define ORBITKV_COLD __device__ __noinline__ static
#else
#define ORBITKV_KERNEL
#define ORBITKV_DEVICE static inline
#define ORBITKV_CONST static const
#define ORBITKV_COLD static
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

#ifdef __CUDACC__
#define ORBITKV_FENCE() __threadfence()
#define ORBITKV_COUNT(p) atomicAdd((p), 1u)
// Another lane's result, published by that lane's fence before its count (after this lane's
// own count and fence a plain load would see it too; this one also skips L1).
#define ORBITKV_SHARED_READ(p) __ldcg(p)
#define ORBITKV_UNROLL _Pragma("unroll")
// Asks L2 for the line holding `p` (no register written, nothing waited for).
#define ORBITKV_PREFETCH_L2(p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p))
#else
#define ORBITKV_FENCE() ((void)0)
#define ORBITKV_COUNT(p) orbitkv_count(p)
#define ORBITKV_SHARED_READ(p) (*(p))
#define ORBITKV_UNROLL
#define ORBITKV_PREFETCH_L2(p) ((void)(p))
// The threads run one after another: a plain increment, returning the old value.
static inline u32 orbitkv_count(u32* p) {
    u32 old = *p;
    *p = old + 1;
    return old;
}
#endif

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

// One stripe's effect on lane j: the partner word (j ^ 1) plus the 32x32-bit product of its
// own word mixed with the secret word `key`. (w0, w1) are the lane pair's 16 bytes.
ORBITKV_DEVICE u64 stripe_lane(u64 w0, u64 w1, u32 j, u64 key) {
    u64 own = (j & 1u) ? w1 : w0;
    u64 partner = (j & 1u) ? w0 : w1;
    u64 k = own ^ key;
    return partner + (k & 0xffffffffull) * (k >> 32);
}

// Lane j's sum over the 16 stripes of a whole block at device address `a` (its lane pair's 16
// bytes of the first stripe; 16-byte aligned): eight loads in flight at a time. `key` is the
// secret (W), where each lane reads its own word at once: shared memory in the kernel.
ORBITKV_DEVICE u64 block_sum(u64 a, u32 j, const u64* key) {
    u64 sum = 0;
    for (u32 h = 0; h < 16; h += 8) {
        u64 w[16];
        ORBITKV_UNROLL
        for (u32 s = 0; s < 8; s++) {
            u64 at = a + 64ull * (h + s);
#ifdef __CUDACC__
            ulonglong2 v = *(const ulonglong2*)at;
            w[2 * s] = v.x;
            w[2 * s + 1] = v.y;
#else
            w[2 * s] = ((const u64*)at)[0];
            w[2 * s + 1] = ((const u64*)at)[1];
#endif
        }
        ORBITKV_UNROLL
        for (u32 s = 0; s < 8; s++) {
            sum += stripe_lane(w[2 * s], w[2 * s + 1], j, key[h + s + j]);
        }
    }
    return sum;
}

// Lane j's sum over the first `n` stripes of the row at chunk offset `base`, word by word
// across segments; the cursor is on the segment holding `base`.
ORBITKV_DEVICE u64 row_sum(Cursor* c, u64 base, u32 n, u32 j, const u64* key) {
    u64 in_stripe = 16ull * (j >> 1);
    u64 sum = 0;
    for (u32 s = 0; s < n; s++) {
        u64 w0, w1;
        pair(c, base + 64ull * s + in_stripe, &w0, &w1);
        sum += stripe_lane(w0, w1, j, key[s + j]);
    }
    return sum;
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
// How far ahead of the group being folded the fold asks L2 for row sums, in groups.
#define FOLD_PREFETCH_GROUPS 4

// Lane j's accumulator from its initial value through "add the row's sum, scramble" for each
// of the chunk's `nb` full blocks; `lane` is the chunk's first row, lane j (rows 64 bytes
// apart, summed by an earlier kernel). The chain is sequential, so what it costs is its length
// (a 2 MiB chunk has 2048 full blocks) times each step, and a step must not wait for memory:
// the next group of row sums is loaded while the current one is folded. Loading a group, then
// folding it, paid a memory round trip per eight steps (measured on the H200, perf dma, 2 MiB
// chunks of 2 KiB pages: beside a bf16 matmul loop, checksummed saves ran at 20 / 23-28 GB/s
// under MPS before / after, and cost the matmul 17-18.5% / 14-15% without it). Groups of 32
// taking turns in two register sets, loaded without a branch, were slower on the H200: 114-116
// us per 64 MiB job of 2 MiB chunks against 81 (ncu).
ORBITKV_DEVICE u64 fold_lane(const u64* lane, u64 nb, u32 j) {
    const u64 key = W[16 + j];
    u64 acc = INIT[j];
    u64 b = 0;
    u64 cur[FOLD_GROUP];
    u64 next[FOLD_GROUP];
    if (nb >= FOLD_GROUP) {
        for (u32 i = 0; i < FOLD_GROUP; i++) {
            cur[i] = lane[8 * i];
        }
        for (;;) {
            // cur holds rows b .. b + FOLD_GROUP; load the group after it, if whole, first.
            int more = b + 2 * FOLD_GROUP <= nb;
            // A group's loads are issued one group (sixteen steps of the chain) before they
            // are needed, which does not cover a trip to HBM: each lane also asks L2 for its
            // words of the group FOLD_PREFETCH_GROUPS ahead, when that group is whole (on the
            // H200, 64 MiB jobs of 2 MiB chunks: 66.6-67.2 us per fold against 79.8-81.4
            // without; eight groups ahead 67.1-68.0; ncu, same call).
            u64 ahead = b + FOLD_PREFETCH_GROUPS * FOLD_GROUP;
            if (ahead + FOLD_GROUP <= nb) {
                ORBITKV_UNROLL
                for (u32 i = 0; i < FOLD_GROUP; i++) {
                    ORBITKV_PREFETCH_L2(&lane[8 * (ahead + i)]);
                }
            }
            if (more) {
                for (u32 i = 0; i < FOLD_GROUP; i++) {
                    next[i] = lane[8 * (b + FOLD_GROUP + i)];
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
        acc = fold_step(acc, lane[8 * b], key);
    }
    return acc;
}

ORBITKV_DEVICE u64 mul_fold(u64 a, u64 b) {
#ifdef __CUDACC__
    return (a * b) ^ __umul64hi(a, b);
#else
    unsigned __int128 p = (unsigned __int128)a * b;
    return (u64)p ^ (u64)(p >> 64);
#endif
}

// The merge of a chunk's 8 folded lanes (`acc`, written by other threads) and the final
// avalanche: the chunk's checksum.
ORBITKV_DEVICE u64 merge(u64 len, const u64* acc) {
    u64 h = len * XXH_PRIME64_1;
    for (u32 i = 0; i < 4; i++) {
        u64 a = ORBITKV_SHARED_READ(&acc[2 * i]);
        u64 b = ORBITKV_SHARED_READ(&acc[2 * i + 1]);
        h += mul_fold(a ^ M[2 * i], b ^ M[2 * i + 1]);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    return h;
}

// The chunk owning row r: the last one whose row_first <= r (chunks in row order).
ORBITKV_DEVICE u32 chunk_of(const HashChunk* chunks, u32 nchunks, u64 r) {
    u32 lo = 0, hi = nchunks;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (chunks[mid].row_first <= r) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Lane j's sum of row r of chunk `ch` by the cursor (rows not whole in one aligned segment,
// and every chunk's last row, which also takes the final stripe with its own secret).
ORBITKV_COLD u64 row_by_cursor(const HashChunk* ch, const HashSeg* segs, const u32* row_segs,
                                 u64 r, u32 j, const u64* key) {
    u64 b = r - ch->row_first;
    u64 nb = full_blocks(ch->len);
    Cursor c;
    c.segs = segs + ch->seg_first;
    c.count = ch->seg_count;
    c.len = ch->len;
    enter(&c, row_segs[r] - ch->seg_first);
    u64 base = b * 1024;
    u32 n = b < nb ? 16 : (u32)(((ch->len - 1) - nb * 1024) / 64);
    u64 sum = row_sum(&c, base, n, j, key);
    if (b == nb) {
        // The final stripe: the chunk's last 64 bytes (it may overlap the stripes above, and
        // need not be 16-byte aligned).
        u64 o = ch->len - 64 + 8ull * (j & ~1u);
        seek(&c, o);
        u64 w0 = word_slow(&c, o);
        u64 w1 = word_slow(&c, o + 8);
        sum += stripe_lane(w0, w1, j, L[j]);
    }
    return sum;
}

// Rows whose addresses are looked up together before they are summed.
#define ROW_BATCH 8

// Eight threads per run of rows (thread j: lane j): the grid's runs split the `rows` rows
// over `nchunks` chunks (row_first ascending) into contiguous runs of equal length, whatever
// the grid (the host picks the run length by the grid it launches). `row_segs[r]` is the
// segment holding row r's first byte. Writes scratch[8 * row + j].
// A row's sum is a few loads of tables (its chunk, its segment) and then its 1 KiB. With one
// row per thread the kernel needed eight times the blocks, each short-lived, and beside an
// engine's kernels (MPS) every block holds an SM the engine waits for. Here a thread looks up
// ROW_BATCH rows' addresses together (their loads independent of each other), then sums them.
// Alone it is not faster (on the H200, 64 MiB of 2 KiB pages: 40-41.5 us against 37-39), but
// beside a bf16 matmul loop checksummed saves cost the matmul 3.0-3.2% instead of 3.8-4.0%.
// The secret comes from shared memory, where a warp's eight different words come at once
// (from constant memory, one after another: 35-36 us against 37-38 with one row per thread).
ORBITKV_KERNEL void orbitkv_xxh3_row_runs(const HashChunk* chunks, u32 nchunks,
                                          const HashSeg* segs, const u32* row_segs,
                                          u64* scratch, u64 rows) {
#ifdef __CUDACC__
    __shared__ u64 key[24];
    if (threadIdx.x < 24) {
        key[threadIdx.x] = W[threadIdx.x];
    }
    __syncthreads();
#else
    const u64* key = W;
#endif
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 runs = ((u64)gridDim.x * blockDim.x) >> 3;
    u64 g = t >> 3;
    u32 j = (u32)(t & 7u);
    u64 per = (rows + runs - 1) / runs;
    u64 first = g * per;
    u64 last = first + per < rows ? first + per : rows;
    if (first >= last) {
        return;
    }
    u32 k = chunk_of(chunks, nchunks, first);
    for (u64 r0 = first; r0 < last; r0 += ROW_BATCH) {
        // Each row's lane-pair address when the row is a whole block, in one segment and
        // aligned; 0 when it goes by the cursor.
        u64 at[ROW_BATCH];
        ORBITKV_UNROLL
        for (u32 i = 0; i < ROW_BATCH; i++) {
            u64 r = r0 + i;
            at[i] = 0;
            if (r < last) {
                while (k + 1 < nchunks && chunks[k + 1].row_first <= r) {
                    k++;
                }
                const HashChunk* ch = &chunks[k];
                u64 b = r - ch->row_first;
                u64 s = row_segs[r];
                u64 end = s + 1 < ch->seg_first + ch->seg_count ? segs[s + 1].start : ch->len;
                u64 base = b * 1024;
                u64 a = segs[s].addr + (base - segs[s].start) + 16ull * (j >> 1);
                if (b < full_blocks(ch->len) && base + 1024 <= end && (a & 15ull) == 0) {
                    at[i] = a;
                }
            }
        }
        ORBITKV_UNROLL
        for (u32 i = 0; i < ROW_BATCH; i++) {
            u64 r = r0 + i;
            if (r < last) {
                u64 sum = at[i] != 0
                              ? block_sum(at[i], j, key)
                              : row_by_cursor(&chunks[chunk_of(chunks, nchunks, r)], segs,
                                              row_segs, r, j, key);
                scratch[8 * r + j] = sum;
            }
        }
    }
}

// Eight threads per chunk (thread j: lane j): lane j's accumulator, folded, left in the
// chunk's last row; the last lane of the chunk to get there merges the eight into out[chunk].
// `counters` holds a zero per chunk and holds it again when the kernel has finished (put back
// by the thread that saw the last count).
// Lane j of chunk k (`len` bytes, its rows from scratch row `row_first`) folded and left in
// the chunk's last row; the last lane of the chunk to get there merges the eight into out[k].
ORBITKV_DEVICE void fold_chunk_lane(u64 len, u64 row_first, u64 k, u32 j, u64* scratch,
                                    u32* counters, u64* out) {
    u64 nb = full_blocks(len);
    u64* lane = scratch + 8 * row_first + j;
    lane[8 * nb] += fold_lane(lane, nb, j);
    // The chunk's lanes all folded (each fenced before it counted): merge them.
    ORBITKV_FENCE();
    if (ORBITKV_COUNT(&counters[k]) != 7u) {
        return;
    }
    counters[k] = 0;
    ORBITKV_FENCE();
    out[k] = merge(len, scratch + 8 * (row_first + nb));
}

ORBITKV_KERNEL void orbitkv_xxh3_fold_merge(const HashChunk* chunks, u32 nchunks, u64* scratch,
                                      u32* counters, u64* out) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 k = t >> 3;
    u32 j = (u32)(t & 7u);
    if (k >= nchunks) {
        return;
    }
    const HashChunk ch = chunks[k];
    fold_chunk_lane(ch.len, ch.row_first, k, j, scratch, counters, out);
}

// Block form (a save planned as block ids, see copy_blocks.cu): writes the chunk, segment and
// row tables the kernels above read, on the GPU, from the job's block ids alone, instead of the
// host writing a record per page and the tables crossing the bus before the sums (for a 64 MiB
// job of 2 KiB pages: 786 KB of tables, about 300 us of a DMA thread on the H200 host, and a
// launch to pull them, against 4 KiB of ids read where the host wrote them, mapped pinned
// memory). Chunk c is `per_chunk` blocks, their ids at ids[c * per_chunk ...]; part p of the
// block with id b lies at bases[p] + b * stride, `part_len` bytes; a chunk's segments are its
// blocks' parts in order (segment k: part k % parts of block k / parts, from chunk offset
// k * part_len), not merged where adjacent (the cursor walks from one to the next). Row r of a
// chunk (chunk offset 1024 r) is in its segment 1024 r / part_len. One thread per segment, per
// row and per chunk record, striding over the grid.
ORBITKV_KERNEL void orbitkv_xxh3_expand_blocks(const u64* ids, const u64* bases, u32 parts,
                                               u64 stride, u64 part_len, u32 per_chunk,
                                               u32 nchunks, HashChunk* chunks, HashSeg* segs,
                                               u32* row_segs) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 threads = (u64)gridDim.x * blockDim.x;
    u64 spc = (u64)per_chunk * parts;
    u64 len = spc * part_len;
    u64 rpc = full_blocks(len) + 1;
    for (u64 c = t; c < nchunks; c += threads) {
        chunks[c].len = len;
        chunks[c].seg_first = c * spc;
        chunks[c].seg_count = spc;
        chunks[c].row_first = c * rpc;
        chunks[c].unused = 0;
    }
    u64 nsegs = spc * nchunks;
    for (u64 g = t; g < nsegs; g += threads) {
        u64 c = g / spc;
        u64 k = g - c * spc;
        segs[g].start = k * part_len;
        segs[g].addr = bases[k % parts] + ids[c * per_chunk + k / parts] * stride;
    }
    u64 nrows = rpc * nchunks;
    for (u64 r = t; r < nrows; r += threads) {
        u64 c = r / rpc;
        u64 b = r - c * rpc;
        row_segs[r] = (u32)(c * spc + (b * 1024) / part_len);
    }
}

// Fused form (`--gpu-checksums fused`, an experiment): the gather of a block-form save sums
// each 1 KiB row's lanes from the bytes it already holds in registers, instead of the row-sum
// kernel reading the job's bytes again from the engine's pages; only the fold runs after it.
// It needs every part a multiple of 1 KiB (so a chunk is too) and 16-byte aligned addresses.

// Adds one 16-byte piece's effect on its lane pair: lanes 2q and 2q+1 (q = (o / 16) % 4) of
// the row holding it, `o` its offset in the row (a multiple of 16), (w0, w1) its two words.
// In a chunk's last row (`last`), stripe 15 is XXH3's final stripe (the chunk's last 64 bytes)
// and takes the final secret `fin` (L) in place of the row's stripe secret: the chunk is a
// multiple of 1 KiB, so its last row has 15 stripes of its own (row_by_cursor's n) and then
// the final one over the same 64 bytes.
ORBITKV_DEVICE void piece_sums(u64 w0, u64 w1, u32 o, int last, const u64* key, const u64* fin,
                               u64* a, u64* b) {
    u32 stripe = o >> 6;
    u32 j = 2u * ((o >> 4) & 3u);
    if (last && stripe == 15u) {
        *a += stripe_lane(w0, w1, j, fin[j]);
        *b += stripe_lane(w0, w1, j + 1u, fin[j + 1u]);
    } else {
        *a += stripe_lane(w0, w1, j, key[stripe + j]);
        *b += stripe_lane(w0, w1, j + 1u, key[stripe + j + 1u]);
    }
}

// orbitkv_xxh3_fold_merge for chunks all of `len` bytes (a multiple of 1 KiB), chunk k's rows
// from k * (full_blocks(len) + 1): no chunk table. Lane j of chunk k is folded, then merged by
// the chunk's last lane.
ORBITKV_KERNEL void orbitkv_xxh3_fold_uniform(u64 len, u32 nchunks, u64* scratch, u32* counters,
                                              u64* out) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 k = t >> 3;
    if (k < nchunks) {
        fold_chunk_lane(len, k * (full_blocks(len) + 1), k, (u32)(t & 7u), scratch, counters,
                        out);
    }
}

#ifdef __CUDACC__
// The block copy kernel's gather (copy_blocks.cu: unit u is piece u % subs of part
// (u / subs) % part_count of the batch's block u / subs / part_count, a warp per group of up
// to eight units) with each 1 KiB row's lane sums written to scratch[8 * row + lane], the row
// numbered in the job: the batch's first block is the job's block `first_block`, chunk c of the
// job is blocks c * per_chunk ..., its rows c * rows_per_chunk .... A row is two 16-byte loads
// per thread of the warp: thread T's first is stripe T / 4, lane pair T % 4, its second stripe
// 8 + T / 4; three xor-shuffles over the thread bits above the pair sum each pair's stripes,
// and threads 0-3 write the row's eight lanes.
#define SUM_UNIT (64ull << 10)
#define SUM_GROUP 8u
ORBITKV_DEVICE u64 warp_pair_sum(u64 v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    return v;
}

// The units' walk shared by the fused gather and the block row sums: `store` copies each unit
// to staging too (the gather); without it only the rows are summed.
__device__ __forceinline__ static void sum_units(
    const u64* __restrict__ parts, const u64* __restrict__ blocks, u64 stride, u64 part_len,
    u64 staging, u64* __restrict__ scratch, u64 rows_per_chunk, u32 part_count, u32 subs,
    u32 count, u32 group, u32 first_block, u32 per_chunk, const u64* key, const u64* fin,
    const int store) {
    const u32 lane = threadIdx.x & 31u;
    const u32 g = group < 1u ? 1u : (group > SUM_GROUP ? SUM_GROUP : group);
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 first = (((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * g; first < count;
         first += warps * g) {
        const u32 here = count - first < g ? (u32)(count - first) : g;
        u64 src = 0, dst = 0, len = 0, row = 0, last_row = 0;
        if (lane < here) {
            const u32 u = (u32)first + lane;
            const u32 r = u / subs;
            const u32 p = r % part_count;
            const u32 i = r / part_count;
            const u64 skip = (u64)(u % subs) * SUM_UNIT;
            const u64 left = part_len - skip;
            len = left < SUM_UNIT ? left : SUM_UNIT;
            src = parts[p] + blocks[i] * stride + skip;
            dst = staging + (u64)r * part_len + skip;
            const u64 b = (u64)first_block + i;
            const u64 c = b / per_chunk;
            const u64 in_chunk = ((b - c * per_chunk) * part_count + p) * part_len + skip;
            row = c * rows_per_chunk + in_chunk / 1024;
            last_row = c * rows_per_chunk + rows_per_chunk - 1;
        }
        for (u32 j = 0; j < here; j++) {
            const ulonglong2* __restrict__ s =
                reinterpret_cast<const ulonglong2*>(__shfl_sync(0xffffffffu, src, j));
            ulonglong2* __restrict__ t =
                reinterpret_cast<ulonglong2*>(__shfl_sync(0xffffffffu, dst, j));
            const u64 rows = __shfl_sync(0xffffffffu, len, j) >> 10;
            const u64 row0 = __shfl_sync(0xffffffffu, row, j);
            const u64 last = __shfl_sync(0xffffffffu, last_row, j);
            u64 k = 0;
            // Two rows at a time: four loads in flight per thread before their stores.
            for (; k + 1 < rows; k += 2) {
                const ulonglong2 x0 = s[64 * k + lane];
                const ulonglong2 y0 = s[64 * k + 32 + lane];
                const ulonglong2 x1 = s[64 * k + 64 + lane];
                const ulonglong2 y1 = s[64 * k + 96 + lane];
                if (store) {
                    t[64 * k + lane] = x0;
                    t[64 * k + 32 + lane] = y0;
                    t[64 * k + 64 + lane] = x1;
                    t[64 * k + 96 + lane] = y1;
                }
                u64 a0 = 0, b0 = 0, a1 = 0, b1 = 0;
                piece_sums(x0.x, x0.y, 16u * lane, row0 + k == last, key, fin, &a0, &b0);
                piece_sums(y0.x, y0.y, 512u + 16u * lane, row0 + k == last, key, fin, &a0, &b0);
                piece_sums(x1.x, x1.y, 16u * lane, row0 + k + 1 == last, key, fin, &a1, &b1);
                piece_sums(y1.x, y1.y, 512u + 16u * lane, row0 + k + 1 == last, key, fin, &a1,
                           &b1);
                a0 = warp_pair_sum(a0);
                b0 = warp_pair_sum(b0);
                a1 = warp_pair_sum(a1);
                b1 = warp_pair_sum(b1);
                if (lane < 4u) {
                    scratch[8 * (row0 + k) + 2 * lane] = a0;
                    scratch[8 * (row0 + k) + 2 * lane + 1] = b0;
                    scratch[8 * (row0 + k + 1) + 2 * lane] = a1;
                    scratch[8 * (row0 + k + 1) + 2 * lane + 1] = b1;
                }
            }
            for (; k < rows; k++) {
                const ulonglong2 x = s[64 * k + lane];
                const ulonglong2 y = s[64 * k + 32 + lane];
                if (store) {
                    t[64 * k + lane] = x;
                    t[64 * k + 32 + lane] = y;
                }
                u64 a = 0, b = 0;
                piece_sums(x.x, x.y, 16u * lane, row0 + k == last, key, fin, &a, &b);
                piece_sums(y.x, y.y, 512u + 16u * lane, row0 + k == last, key, fin, &a, &b);
                a = warp_pair_sum(a);
                b = warp_pair_sum(b);
                if (lane < 4u) {
                    scratch[8 * (row0 + k) + 2 * lane] = a;
                    scratch[8 * (row0 + k) + 2 * lane + 1] = b;
                }
            }
        }
    }
}

// The secret words in shared memory, where a warp's eight different words come at once.
#define SUM_KEYS()                          \
    __shared__ u64 key[24];                 \
    __shared__ u64 fin[8];                  \
    if (threadIdx.x < 24) {                 \
        key[threadIdx.x] = W[threadIdx.x];  \
    }                                       \
    if (threadIdx.x < 8) {                  \
        fin[threadIdx.x] = L[threadIdx.x];  \
    }                                       \
    __syncthreads()

extern "C" __global__ void orbitkv_copy_blocks_summed(
    const u64* __restrict__ parts, const u64* __restrict__ blocks, u64 stride, u64 part_len,
    u64 staging, u64* __restrict__ scratch, u64 rows_per_chunk, u32 part_count, u32 subs,
    u32 count, u32 group, u32 first_block, u32 per_chunk) {
    SUM_KEYS();
    sum_units(parts, blocks, stride, part_len, staging, scratch, rows_per_chunk, part_count, subs,
              count, group, first_block, per_chunk, key, fin, 1);
}

// A block-form save's row sums read from the engine's pages, the fused gather's walk without
// its copy: a warp per group of units, each 1 KiB row as two coalesced 16-byte loads per
// thread and three xor-shuffles per value, into the scratch rows the uniform fold reads
// (orbitkv_xxh3_fold_uniform). `blocks` is the whole job's block ids (its first block is block
// 0); no segment or row tables. Replaces the expansion and the table-driven row sums where
// parts are a multiple of 1 KiB and 16-byte aligned: on the H200 those took 40 us per 64 MiB
// job of 2 KiB pages reading at 1.7 TB/s, latency-bound on their table lookups.
extern "C" __global__ void orbitkv_xxh3_block_rows(
    const u64* __restrict__ parts, const u64* __restrict__ blocks, u64 stride, u64 part_len,
    u64* __restrict__ scratch, u64 rows_per_chunk, u32 part_count, u32 subs, u32 count,
    u32 group, u32 per_chunk) {
    SUM_KEYS();
    sum_units(parts, blocks, stride, part_len, 0, scratch, rows_per_chunk, part_count, subs,
              count, group, 0, per_chunk, key, fin, 0);
}
#endif
