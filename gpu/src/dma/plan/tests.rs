use super::*;
use orbitkv_proto::{KvLayoutKind, KvLayoutSpec};

/// A flat "address space": GPU tensors and the host region side by side, so that copies
/// described by addresses can be executed on the CPU.
struct Memory {
    bytes: Vec<u8>,
}

impl Memory {
    fn copy(&mut self, src: u64, dst: u64, len: u64) {
        let (s, d, n) = (src as usize, dst as usize, len as usize);
        self.bytes.copy_within(s..s + n, d);
    }
}

fn layouts() -> Vec<KvLayoutSpec> {
    let base = KvLayoutSpec {
        kind: KvLayoutKind::FlashAttnNhd,
        num_layers: 3,
        num_blocks: 7,
        block_size: 4,
        kv_heads: 2,
        head_dim: 8,
        elem_bytes: 2,
    };
    vec![
        base,
        KvLayoutSpec { kind: KvLayoutKind::FlashAttnHnd, ..base },
        KvLayoutSpec { kind: KvLayoutKind::CrossLayer, ..base },
        KvLayoutSpec { kind: KvLayoutKind::MlaPerLayer, kv_heads: 1, head_dim: 24, ..base },
        KvLayoutSpec { kind: KvLayoutKind::SglangPerLayer, block_size: 1, num_blocks: 29, ..base },
        KvLayoutSpec { kind: KvLayoutKind::Paged, ..base },
    ]
}

/// Saves blocks through staging batches, checks the host bytes against the layout's segment
/// list, scribbles the engine, loads back, checks the engine bytes.
fn round_trip(l: &KvLayoutSpec, blocks_per_chunk: usize, capacity: u64, max_segments: usize) {
    let tensor_bytes = l.tensor_bytes().unwrap();
    let tensors: Vec<u64> = (0..l.tensor_count() as u64).map(|t| t * tensor_bytes).collect();
    let engine_end = tensor_bytes * l.tensor_count() as u64;
    let chunks: Vec<Vec<u64>> = (0..l.num_blocks)
        .rev()
        .collect::<Vec<_>>()
        .chunks(blocks_per_chunk)
        .map(|c| c.to_vec())
        .collect();
    let chunk_len = l.block_bytes() * blocks_per_chunk as u64;
    // Host slots with a gap between them, in reverse order of the chunks.
    let host_base = engine_end;
    let slot = |i: usize| host_base + (chunks.len() - 1 - i) as u64 * (chunk_len + 48);
    let staging = host_base + chunks.len() as u64 * (chunk_len + 48);
    let mut mem = Memory { bytes: vec![0; (staging + capacity) as usize] };
    for (i, b) in mem.bytes[..engine_end as usize].iter_mut().enumerate() {
        *b = (i * 7 + i / 251) as u8;
    }
    let original = mem.bytes[..engine_end as usize].to_vec();
    let mut pieces = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        let len = chunk_pieces(l, &tensors, c, slot(i), &mut pieces);
        assert_eq!(len, l.block_bytes() * c.len() as u64);
    }
    assert_eq!(pieces.iter().map(|p| p.len).sum::<u64>(), l.block_bytes() * l.num_blocks);
    let batches = stage(&pieces, capacity, max_segments);
    for b in &batches {
        assert!(b.bytes <= capacity && b.segments.len() <= max_segments);
        for d in b.descs(staging, true) {
            mem.copy(d.src, d.dst, d.len);
        }
        for r in &b.runs {
            mem.copy(staging + r.staging, r.host, r.len);
        }
    }
    // Every chunk holds its blocks' segments in order.
    for (i, c) in chunks.iter().enumerate() {
        let mut want = Vec::new();
        for &block in c {
            for s in l.block_segments(block) {
                let at = (tensors[s.tensor as usize] + s.offset) as usize;
                want.extend_from_slice(&original[at..at + s.len as usize]);
            }
        }
        let at = slot(i) as usize;
        assert_eq!(&mem.bytes[at..at + want.len()], &want[..], "{:?} chunk {i}", l.kind);
    }
    mem.bytes[..engine_end as usize].fill(0xee);
    for b in &batches {
        for r in &b.runs {
            mem.copy(r.host, staging + r.staging, r.len);
        }
        for d in b.descs(staging, false) {
            mem.copy(d.src, d.dst, d.len);
        }
    }
    assert_eq!(&mem.bytes[..engine_end as usize], &original[..], "{:?} load", l.kind);
}

