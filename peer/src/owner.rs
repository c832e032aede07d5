//! The owner side of peering: this node's DRAM inventory as peers see it (a view kept from
//! the shards' change logs, served as a snapshot then deltas), and grants on its chunks.
//!
//! A grant is a lease the shards hold for a requester's *holder* (one per requester node and
//! epoch). It is returned when the requester releases it after its read, or when the requester
//! is proven gone: its member key left etcd (or came back with another epoch) and a lease TTL
//! more has passed, so no read of its can still be running. Grants per requester are bounded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orbitkv_proto::{ChunkKey, SlotRef};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::hot::{hot, Warm, HOT_FOR};
use crate::rpc::peer_server::{Peer, PeerServer};
use crate::rpc::{
    GrantReply, GrantRequest, Granted, InventoryRequest, InventoryUpdate, ReleaseReply,
    ReleaseRequest,
};
use crate::{Cluster, Engine, PeeringConfig, State};
use orbitkv_proto::{InventoryChunk, InventoryDelta};

/// How often the shards' change logs are drained.
const INVENTORY_TICK: Duration = Duration::from_millis(50);
/// How often grant holders are checked against the members.
const REAP_TICK: Duration = Duration::from_millis(500);
/// Chunks per snapshot message.
const SNAPSHOT_PART: usize = 4096;
/// Cancelled grant requests remembered per requester.
const CANCELS_KEPT: usize = 1024;
/// Inventory updates a subscriber may fall behind before its stream is ended.
const UPDATES_BEHIND: usize = 1024;

/// One batch of inventory changes.
#[derive(Debug, Default)]
struct Update {
    added: Vec<InventoryChunk>,
    removed: Vec<ChunkKey>,
}

/// The inventory as peers see it: what the shards hold in DRAM, by key.
struct View {
    chunks: HashMap<ChunkKey, (u64, u64)>,
    updates: broadcast::Sender<Arc<Update>>,
}

struct Holder {
    id: u64,
    /// By grant id: the slot and the request that gave it.
    grants: HashMap<u64, (SlotRef, u64)>,
    /// Grants being taken now (counted against the bound).
    pending: usize,
    /// Grant requests the requester cancelled (their answers were lost), most recent last:
    /// a grant that completes after its cancel returns what it took at once.
    cancelled: std::collections::VecDeque<u64>,
    /// The grant ids each answered request gave, for a cancel that comes after the answer.
    by_request: HashMap<u64, Vec<u64>>,
    /// When the requester was first seen gone.
    gone_since: Option<Instant>,
}

#[derive(Default)]
struct Grants {
    next_holder: u64,
    next_grant: u64,
    /// By requester node id and epoch.
    holders: HashMap<(String, u64), Holder>,
}

pub(crate) struct Owner {
    cluster: Arc<Cluster>,
    cfg: Arc<PeeringConfig>,
    te: Engine,
    view: Mutex<View>,
    grants: Mutex<Grants>,
    /// Polls after each grant or release served (the next is likely near).
    warm: Warm,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs a blocking call of the local node on the runtime's blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("local node calls do not panic")
}

impl Owner {
    pub(crate) fn new(sides: crate::node::Sides) -> Arc<Self> {
        let crate::node::Sides { cluster, cfg, te, warm } = sides;
        let (updates, _) = broadcast::channel(UPDATES_BEHIND);
        Arc::new(Self {
            cluster,
            cfg,
            te,
            view: Mutex::new(View { chunks: HashMap::new(), updates }),
            grants: Mutex::new(Grants::default()),
            warm,
        })
    }

