//! Chunk checksums computed on the GPU: the tables of `gpu/kernels/chunk_checksum.cu`.
//!
//! A save's commit stores each chunk's XXH3-64 (`orbitkv_proto::chunk_checksum`). Computing it
//! on the shards means reading every saved byte once more on the CPU, which bounds saves with
//! few shards; the GPU reads the engine's pages at HBM speed instead, beside the copy. The
//! kernels take a chunk table, a segment table (where each chunk's bytes lie, in order) and a
//! row table (the segment holding each 1 KiB row's first byte); this module builds them from
//! the same pieces the copy moves. Pure arithmetic: tested on the CPU against `chunk_checksum`
//! by running the kernel source as C (tests/).

use super::plan::{BlockJob, Piece};
use super::DmaError;

/// Shortest chunk the kernels hash: XXH3's long-input path starts above 240 bytes; shorter
/// chunks are checksummed on the CPU.
pub const MIN_LEN: u64 = 241;

/// Bytes of one chunk record (`HashChunk`: five little-endian u64).
pub const CHUNK_RECORD: usize = 40;

/// Bytes of one segment record (`HashSeg`: two little-endian u64).
pub const SEG_RECORD: usize = 16;

/// Bytes of one row: one of XXH3's 1 KiB blocks of a chunk.
pub const ROW_LEN: u64 = 1024;

/// Bytes of one scratch row (8 lane sums of one 1 KiB block).
pub const ROW_BYTES: u64 = 64;

/// Bytes of one row record (the index of the segment holding the row's first byte, a
/// little-endian u32).
pub const ROW_RECORD: usize = 4;

/// Counters per chunk in the fold kernel's counter table (`u32`): its lanes folded. Zero
/// between submissions (the kernel puts it back).
pub const COUNTERS_PER_CHUNK: usize = 1;

/// Scratch rows of a chunk of `len` bytes: one per full block before the last, and the last.
pub fn rows_of(len: u64) -> u64 {
    (len - 1) / 1024 + 1
}

/// The kernels' input for a group of chunks, as vectors: the readable form of the tables,
/// which [`write_tables`] (what the hasher uses) is tested against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HashTables {
    /// Per chunk: len, first segment, segments, first row, 0.
    pub chunks: Vec<[u64; 5]>,
    /// Per segment: start within its chunk, device address.
    pub segs: Vec<[u64; 2]>,
    /// Per row: the index (into `segs`) of the segment holding its first byte, so that a
    /// row's threads start reading at once instead of searching the chunk's segments.
    pub row_segs: Vec<u32>,
    /// Scratch rows of all chunks.
    pub rows: u64,
}

