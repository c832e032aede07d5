//! The GPU checksum kernels (gpu/kernels/chunk_checksum.cu), compiled as C and run thread by
//! thread on the CPU, give `orbitkv_proto::chunk_checksum` for chunks scattered over
//! segments of every shape: XXH3's block edges (1 KiB), final stripes overlapping the last
//! block, segments shorter than a word, unaligned addresses, words straddling segments.

use std::io::Write;
use std::process::{Command, Stdio};

use orbitkv_gpu::dma::checksum::{
    block_tables, tables_capacity, write_block_ids, write_tables, SEG_RECORD,
};
use orbitkv_gpu::dma::plan::{BlockJob, Piece};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Builds the emulator for the test `name` (each test its own binary: they run in parallel and
/// each removes its own when done).
fn emulator(name: &str) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out =
        std::env::temp_dir().join(format!("orbitkv-checksum-emu-{name}-{}", std::process::id()));
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-x", "c"])
        .arg("-I")
        .arg(root.join("kernels"))
        .arg(root.join("tests/support/checksum_emulation.c"))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("a C compiler (cc) builds the kernel emulation");
    assert!(status.success(), "compiling the kernel source as C failed");
    out
}

/// Runs the emulator (with `mode` as its argument, if any) on `input`; the checksums it
/// prints, one per chunk.
fn emulate(emu: &std::path::Path, mode: Option<&str>, input: &[u8]) -> Vec<u64> {
    let mut child =
        Command::new(emu).args(mode).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "emulation exited {:?}", out.status);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| u64::from_str_radix(l, 16).unwrap())
        .collect()
}

/// Runs the kernels on `data` for the chunks of `pieces` (device addresses are offsets into
/// `data`).
/// The tables are those the hasher writes (`write_tables`), their segment records' unused room
/// left out (the emulation reads the three tables back to back).
fn run(emu: &std::path::Path, data: &[u8], pieces: &[Piece], chunk_len: u64) -> Vec<u64> {
    let (_, capacity) = tables_capacity(pieces, chunk_len).unwrap();
    let mut img = vec![0u8; capacity];
    let t = write_tables(pieces, chunk_len, &mut img).unwrap();
    let mut input = Vec::new();
    for w in [t.chunks as u64, t.segs as u64, t.rows, data.len() as u64] {
        input.extend_from_slice(&w.to_le_bytes());
    }
    input.extend_from_slice(&img[..t.segs_offset + t.segs * SEG_RECORD]);
    input.extend_from_slice(&img[t.row_segs_offset..t.len]);
    input.extend_from_slice(data);
    emulate(emu, None, &input)
}

/// Runs the block-form tables (`write_block_ids`, then the expansion kernel) and the kernels
/// on `data` for `job` (its part bases are offsets into `data`).
fn run_blocks(emu: &std::path::Path, data: &[u8], job: &BlockJob<'_>, chunk_len: u64) -> Vec<u64> {
    let t = block_tables(job, chunk_len).unwrap();
    let mut ids = vec![0u8; t.ids_len];
    write_block_ids(job, &mut ids);
    let mut input = Vec::new();
    let head = [
        t.chunks as u64,
        t.per_chunk as u64,
        job.part_count(),
        job.part_len,
        job.stride,
        data.len() as u64,
    ];
    for w in head {
        input.extend_from_slice(&w.to_le_bytes());
    }
    input.extend_from_slice(&ids);
    for b in job.bases {
        input.extend_from_slice(&b.to_le_bytes());
    }
    input.extend_from_slice(data);
    emulate(emu, Some("blocks"), &input)
}

