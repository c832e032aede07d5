//! Engine KV layouts: where one block's bytes lie in the engine's GPU allocations, in the
//! order they are packed into an arena chunk (layer by layer, K before V).
//!
//! Supported:
//! - vLLM FlashAttention, one tensor per layer `[2, num_blocks, block_size, kv_heads, head_dim]`
//!   (NHD) or `[2, num_blocks, kv_heads, block_size, head_dim]` (HND);
//! - vLLM paged (vLLM >= 0.32), one tensor per layer holding one dense page per block,
//!   `[num_blocks, page]`, a page being `block_size x kv_heads x 2 x head_dim` elements in the
//!   engine's order (its LBNHC and LBHNC layouts: K and V of a token and head side by side);
//! - vLLM cross-layer, one tensor `[num_blocks, layers, 2, block_size, kv_heads, head_dim]`;
//! - MLA, one tensor per layer `[num_blocks, block_size, latent_dim]`;
//! - SGLang, K and V tensors per layer `[tokens, kv_heads, head_dim]` (page size 1: a block is
//!   one token slot).
//!
//! All tensors are dense row-major. A block's data for one (layer, K/V) is contiguous in every
//! one of these layouts, so a block is a short list of segments.
//!
//! A layout is the wire type engines declare ([`KvLayoutSpec`]); [`LayoutGeometry`] is its
//! arithmetic, checked by [`LayoutGeometry::validate`] before any other method is trusted.

use orbitkv_proto::{KvLayoutKind, KvLayoutSpec};

/// Most layers a layout may declare.
const MAX_LAYERS: u32 = 65536;

/// A layout field that is out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid KV layout: {field} {reason}")]
pub struct LayoutError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong.
    pub reason: &'static str,
}

/// A run of bytes in one engine tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Which tensor (see [`LayoutGeometry::tensor_count`] for the numbering).
    pub tensor: u32,
    /// Byte offset in the tensor.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Where a block's bytes lie in the engine's tensors, for a layout engines declare.
pub trait LayoutGeometry {
    /// Checks every field; the error names the first bad one. The other methods assume a
    /// layout that passed.
    fn validate(&self) -> Result<(), LayoutError>;
    /// K/V tensors per layer and token: 1 for MLA, else 2.
    fn kv(&self) -> u64;
    /// Engine tensors: per-layer layouts number them `layer` (FlashAttention, MLA) or
    /// `2 * layer + kv` (SGLang: K then V); cross-layer has one tensor, 0.
    fn tensor_count(&self) -> u32;
    /// Bytes of each engine tensor.
    fn tensor_bytes(&self) -> Option<u64>;
    /// Bytes of one block across all layers: the size of its arena chunk.
    fn block_bytes(&self) -> u64;
    /// Calls `f` with each part of block `block` (one layer's K or V slice), in chunk order
    /// (layer-major, K before V), unmerged. No allocation: this is the copy planner's loop.
    fn for_each_part(&self, block: u64, f: impl FnMut(Segment));
    /// Parts (one layer's K or V slice) per block: `num_layers` for MLA, else twice that.
    fn parts_per_block(&self) -> u64;
    /// Bytes of one part (one layer's K or V slice of one block).
    fn part_len(&self) -> u64;
    /// The layout as arithmetic: part `p` of block `b` (chunk order, as [`for_each_part`]
    /// hands them) lies at device address `bases[p] + b * stride`, for the engine tensors at
    /// `tensors` (numbered as [`tensor_count`]). Every supported layout is one base per part
    /// and one stride per block, which lets the copy kernel find a block's parts from its id
    /// alone instead of from a descriptor per part.
    ///
    /// [`for_each_part`]: LayoutGeometry::for_each_part
    /// [`tensor_count`]: LayoutGeometry::tensor_count
    fn part_bases(&self, tensors: &[u64]) -> (Vec<u64>, u64);
    /// Where block `block`'s bytes are, in chunk order (layer-major, K before V). Adjacent
    /// segments of one tensor are merged.
    fn block_segments(&self, block: u64) -> Vec<Segment>;
}