#[test]
fn every_layout_round_trips_through_staging() {
    for l in layouts() {
        for (per_chunk, capacity, max_segments) in
            [(1, 1 << 20, 1 << 16), (1, 100, 3), (7, 96, 1 << 16), (1, 16, 1), (7, 1 << 20, 5)]
        {
            if l.num_blocks % per_chunk as u64 == 0 {
                round_trip(&l, per_chunk, capacity, max_segments);
            }
        }
    }
}

#[test]
fn contiguous_pieces_merge_on_both_sides() {
    let l = KvLayoutSpec {
        kind: KvLayoutKind::CrossLayer,
        num_layers: 4,
        num_blocks: 8,
        block_size: 16,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
    };
    let mut pieces = Vec::new();
    // Blocks 2, 3, 4 are adjacent in the cross-layer tensor: one piece.
    chunk_pieces(&l, &[1 << 40], &[2, 3, 4], 4096, &mut pieces);
    assert_eq!(pieces.len(), 1);
    assert_eq!(pieces[0].len, 3 * l.block_bytes());
    // A second chunk never merges into the first one's pieces.
    chunk_pieces(&l, &[1 << 40], &[5], 4096 + 3 * l.block_bytes(), &mut pieces);
    assert_eq!(pieces.len(), 2);
}

#[test]
fn staging_runs_follow_host_contiguity() {
    let pieces = [
        Piece { device: 0, host: 1000, len: 10 },
        Piece { device: 50, host: 1010, len: 10 },
        Piece { device: 100, host: 5000, len: 10 },
    ];
    let b = stage(&pieces, 1 << 20, 1 << 16);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].runs.len(), 2);
    assert_eq!(b[0].runs[0], HostRun { staging: 0, host: 1000, len: 20 });
    assert_eq!(b[0].segments.len(), 3);
    let descs: Vec<_> = b[0].descs(1 << 30, true).collect();
    assert_eq!(descs[1], KernelDesc { src: 50, dst: (1 << 30) + 10, len: 10 });
    let mut img = Vec::new();
    descs[1].encode(&mut img);
    assert_eq!(img.len(), KernelDesc::BYTES);
    assert_eq!(&img[8..16], &((1u64 << 30) + 10).to_le_bytes());
}

#[test]
fn long_pieces_become_several_descriptors_and_one_host_run() {
    let pieces = [Piece { device: 1 << 30, host: 1 << 40, len: 3 * MAX_SEGMENT + 100 }];
    let b = stage(&pieces, 1 << 30, 1 << 16);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].segments.len(), 4);
    assert_eq!(b[0].runs, vec![HostRun { staging: 0, host: 1 << 40, len: 3 * MAX_SEGMENT + 100 }]);
    let descs: Vec<_> = b[0].descs(0, true).collect();
    assert_eq!(
        descs[3],
        KernelDesc { src: (1 << 30) + 3 * MAX_SEGMENT, dst: 3 * MAX_SEGMENT, len: 100 }
    );
    // The descriptor bound still splits batches.
    let b = stage(&pieces, 1 << 30, 3);
    assert_eq!(b.len(), 2);
    assert_eq!(b[1].segments.len(), 1);
}

#[test]
fn a_batch_of_one_segment_length_is_uniform_and_laid_out_by_index() {
    // Scattered 2 KiB pages: every batch uniform, segment d at staging offset d * 2048 (what
    // the uniform scatter kernel assumes).
    let pieces: Vec<Piece> = (0..100u64)
        .map(|i| Piece { device: (i * 7919 % 100) << 20, host: 1 << 40 | i << 12, len: 2048 })
        .collect();
    for b in stage(&pieces, 64 << 10, 1 << 16) {
        assert_eq!(b.uniform_len(), Some(2048));
        for (d, &(_, off, _)) in b.segments.iter().enumerate() {
            assert_eq!(off, d as u64 * 2048);
        }
    }
    // A piece split at the batch's end, a long piece cut at MAX_SEGMENT, mixed lengths: not.
    let b = stage(&pieces[..3], 5000, 1 << 16);
    assert_eq!(b[0].uniform_len(), None, "{:?}", b[0].segments);
    let long = [Piece { device: 0, host: 1 << 40, len: MAX_SEGMENT + 16 }];
    assert_eq!(stage(&long, 1 << 30, 1 << 16)[0].uniform_len(), None);
    let mixed = [
        Piece { device: 0, host: 1 << 40, len: 2048 },
        Piece { device: 1 << 20, host: 1 << 41, len: 4096 },
    ];
    assert_eq!(stage(&mixed, 1 << 30, 1 << 16)[0].uniform_len(), None);
    assert_eq!(StagedBatch::default().uniform_len(), None);
}

