//! Chunks gathered from and scattered into engine memory laid out in blocks: vLLM's CPU KV
//! caches, SGLang's host pools, or any pinned staging buffer an engine copies its GPU pages
//! through. The engine's process does the copies (no CUDA IPC, no server-side DMA), straight
//! between its blocks and the arena slots: no bounce buffer.
//!
//! A chunk of `n` blocks (`n = blocks.len() / keys.len()`) is, region by region, the bytes of
//! its blocks in order: `for region in regions { for block in chunk_blocks { region[block] } }`.

use orbitkv_proto::{ChunkKey, ChunkOutcome, ErrorCode};

use crate::client::PutOutcome;
use crate::{Client, Error};

/// Where block `b` of a region lies: bytes `b * stride .. b * stride + block_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// Bytes of one block in this region (its part of a chunk).
    pub block_bytes: usize,
    /// Distance between the starts of consecutive blocks (at least `block_bytes`).
    pub block_stride: usize,
}

impl BlockLayout {
    /// A region of back-to-back blocks of `block_bytes` each.
    pub fn dense(block_bytes: usize) -> Self {
        Self { block_bytes, block_stride: block_bytes }
    }

    fn range(&self, block: u64) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(block).ok()?.checked_mul(self.block_stride)?;
        Some(start..start.checked_add(self.block_bytes)?)
    }
}

/// Checks the packing (same number of blocks per key, at least one) and that every block lies
/// inside every region; returns the blocks per chunk and the chunk length.
fn check(
    regions: &[(usize, BlockLayout)],
    keys: &[ChunkKey],
    blocks: &[u64],
) -> Result<(usize, u64), Error> {
    if regions.is_empty() {
        return Err(Error::InvalidArgument("no regions: give at least one".into()));
    }
    if keys.is_empty() || blocks.is_empty() || !blocks.len().is_multiple_of(keys.len()) {
        return Err(Error::InvalidArgument(format!(
            "{} block ids for {} keys: give the same number (at least one) per key",
            blocks.len(),
            keys.len()
        )));
    }
    for (r, (len, layout)) in regions.iter().enumerate() {
        if layout.block_bytes == 0 || layout.block_stride < layout.block_bytes {
            return Err(Error::InvalidArgument(format!(
                "region {r}: block_bytes {} and block_stride {}: a block has bytes and fits its stride",
                layout.block_bytes, layout.block_stride
            )));
        }
        if let Some(&bad) = blocks.iter().find(|&&b| layout.range(b).is_none_or(|x| x.end > *len)) {
            return Err(Error::InvalidArgument(format!(
                "block {bad} lies outside region {r} ({len} bytes, {} per block)",
                layout.block_stride
            )));
        }
    }
    let per_chunk = blocks.len() / keys.len();
    let len: usize = regions.iter().map(|(_, l)| l.block_bytes * per_chunk).sum();
    Ok((per_chunk, len as u64))
}

