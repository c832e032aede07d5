//! A shard executor's state (`Exec`, shared by its tasks through `Rc`) and what the request
//! handlers do with it: apply an op here ([`Exec::apply_local`]) or on another shard over the
//! mesh ([`Exec::exec_on`]), run a GPU copy ([`Exec::gpu_run`]), answer a request
//! ([`Exec::respond`]). The executor's loop (`executor`) drives it; the handlers (`router`,
//! `transfer`) use it and nothing of the loop.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::channels::channel_mesh::Senders;
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::{GlommioError, ResourceType};
use iceoryx2::prelude::*;
use orbitkv_proto::{ChunkKey, ChunkOutcome, ErrorCode};
use orbitkv_shards::{
    EvictSummary, HashRange, SessionId, ShardCore, ShardOp, ShardReply, StartedTombstone,
};

use crate::control::shared::Shared;
use crate::shard::ipc::{IpcService, SessionServer, SessionService};

/// A request sent over the mesh: (request id, op).
pub type MeshRequest = (u64, ShardOp);
/// A reply sent over the mesh: (request id, reply).
pub type MeshReply = (u64, ShardReply);

/// Bytes of a commit's chunks hashed between two turns of the shard's other work (about
/// 50-100 us of one core); commits hashing less run in one go.
const HASH_PIECE: u64 = 1 << 20;

/// How many more times an admin evict of a namespace tries, a millisecond apart, while its
/// chunks on SSD stay because their shard could not start the namespace's tombstone yet.
const EVICT_RETRIES: u32 = 100;

/// Per-session state on its home shard.
pub(crate) struct SessionState {
    pub(crate) port: RefCell<Option<(SessionService, SessionServer)>>,
    pub(crate) leases: Cell<u64>,
    pub(crate) reservations: Cell<u64>,
    pub(crate) inflight: Cell<usize>,
    /// The namespaces this session registered: its requests may name no other.
    pub(crate) namespaces: RefCell<std::collections::HashSet<u64>>,
}

/// The executor's state, shared by its tasks through `Rc`.
pub(crate) struct Exec {
    pub(crate) id: usize,
    pub(crate) shards: usize,
    pub(crate) cpu: Option<usize>,
    pub(crate) core: RefCell<ShardCore>,
    pub(crate) sessions: RefCell<HashMap<SessionId, Rc<SessionState>>>,
    pub(crate) node: Node<IpcService>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) req_tx: Option<Senders<MeshRequest>>,
    pub(crate) rep_tx: Option<Senders<MeshReply>>,
    pub(crate) pending: RefCell<HashMap<u64, LocalSender<ShardReply>>>,
    pub(crate) next_req: Cell<u64>,
    pub(crate) dropped_replies: Cell<u64>,
    /// Requests still in flight when their session closed.
    pub(crate) orphaned_requests: Cell<u64>,
    pub(crate) rejected: Cell<u64>,
    /// Request, session-close and peer-op tasks in flight (a shard only sleeps on its doorbell
    /// at zero).
    pub(crate) active: Cell<usize>,
    pub(crate) deep_sleeps: Cell<u64>,
    pub(crate) doorbell_wakeups: Cell<u64>,
    pub(crate) naps: Cell<u64>,
    /// Requests waiting for a GPU copy, by job id.
    pub(crate) gpu_waiters: RefCell<HashMap<u64, LocalSender<crate::gpu::GpuResult>>>,
    pub(crate) gpu_next: Cell<u64>,
    /// Lookups waiting for a peer read, by key.
    pub(crate) peer_waiters: RefCell<HashMap<ChunkKey, Vec<LocalSender<()>>>>,
}

impl Exec {
    /// Sends a reply to `peer` over the reply mesh; false when the mesh is gone.
    pub(crate) async fn reply_to(&self, peer: usize, rid: u64, reply: ShardReply) -> bool {
        let tx = self.rep_tx.as_ref().expect("reply mesh exists when request mesh does");
        self.shared.doorbells.mesh_sending(peer);
        let sent = tx.send_to(peer, (rid, reply)).await.is_ok();
        self.shared.doorbells.ring(peer);
        if !sent {
            self.shared.doorbells.mesh_received(peer);
        }
        sent
    }

