//! What to copy: an engine block list turned into contiguous pieces between GPU memory and
//! arena slots, and those pieces packed into staging batches. Pure arithmetic: tested without
//! a GPU against a CPU simulation of the copies.

use crate::layout::LayoutGeometry;
use orbitkv_proto::KvLayoutSpec;

/// One contiguous run of bytes between GPU memory and host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Device address.
    pub device: u64,
    /// Host address (in the registered arena).
    pub host: u64,
    /// Bytes.
    pub len: u64,
}

/// Appends the pieces of one chunk: the blocks `blocks` of an engine whose tensors start at
/// `tensors` (device addresses, numbered as [`KvLayoutSpec::tensor_count`]), packed block after
/// block, each block layer by layer (K before V), into host memory at `host`. Pieces that
/// are contiguous on both sides are merged. Returns the chunk's length.
///
/// Panics if a block id is out of range or `tensors` is short: callers validate first.
pub fn chunk_pieces(
    layout: &KvLayoutSpec,
    tensors: &[u64],
    blocks: &[u64],
    host: u64,
    out: &mut Vec<Piece>,
) -> u64 {
    assert!(tensors.len() >= layout.tensor_count() as usize, "one address per tensor");
    let mut at = host;
    // The tensor of the last piece pushed by this call: pieces merge only within one tensor
    // (two allocations that happen to be adjacent are still two allocations).
    let mut last_tensor = None;
    for &block in blocks {
        layout.for_each_part(block, |seg| {
            let p =
                Piece { device: tensors[seg.tensor as usize] + seg.offset, host: at, len: seg.len };
            at += seg.len;
            match out.last_mut() {
                Some(last)
                    if last_tensor == Some(seg.tensor)
                        && last.device + last.len == p.device
                        && last.host + last.len == p.host =>
                {
                    last.len += p.len
                }
                _ => out.push(p),
            }
            last_tensor = Some(seg.tensor);
        });
    }
    at - host
}

/// A kernel descriptor: copy `len` bytes from `src` to `dst` (both on the GPU). Its byte image
/// is the `CopyDesc` struct of `copy_segments.cu`: three little-endian u64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelDesc {
    /// Source device address.
    pub src: u64,
    /// Destination device address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

impl KernelDesc {
    /// Bytes of one descriptor in the kernel's table.
    pub const BYTES: usize = 24;

    /// Appends the descriptor's image.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut img = [0u8; Self::BYTES];
        self.write_to(&mut img);
        out.extend_from_slice(&img);
    }

    /// Writes the descriptor's image into `out[..BYTES]`.
    pub fn write_to(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.src.to_le_bytes());
        out[8..16].copy_from_slice(&self.dst.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
    }
}

/// A contiguous piece of a staging buffer and the host range it moves to or from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRun {
    /// Offset in the staging buffer.
    pub staging: u64,
    /// Host address.
    pub host: u64,
    /// Bytes.
    pub len: u64,
}

/// The pieces that fit one staging buffer: kernel work on one side, DMA on the other.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagedBatch {
    /// Engine-side pieces: device address, staging offset, length.
    pub segments: Vec<(u64, u64, u64)>,
    /// Host-side runs (staging-contiguous and host-contiguous pieces merged).
    pub runs: Vec<HostRun>,
    /// Bytes staged.
    pub bytes: u64,
}

impl StagedBatch {
    /// The segments' one length, when they all have the same (then segment `d` lies at
    /// staging offset `d * len`, as segments fill the staging buffer in order).
    pub fn uniform_len(&self) -> Option<u64> {
        let (&(_, _, len), rest) = self.segments.split_first()?;
        rest.iter().all(|s| s.2 == len).then_some(len)
    }

    /// Kernel descriptors for this batch with the staging buffer at `staging`: gathering
    /// (engine -> staging) when `gather`, else scattering (staging -> engine).
    pub fn descs(&self, staging: u64, gather: bool) -> impl Iterator<Item = KernelDesc> + '_ {
        self.segments.iter().map(move |&(device, off, len)| {
            if gather {
                KernelDesc { src: device, dst: staging + off, len }
            } else {
                KernelDesc { src: staging + off, dst: device, len }
            }
        })
    }
}

/// Most bytes one kernel descriptor moves (one warp copies a descriptor; longer pieces are
/// split so that many warps share them).
pub const MAX_SEGMENT: u64 = 64 << 10;

/// Where [`next_batch`] continues: the piece, and the bytes of it already staged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageCursor {
    piece: usize,
    done: u64,
}

impl StageCursor {
    /// Whether every piece of `pieces` has been staged ([`next_batch_into`] would plan
    /// nothing more).
    pub fn finished(&self, pieces: &[Piece]) -> bool {
        self.piece >= pieces.len()
    }
}

