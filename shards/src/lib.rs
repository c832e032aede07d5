//! Everything one shard core owns: its slice of the DRAM arena, the allocator over it, the
//! index of its key range, eviction, leases and reservations, and its metrics.
//!
//! [`ShardCore`] is plain synchronous state with no runtime underneath: the server runs one per
//! glommio executor and feeds it [`ShardOp`]s from the shard's own sessions and, over the
//! shard-to-shard mesh, from other shards. Nothing here is shared between threads except the
//! arena mapping, whose slices are disjoint.

#![deny(unsafe_code)]

mod alloc;
mod arena;
mod core;
mod entries;
mod error;
mod inventory;
mod metrics;
mod ops;
mod peering;
mod tiering;

pub use alloc::{Extent, ExtentAllocator, PAGE_SIZE};
pub use arena::{
    Arena, ArenaSlice, PageSize, Populated, SliceReader, DOORBELL_STRIDE, HEADER_BYTES,
};
pub use core::{
    Audit, EvictSummary, HashRange, NamespaceQuota, ShardConfig, ShardCore, StartedTombstone,
};
pub use error::Error;
pub use inventory::{InventoryDrain, RemoteChunk};
pub use metrics::{OpKind, ShardMetrics, ShardStats};
pub use ops::{SessionId, ShardOp, ShardReply};
pub use tiering::{TieredLookup, FREE_TARGET_PERCENT};
