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

/// Which layout the engine uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvLayout {
    /// vLLM FlashAttention, per layer, `[2, blocks, block_size, heads, dim]`.
    FlashAttnNhd,
    /// vLLM FlashAttention, per layer, `[2, blocks, heads, block_size, dim]`.
    FlashAttnHnd,
    /// vLLM cross-layer, one tensor `[blocks, layers, 2, block_size, heads, dim]`.
    CrossLayer,
    /// vLLM paged, per layer, `[blocks, page]`: a block's K and V of every token and head in
    /// one dense page of `block_size x heads x 2 x dim` elements (vLLM >= 0.32).
    Paged,
    /// MLA, per layer, `[blocks, block_size, latent_dim]` (`head_dim` is the latent width).
    MlaPerLayer,
    /// SGLang, K and V per layer, `[tokens, heads, dim]`, page size 1.
    SglangPerLayer,
}

/// Most layers a layout may declare.
const MAX_LAYERS: u32 = 65536;

/// The shape of an engine's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayoutDesc {
    /// Layout.
    pub layout: KvLayout,
    /// Attention layers.
    pub num_layers: u32,
    /// Blocks (token slots for SGLang) per tensor.
    pub num_blocks: u64,
    /// Tokens per block (1 for SGLang).
    pub block_size: u32,
    /// KV heads (1 for MLA).
    pub kv_heads: u32,
    /// Elements per head (latent width for MLA).
    pub head_dim: u32,
    /// Bytes per element.
    pub elem_bytes: u32,
}

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
    /// Which tensor (see [`LayoutDesc::tensor_count`] for the numbering).
    pub tensor: u32,
    /// Byte offset in the tensor.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl LayoutDesc {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), LayoutError> {
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
        if self.layout == KvLayout::SglangPerLayer && self.block_size != 1 {
            return bad("block_size", "must be 1 for SGLang (page size 1)");
        }
        if self.layout == KvLayout::MlaPerLayer && self.kv_heads != 1 {
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

    /// K/V tensors per layer and token: 1 for MLA, else 2.
    fn kv(&self) -> u64 {
        if self.layout == KvLayout::MlaPerLayer {
            1
        } else {
            2
        }
    }

    /// Bytes of one (layer, K/V) slice of one block.
    fn part_bytes(&self) -> u64 {
        self.block_size as u64
            * self.kv_heads as u64
            * self.head_dim as u64
            * self.elem_bytes as u64
    }

    /// Engine tensors: per-layer layouts number them `layer` (FlashAttention, MLA) or
    /// `2 * layer + kv` (SGLang: K then V); cross-layer has one tensor, 0.
    pub fn tensor_count(&self) -> u32 {
        match self.layout {
            KvLayout::CrossLayer => 1,
            KvLayout::SglangPerLayer => 2 * self.num_layers,
            _ => self.num_layers,
        }
    }

    /// Bytes of each engine tensor.
    pub fn tensor_bytes(&self) -> Option<u64> {
        let per_block = self.part_bytes().checked_mul(self.kv())?;
        let blocks = per_block.checked_mul(self.num_blocks)?;
        match self.layout {
            KvLayout::CrossLayer => blocks.checked_mul(self.num_layers as u64),
            KvLayout::SglangPerLayer => self.part_bytes().checked_mul(self.num_blocks),
            _ => Some(blocks),
        }
    }

    /// Bytes of one block across all layers: the size of its arena chunk.
    pub fn block_bytes(&self) -> u64 {
        self.part_bytes() * self.kv() * self.num_layers as u64
    }

    /// Calls `f` with each part of block `block` (one layer's K or V slice), in chunk order
    /// (layer-major, K before V), unmerged. No allocation: this is the copy planner's loop.
    pub fn for_each_part(&self, block: u64, mut f: impl FnMut(Segment)) {
        assert!(block < self.num_blocks, "block {block} of {}", self.num_blocks);
        let part = self.part_bytes();
        for layer in 0..self.num_layers as u64 {
            for t in 0..self.kv() {
                let (tensor, offset) = match self.layout {
                    // [2, blocks, ...]: K/V outermost, then the block.
                    KvLayout::FlashAttnNhd | KvLayout::FlashAttnHnd => {
                        (layer as u32, (t * self.num_blocks + block) * part)
                    }
                    // [blocks, layers, 2, ...]: the block outermost.
                    KvLayout::CrossLayer => {
                        (0, ((block * self.num_layers as u64 + layer) * 2 + t) * part)
                    }
                    KvLayout::MlaPerLayer => (layer as u32, block * part),
                    // [blocks, page]: the block outermost in the layer's tensor.
                    KvLayout::Paged => (layer as u32, (block * 2 + t) * part),
                    KvLayout::SglangPerLayer => ((2 * layer + t) as u32, block * part),
                };
                f(Segment { tensor, offset, len: part });
            }
        }
    }

    /// Parts (one layer's K or V slice) per block: `num_layers` for MLA, else twice that.
    pub fn parts_per_block(&self) -> u64 {
        self.num_layers as u64 * self.kv()
    }

    /// Bytes of one part (one layer's K or V slice of one block).
    pub fn part_len(&self) -> u64 {
        self.part_bytes()
    }

    /// The layout as arithmetic: part `p` of block `b` (chunk order, as [`for_each_part`]
    /// hands them) lies at device address `bases[p] + b * stride`, for the engine tensors at
    /// `tensors` (numbered as [`tensor_count`]). Every supported layout is one base per part
    /// and one stride per block, which lets the copy kernel find a block's parts from its id
    /// alone instead of from a descriptor per part.
    ///
    /// [`for_each_part`]: LayoutDesc::for_each_part
    /// [`tensor_count`]: LayoutDesc::tensor_count
    pub fn part_bases(&self, tensors: &[u64]) -> (Vec<u64>, u64) {
        assert!(tensors.len() >= self.tensor_count() as usize, "one address per tensor");
        let part = self.part_bytes();
        let mut bases = Vec::with_capacity(self.parts_per_block() as usize);
        for layer in 0..self.num_layers as u64 {
            for t in 0..self.kv() {
                bases.push(match self.layout {
                    KvLayout::FlashAttnNhd | KvLayout::FlashAttnHnd => {
                        tensors[layer as usize] + t * self.num_blocks * part
                    }
                    KvLayout::CrossLayer => tensors[0] + (layer * 2 + t) * part,
                    KvLayout::MlaPerLayer => tensors[layer as usize],
                    KvLayout::Paged => tensors[layer as usize] + t * part,
                    KvLayout::SglangPerLayer => tensors[(2 * layer + t) as usize],
                });
            }
        }
        let stride = match self.layout {
            KvLayout::CrossLayer => self.num_layers as u64 * 2 * part,
            KvLayout::Paged => 2 * part,
            _ => part,
        };
        (bases, stride)
    }

    /// Where block `block`'s bytes are, in chunk order (layer-major, K before V). Adjacent
    /// segments of one tensor are merged.
    pub fn block_segments(&self, block: u64) -> Vec<Segment> {
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
