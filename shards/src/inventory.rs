//! What a shard keeps for cluster peering (the behaviour is in `peering`): the change log of
//! its DRAM inventory, its slice of the peers' catalog, and the peer reads waiting to be
//! handed to the peer thread.

use std::collections::{HashMap, VecDeque};

use orbitkv_proto::{ChunkKey, InventoryDelta, PeerFetch};

use crate::ops::SessionId;

/// Owner of a reservation that a peer read fills (never a session id; SSD promotions use
/// `SessionId::MAX`).
pub(crate) const PEER_PROMOTER: SessionId = SessionId::MAX - 1;

/// What [`ShardCore::inventory_drain`] hands over.
#[derive(Debug, Default)]
pub struct InventoryDrain {
    /// The changes since the last drain or snapshot, oldest first.
    pub deltas: Vec<InventoryDelta>,
    /// The log filled and changes were lost: take a snapshot.
    pub overflowed: bool,
}

/// The bounded change log of a shard's DRAM inventory (kept only in cluster mode).
#[derive(Debug)]
pub(crate) struct InventoryLog {
    pub(crate) deltas: VecDeque<InventoryDelta>,
    pub(crate) cap: usize,
    pub(crate) overflowed: bool,
}

impl InventoryLog {
    pub(crate) fn new(cap: usize) -> Self {
        Self { deltas: VecDeque::new(), cap: cap.max(1), overflowed: false }
    }

    pub(crate) fn record(&mut self, delta: InventoryDelta) {
        if self.overflowed {
            return;
        }
        if self.deltas.len() >= self.cap {
            // Lost changes cannot be replayed: the drainer resynchronises from a snapshot.
            self.deltas = VecDeque::new();
            self.overflowed = true;
            return;
        }
        self.deltas.push_back(delta);
    }
}

/// A chunk a peer holds, as the catalog knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteChunk {
    /// The peer (an index the peer thread assigns).
    pub peer: u32,
    /// Length in bytes.
    pub len: u64,
    /// The owner's checksum.
    pub checksum: u64,
}

/// The peer side of a shard: its inventory log, its slice of the catalog, and the peer
/// promotions waiting to be handed to the peer thread.
#[derive(Debug, Default)]
pub(crate) struct Peering {
    pub(crate) catalog: HashMap<ChunkKey, RemoteChunk>,
    pub(crate) fetches: Vec<PeerFetch>,
}