    /// Keeps the view, reaps the grants of requesters gone, and serves the RPC on `listener`.
    pub(crate) async fn serve(self: Arc<Self>, listener: std::net::TcpListener) {
        tokio::spawn(Arc::clone(&self).follow_shards());
        tokio::spawn(Arc::clone(&self).reap());
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "peer RPC: the listener could not be used");
                return;
            }
        };
        // Small answers (grants) must leave at once: without TCP_NODELAY, Nagle's algorithm
        // held each one back until the requester's delayed ACK, some 40 ms.
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            |stream| {
                stream.inspect(|s| {
                    if let Err(e) = s.set_nodelay(true) {
                        tracing::warn!(error = %e, "peer RPC: TCP_NODELAY not set");
                    }
                })
            },
        );
        let served = tonic::transport::Server::builder()
            .add_service(PeerServer::new(Service(self)))
            .serve_with_incoming(incoming)
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "peer RPC: stopped");
        }
    }

    /// Drains the shards' change logs into the view and the subscribers' streams, while there
    /// are subscribers; a shard whose log overflowed (or that was not followed) is read whole
    /// and compared with the view.
    async fn follow_shards(self: Arc<Self>) {
        let shards = self.cfg.node.shards();
        let mut fresh = vec![true; shards];
        loop {
            // Nobody follows this node: leave the shards asleep (their logs overflow, bounded)
            // and read them whole once a subscriber comes; its snapshot is then corrected by
            // the deltas of that resync.
            if lock(&self.view).updates.receiver_count() == 0 {
                fresh.fill(true);
                tokio::time::sleep(INVENTORY_TICK).await;
                continue;
            }
            let node = Arc::clone(&self.cfg.node);
            let wanted = fresh.clone();
            let got = blocking(move || {
                (0..shards)
                    .map(|s| {
                        if wanted[s] {
                            node.inventory_snapshot(s).map(Err)
                        } else {
                            node.inventory_drain(s).map(Ok)
                        }
                    })
                    .collect::<Vec<_>>()
            })
            .await;
            let mut update = Update::default();
            {
                let mut view = lock(&self.view);
                for (s, r) in got.into_iter().enumerate() {
                    match r {
                        None => {} // the shard did not answer: next round
                        Some(Ok((deltas, overflowed))) => {
                            fresh[s] = overflowed;
                            for d in deltas {
                                match d {
                                    InventoryDelta::Added(c) => {
                                        view.chunks.insert(c.key, (c.len, c.checksum));
                                        update.added.push(c);
                                    }
                                    InventoryDelta::Removed(k) => {
                                        if view.chunks.remove(&k).is_some() {
                                            update.removed.push(k);
                                        }
                                    }
                                }
                            }
                        }
                        Some(Err(snapshot)) => {
                            fresh[s] = false;
                            view.resync(s, shards, snapshot, &mut update);
                        }
                    }
                }
                if !update.added.is_empty() || !update.removed.is_empty() {
                    // No subscriber is no error.
                    let _ = view.updates.send(Arc::new(update));
                }
            }
            tokio::time::sleep(INVENTORY_TICK).await;
        }
    }

    /// Returns the grants of requesters gone for longer than a lease TTL (their member key
    /// left etcd, or it has another epoch now). Nothing is reaped while etcd is unreachable:
    /// then no death can be proven.
    async fn reap(self: Arc<Self>) {
        loop {
            tokio::time::sleep(REAP_TICK).await;
            let status = self.cluster.status();
            if status.state != State::Joined {
                continue;
            }
            let bound = self.cluster.cfg.lease_ttl;
            let mut gone = Vec::new();
            {
                let mut g = lock(&self.grants);
                let now = Instant::now();
                g.holders.retain(|(node, epoch), h| {
                    let alive =
                        status.members.iter().any(|m| m.node_id == *node && m.epoch == *epoch);
                    if alive {
                        h.gone_since = None;
                        return true;
                    }
                    let since = *h.gone_since.get_or_insert(now);
                    if now.duration_since(since) < bound || h.pending > 0 {
                        return true;
                    }
                    gone.push((node.clone(), *epoch, h.id, h.grants.len()));
                    false
                });
            }
            for (node, epoch, id, grants) in gone {
                tracing::info!(requester = %node, epoch, grants, "peer gone: its grants returned");
                self.cluster.update_peer(&node, |v| v.grants_given = 0);
                let n = Arc::clone(&self.cfg.node);
                blocking(move || n.release_all(id)).await;
            }
        }
    }

    /// This node's epoch, or UNAVAILABLE before it has one.
    fn epoch(&self) -> Result<u64, Status> {
        self.cluster.epoch().ok_or_else(|| Status::unavailable("this node has not joined yet"))
    }

    /// Refuses a requester that is not a member of the cluster at that epoch (as last read
    /// from etcd): only members take grants and inventories, so the holders here, and what
    /// they pin, are bounded by the cluster's size.
    fn check_member(&self, requester: &str, epoch: u64) -> Result<(), Status> {
        let status = self.cluster.status();
        if status.members.iter().any(|m| m.node_id == requester && m.epoch == epoch) {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "{requester} at epoch {epoch} is not a member of cluster {} (as {} last read it)",
            status.cluster, status.node_id
        )))
    }

    fn check_owner_epoch(&self, asked: u64) -> Result<u64, Status> {
        let epoch = self.epoch()?;
        if asked != epoch {
            return Err(Status::failed_precondition(format!(
                "owner epoch {asked} is stale: {} is at epoch {epoch}",
                self.cluster.cfg.node_id
            )));
        }
        Ok(epoch)
    }
}