/// Every batch `next_batch_into` plans: the same runs and bytes as `next_batch`'s, and the
/// table image `descs` would give, both ways.
fn same_batches_in_one_pass(pieces: &[Piece], capacity: u64, max_segments: usize) {
    let staging = 1 << 44;
    for gather in [true, false] {
        let (mut at, mut at_into) = (StageCursor::default(), StageCursor::default());
        let (mut want, mut got) = (StagedBatch::default(), StagedBatch::default());
        let mut table = vec![0xa5u8; max_segments * KernelDesc::BYTES];
        loop {
            let more = next_batch(pieces, &mut at, capacity, max_segments, &mut want);
            // Finished exactly when nothing more is planned.
            assert_eq!(at_into.finished(pieces), !more);
            let (n, uniform) = next_batch_into(
                pieces,
                &mut at_into,
                (capacity, max_segments),
                (staging, gather),
                &mut table,
                &mut got,
            );
            assert_eq!((n > 0, n), (more, want.segments.len()));
            assert_eq!((&got.runs, got.bytes, at_into), (&want.runs, want.bytes, at));
            assert!(got.segments.is_empty());
            assert_eq!(uniform, want.uniform_len());
            let mut img = Vec::new();
            want.descs(staging, gather).for_each(|d| d.encode(&mut img));
            assert_eq!(&table[..img.len()], &img[..]);
            if !more {
                break;
            }
            if let (false, Some(_)) = (gather, uniform) {
                compact_uniform(&mut table, n);
                for (d, &(device, _, _)) in want.segments.iter().enumerate() {
                    assert_eq!(&table[d * 8..d * 8 + 8], &device.to_le_bytes(), "segment {d}");
                }
            }
        }
    }
}

#[test]
fn batches_planned_into_the_table_match_the_segment_lists() {
    for l in layouts() {
        let tensors: Vec<u64> =
            (0..l.tensor_count() as u64).map(|t| t * l.tensor_bytes().unwrap()).collect();
        let mut pieces = Vec::new();
        let blocks: Vec<u64> = (0..l.num_blocks).rev().collect();
        for (i, c) in blocks.chunks(3).enumerate() {
            chunk_pieces(&l, &tensors, c, (1 << 40) + i as u64 * (1 << 20), &mut pieces);
        }
        for (capacity, max_segments) in [(1 << 20, 1 << 16), (100, 3), (96, 1 << 16), (16, 1)] {
            same_batches_in_one_pass(&pieces, capacity, max_segments);
        }
    }
    // Scattered 2 KiB pages (uniform batches, compacted for the uniform scatter), and long
    // pieces cut at MAX_SEGMENT.
    let pages: Vec<Piece> = (0..300u64)
        .map(|i| Piece { device: (i * 7919 % 300) << 20, host: 1 << 40 | i << 11, len: 2048 })
        .collect();
    same_batches_in_one_pass(&pages, 64 << 10, 1 << 16);
    same_batches_in_one_pass(&pages, 5000, 7);
    let long = [Piece { device: 0, host: 1 << 40, len: 3 * MAX_SEGMENT + 100 }];
    same_batches_in_one_pass(&long, 1 << 30, 2);
}