impl HashTables {
    /// Empties the tables, keeping their memory.
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.segs.clear();
        self.row_segs.clear();
        self.rows = 0;
    }

    /// Adds the chunks whose bytes are `pieces` in order (device side; consecutive chunks of
    /// `chunk_len` bytes each, as `chunk_pieces` appends them). Returns how many were added.
    /// On an error the tables are as they were before the call.
    pub fn add_chunks(&mut self, pieces: &[Piece], chunk_len: u64) -> Result<usize, DmaError> {
        let before = (self.chunks.len(), self.segs.len(), self.row_segs.len(), self.rows);
        let added = self.append(pieces, chunk_len);
        if added.is_err() {
            self.chunks.truncate(before.0);
            self.segs.truncate(before.1);
            self.row_segs.truncate(before.2);
            self.rows = before.3;
        }
        added
    }

    fn append(&mut self, pieces: &[Piece], chunk_len: u64) -> Result<usize, DmaError> {
        if chunk_len < MIN_LEN {
            return Err(DmaError::Invalid(format!(
                "chunks of {chunk_len} bytes are checksummed on the CPU (the GPU kernels need at \
                 least {MIN_LEN})"
            )));
        }
        let mut added = 0;
        let mut at = 0u64; // bytes of the current chunk so far
        let mut next_row = 0u64; // chunk offset of the next row without its segment
        for p in pieces {
            if p.len == 0 {
                continue;
            }
            if at == 0 {
                self.chunks.push([chunk_len, self.segs.len() as u64, 0, self.rows, 0]);
                self.rows += rows_of(chunk_len);
                added += 1;
            }
            if at + p.len > chunk_len {
                return Err(DmaError::Invalid(format!(
                    "a piece of {} bytes crosses the end of a {chunk_len}-byte chunk",
                    p.len
                )));
            }
            let chunk = self.chunks.last_mut().expect("pushed above");
            let first = chunk[1] as usize;
            // Device-contiguous pieces of one chunk are one segment.
            match self.segs[first..].last() {
                Some(&[start, addr]) if addr + (at - start) == p.device => {}
                _ => {
                    self.segs.push([at, p.device]);
                    chunk[2] += 1;
                }
            }
            at += p.len;
            let seg = u32::try_from(self.segs.len() - 1).map_err(|_| {
                DmaError::Invalid(format!(
                    "{} segments in one checksum submission",
                    self.segs.len()
                ))
            })?;
            // Rows start every 1 KiB, each below the chunk's end (`rows_of`).
            while next_row < at {
                self.row_segs.push(seg);
                next_row += 1024;
            }
            if at == chunk_len {
                at = 0;
                next_row = 0;
            }
        }
        if at != 0 {
            return Err(DmaError::Invalid(format!(
                "the pieces end {at} bytes into a {chunk_len}-byte chunk"
            )));
        }
        Ok(added)
    }

    /// Byte offset of the segment records in the encoded tables.
    pub fn segs_offset(&self) -> usize {
        self.chunks.len() * CHUNK_RECORD
    }

    /// Byte offset of the row records in the encoded tables.
    pub fn row_segs_offset(&self) -> usize {
        self.segs_offset() + self.segs.len() * SEG_RECORD
    }

    /// Bytes of the encoded tables: chunk records, then segment records, then row records.
    pub fn encoded_len(&self) -> usize {
        self.row_segs_offset() + self.row_segs.len() * ROW_RECORD
    }

    /// Writes the chunk records, the segment records, then the row records into
    /// `out[..encoded_len()]`.
    pub fn encode(&self, out: &mut [u8]) {
        let (words, rows) = out[..self.encoded_len()].split_at_mut(self.row_segs_offset());
        let all = self.chunks.iter().flatten().chain(self.segs.iter().flatten());
        for (w, slot) in all.zip(words.chunks_exact_mut(8)) {
            slot.copy_from_slice(&w.to_le_bytes());
        }
        for (r, slot) in self.row_segs.iter().zip(rows.chunks_exact_mut(ROW_RECORD)) {
            slot.copy_from_slice(&r.to_le_bytes());
        }
    }
}

/// Where [`write_tables`] laid the tables out in its buffer: the chunk records from offset 0,
/// the segment records from `segs_offset`, the row records from `row_segs_offset`, `len`
/// bytes in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TablesImage {
    /// Chunks.
    pub chunks: usize,
    /// Segments.
    pub segs: usize,
    /// Rows (scratch rows too).
    pub rows: u64,
    /// Offset of the segment records.
    pub segs_offset: usize,
    /// Offset of the row records.
    pub row_segs_offset: usize,
    /// Bytes of the image, to the end of the row records.
    pub len: usize,
}