impl Grants {
    /// The holder of requester `node` at `epoch`, made on first use.
    fn holder(&mut self, node: &str, epoch: u64) -> &mut Holder {
        let next = &mut self.next_holder;
        self.holders.entry((node.to_owned(), epoch)).or_insert_with(|| {
            *next += 1;
            Holder {
                id: *next,
                grants: HashMap::new(),
                pending: 0,
                cancelled: Default::default(),
                by_request: HashMap::new(),
                gone_since: None,
            }
        })
    }
}

impl View {
    /// Replaces what the view holds of shard `shard` by `snapshot`, noting the differences.
    fn resync(
        &mut self,
        shard: usize,
        shards: usize,
        snapshot: Vec<InventoryChunk>,
        update: &mut Update,
    ) {
        let mut now: HashMap<ChunkKey, (u64, u64)> =
            snapshot.into_iter().map(|c| (c.key, (c.len, c.checksum))).collect();
        self.chunks.retain(|k, v| {
            if k.shard(shards) != shard {
                return true;
            }
            match now.remove(k) {
                Some(same) if same == *v => true,
                Some(other) => {
                    *v = other;
                    update.added.push(InventoryChunk { key: *k, len: other.0, checksum: other.1 });
                    true
                }
                None => {
                    update.removed.push(*k);
                    false
                }
            }
        });
        for (key, (len, checksum)) in now {
            self.chunks.insert(key, (len, checksum));
            update.added.push(InventoryChunk { key, len, checksum });
        }
    }
}

fn chunk_msg(c: &InventoryChunk) -> crate::rpc::Chunk {
    crate::rpc::Chunk { key: Some((&c.key).into()), len: c.len, checksum: c.checksum }
}

/// The RPC service over an [`Owner`].
struct Service(Arc<Owner>);

#[tonic::async_trait]
impl Peer for Service {
    type InventoryStream = ReceiverStream<Result<InventoryUpdate, Status>>;