/// The block form of [`round_trip`]: chunks planned by `next_blocks_into` and copied by the
/// kernel's CPU model (`block_copies`) land as the layout's segments say, and load back.
fn block_round_trip(l: &KvLayoutSpec, blocks_per_chunk: usize, capacity: u64, table_ids: usize) {
    let tensor_bytes = l.tensor_bytes().unwrap();
    let tensors: Vec<u64> = (0..l.tensor_count() as u64).map(|t| t * tensor_bytes).collect();
    let engine_end = tensor_bytes * l.tensor_count() as u64;
    let ids: Vec<u64> = (0..l.num_blocks).map(|b| (b * 5 + 3) % l.num_blocks).collect();
    let chunk_len = l.block_bytes() * blocks_per_chunk as u64;
    let n = ids.len() / blocks_per_chunk;
    // Slots with a gap between them, in reverse order of the chunks; two adjacent (merged).
    let host_base = engine_end;
    let chunks: Vec<(u64, Vec<u64>)> = ids
        .chunks(blocks_per_chunk)
        .enumerate()
        .map(|(i, c)| {
            let gap = if i == 1 { 0 } else { 48 };
            ((n - 1 - i) as u64 * (chunk_len + 48) + gap, c.to_vec())
        })
        .collect();
    let staging = host_base + n as u64 * (chunk_len + 48) + 48;
    let (bases, stride) = l.part_bases(&tensors);
    let job = BlockJob {
        parts: 0,
        bases: &bases,
        part_len: l.part_len(),
        stride,
        host_base,
        chunks: &chunks,
    };
    let mut mem = Memory { bytes: vec![0; (staging + capacity) as usize] };
    for (i, b) in mem.bytes[..engine_end as usize].iter_mut().enumerate() {
        *b = (i * 7 + i / 251) as u8;
    }
    let original = mem.bytes[..engine_end as usize].to_vec();
    let mut table = vec![0u8; table_ids * 8];
    let mut batch = StagedBatch::default();
    let mut at = BlockCursor::default();
    let mut batches = Vec::new();
    loop {
        let taken = next_blocks_into(&job, &mut at, capacity, &mut table, &mut batch);
        if taken == 0 {
            break;
        }
        assert!(batch.bytes <= capacity && taken <= table_ids && batch.segments.is_empty());
        assert_eq!(batch.bytes, taken as u64 * l.block_bytes());
        let ids: Vec<u64> = table[..taken * 8]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        for d in block_copies(&job, &ids, staging, true) {
            assert!(d.len <= BLOCK_UNIT);
            mem.copy(d.src, d.dst, d.len);
        }
        for r in &batch.runs {
            mem.copy(staging + r.staging, r.host, r.len);
        }
        batches.push((ids, batch.clone()));
    }
    assert_eq!(batches.iter().map(|(i, _)| i.len()).sum::<usize>(), ids.len());
    for (offset, c) in &chunks {
        let mut want = Vec::new();
        for &block in c {
            for s in l.block_segments(block) {
                let at = (tensors[s.tensor as usize] + s.offset) as usize;
                want.extend_from_slice(&original[at..at + s.len as usize]);
            }
        }
        let at = (host_base + offset) as usize;
        assert_eq!(&mem.bytes[at..at + want.len()], &want[..], "{:?} chunk at {offset}", l.kind);
    }
    mem.bytes[..engine_end as usize].fill(0xee);
    for (ids, b) in &batches {
        for r in &b.runs {
            mem.copy(r.host, staging + r.staging, r.len);
        }
        for d in block_copies(&job, ids, staging, false) {
            mem.copy(d.src, d.dst, d.len);
        }
    }
    // Every block was loaded back (the ids cover them all).
    assert_eq!(&mem.bytes[..engine_end as usize], &original[..], "{:?} load", l.kind);
}

#[test]
fn every_layout_round_trips_in_block_form() {
    for l in layouts() {
        let block = l.block_bytes();
        for (per_chunk, capacity, table_ids) in
            [(1, 1 << 20, 1 << 10), (1, block, 1), (7, 3 * block + 5, 1 << 10), (7, 1 << 20, 2)]
        {
            if l.num_blocks % per_chunk as u64 == 0 {
                block_round_trip(&l, per_chunk, capacity, table_ids);
            }
        }
    }
}

