//! What peering asks of the local server ([`LocalNode`]), its settings, the shards' queue of
//! peer reads, and what the owner and requester sides share.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use orbitkv_proto::{ChunkKey, Hit, InventoryChunk, InventoryDelta, PeerFetch, SlotRef};

use crate::{Cluster, Engine};

/// An answer of the shards that comes later (awaited on the peer thread's runtime).
pub type Later<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// The local server, as peering uses it. Calls block (they go through the shards' control
/// queues) and are made from the runtime's blocking pool, except [`LocalNode::grant`] and
/// [`LocalNode::fetched_now`]; `None` means a shard did not answer.
pub trait LocalNode: Send + Sync + 'static {
    /// Shard count (keys are placed by [`ChunkKey::shard`]).
    fn shards(&self) -> usize;
    /// The chunks shard `shard` holds in DRAM; restarts its change log.
    fn inventory_snapshot(&self, shard: usize) -> Option<Vec<InventoryChunk>>;
    /// The changes on shard `shard` since the last drain or snapshot, and whether some were
    /// lost (the log filled): then a snapshot is due.
    fn inventory_drain(&self, shard: usize) -> Option<(Vec<InventoryDelta>, bool)>;
    /// Leases `keys` for grant holder `holder` (DRAM only): a hit or None per key. Asks every
    /// shard concerned at once without blocking the caller; the answer is awaited (a shard
    /// that does not answer within its wait gives None for its keys). What a shard leases
    /// after its answer is no longer awaited (dropped, or past the wait) goes back at once.
    fn grant(&self, holder: u64, keys: &[ChunkKey]) -> Later<Vec<Option<Hit>>>;
    /// Returns leases of `holder`.
    fn release(&self, holder: u64, slots: &[SlotRef]);
    /// Returns every lease of `holder`.
    fn release_all(&self, holder: u64);
    /// Adds to the catalog what peer `peer` holds, and removes what it no longer holds.
    fn catalog_apply(&self, peer: u32, added: Vec<InventoryChunk>, removed: Vec<ChunkKey>);
    /// Forgets everything of peer `peer`.
    fn catalog_drop(&self, peer: u32);
    /// A peer read is over: `read` when its bytes landed (the shard checks their checksum).
    fn fetched(&self, fetch: PeerFetch, read: bool);
    /// As [`LocalNode::fetched`] when the shard's queue has room now, without blocking (the
    /// peer thread's runtime calls it); false when it has not (then call `fetched`).
    fn fetched_now(&self, fetch: PeerFetch, read: bool) -> bool;
}

/// What peering needs besides the cluster.
pub struct PeeringConfig {
    /// The local server.
    pub node: Arc<dyn LocalNode>,
    /// Address and length of the arena mapping in this process (registered with TE: peers
    /// read from it, and peer reads land in it).
    pub arena: (u64, u64),
    /// Catalog entries kept per peer; more and its coverage is partial.
    pub catalog_max_per_peer: usize,
    /// Grants a requester may hold here at once.
    pub max_grants_per_peer: usize,
    /// How long the peer thread keeps polling after a grant it served or a read it did, like a
    /// shard after work (`--peer-spin-window`), when it has two cores or more (one for itself,
    /// the others for TE's threads); otherwise it parks at once.
    pub spin_window: std::time::Duration,
}

impl std::fmt::Debug for PeeringConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeeringConfig")
            .field("arena", &self.arena)
            .field("catalog_max_per_peer", &self.catalog_max_per_peer)
            .field("max_grants_per_peer", &self.max_grants_per_peer)
            .field("spin_window", &self.spin_window)
            .finish_non_exhaustive()
    }
}

/// Why peering did not start.
#[derive(Debug, thiserror::Error)]
pub enum PeeringError {
    /// This build has no Transfer Engine route.
    #[error(
        "this build has no Mooncake Transfer Engine (build with the te-python feature): \
         cluster membership only, no peer reads"
    )]
    NoTransferEngine,
    /// Registering the arena with TE failed.
    #[error("registering the arena with the Transfer Engine: {0}")]
    Register(crate::engine::EngineError),
    /// Already started.
    #[error("peering already started")]
    AlreadyStarted,
}

/// What this node knows of one peer, for `ctl peers`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerView {
    /// The peer's epoch the stream is for.
    pub epoch: u64,
    /// `connecting`, `snapshot`, `live`, or `error: ...`.
    pub stream: String,
    /// Whether the catalog holds the peer's whole inventory.
    pub complete: bool,
    /// Catalog entries of the peer.
    pub catalog_entries: u64,
    /// Grants this node holds at the peer now.
    pub grants_held: u64,
    /// Grants the peer holds here now.
    pub grants_given: u64,
    /// Bytes read from the peer.
    pub bytes_read: u64,
    /// Chunks read from the peer.
    pub chunks_read: u64,
    /// Reads from the peer that failed.
    pub read_failures: u64,
    /// Groups of fetches read from the peer (one grant, one Transfer Engine batch each).
    pub groups: u64,
    /// Time those groups' first fetch waited in the queue before the group started, in
    /// nanoseconds.
    pub queue_ns: u64,
    /// Time those groups spent in their grant round trip, in nanoseconds.
    pub grant_ns: u64,
    /// Time they spent in Transfer Engine reads, in nanoseconds.
    pub te_read_ns: u64,
    /// Time handing their results to the shards took, in nanoseconds.
    pub handoff_ns: u64,
}