/// Cuts `n` chunks of `chunk_len` bytes into pieces (lengths from `piece_len`) placed at
/// random, non-overlapping places of a data buffer, each at a multiple of `align` bytes;
/// returns the data, the pieces and each chunk's bytes.
fn scatter(
    rng: &mut Rng,
    n: usize,
    chunk_len: u64,
    align: u64,
    mut piece_len: impl FnMut(&mut Rng) -> u64,
) -> (Vec<u8>, Vec<Piece>, Vec<Vec<u8>>) {
    let mut lens = Vec::new();
    for _ in 0..n {
        let mut left = chunk_len;
        while left > 0 {
            let l = piece_len(rng).clamp(1, left);
            lens.push(l);
            left -= l;
        }
    }
    // Each piece gets its own place: shuffled order, gaps of 0-9 bytes (unaligned starts).
    let mut order: Vec<usize> = (0..lens.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut place = vec![0u64; lens.len()];
    let mut at = 0u64;
    for &i in &order {
        at = (at + rng.below(10)).next_multiple_of(align);
        place[i] = at;
        at += lens[i];
    }
    let data: Vec<u8> = (0..at + 16).map(|_| rng.next() as u8).collect();
    let pieces: Vec<Piece> =
        lens.iter().zip(&place).map(|(&len, &device)| Piece { device, host: 0, len }).collect();
    let mut chunks = Vec::new();
    let mut k = 0;
    for _ in 0..n {
        let mut bytes = Vec::new();
        while (bytes.len() as u64) < chunk_len {
            let p = pieces[k];
            bytes.extend_from_slice(&data[p.device as usize..(p.device + p.len) as usize]);
            k += 1;
        }
        chunks.push(bytes);
    }
    (data, pieces, chunks)
}

#[test]
fn kernels_match_chunk_checksum() {
    let emu = emulator("segments");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // XXH3 edges: the shortest long input, around 1 KiB blocks and 64-byte stripes.
    // Around the fold's groups of 32 rows (two in flight) too: 15, 16, 17, 31, 32, 33, 48,
    // 63, 64, 95, 96, 97, 128 and 192 full blocks (16_384 .. 196_609; 97_281 and 98_304 both
    // have 95, with a last row of 1 byte and of 1 KiB).
    let lens = [
        241u64, 255, 256, 1023, 1024, 1025, 1087, 1088, 2047, 2048, 2049, 4103, 16_384, 16_385,
        17_508, 32_768, 32_769, 33_797, 49_153, 65_536, 65_537, 97_281, 98_304, 98_305, 99_329,
        131_073, 196_609,
    ];
    for &len in &lens {
        for shape in 0..3 {
            let (data, pieces, chunks) = scatter(&mut rng, 3, len, 1, |r| match shape {
                0 => len,                    // one segment per chunk
                1 => 1 + r.below(40),        // tiny segments: words straddle them
                _ => 64 * (1 + r.below(20)), // page-like
            });
            let got = run(&emu, &data, &pieces, len);
            let want: Vec<u64> = chunks.iter().map(|c| orbitkv_proto::chunk_checksum(c)).collect();
            assert_eq!(got, want, "chunk length {len}, shape {shape}");
        }
    }
    // KV-like: 64 chunks of 64 KiB in 2 KiB pages, and 2 chunks of 1 MiB + 13 bytes.
    let (data, pieces, chunks) = scatter(&mut rng, 64, 64 << 10, 1, |_| 2048);
    let want: Vec<u64> = chunks.iter().map(|c| orbitkv_proto::chunk_checksum(c)).collect();
    assert_eq!(run(&emu, &data, &pieces, 64 << 10), want);
    // Pages as engines allocate them (16-byte aligned), whose whole rows take the kernel's
    // fast path: 2 KiB pages, 18 KiB pages, and 3 KiB pages in 40 KiB + 512 byte chunks (rows
    // that straddle pages, and a partial last row).
    for (page, chunk_len) in
        [(2048u64, 64u64 << 10), (18 << 10, 576 << 10), (3072, (40 << 10) + 512)]
    {
        let (data, pieces, chunks) = scatter(&mut rng, 8, chunk_len, 16, |_| page);
        let want: Vec<u64> = chunks.iter().map(|c| orbitkv_proto::chunk_checksum(c)).collect();
        assert_eq!(run(&emu, &data, &pieces, chunk_len), want, "{page}-byte pages");
    }
    let (data, pieces, chunks) = scatter(&mut rng, 2, (1 << 20) + 13, 1, |r| 1 + r.below(70_000));
    let want: Vec<u64> = chunks.iter().map(|c| orbitkv_proto::chunk_checksum(c)).collect();
    assert_eq!(run(&emu, &data, &pieces, (1 << 20) + 13), want);
    let _ = std::fs::remove_file(emu);
}

#[test]
fn block_form_tables_expanded_by_the_kernel_give_chunk_checksum() {
    use orbitkv_gpu::LayoutGeometry;
    use orbitkv_proto::{KvLayoutKind, KvLayoutSpec};
    let emu = emulator("blocks");
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let base = KvLayoutSpec {
        kind: KvLayoutKind::FlashAttnNhd,
        num_layers: 3,
        num_blocks: 24,
        block_size: 4,
        kv_heads: 2,
        head_dim: 32,
        elem_bytes: 2,
    };
    // 512-byte parts (rows straddle parts), 2 KiB, 768 bytes (MLA), cross-layer (parts one
    // after another), SGLang's 128-byte token slots.
    for l in [
        base,
        KvLayoutSpec { block_size: 16, ..base },
        KvLayoutSpec { kind: KvLayoutKind::FlashAttnHnd, ..base },
        KvLayoutSpec { kind: KvLayoutKind::MlaPerLayer, kv_heads: 1, head_dim: 96, ..base },
        KvLayoutSpec { kind: KvLayoutKind::CrossLayer, ..base },
        KvLayoutSpec { kind: KvLayoutKind::Paged, ..base },
        KvLayoutSpec { kind: KvLayoutKind::SglangPerLayer, block_size: 1, ..base },
    ] {
        let tensor_bytes = l.tensor_bytes().unwrap();
        let tensors: Vec<u64> = (0..l.tensor_count() as u64).map(|t| t * tensor_bytes).collect();
        let data: Vec<u8> =
            (0..tensor_bytes * l.tensor_count() as u64).map(|_| rng.next() as u8).collect();
        let (bases, stride) = l.part_bases(&tensors);
        for per_chunk in [1usize, 3] {
            let chunk_len = l.block_bytes() * per_chunk as u64;
            if chunk_len < 241 {
                continue;
            }
            let mut ids: Vec<u64> = (0..l.num_blocks).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let chunks: Vec<(u64, Vec<u64>)> =
                ids.chunks_exact(per_chunk).map(|c| (0, c.to_vec())).collect();
            let job = BlockJob {
                parts: 0,
                bases: &bases,
                part_len: l.part_len(),
                stride,
                host_base: 0,
                chunks: &chunks,
            };
            let want: Vec<u64> = chunks
                .iter()
                .map(|(_, c)| {
                    let mut bytes = Vec::new();
                    for &b in c {
                        l.for_each_part(b, |s| {
                            let at = (tensors[s.tensor as usize] + s.offset) as usize;
                            bytes.extend_from_slice(&data[at..at + s.len as usize]);
                        });
                    }
                    orbitkv_proto::chunk_checksum(&bytes)
                })
                .collect();
            let got = run_blocks(&emu, &data, &job, chunk_len);
            assert_eq!(got, want, "{:?}, {per_chunk} blocks per chunk", l.kind);
        }
    }
    let _ = std::fs::remove_file(emu);
}

#[test]
fn fused_row_sums_and_the_uniform_fold_give_chunk_checksum() {
    let mode = "fused";
    let emu = emulator(mode);
    let mut rng = Rng(0x1357_9bdf_2468_ace0);
    // One row, two, the fold's groups of 16 rows around their edges, 2 MiB.
    for (nchunks, len) in
        [(3u64, 1024u64), (2, 2048), (4, 16 << 10), (2, 17 << 10), (3, 33 << 10), (1, 2 << 20)]
    {
        let data: Vec<u8> = (0..nchunks * len).map(|_| rng.next() as u8).collect();
        let mut input = Vec::new();
        for w in [nchunks, len] {
            input.extend_from_slice(&w.to_le_bytes());
        }
        input.extend_from_slice(&data);
        let got = emulate(&emu, Some(mode), &input);
        let want: Vec<u64> = data.chunks(len as usize).map(orbitkv_proto::chunk_checksum).collect();
        assert_eq!(got, want, "{nchunks} chunks of {len} bytes");
    }
    let _ = std::fs::remove_file(emu);
}