    /// Executes an op on this shard. A lookup that finds chunks only on SSD or only at a peer
    /// waits here until their promotion into DRAM completes (the main loop drives the SSD
    /// ring and takes the peer thread's answers).
    pub(crate) async fn apply_local(&self, op: ShardOp) -> ShardReply {
        match op {
            ShardOp::Lookup { session, keys, lease } if self.core.borrow().tiered() => {
                let first = self.core.borrow_mut().lookup_start(session, &keys, lease);
                self.hand_peer_fetches();
                if first.pending.is_empty() {
                    return ShardReply::Hits(
                        self.core.borrow_mut().finish_lookup(session, &keys, lease, first),
                    );
                }
                let (started, pending) = (Instant::now(), first.pending.len());
                self.wait_moving_in(first.pending.iter().map(|&i| keys[i])).await;
                let waited = started.elapsed();
                let hits = self.core.borrow_mut().finish_lookup(session, &keys, lease, first);
                tracing::debug!(
                    shard = self.id,
                    keys = keys.len(),
                    pending,
                    wait_us = waited.as_micros() as u64,
                    finish_us = (started.elapsed() - waited).as_micros() as u64,
                    "lookup waited for chunks moving in (SSD or peer)"
                );
                ShardReply::Hits(hits)
            }
            op @ (ShardOp::Commit { .. } | ShardOp::CommitSummed { .. }) => {
                let ranges = self.core.borrow().hash_ranges(&op);
                if ranges.iter().map(|r| r.len).sum::<u64>() < HASH_PIECE {
                    return self.core.borrow_mut().apply(op);
                }
                self.active.set(self.active.get() + 1);
                let hashed = self.hash_in_pieces(&ranges).await;
                self.active.set(self.active.get() - 1);
                self.core.borrow_mut().apply_hashed(op, &hashed)
            }
            ShardOp::Evict { keys } => ShardReply::Outcomes(self.evict(&keys).await),
            op => self.core.borrow_mut().apply(op),
        }
    }