    async fn inventory(
        &self,
        request: Request<InventoryRequest>,
    ) -> Result<Response<Self::InventoryStream>, Status> {
        let r = request.into_inner();
        let owner_epoch = self.0.epoch()?;
        self.0.check_member(&r.requester, r.requester_epoch)?;
        let max = if r.max_entries == 0 { usize::MAX } else { r.max_entries as usize };
        // The snapshot and the subscription under one lock: no change falls between them.
        let (snapshot, complete, mut updates) = {
            let view = lock(&self.0.view);
            let snapshot: Vec<crate::rpc::Chunk> = view
                .chunks
                .iter()
                .take(max)
                .map(|(key, &(len, checksum))| {
                    chunk_msg(&InventoryChunk { key: *key, len, checksum })
                })
                .collect();
            (snapshot, view.chunks.len() <= max, view.updates.subscribe())
        };
        tracing::info!(requester = %r.requester, epoch = r.requester_epoch, chunks = snapshot.len(), complete, "peer subscribed to the inventory");
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut parts = snapshot.chunks(SNAPSHOT_PART).peekable();
            let msg = |added: Vec<crate::rpc::Chunk>, removed, end| InventoryUpdate {
                owner_epoch,
                added,
                removed,
                snapshot_end: end,
                complete: end && complete,
            };
            if parts.peek().is_none()
                && tx.send(Ok(msg(Vec::new(), Vec::new(), true))).await.is_err()
            {
                return;
            }
            while let Some(part) = parts.next() {
                let end = parts.peek().is_none();
                if tx.send(Ok(msg(part.to_vec(), Vec::new(), end))).await.is_err() {
                    return;
                }
            }
            loop {
                let next = match updates.recv().await {
                    Ok(u) => Ok(msg(
                        u.added.iter().map(chunk_msg).collect(),
                        u.removed.iter().map(Into::into).collect(),
                        false,
                    )),
                    Err(broadcast::error::RecvError::Lagged(n)) => Err(Status::resource_exhausted(
                        format!("fell {n} inventory updates behind; subscribe again"),
                    )),
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let stop = next.is_err();
                if tx.send(next).await.is_err() || stop {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn grant(&self, request: Request<GrantRequest>) -> Result<Response<GrantReply>, Status> {
        // In a task of its own: a requester that gives up (timeout, disconnect) drops this
        // future, and the leases taken must still be recorded for their release.
        let owner = Arc::clone(&self.0);
        let answer = tokio::spawn(async move { owner.grant(request.into_inner()).await })
            .await
            .map_err(|e| Status::internal(format!("grant: {e}")))?;
        self.0.warm.touch();
        answer
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseReply>, Status> {
        let owner = Arc::clone(&self.0);
        let answer = tokio::spawn(async move { owner.release(request.into_inner()).await })
            .await
            .map_err(|e| Status::internal(format!("release: {e}")))?;
        self.0.warm.touch();
        answer
    }
}

impl Owner {
    async fn grant(self: &Arc<Self>, r: GrantRequest) -> Result<Response<GrantReply>, Status> {
        let owner = self;
        let started = std::time::Instant::now();
        let owner_epoch = owner.check_owner_epoch(r.owner_epoch)?;
        owner.check_member(&r.requester, r.requester_epoch)?;
        let keys: Vec<ChunkKey> = r
            .keys
            .iter()
            .map(|k| k.to_chunk_key())
            .collect::<Option<_>>()
            .ok_or_else(|| Status::invalid_argument("a key's digest is not 32 bytes"))?;
        let max = owner.cfg.max_grants_per_peer;
        let holder = {
            let mut g = lock(&owner.grants);
            let h = g.holder(&r.requester, r.requester_epoch);
            if h.grants.len() + h.pending + keys.len() > max {
                return Err(Status::resource_exhausted(format!(
                    "{} holds {} grants here; {} more exceed the bound of {max} per peer",
                    r.requester,
                    h.grants.len() + h.pending,
                    keys.len()
                )));
            }
            h.pending += keys.len();
            h.id
        };
        let asking = std::time::Instant::now();
        let hits = hot(owner.cfg.node.grant(holder, &keys), HOT_FOR).await;
        let shards_took = asking.elapsed();
        let (chunks, undo) = owner.record_grants(&r, &keys, hits);
        if !undo.is_empty() {
            let node = Arc::clone(&owner.cfg.node);
            blocking(move || node.release(holder, &undo)).await;
            return Err(Status::cancelled("the requester cancelled this grant"));
        }
        tracing::debug!(
            requester = %r.requester,
            keys = keys.len(),
            shards_us = shards_took.as_micros() as u64,
            total_us = started.elapsed().as_micros() as u64,
            "grant served"
        );
        Ok(Response::new(GrantReply {
            owner_epoch,
            segment: owner.te.segment().to_owned(),
            chunks,
        }))
    }

    /// Records the leases the shards took for grant request `r` (one hit or miss per key) as
    /// grants of its holder: the answer per key, the leases to give back at once (the request
    /// was cancelled before this answer). The peer view's count of grants given is set under
    /// the same lock (set after it, a grant's count could land after a later release's).
    fn record_grants(
        &self,
        r: &GrantRequest,
        keys: &[ChunkKey],
        hits: Vec<Option<orbitkv_proto::Hit>>,
    ) -> (Vec<Granted>, Vec<SlotRef>) {
        let mut chunks = Vec::with_capacity(keys.len());
        let mut undo = Vec::new();
        let mut g = lock(&self.grants);
        let mut next_grant = g.next_grant;
        let h = g
            .holders
            .get_mut(&(r.requester.clone(), r.requester_epoch))
            .expect("a holder with pending grants is not reaped");
        h.pending -= keys.len();
        let cancelled = r.request_id != 0 && h.cancelled.contains(&r.request_id);
        let mut ids = Vec::new();
        for (key, hit) in keys.iter().zip(hits) {
            chunks.push(match hit {
                Some(hit) if cancelled => {
                    undo.push(SlotRef { key: *key, generation: hit.generation });
                    Granted::default()
                }
                Some(hit) => {
                    next_grant += 1;
                    ids.push(next_grant);
                    let slot = SlotRef { key: *key, generation: hit.generation };
                    h.grants.insert(next_grant, (slot, r.request_id));
                    Granted {
                        present: true,
                        addr: self.cfg.arena.0 + hit.offset,
                        len: hit.len,
                        checksum: hit.checksum,
                        generation: hit.generation,
                        grant_id: next_grant,
                    }
                }
                None => Granted::default(),
            });
        }
        if r.request_id != 0 && !ids.is_empty() {
            h.by_request.insert(r.request_id, ids);
        }
        let given = h.grants.len() as u64;
        g.next_grant = next_grant;
        self.cluster.update_peer(&r.requester, |v| v.grants_given = given);
        (chunks, undo)
    }

    async fn release(
        self: &Arc<Self>,
        r: ReleaseRequest,
    ) -> Result<Response<ReleaseReply>, Status> {
        let owner = self;
        owner.check_owner_epoch(r.owner_epoch)?;
        let (holder, slots, unknown) = {
            let mut g = lock(&owner.grants);
            let key = (r.requester.clone(), r.requester_epoch);
            if r.requests.is_empty() && !g.holders.contains_key(&key) {
                return Ok(Response::new(ReleaseReply {
                    released: 0,
                    unknown: r.grant_ids.len() as u32,
                }));
            }
            // A cancel may come before the first grant: the holder remembers it.
            let h = g.holder(&r.requester, r.requester_epoch);
            let mut ids = r.grant_ids.clone();
            for req in &r.requests {
                match h.by_request.remove(req) {
                    Some(given) => ids.extend(given),
                    None => {
                        // Not answered yet (or it took nothing): remembered, bounded.
                        if h.cancelled.len() >= CANCELS_KEPT {
                            h.cancelled.pop_front();
                        }
                        h.cancelled.push_back(*req);
                    }
                }
            }
            let mut slots = Vec::with_capacity(ids.len());
            for id in &ids {
                let Some((slot, req)) = h.grants.remove(id) else { continue };
                slots.push(slot);
                if let Some(given) = h.by_request.get_mut(&req) {
                    given.retain(|g| g != id);
                    if given.is_empty() {
                        h.by_request.remove(&req);
                    }
                }
            }
            let unknown = ids.len().saturating_sub(slots.len()) as u32;
            // Under the grants' lock, as a grant sets it.
            let given = h.grants.len() as u64;
            owner.cluster.update_peer(&r.requester, |v| v.grants_given = given);
            (h.id, slots, unknown)
        };
        let released = slots.len() as u32;
        let node = Arc::clone(&owner.cfg.node);
        blocking(move || node.release(holder, &slots)).await;
        Ok(Response::new(ReleaseReply { released, unknown }))
    }
}
