//! What a shard and the peer thread exchange in cluster mode: the chunks of a shard's DRAM
//! inventory, its changes, and the peer reads a shard waits for.

use std::time::Instant;

use crate::ChunkKey;

/// A chunk in a shard's DRAM inventory, as peers learn of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InventoryChunk {
    /// The chunk.
    pub key: ChunkKey,
    /// Its length in bytes.
    pub len: u64,
    /// Its xxh3-64 checksum.
    pub checksum: u64,
}

/// One change to a shard's DRAM inventory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InventoryDelta {
    /// The chunk became visible in DRAM.
    Added(InventoryChunk),
    /// The chunk left DRAM.
    Removed(ChunkKey),
}

/// A peer read a shard waits for: the bytes of `key` from peer `peer` into the local arena at
/// `offset` (a reserved slot of generation `generation` on shard `shard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerFetch {
    /// The shard waiting.
    pub shard: usize,
    /// The chunk.
    pub key: ChunkKey,
    /// The peer that holds it (as the catalog numbers it).
    pub peer: u32,
    /// Byte offset of the reserved slot in the arena.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Generation of the reserved slot.
    pub generation: u64,
    /// When the shard queued it.
    pub queued: Instant,
}