    /// Evicts `keys`, answering once their tombstones are on SSD. A key whose tombstone could
    /// not start (`Busy`: the SSD queue full, or a region being opened by the write before
    /// it) is evicted again once the tombstones started have landed, while that makes
    /// progress; leased chunks stay `Busy`.
    pub(crate) async fn evict(&self, keys: &[ChunkKey]) -> Vec<ChunkOutcome> {
        let mut outcomes = vec![ChunkOutcome::Failed(ErrorCode::Internal); keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        loop {
            let batch = pending.iter().map(|&i| keys[i]).collect();
            let reply = self.core.borrow_mut().apply(ShardOp::Evict { keys: batch });
            let started = self.core.borrow_mut().take_started_tombstones();
            if let ShardReply::Outcomes(o) = reply {
                for (&i, o) in pending.iter().zip(o) {
                    outcomes[i] = o;
                }
            }
            let progress = !started.is_empty();
            for t in self.wait_tombstones(started).await {
                // Gone now, but its deletion is not on SSD: it may come back after a restart
                // (logged by the tier).
                if let Some(i) = keys.iter().position(|k| *k == t.key) {
                    outcomes[i] = ChunkOutcome::Failed(ErrorCode::Internal);
                }
            }
            pending.retain(|&i| outcomes[i] == ChunkOutcome::Failed(ErrorCode::Busy));
            if pending.is_empty() || !progress {
                return outcomes;
            }
        }
    }

    /// Evicts a namespace (every chunk with None) as [`ShardCore::evict_namespace`] does, and
    /// again while chunks on SSD stayed only because the namespace's tombstone could not
    /// start yet (a region being opened; a bounded number of tries a millisecond apart).
    pub(crate) async fn evict_namespace(&self, namespace: Option<u64>) -> EvictSummary {
        let mut total = EvictSummary::default();
        for attempt in 0.. {
            let (summary, unrecorded) = self.core.borrow_mut().evict_namespace_once(namespace);
            let started = self.core.borrow_mut().take_started_tombstones();
            total.removed += summary.removed;
            total.busy = summary.busy;
            for t in self.wait_tombstones(started).await {
                total.not_durable += t.covers;
            }
            if unrecorded == 0 || attempt == EVICT_RETRIES {
                break;
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        total
    }

    /// Waits until the tombstones `started` have landed on SSD (the loop keeps polling the
    /// ring while they are in flight): an eviction is answered only once it is durable.
    /// Returns those whose write failed.
    pub(crate) async fn wait_tombstones(
        &self,
        started: Vec<StartedTombstone>,
    ) -> Vec<StartedTombstone> {
        let mut failed = Vec::new();
        if started.is_empty() {
            return failed;
        }
        self.active.set(self.active.get() + 1);
        let mut waiting = started;
        loop {
            waiting.retain(|t| match self.core.borrow_mut().tombstone_result(t.ticket) {
                None => true,
                Some(true) => false,
                Some(false) => {
                    failed.push(*t);
                    false
                }
            });
            if waiting.is_empty() {
                break;
            }
            glommio::timer::sleep(Duration::from_micros(20)).await;
        }
        self.active.set(self.active.get() - 1);
        failed
    }

    /// Waits until none of `keys` is moving into DRAM. SSD reads complete on this shard's
    /// ring, which the loop keeps polling while they are in flight; a peer read (milliseconds)
    /// ends with a control message, which rings the doorbell and wakes its waiters
    /// ([`Exec::peer_fetched`]): the loop may sleep meanwhile and leave the cores to the
    /// Transfer Engine.
    pub(crate) async fn wait_moving_in(&self, keys: impl Iterator<Item = ChunkKey>) {
        let mut ssd = Vec::new();
        let mut peer = Vec::new();
        for key in keys {
            let core = self.core.borrow();
            if core.promotion_pending(&key) {
                ssd.push(key);
            } else if core.peer_promotion_pending(&key) {
                let (tx, rx) = local_channel::new_bounded(1);
                self.peer_waiters.borrow_mut().entry(key).or_default().push(tx);
                peer.push(rx);
            }
        }
        for rx in peer {
            // None: the sender went without a word (the shard stops); either way it is over.
            let _ = rx.recv().await;
        }
        if !ssd.is_empty() {
            self.active.set(self.active.get() + 1);
            while ssd.iter().any(|k| self.core.borrow().moving_in(k)) {
                glommio::timer::sleep(Duration::from_micros(20)).await;
            }
            self.active.set(self.active.get() - 1);
        }
    }

    /// A peer read of `key` ended (the control message applied): its lookups go on.
    pub(crate) fn peer_fetched(&self, key: &ChunkKey) {
        if let Some(waiters) = self.peer_waiters.borrow_mut().remove(key) {
            for tx in waiters {
                let _ = tx.try_send(());
            }
        }
    }

    /// Hands the peer reads a lookup started to the peer thread; a read that cannot be queued
    /// (no peering, or its queue full) ends at once as a miss.
    pub(crate) fn hand_peer_fetches(&self) {
        let fetches = self.core.borrow_mut().take_peer_fetches();
        // In one message (up to its bound): the peer thread takes them as one group.
        for piece in fetches.chunks(orbitkv_peer::FETCHES_PER_MESSAGE) {
            let queued =
                self.shared.peer_fetches.get().is_some_and(|q| q.try_send(piece.to_vec()).is_ok());
            if !queued {
                for f in piece {
                    let _ = self.core.borrow_mut().finish_peer_fetch(f, false);
                    self.peer_fetched(&f.key);
                }
            }
        }
    }

    /// Whether `op` hashes enough of the arena (a commit of long chunks) to be hashed a piece
    /// at a time ([`Exec::hash_in_pieces`]) rather than in one go.
    pub(crate) fn hashes_long(&self, op: &ShardOp) -> bool {
        matches!(op, ShardOp::Commit { .. } | ShardOp::CommitSummed { .. })
            && self.core.borrow().hash_ranges(op).iter().map(|r| r.len).sum::<u64>() >= HASH_PIECE
    }

    /// The checksums of `ranges` of this shard's arena, hashed [`HASH_PIECE`] bytes at a time
    /// with this shard's other work between the pieces: ops from other shards included, which
    /// arrive through glommio's reactor. In one go, an 8 MiB chunk (a commit's check of a GPU
    /// save's checksum) held the shard for about a millisecond, and a save's next
    /// reservations, which need every shard, waited behind it while the GPU ran out of jobs.
    pub(crate) async fn hash_in_pieces(&self, ranges: &[HashRange]) -> Vec<(HashRange, u64)> {
        let reader = self.core.borrow().reader();
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let mut h = orbitkv_proto::ChunkChecksum::new();
            let mut at = 0;
            while at < r.len {
                let n = (r.len - at).min(HASH_PIECE);
                h.update(reader.bytes(r.offset + at, n));
                at += n;
                if self.shards > 1 {
                    // Through the reactor, as the shard's main loop yields (a plain yield
                    // would not poll it).
                    glommio::timer::sleep(Duration::from_micros(1)).await;
                } else {
                    glommio::executor().yield_now().await;
                }
            }
            out.push((*r, h.finish()));
        }
        out
    }

    /// Executes `op` on shard `shard`: here directly, elsewhere over the mesh.
    pub(crate) async fn exec_on(&self, shard: usize, op: ShardOp) -> ShardReply {
        if shard == self.id {
            return self.apply_local(op).await;
        }
        let sent = self.send_remote(shard, op).await;
        Self::remote_reply(sent).await
    }

    /// Sends `op` to another shard over the mesh and returns where its reply will arrive
    /// (none when the mesh is gone). Waits only when that shard's queue is full.
    pub(crate) async fn send_remote(
        &self,
        shard: usize,
        op: ShardOp,
    ) -> Option<LocalReceiver<ShardReply>> {
        debug_assert_ne!(shard, self.id, "local ops do not travel over the mesh");
        let rid = self.next_req.get();
        self.next_req.set(rid + 1);
        let (tx, rx) = local_channel::new_bounded(1);
        self.pending.borrow_mut().insert(rid, tx);
        let mesh = self.req_tx.as_ref().expect("several shards imply a mesh");
        self.shared.doorbells.mesh_sending(shard);
        let sent = match mesh.try_send_to(shard, (rid, op)) {
            Ok(()) => true,
            // Full: wait for room.
            Err(GlommioError::WouldBlock(ResourceType::Channel(msg))) => {
                mesh.send_to(shard, msg).await.is_ok()
            }
            Err(_) => false,
        };
        self.shared.doorbells.ring(shard);
        if !sent {
            self.shared.doorbells.mesh_received(shard);
            self.pending.borrow_mut().remove(&rid);
            return None;
        }
        Some(rx)
    }

    /// Waits for the reply of an op sent by [`Exec::send_remote`]; a lost one reads as an
    /// empty outcome list, which callers treat as a failed shard.
    pub(crate) async fn remote_reply(sent: Option<LocalReceiver<ShardReply>>) -> ShardReply {
        match sent {
            Some(rx) => rx.recv().await.unwrap_or(ShardReply::Outcomes(Vec::new())),
            None => ShardReply::Outcomes(Vec::new()),
        }
    }

    /// Runs a GPU copy on the DMA thread for `direction` and waits for its completion (the CUDA
    /// event). Whatever the requester does meanwhile, the caller holds the arena slots until
    /// this returns.
    pub(crate) async fn gpu_run(
        &self,
        direction: orbitkv_gpu::dma::Direction,
        device: usize,
        memory: Arc<orbitkv_gpu::dma::EngineMemory>,
        (chunks, chunk_len): (Vec<(u64, Vec<u64>)>, u64),
    ) -> Result<Option<Vec<u64>>, (orbitkv_proto::ErrorCode, String)> {
        use orbitkv_proto::ErrorCode;
        let Some(gpu) = self.shared.gpu_service.get() else {
            return Err((ErrorCode::Unavailable, "this server has no GPU in use".into()));
        };
        let id = self.gpu_next.get();
        self.gpu_next.set(id + 1);
        let (tx, rx) = local_channel::new_bounded(1);
        self.gpu_waiters.borrow_mut().insert(id, tx);
        let mut job = crate::gpu::GpuJob {
            shard: self.id,
            id,
            device,
            memory,
            chunks,
            chunk_len,
            queued_at: Instant::now(),
        };
        // A full queue means the copy engine is behind: wait for room (the queue is bounded,
        // and so are the jobs a request splits into). The wait ends when the DMA thread takes
        // jobs; it does not end when the client gives up, since the request holds slots.
        while let Err(back) = gpu.submit(direction, job) {
            job = back;
            glommio::timer::sleep(Duration::from_micros(20)).await;
            job.queued_at = Instant::now();
        }
        match rx.recv().await {
            Some(Ok(sums)) => Ok(sums),
            Some(Err(e)) => Err((ErrorCode::DeviceError, e.to_string())),
            None => Err((ErrorCode::Internal, "GPU completion lost".into())),
        }
    }

    /// Sends a response for `req`, counting it as dropped when the client is gone.
    pub(crate) fn respond(&self, req: crate::shard::ipc::ActiveRequest, bytes: &[u8]) {
        let sent = req
            .loan_slice_uninit(bytes.len())
            .map_err(|e| format!("{e:?}"))
            .and_then(|r| r.write_from_slice(bytes).send().map_err(|e| format!("{e:?}")));
        if let Err(e) = sent {
            self.dropped_replies.set(self.dropped_replies.get() + 1);
            tracing::debug!(shard = self.id, error = %e, "response not delivered");
        }
    }
}

/// Lease and reservation counters of one session (for the per-session bounds) plus its
/// in-flight request count.
pub(crate) struct SessionCounters(pub(crate) Rc<SessionState>);

impl SessionCounters {
    pub(crate) fn leases(&self) -> u64 {
        self.0.leases.get()
    }
    pub(crate) fn reservations(&self) -> u64 {
        self.0.reservations.get()
    }
    pub(crate) fn add_leases(&self, delta: i64) {
        self.0.leases.set(self.0.leases.get().saturating_add_signed(delta));
    }
    pub(crate) fn add_reservations(&self, delta: i64) {
        self.0.reservations.set(self.0.reservations.get().saturating_add_signed(delta));
    }
    /// Whether the session registered namespace `id`.
    pub(crate) fn registered(&self, id: u64) -> bool {
        self.0.namespaces.borrow().contains(&id)
    }
    /// Notes that the session registered namespace `id`.
    pub(crate) fn add_namespace(&self, id: u64) {
        self.0.namespaces.borrow_mut().insert(id);
    }
    /// Marks the request finished.
    pub(crate) fn done(&self) {
        self.0.inflight.set(self.0.inflight.get() - 1);
    }
}