#[test]
fn block_form_runs_merge_across_adjacent_slots_and_long_parts_split() {
    // Two chunks of two 4 KiB blocks in adjacent slots: one host run; a third further on.
    let chunks = vec![(0u64, vec![9u64, 2]), (8192, vec![4, 4]), (20000, vec![1, 0])];
    let job = BlockJob {
        parts: 0,
        bases: &[0, 1 << 20],
        part_len: 2048,
        stride: 2048,
        host_base: 1 << 30,
        chunks: &chunks,
    };
    let mut table = vec![0u8; 64];
    let (mut batch, mut at) = (StagedBatch::default(), BlockCursor::default());
    assert_eq!(next_blocks_into(&job, &mut at, 1 << 20, &mut table, &mut batch), 6);
    assert_eq!(
        batch.runs,
        vec![
            HostRun { staging: 0, host: 1 << 30, len: 16384 },
            HostRun { staging: 16384, host: (1 << 30) + 20000, len: 8192 },
        ]
    );
    assert_eq!(&table[8..16], &2u64.to_le_bytes());
    assert_eq!(next_blocks_into(&job, &mut at, 1 << 20, &mut table, &mut batch), 0);
    // A 150 KiB part is three units of at most 64 KiB, in order.
    let one = [(0u64, vec![1u64])];
    let long =
        BlockJob { bases: &[1000], part_len: 150 << 10, stride: 1 << 20, chunks: &one, ..job };
    // Parts one after another, blocks one after another: one run per block (cross-layer).
    let packed = BlockJob { bases: &[0, 2048], stride: 4096, ..job };
    assert!(!job.blocks_contiguous() && !long.blocks_contiguous() && packed.blocks_contiguous());
    let units = block_copies(&long, &[1], 0, true);
    assert_eq!(
        units.iter().map(|d| (d.src, d.dst, d.len)).collect::<Vec<_>>(),
        vec![
            (1000 + (1 << 20), 0, 64 << 10),
            (1000 + (1 << 20) + (64 << 10), 64 << 10, 64 << 10),
            (1000 + (1 << 20) + (128 << 10), 128 << 10, 22 << 10),
        ]
    );
}

/// Every byte's (engine address -> host address) under a plan: the block form's (ids through
/// the kernel's CPU model, then the host runs) and the piece form's must agree for any layout,
/// ids and staging size.
#[test]
fn block_form_and_piece_form_move_every_byte_alike() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let kinds = [
        KvLayoutKind::FlashAttnNhd,
        KvLayoutKind::FlashAttnHnd,
        KvLayoutKind::CrossLayer,
        KvLayoutKind::MlaPerLayer,
        KvLayoutKind::SglangPerLayer,
        KvLayoutKind::Paged,
    ];
    for round in 0..200 {
        let layout = kinds[round % kinds.len()];
        let l = KvLayoutSpec {
            kind: layout,
            num_layers: 1 + rand(4) as u32,
            num_blocks: 1 + rand(12),
            block_size: if layout == KvLayoutKind::SglangPerLayer { 1 } else { 1 + rand(3) as u32 },
            kv_heads: if layout == KvLayoutKind::MlaPerLayer { 1 } else { 1 + rand(3) as u32 },
            head_dim: 1 + rand(8) as u32,
            elem_bytes: [1, 2, 4][rand(3) as usize],
        };
        l.validate().unwrap();
        let tensor_bytes = l.tensor_bytes().unwrap();
        // Tensors apart from each other (as allocations are), the host far above.
        let tensors: Vec<u64> =
            (0..l.tensor_count() as u64).map(|t| t * (tensor_bytes + 64)).collect();
        let per_chunk = 1 + rand(3) as usize;
        let nchunks = 1 + rand(5) as usize;
        let chunk_len = l.block_bytes() * per_chunk as u64;
        let host_base = 1 << 40;
        let chunks: Vec<(u64, Vec<u64>)> = (0..nchunks)
            .map(|c| {
                let ids = (0..per_chunk).map(|_| rand(l.num_blocks)).collect();
                // Slots in any order, some adjacent.
                let slot = (nchunks - 1 - c) as u64 * chunk_len * (1 + rand(2));
                (slot, ids)
            })
            .collect();
        // Slots must not overlap: keep the round only if they do not.
        let mut spans: Vec<(u64, u64)> = chunks.iter().map(|(o, _)| (*o, o + chunk_len)).collect();
        spans.sort();
        if spans.windows(2).any(|w| w[0].1 > w[1].0) {
            continue;
        }
        let staging = 1u64 << 50;
        let capacity = l.block_bytes() * (1 + rand(4)) + rand(7);
        // The piece form.
        let mut want = std::collections::BTreeMap::new();
        let mut pieces = Vec::new();
        for (off, ids) in &chunks {
            chunk_pieces(&l, &tensors, ids, host_base + off, &mut pieces);
        }
        for b in stage(&pieces, capacity, 1 << 20) {
            for d in b.descs(staging, true) {
                for k in 0..d.len {
                    want.insert(d.src + k, d.dst + k - staging);
                }
            }
            let mut out = std::collections::BTreeMap::new();
            for r in &b.runs {
                for k in 0..r.len {
                    out.insert(r.staging + k, r.host + k);
                }
            }
            for v in want.values_mut() {
                if let Some(h) = out.get(v) {
                    *v = *h | (1 << 63);
                }
            }
        }
        // The block form.
        let (bases, stride) = l.part_bases(&tensors);
        let job = BlockJob {
            parts: 0,
            bases: &bases,
            part_len: l.part_len(),
            stride,
            host_base,
            chunks: &chunks,
        };
        let mut got = std::collections::BTreeMap::new();
        let mut table = vec![0u8; 8 * (1 + rand(6) as usize)];
        let (mut batch, mut at) = (StagedBatch::default(), BlockCursor::default());
        loop {
            let n = next_blocks_into(&job, &mut at, capacity, &mut table, &mut batch);
            if n == 0 {
                break;
            }
            let ids: Vec<u64> = table[..n * 8]
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                .collect();
            let mut staged = std::collections::BTreeMap::new();
            for d in block_copies(&job, &ids, staging, true) {
                for k in 0..d.len {
                    staged.insert(d.src + k, d.dst + k - staging);
                }
            }
            let mut out = std::collections::BTreeMap::new();
            for r in &batch.runs {
                for k in 0..r.len {
                    out.insert(r.staging + k, r.host + k);
                }
            }
            for (src, st) in staged {
                got.insert(src, out[&st] | (1 << 63));
            }
        }
        // A block id repeated within a job maps its bytes twice in both forms; the maps keep
        // the last, the same in both (the forms walk chunks and blocks in the same order).
        assert_eq!(got, want, "{l:?}, {chunks:?}, capacity {capacity}");
    }
}