impl Client {
    /// Saves engine blocks as chunks: chunk `i` gathers `blocks[i * n .. (i + 1) * n]` (see the
    /// module docs) from `regions` straight into its reserved slot, then all are committed.
    /// One outcome per key; chunks already present are not copied again. A bad block id or
    /// layout is refused before anything is reserved, naming it.
    pub fn save_blocks(
        &mut self,
        regions: &[(&[u8], BlockLayout)],
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Vec<PutOutcome>, Error> {
        let shape: Vec<(usize, BlockLayout)> = regions.iter().map(|(r, l)| (r.len(), *l)).collect();
        let (per_chunk, len) = check(&shape, keys, blocks)?;
        self.put_with(keys, &vec![len; keys.len()], |i| {
            let chunk = &blocks[i * per_chunk..(i + 1) * per_chunk];
            regions.iter().flat_map(move |(region, layout)| {
                chunk
                    .iter()
                    .map(|&b| &region[layout.range(b).expect("checked against every region")])
            })
        })
    }

    /// Loads the longest present prefix of `keys` into engine blocks (packing as
    /// [`Client::save_blocks`]): leased, scattered from the arena straight into `regions`, and
    /// released (deferred). One outcome per key: `Done` for the chunks loaded, `NotFound` after
    /// the first missing one, and `Failed(InvalidArgument)` for a chunk whose length is not
    /// the blocks' (written under the same namespace with another layout), after which
    /// nothing more is loaded. Blocks of keys not `Done` are left as they were.
    pub fn load_blocks(
        &mut self,
        regions: &mut [(&mut [u8], BlockLayout)],
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Vec<ChunkOutcome>, Error> {
        let shape: Vec<(usize, BlockLayout)> = regions.iter().map(|(r, l)| (r.len(), *l)).collect();
        let (per_chunk, len) = check(&shape, keys, blocks)?;
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::InvalidArgument(format!(
                "block {} named twice: a load writes each block once",
                w[0]
            )));
        }
        let leases = self.lookup_leased(keys)?;
        let mut out = vec![ChunkOutcome::Failed(ErrorCode::NotFound); keys.len()];
        let mut usable = leases.len();
        if let Some(i) = leases.iter().position(|l| l.hit.len != len) {
            tracing::warn!(
                chunk = leases[i].hit.len,
                blocks = len,
                "chunk length differs from its blocks'; loading stops there"
            );
            out[i] = ChunkOutcome::Failed(ErrorCode::InvalidArgument);
            usable = i;
        }
        let threads = self.copy_threads(len * usable as u64, usable);
        let stores = crate::copies::stores_for(len * usable as u64);
        let copied = (|| {
            let sources = leases[..usable]
                .iter()
                .map(|lease| self.chunk(lease))
                .collect::<Result<Vec<&[u8]>, Error>>()?;
            let pieces = block_pieces(regions, &blocks[..usable * per_chunk], per_chunk);
            let items: Vec<(&[u8], Vec<&mut [u8]>)> = sources.into_iter().zip(pieces).collect();
            crate::copies::for_each(threads, items, |(src, pieces)| {
                let mut at = 0;
                for dst in pieces {
                    let n = dst.len();
                    crate::mapping::copy_as(dst, &src[at..at + n], stores);
                    at += n;
                }
            });
            Ok::<(), Error>(())
        })();
        self.release_deferred(&leases)?;
        copied?;
        out[..usable].fill(ChunkOutcome::Done);
        Ok(out)
    }
}

/// Each chunk's destinations (its blocks in each region, in chunk order: region by region, its
/// blocks in order), carved out of the regions. The blocks are distinct and inside every
/// region (checked), so the pieces are disjoint.
fn block_pieces<'a>(
    regions: &'a mut [(&mut [u8], BlockLayout)],
    blocks: &[u64],
    per_chunk: usize,
) -> Vec<Vec<&'a mut [u8]>> {
    let chunks = blocks.len() / per_chunk;
    let mut out: Vec<Vec<&mut [u8]>> =
        (0..chunks).map(|_| Vec::with_capacity(per_chunk * regions.len())).collect();
    // Positions of `blocks` by address order (the same in every region), to carve front to back.
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_unstable_by_key(|&p| blocks[p]);
    for (region, layout) in regions.iter_mut() {
        let mut carved: Vec<Option<&mut [u8]>> = (0..blocks.len()).map(|_| None).collect();
        let mut rest: &mut [u8] = region;
        let mut base = 0;
        for &p in &order {
            let range = layout.range(blocks[p]).expect("checked against every region");
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - base);
            let (piece, tail) = tail.split_at_mut(range.len());
            carved[p] = Some(piece);
            rest = tail;
            base = range.end;
        }
        for (p, piece) in carved.into_iter().enumerate() {
            out[p / per_chunk].push(piece.expect("every block carved"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> ChunkKey {
        ChunkKey::new(1, [i; 32])
    }

    #[test]
    fn packing_and_bounds_are_checked_naming_what_is_wrong() {
        let dense = BlockLayout::dense(100);
        let regions = [(1000, dense), (1000, BlockLayout { block_bytes: 50, block_stride: 100 })];
        assert_eq!(check(&regions, &[key(1), key(2)], &[0, 9]).unwrap(), (1, 150));
        assert_eq!(check(&regions, &[key(1)], &[3, 4]).unwrap(), (2, 300));
        let err = |r: &[(usize, BlockLayout)], k: &[ChunkKey], b: &[u64]| {
            check(r, k, b).unwrap_err().to_string()
        };
        assert!(err(&regions, &[key(1)], &[10]).contains("block 10 lies outside region 0"));
        assert!(err(&regions, &[key(1), key(2)], &[1, 2, 3]).contains("3 block ids for 2 keys"));
        assert!(err(&regions, &[], &[]).contains("0 block ids for 0 keys"));
        assert!(err(&[], &[key(1)], &[0]).contains("no regions"));
        let short = [(1000, BlockLayout { block_bytes: 100, block_stride: 10 })];
        assert!(err(&short, &[key(1)], &[0]).contains("region 0: block_bytes 100"));
        let last = [(950, dense)];
        assert!(err(&last, &[key(1)], &[9]).contains("block 9 lies outside region 0"));
        assert!(err(&last, &[key(1)], &[u64::MAX]).contains("outside region 0"));
    }
}