/// Fetches queued from the shards to the peer thread at most.
pub const FETCH_QUEUE: usize = 4096;

/// Reads a shard puts in one message of a [`FetchQueue`] at most (a lookup of more goes in
/// several).
pub const FETCHES_PER_MESSAGE: usize = 1024;

/// Where shards queue their peer reads for the peer thread, a lookup's reads in one message
/// (so that the peer thread, awake, does not start a lookup's group with its first read alone),
/// holding at most [`FETCH_QUEUE`] reads.
#[derive(Clone, Debug)]
pub struct FetchQueue {
    tx: tokio::sync::mpsc::UnboundedSender<Vec<PeerFetch>>,
    queued: Arc<AtomicUsize>,
}

/// The peer thread's end of a [`FetchQueue`].
#[derive(Debug)]
pub(crate) struct FetchReceiver {
    rx: tokio::sync::mpsc::UnboundedReceiver<Vec<PeerFetch>>,
    queued: Arc<AtomicUsize>,
}

/// A queue of at most [`FETCH_QUEUE`] reads.
pub(crate) fn fetch_queue() -> (FetchQueue, FetchReceiver) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let queued = Arc::new(AtomicUsize::new(0));
    (FetchQueue { tx, queued: Arc::clone(&queued) }, FetchReceiver { rx, queued })
}

impl FetchQueue {
    /// Queues one lookup's reads; given back when they would pass the bound or the peer
    /// thread is gone.
    pub fn try_send(&self, fetches: Vec<PeerFetch>) -> Result<(), Vec<PeerFetch>> {
        let n = fetches.len();
        if n == 0 {
            return Ok(());
        }
        if self.queued.fetch_add(n, Ordering::AcqRel) + n > FETCH_QUEUE {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(fetches);
        }
        self.tx.send(fetches).map_err(|e| {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            e.0
        })
    }
}

impl FetchReceiver {
    /// The next lookup's reads; None when every sender is gone.
    pub(crate) async fn recv(&mut self) -> Option<Vec<PeerFetch>> {
        let got = self.rx.recv().await?;
        self.queued.fetch_sub(got.len(), Ordering::AcqRel);
        Some(got)
    }

    /// The next lookup's reads if some are queued.
    pub(crate) fn try_recv(&mut self) -> Option<Vec<PeerFetch>> {
        let got = self.rx.try_recv().ok()?;
        self.queued.fetch_sub(got.len(), Ordering::AcqRel);
        Some(got)
    }
}

/// What the owner and requester sides of the peer thread both hold.
#[derive(Clone)]
pub(crate) struct Sides {
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) cfg: Arc<PeeringConfig>,
    pub(crate) te: Engine,
    /// The peer thread's polling after activity (shared: either side's activity keeps it up).
    pub(crate) warm: crate::hot::Warm,
}

impl Cluster {
    /// What peering knows of each peer, by node id.
    pub fn peers(&self) -> std::collections::BTreeMap<String, PeerView> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn update_peer(&self, node: &str, f: impl FnOnce(&mut PeerView)) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        f(peers.entry(node.to_owned()).or_default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads(n: usize) -> Vec<PeerFetch> {
        let f = PeerFetch {
            shard: 0,
            key: ChunkKey::new(1, [7; 32]),
            peer: 1,
            offset: 0,
            len: 4096,
            generation: 1,
            queued: std::time::Instant::now(),
        };
        vec![f; n]
    }

    #[test]
    fn the_fetch_queue_holds_lookups_whole_up_to_its_bound_in_reads() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (tx, mut rx) = fetch_queue();
        assert!(tx.try_send(Vec::new()).is_ok(), "nothing to queue");
        tx.try_send(reads(32)).unwrap();
        tx.try_send(reads(FETCH_QUEUE - 33)).unwrap();
        assert_eq!(tx.try_send(reads(2)).unwrap_err().len(), 2, "past the bound: given back");
        tx.try_send(reads(1)).unwrap();
        assert!(tx.try_send(reads(1)).is_err(), "full");
        // A lookup's reads come out as they went in, and make room.
        assert_eq!(rt.block_on(rx.recv()).unwrap().len(), 32);
        tx.try_send(reads(32)).unwrap();
        assert_eq!(rx.try_recv().unwrap().len(), FETCH_QUEUE - 33);
        assert_eq!(rx.try_recv().unwrap().len(), 1);
        assert_eq!(rx.try_recv().unwrap().len(), 32);
        assert!(rx.try_recv().is_none());
        // The peer thread gone: the reads are given back, nothing counted.
        drop(rx);
        assert_eq!(tx.try_send(reads(3)).unwrap_err().len(), 3);
        assert_eq!(tx.queued.load(Ordering::Acquire), 0);
    }
}
