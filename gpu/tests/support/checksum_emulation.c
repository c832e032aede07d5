// Runs gpu/kernels/chunk_checksum.cu's kernels on the CPU, thread by thread, for the test
// suite (tests/checksum_kernel_on_cpu.rs). Reads from stdin, all little-endian u64:
// nchunks, nsegs, rows, data_len, then nchunks records of 5 words (HashChunk), nsegs records
// of 2 words (HashSeg, addresses as offsets into the data), then data_len bytes of data.
// Prints one checksum per chunk, in hex, one per line.
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    unsigned int x, y, z;
} orbitkv_dim3;
static orbitkv_dim3 blockIdx, threadIdx, blockDim;

#include "chunk_checksum.cu"

static void* read_exact(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

int main(void) {
    u64* head = read_exact(4 * sizeof(u64));
    u64 nchunks = head[0], nsegs = head[1], rows = head[2], data_len = head[3];
    HashChunk* chunks = read_exact(nchunks * sizeof(HashChunk));
    HashSeg* segs = read_exact(nsegs * sizeof(HashSeg));
    // 8 spare bytes in front so that offsets map to unaligned addresses too when the test
    // asks (the data starts at base + 0 with base 8-aligned from malloc).
    unsigned char* data = read_exact(data_len);
    for (u64 i = 0; i < nsegs; i++) {
        segs[i].addr += (u64)data;
    }
    u64* scratch = calloc(rows * 8, sizeof(u64));
    u64* out = calloc(nchunks ? nchunks : 1, sizeof(u64));
    const u32 threads = 128;
    blockDim.x = threads;
    // Each kernel's threads, one after another (the kernels use neither shared memory nor
    // barriers, so any order of threads is a valid execution).
    for (u64 t = 0; t < rows * 8; t++) {
        blockIdx.x = (u32)(t / threads);
        threadIdx.x = (u32)(t % threads);
        orbitkv_xxh3_blocks(chunks, (u32)nchunks, segs, scratch, rows);
    }
    for (u64 t = 0; t < nchunks * 8; t++) {
        blockIdx.x = (u32)(t / threads);
        threadIdx.x = (u32)(t % threads);
        orbitkv_xxh3_fold(chunks, (u32)nchunks, scratch);
    }
    for (u64 t = 0; t < nchunks; t++) {
        blockIdx.x = (u32)(t / threads);
        threadIdx.x = (u32)(t % threads);
        orbitkv_xxh3_merge(chunks, (u32)nchunks, scratch, out);
    }
    for (u64 i = 0; i < nchunks; i++) {
        printf("%016llx\n", out[i]);
    }
    return 0;
}