/// Chunks in `pieces` of chunks of `chunk_len` bytes, and the bytes [`write_tables`] needs for
/// their tables: their records, room for one segment per piece, their rows' records. Refuses
/// what `add_chunks` refuses for it (a chunk shorter than [`MIN_LEN`]; pieces not ending with
/// a whole chunk).
pub fn tables_capacity(pieces: &[Piece], chunk_len: u64) -> Result<(usize, usize), DmaError> {
    if chunk_len < MIN_LEN {
        return Err(DmaError::Invalid(format!(
            "chunks of {chunk_len} bytes are checksummed on the CPU (the GPU kernels need at \
             least {MIN_LEN})"
        )));
    }
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    if !total.is_multiple_of(chunk_len) {
        return Err(DmaError::Invalid(format!(
            "the pieces end {} bytes into a {chunk_len}-byte chunk",
            total % chunk_len
        )));
    }
    let chunks = (total / chunk_len) as usize;
    let rows = chunks * rows_of(chunk_len) as usize;
    Ok((chunks, chunks * CHUNK_RECORD + pieces.len() * SEG_RECORD + rows * ROW_RECORD))
}

/// The tables of `pieces` (chunks of `chunk_len` bytes, as `chunk_pieces` appends them)
/// written straight into `out` in one pass: the records [`HashTables::add_chunks`] and
/// [`HashTables::encode`] would give, except that the segment records have room for one
/// segment per piece, so that the row records follow that room. About 60% of the host's work
/// of building the tables then encoding them (on the VM, for 32,768 pieces per 64 MiB job at
/// 2 KiB pages). `out` must hold [`tables_capacity`] bytes.
pub fn write_tables(
    pieces: &[Piece],
    chunk_len: u64,
    out: &mut [u8],
) -> Result<TablesImage, DmaError> {
    let (chunks, capacity) = tables_capacity(pieces, chunk_len)?;
    assert!(out.len() >= capacity, "{} bytes for tables of {capacity}", out.len());
    let segs_offset = chunks * CHUNK_RECORD;
    let row_segs_offset = segs_offset + pieces.len() * SEG_RECORD;
    let (records, rest) = out[..capacity].split_at_mut(segs_offset);
    let (seg_out, row_out) = rest.split_at_mut(pieces.len() * SEG_RECORD);
    let per_chunk_rows = rows_of(chunk_len);
    let (mut chunk, mut segs, mut rows) = (0usize, 0usize, 0usize);
    let mut at = 0u64; // bytes of the current chunk so far
    let mut next_row = 0u64; // chunk offset of the next row without its segment
    let mut first_seg = 0usize; // the current chunk's first segment
    let mut last = (0u64, 0u64); // the current segment's chunk offset and device address
    for p in pieces.iter().filter(|p| p.len > 0) {
        if at == 0 {
            first_seg = segs;
        }
        if at + p.len > chunk_len {
            return Err(DmaError::Invalid(format!(
                "a piece of {} bytes crosses the end of a {chunk_len}-byte chunk",
                p.len
            )));
        }
        if segs == first_seg || last.1 + (at - last.0) != p.device {
            let slot = &mut seg_out[segs * SEG_RECORD..(segs + 1) * SEG_RECORD];
            slot[..8].copy_from_slice(&at.to_le_bytes());
            slot[8..].copy_from_slice(&p.device.to_le_bytes());
            last = (at, p.device);
            segs += 1;
        }
        at += p.len;
        let seg = u32::try_from(segs - 1).map_err(|_| {
            DmaError::Invalid(format!("{segs} segments in one checksum submission"))
        })?;
        while next_row < at {
            row_out[rows * ROW_RECORD..(rows + 1) * ROW_RECORD].copy_from_slice(&seg.to_le_bytes());
            rows += 1;
            next_row += 1024;
        }
        if at == chunk_len {
            let record = [
                chunk_len,
                first_seg as u64,
                (segs - first_seg) as u64,
                chunk as u64 * per_chunk_rows,
                0,
            ];
            let slot = &mut records[chunk * CHUNK_RECORD..(chunk + 1) * CHUNK_RECORD];
            for (w, b) in record.iter().zip(slot.chunks_exact_mut(8)) {
                b.copy_from_slice(&w.to_le_bytes());
            }
            chunk += 1;
            at = 0;
            next_row = 0;
        }
    }
    debug_assert_eq!((chunk, rows), (chunks, chunks * per_chunk_rows as usize));
    Ok(TablesImage { chunks, segs, rows: rows as u64, segs_offset, row_segs_offset, len: capacity })
}