/// A random block-form job's part bases and part length (a multiple of 1 KiB, some longer
/// than a unit), its chunks (host offset, block ids), and a staging capacity.
type SummableJob = (Vec<u64>, u64, Vec<(u64, Vec<u64>)>, u64);

fn summable_job(rand: &mut impl FnMut(u64) -> u64) -> SummableJob {
    let part_len = 1024 * [1, 2, 18, 64, 130][rand(5) as usize];
    let part_count = 1 + rand(5);
    let per_chunk = 1 + rand(3) as usize;
    let nchunks = 1 + rand(6) as usize;
    let bases: Vec<u64> = (0..part_count).map(|p| (p + 1) << 36).collect();
    let chunks: Vec<(u64, Vec<u64>)> =
        (0..nchunks).map(|c| (c as u64 * 10, (0..per_chunk).map(|_| rand(50)).collect())).collect();
    let capacity = part_len * part_count * per_chunk as u64 * (1 + rand(4));
    (bases, part_len, chunks, capacity)
}

/// A job over `chunks` whose parts lie at `bases`, one part length apart per block id.
fn packed_job<'a>(bases: &'a [u64], part_len: u64, chunks: &'a [(u64, Vec<u64>)]) -> BlockJob<'a> {
    BlockJob { parts: 0, bases, part_len, stride: part_len, host_base: 0, chunks }
}

/// The rows the units of one launch name, as `sum_units` in chunk_checksum.cu works them out
/// per unit (the fused gather, the block row sums): `n` blocks from the job's block
/// `first_block`, the id of batch position i read from `ids`. Each row goes into `rows` (row in
/// the job -> chunk, chunk offset, whether the chunk's last row), named once; each id read is
/// checked to be the chunk's block the numbering says it is.
fn claim_rows(
    job: &BlockJob<'_>,
    (first_block, n): (u64, u64),
    ids: &[u8],
    rows: &mut std::collections::BTreeMap<u64, (u64, u64, bool)>,
) {
    const UNIT: u64 = BLOCK_UNIT;
    let (part_len, part_count) = (job.part_len, job.part_count());
    let per_chunk = job.chunks[0].1.len() as u64;
    let rpc = job.block_bytes() * per_chunk / 1024;
    let subs = part_len.div_ceil(UNIT);
    for u in 0..n * part_count * subs {
        let r = u / subs;
        let p = r % part_count;
        let i = r / part_count;
        let skip = (u % subs) * UNIT;
        let len = (part_len - skip).min(UNIT);
        let b = first_block + i;
        let c = b / per_chunk;
        let in_chunk = ((b - c * per_chunk) * part_count + p) * part_len + skip;
        let row = c * rpc + in_chunk / 1024;
        let last_row = c * rpc + rpc - 1;
        let id = u64::from_le_bytes(ids[i as usize * 8..][..8].try_into().unwrap());
        assert_eq!(id, job.chunks[c as usize].1[(b - c * per_chunk) as usize]);
        for k in 0..len / 1024 {
            let claim = (c, in_chunk + 1024 * k, row + k == last_row);
            assert!(rows.insert(row + k, claim).is_none(), "row {} twice", row + k);
        }
    }
}

