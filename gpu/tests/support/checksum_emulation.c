// Runs gpu/kernels/chunk_checksum.cu's kernels on the CPU, thread by thread, for the test
// suite (tests/checksum_kernel_on_cpu.rs). Reads from stdin, little-endian: nchunks, nsegs,
// rows, data_len (u64 each), then nchunks records of 5 u64 (HashChunk), nsegs records of 2 u64
// (HashSeg, addresses as offsets into the data), rows u32 (each row's segment), then data_len
// bytes of data. Prints one checksum per chunk, in hex, one per line; exits 3 when the fold
// left a counter non-zero, 4 when the two runs disagree (the second splits the rows into a few
// long runs: one block of the row kernel), 5 when a chunk merged early, 6 when the row table
// names a segment that does not hold its row's first byte, 7 when chunk_of names the wrong
// chunk for a row of chunks of unequal lengths.
// With the argument `blocks`, the input is a save in block form instead: nchunks, per_chunk,
// parts, part_len, stride, data_len (u64 each), nchunks x per_chunk block ids, parts part
// bases (offsets into the data), then the data; the chunk, segment and row tables are written
// by orbitkv_xxh3_expand_blocks (run thread by thread on a small grid, so that its threads
// stride) before the kernels above run on them.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    unsigned int x, y, z;
} orbitkv_dim3;
static orbitkv_dim3 blockIdx, threadIdx, blockDim, gridDim;

#include "chunk_checksum.cu"

