//! The messages a shard executor takes on its control queue: from the control threads
//! (sessions, stats, audits, evictions, stop) and from the peer thread (inventory, grants,
//! catalog, peer reads).

use crossbeam_channel::Sender;
use orbitkv_proto::{ChunkKey, Hit, InventoryChunk, InventoryDelta, PeerFetch, SlotRef};
use orbitkv_shards::{Audit, EvictSummary, SessionId, ShardCore, ShardStats};

/// A control message to one shard executor (polled by its loop).
#[derive(Debug)]
pub enum ControlMsg {
    /// Open the session's request service on this (home) shard.
    OpenSession {
        /// The session.
        session: SessionId,
        /// Its iceoryx2 service name.
        service: String,
        /// Answer: Ok once the service accepts requests.
        reply: Sender<Result<(), crate::shard::ipc::IpcError>>,
    },
    /// The session's socket closed: reclaim everything it held, on every shard.
    CloseSession {
        /// The session.
        session: SessionId,
    },
    /// Snapshot of the shard.
    Stats {
        /// Where to send it.
        reply: Sender<ShardSnapshot>,
    },
    /// A full scan of the shard's bookkeeping ([`orbitkv_shards::ShardCore::audit`]).
    Audit {
        /// Where to send it.
        reply: Sender<Audit>,
    },
    /// Remove the chunks of a namespace (of every namespace with None) from every tier.
    Evict {
        /// The namespace id.
        namespace: Option<u64>,
        /// Where to send what was done.
        reply: Sender<EvictSummary>,
    },
    /// Cluster peering's business with the shard (inventory, grants, catalog, peer reads).
    Peer(PeerMsg),
    /// Leave the executor loop.
    Stop,
}

/// A shard's stats plus what only the executor knows.
#[derive(Debug, Clone)]
pub struct ShardSnapshot {
    /// The shard state machine's view.
    pub stats: ShardStats,
    /// The core it is pinned to, if pinned.
    pub core: Option<usize>,
    /// Sessions homed here.
    pub sessions: u64,
    /// Requests whose reply was dropped because the client vanished.
    pub dropped_replies: u64,
    /// Requests still running when their session closed (the client went away meanwhile):
    /// each ran to its end, owning what it used, before the session was reclaimed.
    pub orphaned_requests: u64,
    /// Requests rejected before execution (malformed, too large, draining, limits).
    pub rejected_requests: u64,
    /// Times the shard slept on its doorbell.
    pub deep_sleeps: u64,
    /// Doorbell sleeps ended by a ring (work arrived) rather than the timeout.
    pub doorbell_wakeups: u64,
    /// Naps on a timer: idle past the spin window with a task or SSD operation in flight (a
    /// request arriving meanwhile waits for the nap's end, up to `--idle-poll-max`).
    pub naps: u64,
}

/// What the peer thread asks one shard (see [`ControlMsg::Peer`]).
#[derive(Debug)]
pub enum PeerMsg {
    /// The DRAM inventory now (the change log restarts).
    Snapshot(Sender<Vec<InventoryChunk>>),
    /// The changes since the last drain, and whether some were lost.
    Drain(Sender<(Vec<InventoryDelta>, bool)>),
    /// Lease keys for a grant holder (answered to the peer thread's runtime).
    Grant {
        session: SessionId,
        keys: Vec<ChunkKey>,
        reply: tokio::sync::oneshot::Sender<Vec<Option<Hit>>>,
    },
    /// Return leases of a grant holder.
    Release { session: SessionId, slots: Vec<SlotRef> },
    /// Return every lease of a grant holder.
    ReleaseAll { session: SessionId },
    /// Catalog changes of one peer.
    Catalog { peer: u32, added: Vec<InventoryChunk>, removed: Vec<ChunkKey> },
    /// Forget a peer's catalog entries.
    Forget { peer: u32 },
    /// A peer read is over.
    Fetched { fetch: PeerFetch, read: bool },
}

impl PeerMsg {
    /// Applies the message to the shard's state; the key of a peer read that ended, whose
    /// lookups may go on.
    pub fn apply(self, core: &mut ShardCore) -> Option<ChunkKey> {
        match self {
            PeerMsg::Snapshot(reply) => {
                let _ = reply.send(core.inventory_snapshot());
            }
            PeerMsg::Drain(reply) => {
                let d = core.inventory_drain();
                let _ = reply.send((d.deltas, d.overflowed));
            }
            PeerMsg::Grant { session, keys, reply } => {
                if let Err(hits) = reply.send(core.lease_for_peer(session, &keys)) {
                    // Nobody waits for the answer any more (the peer thread gave up on this
                    // shard): what it leased goes back at once.
                    core.return_peer_leases(session, &keys, &hits);
                }
            }
            PeerMsg::Release { session, slots } => {
                core.apply(orbitkv_shards::ShardOp::Release { session, slots });
            }
            PeerMsg::ReleaseAll { session } => {
                core.apply(orbitkv_shards::ShardOp::SessionClosed { session });
            }
            PeerMsg::Catalog { peer, added, removed } => core.catalog_apply(peer, &added, &removed),
            PeerMsg::Forget { peer } => {
                core.catalog_drop(peer);
            }
            PeerMsg::Fetched { fetch, read } => {
                // A failure is counted and logged by the shard; the lookup answers a miss.
                let _ = core.finish_peer_fetch(&fetch, read);
                return Some(fetch.key);
            }
        }
        None
    }
}