/// Every row of every chunk named once, at its own chunk offset, the last of each flagged.
fn assert_rows_cover(
    rows: &std::collections::BTreeMap<u64, (u64, u64, bool)>,
    chunks: u64,
    rpc: u64,
) {
    assert_eq!(rows.len() as u64, chunks * rpc);
    for (&row, &(c, off, last)) in rows {
        assert_eq!((c, off), (row / rpc, (row % rpc) * 1024), "row {row}");
        assert_eq!(last, row % rpc == rpc - 1);
    }
}

fn xorshift() -> impl FnMut(u64) -> u64 {
    let mut x = 0x0123_4567_89ab_cdefu64;
    move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

/// The fused gather's row numbering (`orbitkv_copy_blocks_summed` in chunk_checksum.cu,
/// mirrored by `claim_rows`): over a job's batches, its units name every 1 KiB row of every
/// chunk once, each at the chunk offset whose bytes the unit copies, and flag each chunk's last
/// row.
#[test]
fn fused_gather_rows_cover_each_chunk_once_in_order() {
    let mut rand = xorshift();
    for _ in 0..100 {
        let (bases, part_len, chunks, capacity) = summable_job(&mut rand);
        let job = packed_job(&bases, part_len, &chunks);
        let mut table = vec![0u8; 8 * 64];
        let (mut batch, mut at) = (StagedBatch::default(), BlockCursor::default());
        let mut first_block = 0u64;
        let mut rows = std::collections::BTreeMap::new();
        loop {
            let finished = at.finished(&job);
            let n = next_blocks_into(&job, &mut at, capacity, &mut table, &mut batch) as u64;
            assert_eq!(finished, n == 0, "finished exactly when no block is left");
            if n == 0 {
                break;
            }
            // The unit copies the id the planner put at batch position i.
            claim_rows(&job, (first_block, n), &table, &mut rows);
            first_block += n;
        }
        let rpc = job.block_bytes() * chunks[0].1.len() as u64 / 1024;
        assert_rows_cover(&rows, chunks.len() as u64, rpc);
    }
}

/// A block cursor is finished exactly when no block is left, empty chunks anywhere.
#[test]
fn block_cursor_finishes_past_empty_chunks() {
    let bases = [1u64 << 36];
    for chunks in [
        vec![(0, vec![1, 2]), (10, vec![]), (20, vec![3])],
        vec![(0, vec![]), (10, vec![4])],
        vec![(0, vec![5]), (10, vec![]), (20, vec![])],
        vec![(0, vec![]), (10, vec![])],
        vec![],
    ] {
        let job = packed_job(&bases, 4096, &chunks);
        let (mut batch, mut at) = (StagedBatch::default(), BlockCursor::default());
        // One block per batch: the cursor stops inside and between chunks.
        let mut table = [0u8; 8];
        let mut taken = 0;
        loop {
            let finished = at.finished(&job);
            let n = next_blocks_into(&job, &mut at, 4096, &mut table, &mut batch);
            assert_eq!(finished, n == 0, "{chunks:?} after {taken} blocks");
            if n == 0 {
                break;
            }
            taken += n;
        }
        assert_eq!(taken, chunks.iter().map(|c| c.1.len()).sum::<usize>());
    }
}

/// The block row sums (`orbitkv_xxh3_block_rows`): one launch over the whole job, its block ids
/// as the hasher writes them (`write_block_ids`), the same numbering from block 0.
#[test]
fn block_rows_cover_each_chunk_once_in_order() {
    let mut rand = xorshift();
    for _ in 0..100 {
        let (bases, part_len, chunks, _) = summable_job(&mut rand);
        let job = packed_job(&bases, part_len, &chunks);
        let blocks: usize = chunks.iter().map(|c| c.1.len()).sum();
        let mut ids = vec![0u8; 8 * blocks];
        crate::dma::checksum::write_block_ids(&job, &mut ids);
        let mut rows = std::collections::BTreeMap::new();
        claim_rows(&job, (0, blocks as u64), &ids, &mut rows);
        let rpc = job.block_bytes() * chunks[0].1.len() as u64 / 1024;
        assert_rows_cover(&rows, chunks.len() as u64, rpc);
    }
}