/// Fills `batch` (cleared first) with the next pieces from `at`, at most `capacity` staged
/// bytes and `max_segments` kernel descriptors, splitting a piece that does not fit; false
/// when every piece has been staged. Batches are built one at a time, so the first one can be
/// on the GPU while the next is planned.
pub fn next_batch(
    pieces: &[Piece],
    at: &mut StageCursor,
    capacity: u64,
    max_segments: usize,
    batch: &mut StagedBatch,
) -> bool {
    let mut segments = std::mem::take(&mut batch.segments);
    segments.clear();
    fill_batch(pieces, at, capacity, max_segments, batch, |device, off, len| {
        segments.push((device, off, len))
    });
    batch.segments = segments;
    batch.bytes > 0
}

/// [`next_batch`] in one pass that writes each segment's kernel descriptor straight into
/// `table` (the image [`StagedBatch::descs`] gives, with the staging buffer at `staging`:
/// gathering when `gather`, else scattering) instead of keeping the segments, which is half
/// the host's work per piece at 2 KiB pages. `batch.segments` is left empty; its runs and
/// bytes are as `next_batch` makes them. Returns the descriptors written (0 when every piece
/// has been staged) and, when they all move one length, that length (see
/// [`compact_uniform`]).
///
/// Panics if `table` is shorter than `max_segments` descriptors.
pub fn next_batch_into(
    pieces: &[Piece],
    at: &mut StageCursor,
    (capacity, max_segments): (u64, usize),
    (staging, gather): (u64, bool),
    table: &mut [u8],
    batch: &mut StagedBatch,
) -> (usize, Option<u64>) {
    assert!(table.len() >= max_segments * KernelDesc::BYTES, "a descriptor table per batch");
    batch.segments.clear();
    let table = &mut table[..max_segments * KernelDesc::BYTES];
    let (mut n, mut first, mut same) = (0, 0, true);
    fill_batch(pieces, at, capacity, max_segments, batch, |device, off, len| {
        let (src, dst) = if gather { (device, staging + off) } else { (staging + off, device) };
        let slot = &mut table[n * KernelDesc::BYTES..(n + 1) * KernelDesc::BYTES];
        KernelDesc { src, dst, len }.write_to(slot);
        if n == 0 {
            first = len;
        }
        same &= len == first;
        n += 1;
    });
    (n, (n > 0 && same).then_some(first))
}

/// Rewrites the first `n` scatter descriptors of `table` (as [`next_batch_into`] wrote them,
/// not gathering) as the uniform scatter kernel's table: each segment's engine address, eight
/// bytes little-endian, segment after segment from the start of `table`.
pub fn compact_uniform(table: &mut [u8], n: usize) {
    for d in 0..n {
        // Descriptor d's destination sits at 24 d + 8, at or after 8 d + 8: each read is of a
        // descriptor not yet overwritten.
        let at = d * KernelDesc::BYTES + 8;
        table.copy_within(at..at + 8, d * 8);
    }
}

/// The one walk over the pieces behind [`next_batch`] and [`next_batch_into`]: clears
/// `batch`'s runs and bytes, hands each segment (device address, staging offset, length) to
/// `segment`, and fills the runs and bytes.
fn fill_batch(
    pieces: &[Piece],
    at: &mut StageCursor,
    capacity: u64,
    max_segments: usize,
    batch: &mut StagedBatch,
    mut segment: impl FnMut(u64, u64, u64),
) {
    assert!(capacity > 0 && max_segments > 0, "a staging buffer holds something");
    batch.runs.clear();
    batch.bytes = 0;
    let mut segments = 0;
    while let Some(p) = pieces.get(at.piece) {
        if batch.bytes == capacity || segments == max_segments {
            break;
        }
        // One kernel descriptor (one warp) moves at most MAX_SEGMENT bytes: a long piece
        // becomes several, copied in parallel; its host run stays one.
        let len = (p.len - at.done).min(capacity - batch.bytes).min(MAX_SEGMENT);
        let (device, host, off) = (p.device + at.done, p.host + at.done, batch.bytes);
        segment(device, off, len);
        segments += 1;
        match batch.runs.last_mut() {
            Some(r) if r.staging + r.len == off && r.host + r.len == host => r.len += len,
            _ => batch.runs.push(HostRun { staging: off, host, len }),
        }
        batch.bytes += len;
        at.done += len;
        if at.done == p.len {
            at.piece += 1;
            at.done = 0;
        }
    }
}

/// A job in block form: the layout reduced to arithmetic ([`KvLayoutSpec::part_bases`]) and each
/// chunk's block ids, with no piece or descriptor per part. The copy kernel finds part `p` of
/// the block with id `b` at `bases[p] + b * stride` (the bases in device memory at `parts`),
/// and staging holds the batch's blocks one after another, each part after part.
#[derive(Clone, Copy, Debug)]
pub struct BlockJob<'a> {
    /// Device address of `bases` as the kernel reads them (little-endian u64 each).
    pub parts: u64,
    /// Part `p` of block `b` lies at `bases[p] + b * stride` (one base per part).
    pub bases: &'a [u64],
    /// Bytes of each part.
    pub part_len: u64,
    /// Bytes from one block's part to the next block's same part.
    pub stride: u64,
    /// Added to each chunk's offset to give its host address.
    pub host_base: u64,
    /// Per chunk: host offset (from `host_base`) and its block ids, packed block after block.
    pub chunks: &'a [(u64, Vec<u64>)],
}