impl LayoutGeometry for KvLayoutSpec {
    fn validate(&self) -> Result<(), LayoutError> {
        let bad = |field, reason| Err(LayoutError { field, reason });
        for (field, v) in [
            ("num_layers", self.num_layers as u64),
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size as u64),
            ("kv_heads", self.kv_heads as u64),
            ("head_dim", self.head_dim as u64),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1");
            }
        }
        if ![1, 2, 4].contains(&self.elem_bytes) {
            return bad("elem_bytes", "must be 1, 2 or 4");
        }
        if self.kind == KvLayoutKind::SglangPerLayer && self.block_size != 1 {
            return bad("block_size", "must be 1 for SGLang (page size 1)");
        }
        if self.kind == KvLayoutKind::MlaPerLayer && self.kv_heads != 1 {
            return bad("kv_heads", "must be 1 for MLA (head_dim is the latent width)");
        }
        if self.num_layers > MAX_LAYERS {
            return bad("num_layers", "must be at most 65536");
        }
        // The block arithmetic below is unchecked: make sure it fits first, naming the factor
        // at which the product overflows.
        let mut block = 1u64;
        for (field, v) in [
            ("block_size", self.block_size as u64),
            ("kv_heads", self.kv_heads as u64),
            ("head_dim", self.head_dim as u64),
            ("elem_bytes", self.elem_bytes as u64),
            ("num_layers", 2 * self.num_layers as u64),
        ] {
            block = match block.checked_mul(v) {
                Some(b) => b,
                None => {
                    return bad(
                        field,
                        "makes a block (block_size x kv_heads x head_dim x elem_bytes x 2 x \
                         num_layers) larger than 2^64 bytes",
                    )
                }
            };
        }
        if self.tensor_bytes().is_none() {
            return bad("num_blocks", "makes a tensor larger than 2^64 bytes");
        }
        Ok(())
    }

    fn kv(&self) -> u64 {
        if self.kind == KvLayoutKind::MlaPerLayer {
            1
        } else {
            2
        }
    }

    fn tensor_count(&self) -> u32 {
        match self.kind {
            KvLayoutKind::CrossLayer => 1,
            KvLayoutKind::SglangPerLayer => 2 * self.num_layers,
            _ => self.num_layers,
        }
    }

    fn tensor_bytes(&self) -> Option<u64> {
        let per_block = self.part_len().checked_mul(self.kv())?;
        let blocks = per_block.checked_mul(self.num_blocks)?;
        match self.kind {
            KvLayoutKind::CrossLayer => blocks.checked_mul(self.num_layers as u64),
            KvLayoutKind::SglangPerLayer => self.part_len().checked_mul(self.num_blocks),
            _ => Some(blocks),
        }
    }

    fn block_bytes(&self) -> u64 {
        self.part_len() * self.kv() * self.num_layers as u64
    }

    fn for_each_part(&self, block: u64, mut f: impl FnMut(Segment)) {
        assert!(block < self.num_blocks, "block {block} of {}", self.num_blocks);
        let part = self.part_len();
        for layer in 0..self.num_layers as u64 {
            for t in 0..self.kv() {
                let (tensor, offset) = match self.kind {
                    // [2, blocks, ...]: K/V outermost, then the block.
                    KvLayoutKind::FlashAttnNhd | KvLayoutKind::FlashAttnHnd => {
                        (layer as u32, (t * self.num_blocks + block) * part)
                    }
                    // [blocks, layers, 2, ...]: the block outermost.
                    KvLayoutKind::CrossLayer => {
                        (0, ((block * self.num_layers as u64 + layer) * 2 + t) * part)
                    }
                    KvLayoutKind::MlaPerLayer => (layer as u32, block * part),
                    // [blocks, page]: the block outermost in the layer's tensor.
                    KvLayoutKind::Paged => (layer as u32, (block * 2 + t) * part),
                    KvLayoutKind::SglangPerLayer => ((2 * layer + t) as u32, block * part),
                };
                f(Segment { tensor, offset, len: part });
            }
        }
    }

    fn parts_per_block(&self) -> u64 {
        self.num_layers as u64 * self.kv()
    }

    fn part_len(&self) -> u64 {
        self.block_size as u64
            * self.kv_heads as u64
            * self.head_dim as u64
            * self.elem_bytes as u64
    }

    fn part_bases(&self, tensors: &[u64]) -> (Vec<u64>, u64) {
        assert!(tensors.len() >= self.tensor_count() as usize, "one address per tensor");
        let part = self.part_len();
        let mut bases = Vec::with_capacity(self.parts_per_block() as usize);
        for layer in 0..self.num_layers as u64 {
            for t in 0..self.kv() {
                bases.push(match self.kind {
                    KvLayoutKind::FlashAttnNhd | KvLayoutKind::FlashAttnHnd => {
                        tensors[layer as usize] + t * self.num_blocks * part
                    }
                    KvLayoutKind::CrossLayer => tensors[0] + (layer * 2 + t) * part,
                    KvLayoutKind::MlaPerLayer => tensors[layer as usize],
                    KvLayoutKind::Paged => tensors[layer as usize] + t * part,
                    KvLayoutKind::SglangPerLayer => tensors[(2 * layer + t) as usize],
                });
            }
        }
        let stride = match self.kind {
            KvLayoutKind::CrossLayer => self.num_layers as u64 * 2 * part,
            KvLayoutKind::Paged => 2 * part,
            _ => part,
        };
        (bases, stride)
    }

    fn block_segments(&self, block: u64) -> Vec<Segment> {
        let mut out: Vec<Segment> =
            Vec::with_capacity((self.num_layers as u64 * self.kv()) as usize);
        self.for_each_part(block, |s| match out.last_mut() {
            Some(last) if last.tensor == s.tensor && last.offset + last.len == s.offset => {
                last.len += s.len
            }
            _ => out.push(s),
        });
        out
    }
}

#[cfg(test)]
mod tests;