static void* read_exact(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

// chunk_of against a walk over chunks of unequal lengths (a submission's chunks are all of one
// length; the kernel's search must not depend on it).
static int check_chunk_of(void) {
    HashChunk c[9];
    u64 row = 0;
    for (u32 k = 0; k < 9; k++) {
        c[k].len = 241 + (u64)((k * 7919) % 5) * 1024 + (k % 3) * 500;
        c[k].row_first = row;
        row += full_blocks(c[k].len) + 1;
    }
    for (u32 n = 1; n <= 9; n++) {
        u64 rows = c[n - 1].row_first + full_blocks(c[n - 1].len) + 1;
        for (u64 r = 0; r < rows; r++) {
            u32 want = 0;
            while (want + 1 < n && c[want + 1].row_first <= r) {
                want++;
            }
            if (chunk_of(c, n, r) != want) {
                fprintf(stderr, "chunk_of(%u chunks, row %llu) = %u, not %u\n", n, r,
                        chunk_of(c, n, r), want);
                return 0;
            }
        }
    }
    return 1;
}

// The data, 64-byte aligned, so that offsets aligned in the test are aligned addresses.
static unsigned char* read_data(u64 data_len) {
    unsigned char* data = aligned_alloc(64, (data_len + 64) / 64 * 64);
    if (!data || fread(data, 1, data_len, stdin) != data_len) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return data;
}

// The fused form's arithmetic (argument `fused`): input nchunks, chunk_len (a multiple
// of 1 KiB), then the chunks' bytes one after another. Each row's lane sums are the sums of
// piece_sums over its 64 pieces of 16 bytes (what the warp's threads add up with shuffles in
// orbitkv_copy_blocks_summed), then orbitkv_xxh3_fold_uniform folds them, thread by thread in
// reverse order; prints one checksum per chunk; exits 3 when a counter is left non-zero.
static int fused(void) {
    u64* head = read_exact(2 * sizeof(u64));
    u64 nchunks = head[0], len = head[1];
    unsigned char* data = read_data(nchunks * len);
    u64 rpc = full_blocks(len) + 1;
    u64* scratch = calloc(nchunks * rpc * 8 + 1, sizeof(u64));
    u32* counters = calloc(nchunks + 1, sizeof(u32));
    u64* out = calloc(nchunks + 1, sizeof(u64));
    for (u64 c = 0; c < nchunks; c++) {
        for (u64 r = 0; r < rpc; r++) {
            const unsigned char* row = data + c * len + r * 1024;
            u64* lanes = scratch + 8 * (c * rpc + r);
            for (u32 o = 0; o < 1024; o += 16) {
                u64 w[2];
                memcpy(w, row + o, 16);
                u32 q = (o >> 4) & 3u;
                piece_sums(w[0], w[1], o, r + 1 == rpc, W, L, &lanes[2 * q], &lanes[2 * q + 1]);
            }
        }
    }
    blockDim.x = 128;
    gridDim.x = (u32)((nchunks * 8 + 127) / 128);
    for (u64 i = 0; i < nchunks * 8; i++) {
        u64 t = nchunks * 8 - 1 - i;
        blockIdx.x = (u32)(t / 128);
        threadIdx.x = (u32)(t % 128);
        orbitkv_xxh3_fold_uniform(len, (u32)nchunks, scratch, counters, out);
    }
    for (u64 c = 0; c < nchunks; c++) {
        printf("%016llx\n", out[c]);
        if (counters[c] != 0) {
            return 3;
        }
    }
    return 0;
}

int main(int argc, char** argv) {
    if (!check_chunk_of()) {
        return 7;
    }
    if (argc > 1 && strcmp(argv[1], "fused") == 0) {
        return fused();
    }
    u64 nchunks, nsegs, rows;
    HashChunk* chunks;
    HashSeg* segs;
    u32* row_segs;
    if (argc > 1 && strcmp(argv[1], "blocks") == 0) {
        u64* head = read_exact(6 * sizeof(u64));
        u64 per_chunk = head[1], parts = head[2], part_len = head[3], stride = head[4];
        u64 data_len = head[5];
        nchunks = head[0];
        nsegs = nchunks * per_chunk * parts;
        rows = nchunks * (full_blocks(per_chunk * parts * part_len) + 1);
        chunks = malloc((nchunks ? nchunks : 1) * sizeof(HashChunk));
        u64* ids = read_exact(nchunks * per_chunk * sizeof(u64));
        u64* bases = read_exact(parts * sizeof(u64));
        unsigned char* data = read_data(data_len);
        for (u64 p = 0; p < parts; p++) {
            bases[p] += (u64)data;
        }
        segs = malloc((nsegs ? nsegs : 1) * sizeof(HashSeg));
        row_segs = malloc((rows ? rows : 1) * sizeof(u32));
        blockDim.x = 32;
        gridDim.x = 2;
        for (u64 t = 0; t < 64; t++) {
            blockIdx.x = (u32)(t / 32);
            threadIdx.x = (u32)(t % 32);
            orbitkv_xxh3_expand_blocks(ids, bases, (u32)parts, stride, part_len, (u32)per_chunk,
                                       (u32)nchunks, chunks, segs, row_segs);
        }
    } else {
        u64* head = read_exact(4 * sizeof(u64));
        nchunks = head[0];
        nsegs = head[1];
        rows = head[2];
        chunks = read_exact(nchunks * sizeof(HashChunk));
        segs = read_exact(nsegs * sizeof(HashSeg));
        row_segs = read_exact(rows * sizeof(u32));
        unsigned char* data = read_data(head[3]);
        for (u64 i = 0; i < nsegs; i++) {
            segs[i].addr += (u64)data;
        }
    }
    // Each row's segment holds the row's first byte (a wrong one would only cost the kernel
    // its fast path: the slow path walks forward from any earlier segment of the chunk).
    for (u64 k = 0; k < nchunks; k++) {
        const HashChunk* c = &chunks[k];
        for (u64 b = 0; b <= full_blocks(c->len); b++) {
            u64 s = row_segs[c->row_first + b];
            u64 end = s + 1 < c->seg_first + c->seg_count ? segs[s + 1].start : c->len;
            if (s < c->seg_first || s >= c->seg_first + c->seg_count || segs[s].start > b * 1024 ||
                end <= b * 1024) {
                fprintf(stderr, "chunk %llu row %llu: segment %llu does not hold its first byte\n",
                        k, b, s);
                return 6;
            }
        }
    }
    u64* scratch = calloc(rows * 8, sizeof(u64));
    u64* out = calloc(nchunks ? nchunks : 1, sizeof(u64));
    u64* again = calloc(nchunks ? nchunks : 1, sizeof(u64));
    u32* counters = calloc(nchunks ? nchunks : 1, sizeof(u32));
    // Lanes of each chunk folded so far: a checksum written before all eight is a merge of
    // unfolded lanes (on a GPU a race, even when a later merge would overwrite it here).
    u32* folded = calloc(nchunks ? nchunks : 1, sizeof(u32));
    const u64 unset = 0x5a5a5a5a5a5a5a5aull;
    const u32 threads = 128;
    blockDim.x = threads;
    // Each kernel's threads one after another (their threads never wait for each other; the
    // row kernel's barrier only follows its copy of the secret, which the C build does not
    // make), so any order of threads is a valid execution. Twice: runs of 8 rows and the fold
    // in order, then one block's few long runs (batches crossing chunks) and the fold in
    // reverse order (another lane merges), with the counters the first run put back.
    for (int round = 0; round < 2; round++) {
        u64* dst = round == 0 ? out : again;
        for (u64 i = 0; i < nchunks; i++) {
            dst[i] = unset;
            folded[i] = 0;
        }
        // Rows the row kernel leaves out keep a pattern, not the other round's sums.
        memset(scratch, 0xa5, rows * 8 * sizeof(u64));
        gridDim.x = round == 0 ? (u32)(((rows + 7) / 8 * 8 + threads - 1) / threads) : 1;
        for (u64 t = 0; t < (u64)gridDim.x * threads; t++) {
            blockIdx.x = (u32)(t / threads);
            threadIdx.x = (u32)(t % threads);
            orbitkv_xxh3_row_runs(chunks, (u32)nchunks, segs, row_segs, scratch, rows);
        }
        gridDim.x = (u32)((nchunks * 8 + threads - 1) / threads);
        for (u64 i = 0; i < nchunks * 8; i++) {
            u64 t = round == 0 ? i : nchunks * 8 - 1 - i;
            blockIdx.x = (u32)(t / threads);
            threadIdx.x = (u32)(t % threads);
            orbitkv_xxh3_fold_merge(chunks, (u32)nchunks, scratch, counters, dst);
            u64 k = t / 8;
            if (k < nchunks && ++folded[k] < 8 && dst[k] != unset) {
                fprintf(stderr, "chunk %llu merged after %u of its 8 lanes\n", k, folded[k]);
                return 5;
            }
        }
    }
    for (u64 i = 0; i < nchunks; i++) {
        printf("%016llx\n", out[i]);
        if (again[i] != out[i]) {
            fprintf(stderr, "chunk %llu: %016llx in order, %016llx in reverse\n", i, out[i], again[i]);
            return 4;
        }
    }
    for (u64 i = 0; i < nchunks; i++) {
        if (counters[i] != 0) {
            fprintf(stderr, "counter %llu left at %u\n", i, counters[i]);
            return 3;
        }
    }
    return 0;
}