impl BlockJob<'_> {
    /// Parts per block.
    pub fn part_count(&self) -> u64 {
        self.bases.len() as u64
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.part_len * self.part_count()
    }

    /// Whether each block's parts lie one after another on the device, so that a block is
    /// one contiguous run (the cross-layer layout), which the copy engines move well alone.
    pub fn blocks_contiguous(&self) -> bool {
        self.stride == self.block_bytes()
            && self.bases.windows(2).all(|w| w[0] + self.part_len == w[1])
    }
}

/// Where [`next_blocks_into`] continues: the chunk, and the block in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCursor {
    chunk: usize,
    block: usize,
}

impl BlockCursor {
    /// Whether every block of `job` has been staged ([`next_blocks_into`] would take none).
    pub fn finished(&self, job: &BlockJob<'_>) -> bool {
        let mut rest = job.chunks.iter().skip(self.chunk).map(|(_, ids)| ids.len());
        rest.next().is_none_or(|first| first <= self.block) && rest.all(|n| n == 0)
    }
}

/// Fills `batch` (its runs and bytes; `segments` left empty) with the next whole blocks of
/// `job` from `at`: at most `capacity` staged bytes and as many blocks as `table` holds ids,
/// each id written into `table` as a little-endian u64. Returns the blocks taken, 0 when every
/// block has been staged. The host side is the same runs as the piece form's (a chunk's blocks
/// are host-contiguous; adjacent slots merge).
///
/// Panics if a block is larger than `capacity` or `table` holds no id: callers choose the
/// block form only where a block fits a staging half.
pub fn next_blocks_into(
    job: &BlockJob<'_>,
    at: &mut BlockCursor,
    capacity: u64,
    table: &mut [u8],
    batch: &mut StagedBatch,
) -> usize {
    let block_bytes = job.block_bytes();
    assert!(block_bytes > 0 && block_bytes <= capacity, "a block fits the staging buffer");
    let max = table.len() / 8;
    assert!(max > 0, "room for a block id");
    batch.segments.clear();
    batch.runs.clear();
    batch.bytes = 0;
    let mut n = 0;
    while let Some((offset, ids)) = job.chunks.get(at.chunk) {
        let Some(&id) = ids.get(at.block) else {
            at.chunk += 1;
            at.block = 0;
            continue;
        };
        if batch.bytes + block_bytes > capacity || n == max {
            break;
        }
        table[n * 8..n * 8 + 8].copy_from_slice(&id.to_le_bytes());
        let (host, off) = (job.host_base + offset + at.block as u64 * block_bytes, batch.bytes);
        match batch.runs.last_mut() {
            Some(r) if r.staging + r.len == off && r.host + r.len == host => r.len += block_bytes,
            _ => batch.runs.push(HostRun { staging: off, host, len: block_bytes }),
        }
        batch.bytes += block_bytes;
        at.block += 1;
        n += 1;
    }
    n
}

/// Longest run of bytes one warp of the block copy kernel moves (`UNIT` in
/// `copy_blocks.cu`): a longer part is several units, copied in parallel.
pub const BLOCK_UNIT: u64 = 64 << 10;

/// What the block copy kernel does for a batch of `ids` (the CPU model it is tested against):
/// the copies of each unit, gathering (engine -> staging at `staging`) when `gather`, else
/// scattering.
pub fn block_copies(
    job: &BlockJob<'_>,
    ids: &[u64],
    staging: u64,
    gather: bool,
) -> Vec<KernelDesc> {
    let subs = job.part_len.div_ceil(BLOCK_UNIT).max(1);
    let mut out = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        for (p, &base) in job.bases.iter().enumerate() {
            for s in 0..subs {
                let skip = s * BLOCK_UNIT;
                let len = (job.part_len - skip).min(BLOCK_UNIT);
                let engine = base + id * job.stride + skip;
                let staged =
                    staging + (i as u64 * job.part_count() + p as u64) * job.part_len + skip;
                let (src, dst) = if gather { (engine, staged) } else { (staged, engine) };
                out.push(KernelDesc { src, dst, len });
            }
        }
    }
    out
}

/// Packs `pieces` in order into batches of at most `capacity` staged bytes and `max_segments`
/// kernel descriptors; pieces longer than `capacity` are split.
pub fn stage(pieces: &[Piece], capacity: u64, max_segments: usize) -> Vec<StagedBatch> {
    let mut out = Vec::new();
    let mut at = StageCursor::default();
    let mut b = StagedBatch::default();
    while next_batch(pieces, &mut at, capacity, max_segments, &mut b) {
        out.push(b.clone());
    }
    out
}

#[cfg(test)]
mod tests;