/// A save in block form's tables: the host writes only the block ids ([`write_block_ids`],
/// read in place by the expansion kernel, `orbitkv_xxh3_expand_blocks`), which writes the
/// chunk, segment and row records on the device. Offsets are from the device tables' start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockTables {
    /// Chunks (their records from offset 0).
    pub chunks: usize,
    /// Blocks per chunk.
    pub per_chunk: usize,
    /// Bytes of the ids the host writes.
    pub ids_len: usize,
    /// The segment records (one per part, not merged) and their offset.
    pub segs: usize,
    pub segs_offset: usize,
    /// Rows (scratch rows too) and the row records' offset.
    pub rows: u64,
    pub row_segs_offset: usize,
    /// Bytes of the tables on the device.
    pub len: usize,
}

/// The layout of `job`'s tables for chunks of `chunk_len` bytes. Refuses chunks shorter than
/// [`MIN_LEN`], chunks whose blocks do not make `chunk_len` bytes, and more segments than a
/// row record can name.
pub fn block_tables(job: &BlockJob<'_>, chunk_len: u64) -> Result<BlockTables, DmaError> {
    if chunk_len < MIN_LEN {
        return Err(DmaError::Invalid(format!(
            "chunks of {chunk_len} bytes are checksummed on the CPU (the GPU kernels need at \
             least {MIN_LEN})"
        )));
    }
    let block_bytes = job.block_bytes();
    if let Some((_, ids)) =
        job.chunks.iter().find(|(_, ids)| ids.len() as u64 * block_bytes != chunk_len)
    {
        return Err(DmaError::Invalid(format!(
            "a chunk of {} blocks of {block_bytes} bytes where chunks are {chunk_len} bytes",
            ids.len()
        )));
    }
    let chunks = job.chunks.len();
    let per_chunk = (chunk_len / block_bytes) as usize;
    let segs = per_chunk * job.bases.len() * chunks;
    if u32::try_from(segs).is_err() {
        return Err(DmaError::Invalid(format!("{segs} segments in one checksum submission")));
    }
    let rows = chunks as u64 * rows_of(chunk_len);
    let segs_offset = chunks * CHUNK_RECORD;
    let row_segs_offset = segs_offset + segs * SEG_RECORD;
    let len = row_segs_offset + rows as usize * ROW_RECORD;
    Ok(BlockTables {
        chunks,
        per_chunk,
        ids_len: chunks * per_chunk * 8,
        segs,
        segs_offset,
        rows,
        row_segs_offset,
        len,
    })
}

/// Writes `job`'s block ids, chunk after chunk, as little-endian u64 into the start of `out`.
pub fn write_block_ids(job: &BlockJob<'_>, out: &mut [u8]) {
    let all = job.chunks.iter().flat_map(|(_, ids)| ids);
    for (id, slot) in all.zip(out.chunks_exact_mut(8)) {
        slot.copy_from_slice(&id.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(device: u64, len: u64) -> Piece {
        Piece { device, host: 0, len }
    }

    #[test]
    fn chunks_segments_and_rows() {
        let mut t = HashTables::default();
        // Chunk 0: two device-contiguous pieces (one segment) and a separate one; chunk 1:
        // one piece.
        let pieces = [piece(1000, 600), piece(1600, 424), piece(9000, 1000), piece(50_000, 2024)];
        assert_eq!(t.add_chunks(&pieces, 2024).unwrap(), 2);
        assert_eq!(t.chunks, vec![[2024, 0, 2, 0, 0], [2024, 2, 1, 2, 0]]);
        assert_eq!(t.segs, vec![[0, 1000], [1024, 9000], [0, 50_000]]);
        assert_eq!(t.rows, 4);
        // Chunk 0's rows start at 0 (segment 0) and 1024 (segment 1, which starts there);
        // chunk 1's at 0 and 1024, both in its one segment (2).
        assert_eq!(t.row_segs, vec![0, 1, 2, 2]);
        assert_eq!(t.encoded_len(), 2 * 40 + 3 * 16 + 4 * 4);
        let mut img = vec![0u8; t.encoded_len()];
        t.encode(&mut img);
        assert_eq!(&img[0..8], &2024u64.to_le_bytes());
        assert_eq!(&img[80..88], &0u64.to_le_bytes());
        assert_eq!(&img[88..96], &1000u64.to_le_bytes());
        assert_eq!(t.row_segs_offset(), 128);
        assert_eq!(&img[128..144], &[0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0]);
        // A second group continues the rows and segments.
        t.add_chunks(&[piece(7, 241)], 241).unwrap();
        assert_eq!(t.chunks[2], [241, 3, 1, 4, 0]);
        assert_eq!(t.row_segs[4..], [3]);
        t.clear();
        assert_eq!((t.chunks.len(), t.segs.len(), t.row_segs.len(), t.rows), (0, 0, 0, 0));
    }

    #[test]
    fn each_row_names_the_segment_holding_its_first_byte() {
        // A 3000-byte chunk in pieces of 700, 700 (device-contiguous with the first), 1000 and
        // 600: segments start at 0 and 1400 and 2400; rows at 0, 1024 and 2048.
        let mut t = HashTables::default();
        let pieces = [piece(0, 700), piece(700, 700), piece(5000, 1000), piece(9000, 600)];
        t.add_chunks(&pieces, 3000).unwrap();
        assert_eq!(t.segs, vec![[0, 0], [1400, 5000], [2400, 9000]]);
        assert_eq!(t.row_segs, vec![0, 0, 1]);
        assert_eq!(t.row_segs.len() as u64, t.rows);
    }

    /// `write_tables`' image against `add_chunks` then `encode`: the same records, the rows
    /// after room for a segment per piece; refused where they refuse.
    fn same_tables_in_one_pass(pieces: &[Piece], chunk_len: u64) {
        let mut t = HashTables::default();
        let want = t.add_chunks(pieces, chunk_len);
        let got = tables_capacity(pieces, chunk_len).and_then(|(_, capacity)| {
            let mut out = vec![0xa5u8; capacity];
            write_tables(pieces, chunk_len, &mut out).map(|image| (image, out))
        });
        let (image, out) = match (want, got) {
            (Ok(n), Ok(got)) => {
                assert_eq!(n, got.0.chunks);
                got
            }
            (Err(_), Err(_)) => return,
            (want, got) => panic!("add_chunks {want:?}, write_tables {:?}", got.map(|g| g.0)),
        };
        let mut img = vec![0u8; t.encoded_len()];
        t.encode(&mut img);
        assert_eq!((image.segs, image.rows), (t.segs.len(), t.rows));
        assert_eq!(image.segs_offset, t.segs_offset());
        assert_eq!(&out[..t.row_segs_offset()], &img[..t.row_segs_offset()]);
        assert_eq!(image.row_segs_offset, image.segs_offset + pieces.len() * SEG_RECORD);
        let rows = &out[image.row_segs_offset..image.len];
        assert_eq!(rows, &img[t.row_segs_offset()..]);
    }

    #[test]
    fn tables_written_in_one_pass_match_the_built_ones() {
        same_tables_in_one_pass(
            &[piece(1000, 600), piece(1600, 424), piece(9000, 1000), piece(50_000, 2024)],
            2024,
        );
        same_tables_in_one_pass(&[piece(0, 700), piece(700, 700), piece(5000, 1000)], 2400);
        // Scattered 2 KiB pages in 32 KiB chunks, some adjacent on the device, and pieces of
        // uneven lengths; an empty piece; nothing.
        let mut x = 7u64;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let pages: Vec<Piece> = (0..256)
            .map(|i| piece(if i % 3 == 0 { i * 2048 } else { rand() % (1 << 40) }, 2048))
            .collect();
        same_tables_in_one_pass(&pages, 32 << 10);
        let mut uneven = Vec::new();
        for _ in 0..8 {
            let mut left = 5000u64;
            while left > 0 {
                let len = (rand() % 1500 + 1).min(left);
                uneven.push(piece(rand() % (1 << 30), len));
                left -= len;
            }
        }
        uneven.insert(3, piece(123, 0));
        same_tables_in_one_pass(&uneven, 5000);
        same_tables_in_one_pass(&[], 4096);
        // Refusals: too short a chunk, a piece across a chunk's end, a chunk left unfinished.
        same_tables_in_one_pass(&[piece(0, 240)], 240);
        same_tables_in_one_pass(&[piece(0, 300), piece(400, 300)], 500);
        same_tables_in_one_pass(&[piece(0, 1500), piece(9000, 300), piece(0, 1400)], 1600);
        same_tables_in_one_pass(&[piece(0, 300)], 500);
        assert!(tables_capacity(&[piece(0, 300)], 500)
            .unwrap_err()
            .to_string()
            .contains("end 300"));
    }

    #[test]
    fn block_form_layout_and_ids() {
        let bases = [1000u64, 9000];
        let chunks = vec![(0u64, vec![3u64, 4]), (1 << 20, vec![11, 0])];
        let job = BlockJob {
            parts: 0,
            bases: &bases,
            part_len: 2048,
            stride: 2048,
            host_base: 0,
            chunks: &chunks,
        };
        let t = block_tables(&job, 8192).unwrap();
        assert_eq!((t.chunks, t.per_chunk, t.segs, t.rows, t.ids_len), (2, 2, 8, 16, 32));
        assert_eq!((t.segs_offset, t.row_segs_offset, t.len), (80, 80 + 128, 80 + 128 + 64));
        let mut out = vec![0u8; t.ids_len];
        write_block_ids(&job, &mut out);
        let words: Vec<u64> =
            out.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap())).collect();
        assert_eq!(words, [3, 4, 11, 0]);
        // Refused: a short chunk, a chunk of the wrong length.
        assert!(block_tables(&job, 240).unwrap_err().to_string().contains("CPU"));
        let short = [(0u64, vec![1u64])];
        let e = block_tables(&BlockJob { chunks: &short, ..job }, 8192).unwrap_err().to_string();
        assert!(e.contains("a chunk of 1 blocks"), "{e}");
    }

    #[test]
    fn rows_follow_xxh3_blocks() {
        assert_eq!(rows_of(241), 1);
        assert_eq!(rows_of(1024), 1);
        assert_eq!(rows_of(1025), 2);
        assert_eq!(rows_of(2048), 2);
        assert_eq!(rows_of(2 << 20), 2048);
    }

    #[test]
    fn bad_piece_lists_are_refused() {
        let mut t = HashTables::default();
        assert!(t.add_chunks(&[piece(0, 240)], 240).unwrap_err().to_string().contains("CPU"));
        let e = t.add_chunks(&[piece(0, 300), piece(400, 300)], 500).unwrap_err().to_string();
        assert!(e.contains("crosses the end"), "{e}");
        let mut t = HashTables::default();
        t.add_chunks(&[piece(0, 300)], 300).unwrap();
        let kept = t.clone();
        let e = t.add_chunks(&[piece(0, 300)], 500).unwrap_err().to_string();
        assert!(e.contains("end 300 bytes into"), "{e}");
        assert_eq!(t, kept);
        // A refused list leaves the tables as they were, the rows it had added too.
        let e = t.add_chunks(&[piece(0, 1500), piece(9000, 300)], 1600).unwrap_err().to_string();
        assert!(e.contains("crosses the end"), "{e}");
        assert_eq!(t, kept);
    }
}
