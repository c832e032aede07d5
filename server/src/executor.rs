//! One shard executor: a glommio `LocalExecutor` on its own core that owns a [`ShardCore`],
//! the iceoryx2 services of the sessions homed on it, and its ends of the shard mesh.
//!
//! Polling is adaptive: after work it spins (yielding to its own tasks) for `--spin-window`,
//! then sleeps in growing naps up to `--idle-poll-max`, so a quiet server burns no core.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use glommio::channels::channel_mesh::{Full, MeshBuilder, Receivers, Senders};
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::{GlommioError, LocalExecutorBuilder, Placement, ResourceType};
use iceoryx2::prelude::*;
use orbitkv_proto::{ChunkKey, ChunkOutcome, ErrorCode};
use orbitkv_shards::{
    EvictSummary, HashRange, SessionId, ShardCore, ShardOp, ShardReply, StartedTombstone,
};
use orbitkv_ssd::store::{SsdConfig, SsdStore};

use crate::doorbell::{Doorbells, LoopStage};
use crate::error::ShardStartError;
use crate::ipc::{self, IpcNames, IpcService, SessionServer, SessionService};
use crate::messages::{ControlMsg, ShardSnapshot};
use crate::shared::Shared;

/// A request sent over the mesh: (request id, op).
pub type MeshRequest = (u64, ShardOp);
/// A reply sent over the mesh: (request id, reply).
pub type MeshReply = (u64, ShardReply);

/// How long an executor with a core of its own polls glommio's reactor before parking.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(100);
/// Most requests taken from one session per poll round (fairness between sessions).
const REQUESTS_PER_ROUND: usize = 16;
/// How a shard waits for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Spare cores exist: spin briefly after work, nap, then sleep on the doorbell.
    Poll,
    /// Every core runs a shard: spinning would steal the core from clients, so a shard
    /// sleeps on its doorbell as soon as it has nothing to do.
    Sleep,
}
/// Longest doorbell sleep before looking around anyway.
const DEEP_SLEEP: Duration = Duration::from_millis(250);
/// Bytes of a commit's chunks hashed between two turns of the shard's other work (about
/// 50-100 us of one core); commits hashing less run in one go.
const HASH_PIECE: u64 = 1 << 20;

/// How many more times an admin evict of a namespace tries, a millisecond apart, while its
/// chunks on SSD stay because their shard could not start the namespace's tombstone yet.
const EVICT_RETRIES: u32 = 100;

/// Everything a shard executor starts with.
pub struct ShardContext {
    /// Shard id.
    pub id: usize,
    /// Shard count.
    pub shards: usize,
    /// CPU to pin to, if pinning.
    pub cpu: Option<usize>,
    /// io_uring registered memory per ring (bounded by RLIMIT_MEMLOCK).
    pub io_memory: usize,
    /// The shard's state machine.
    pub core: ShardCore,
    /// Control messages from the bootstrap/admin threads.
    pub control: Receiver<ControlMsg>,
    /// Shard-to-shard request mesh (None with one shard).
    pub req_mesh: Option<MeshBuilder<MeshRequest, Full>>,
    /// Shard-to-shard reply mesh (None with one shard).
    pub rep_mesh: Option<MeshBuilder<MeshReply, Full>>,
    /// Control-plane state.
    pub shared: Arc<Shared>,
    /// iceoryx2 names.
    pub ipc: IpcNames,
    /// Reports start-up success or failure.
    pub ready: Sender<Result<(), ShardStartError>>,
    /// How to wait for work.
    pub idle: IdlePolicy,
    /// This shard's SSD store, when the tier is configured.
    pub ssd: Option<SsdConfig>,
}

/// Starts the executor thread of one shard. Pinning is best effort: a placement that fails
/// is retried unpinned with a warning.
pub fn spawn(
    ctx: ShardContext,
) -> Result<glommio::ExecutorJoinHandle<()>, crate::error::StartError> {
    let id = ctx.id;
    let cpu = ctx.cpu;
    let io_memory = ctx.io_memory;
    // With a core of its own, glommio polls its reactor (timers, mesh messages) for a while
    // before blocking in the kernel, so a message from another shard or a short timer is seen
    // within a microsecond instead of after a kernel wake-up.
    let spin_before_park = match ctx.idle {
        IdlePolicy::Poll => SPIN_BEFORE_PARK,
        IdlePolicy::Sleep => Duration::ZERO,
    };
    let slot = Arc::new(Mutex::new(Some(ctx)));
    let start = |placement: Placement, pinned: Option<usize>| {
        let slot = Arc::clone(&slot);
        LocalExecutorBuilder::new(placement)
            .name(&format!("shard-{id}"))
            .io_memory(io_memory)
            .spin_before_park(spin_before_park)
            .spawn(move || async move {
                let ctx = slot.lock().expect("context lock is never poisoned").take();
                if let Some(mut ctx) = ctx {
                    ctx.cpu = pinned;
                    run(ctx).await;
                }
            })
    };
    if let Some(cpu) = cpu {
        match start(Placement::Fixed(cpu), Some(cpu)) {
            Ok(h) => return Ok(h),
            Err(e) => {
                tracing::warn!(shard = id, cpu, error = %e, "pinning failed; running unpinned")
            }
        }
    }
    start(Placement::Unbound, None)
        .map_err(|e| crate::error::StartError::Executor { shard: id, detail: e.to_string() })
}

/// Per-session state on its home shard.
struct SessionState {
    port: RefCell<Option<(SessionService, SessionServer)>>,
    leases: Cell<u64>,
    reservations: Cell<u64>,
    inflight: Cell<usize>,
    /// The namespaces this session registered: its requests may name no other.
    namespaces: RefCell<std::collections::HashSet<u64>>,
}

/// The executor's state, shared by its tasks through `Rc`.
pub(crate) struct Exec {
    pub(crate) id: usize,
    pub(crate) shards: usize,
    cpu: Option<usize>,
    pub(crate) core: RefCell<ShardCore>,
    sessions: RefCell<HashMap<SessionId, Rc<SessionState>>>,
    node: Node<IpcService>,
    pub(crate) shared: Arc<Shared>,
    req_tx: Option<Senders<MeshRequest>>,
    rep_tx: Option<Senders<MeshReply>>,
    pending: RefCell<HashMap<u64, LocalSender<ShardReply>>>,
    next_req: Cell<u64>,
    pub(crate) dropped_replies: Cell<u64>,
    /// Requests still in flight when their session closed.
    orphaned_requests: Cell<u64>,
    pub(crate) rejected: Cell<u64>,
    /// Request, session-close and peer-op tasks in flight (a shard only sleeps on its doorbell
    /// at zero).
    pub(crate) active: Cell<usize>,
    deep_sleeps: Cell<u64>,
    doorbell_wakeups: Cell<u64>,
    naps: Cell<u64>,
    /// Requests waiting for a GPU copy, by job id.
    gpu_waiters: RefCell<HashMap<u64, LocalSender<crate::gpu::GpuResult>>>,
    gpu_next: Cell<u64>,
    /// Lookups waiting for a peer read, by key.
    peer_waiters: RefCell<HashMap<ChunkKey, Vec<LocalSender<()>>>>,
}

/// This shard's ends of a mesh, or none with one shard.
async fn join_mesh<T: Send + 'static>(
    mesh: Option<MeshBuilder<T, Full>>,
    (shard, what): (usize, &'static str),
) -> Result<(Option<Senders<T>>, Option<Receivers<T>>), ShardStartError> {
    match mesh {
        None => Ok((None, None)),
        Some(m) => match m.join().await {
            Ok((tx, rx)) => Ok((Some(tx), Some(rx))),
            Err(e) => Err(ShardStartError::Mesh { shard, mesh: what, detail: e.to_string() }),
        },
    }
}

async fn run(ctx: ShardContext) {
    let ShardContext {
        id,
        shards,
        cpu,
        core,
        control,
        req_mesh,
        rep_mesh,
        shared,
        ipc,
        ready,
        idle: policy,
        ssd,
        ..
    } = ctx;
    // Past the spin window a shard with nothing in flight sleeps on its doorbell, which every
    // producer rings: a request is then seen as soon as the thread wakes. (Napping on a timer
    // instead, as it still does with tasks in flight, kept a request that came 2-20 ms after
    // the last one waiting up to `--idle-poll-max`: 190-520 us on a 2-vCPU VM, against about
    // 100 us for the doorbell's wake-up there.)
    let spin_window = match policy {
        IdlePolicy::Poll => shared.settings.spin_window,
        IdlePolicy::Sleep => Duration::ZERO,
    };
    let started = async {
        let node = open_node(id, &ipc)?;
        let (req_tx, req_rx) = join_mesh(req_mesh, (id, "request")).await?;
        let (rep_tx, rep_rx) = join_mesh(rep_mesh, (id, "reply")).await?;
        let exec = Rc::new(Exec {
            id,
            shards,
            cpu,
            core: RefCell::new(core),
            sessions: RefCell::new(HashMap::new()),
            node,
            shared,
            req_tx,
            rep_tx,
            pending: RefCell::new(HashMap::new()),
            next_req: Cell::new(1),
            dropped_replies: Cell::new(0),
            orphaned_requests: Cell::new(0),
            rejected: Cell::new(0),
            active: Cell::new(0),
            deep_sleeps: Cell::new(0),
            naps: Cell::new(0),
            doorbell_wakeups: Cell::new(0),
            gpu_waiters: RefCell::new(HashMap::new()),
            gpu_next: Cell::new(1),
            peer_waiters: RefCell::new(HashMap::new()),
        });
        serve_peers(&exec, req_rx, rep_rx);
        if let Some(cfg) = ssd {
            open_ssd(&exec, &cfg)?;
        }
        Ok::<_, ShardStartError>(exec)
    };
    let exec = match started.await {
        Ok(exec) => exec,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    tracing::info!(shard = id, cpu = ?cpu, "shard serving");
    serve(&exec, &control, spin_window).await;
    exec.sessions.borrow_mut().clear();
    tracing::info!(shard = id, "shard stopped");
}

/// The shard's iceoryx2 node.
fn open_node(id: usize, ipc: &IpcNames) -> Result<Node<IpcService>, ShardStartError> {
    let node_name = format!("orbitkv-shard-{id}");
    ipc::config(ipc)
        .and_then(|cfg| {
            let name = NodeName::new(&node_name)
                .map_err(|e| ipc::IpcError::new("node name", &node_name, e))?;
            NodeBuilder::new()
                .name(&name)
                .config(&cfg)
                .create::<IpcService>()
                .map_err(|e| ipc::IpcError::new("node", &node_name, e))
        })
        .map_err(|source| ShardStartError::Ipc { shard: id, source })
}

/// Starts the tasks that serve the other shards: their ops (executed and answered on the
/// reply mesh) and the replies to this shard's own ops.
fn serve_peers(
    exec: &Rc<Exec>,
    req_rx: Option<Receivers<MeshRequest>>,
    rep_rx: Option<Receivers<MeshReply>>,
) {
    // Ops from other shards: execute and answer on the reply mesh. Reply receivers never block,
    // so this task cannot deadlock against another shard's.
    if let Some(mut rx) = req_rx {
        for (peer, stream) in rx.streams() {
            let e = Rc::clone(exec);
            glommio::spawn_local(async move {
                while let Some((rid, op)) = stream.recv().await {
                    e.shared.doorbells.mesh_received(e.id);
                    // A lookup may wait for SSD promotions, and a commit of long chunks hashes
                    // them a piece at a time: run such an op in its own task so that later
                    // ops from the same peer are not queued behind it.
                    if (matches!(op, ShardOp::Lookup { .. }) && e.core.borrow().tiered())
                        || e.hashes_long(&op)
                    {
                        let e = Rc::clone(&e);
                        e.active.set(e.active.get() + 1);
                        glommio::spawn_local(async move {
                            let reply = e.apply_local(op).await;
                            e.reply_to(peer, rid, reply).await;
                            e.active.set(e.active.get() - 1);
                        })
                        .detach();
                        continue;
                    }
                    // In flight until its reply is sent: a reply to a full channel waits for a
                    // wake through glommio's reactor, which a doorbell sleep would not see.
                    e.active.set(e.active.get() + 1);
                    let reply = e.apply_local(op).await;
                    let sent = e.reply_to(peer, rid, reply).await;
                    e.active.set(e.active.get() - 1);
                    if !sent {
                        break;
                    }
                }
            })
            .detach();
        }
    }
    if let Some(mut rx) = rep_rx {
        for (_peer, stream) in rx.streams() {
            let e = Rc::clone(exec);
            glommio::spawn_local(async move {
                while let Some((rid, reply)) = stream.recv().await {
                    e.shared.doorbells.mesh_received(e.id);
                    if let Some(tx) = e.pending.borrow_mut().remove(&rid) {
                        let _ = tx.try_send(reply);
                    }
                }
            })
            .detach();
        }
    }
}

/// Opens the shard's SSD file (recovering its records) and attaches it to the shard.
fn open_ssd(exec: &Exec, cfg: &SsdConfig) -> Result<(), ShardStartError> {
    let id = exec.id;
    let (store, report) =
        SsdStore::open(cfg).map_err(|source| ShardStartError::Ssd { shard: id, source })?;
    if let Some(why) = &report.rebuilt {
        tracing::warn!(shard = id, path = %store.path().display(), reason = %why, "SSD file started afresh");
    }
    tracing::info!(
        shard = id,
        path = %store.path().display(),
        kept = report.recovery.kept,
        superseded = report.recovery.superseded,
        dropped = report.recovery.dropped,
        deleted = report.recovery.deleted,
        reclaimed_regions = report.recovery.reclaimed,
        recovery_ms = report.elapsed.as_millis() as u64,
        "SSD tier recovered"
    );
    exec.core.borrow_mut().attach_ssd(store);
    Ok(())
}

/// The shard's loop until it is told to stop: control messages, sessions' requests, GPU
/// completions, SSD completions and upkeep; when idle, spin, nap or sleep on the doorbell.
async fn serve(exec: &Rc<Exec>, control: &Receiver<ControlMsg>, spin_window: Duration) {
    let (id, shards) = (exec.id, exec.shards);
    let idle_poll_max = exec.shared.settings.idle_poll_max;
    let mut last_work = Instant::now();
    // Where the loop is, for `ctl stats` when the shard stops answering.
    let mut iteration = 0u64;
    let doorbells = Arc::clone(&exec.shared.doorbells);
    let beat = |iteration: u64, stage: LoopStage| doorbells.beat(id, iteration, stage);
    glommio::spawn_local(NudgeTarget { doorbells: Arc::clone(&doorbells), shard: id }).detach();
    loop {
        iteration += 1;
        beat(iteration, LoopStage::Working);
        let mut work = 0usize;
        let mut stop = false;
        while let Ok(msg) = control.try_recv() {
            work += 1;
            if !exec.handle_control(msg) {
                stop = true;
            }
        }
        if stop {
            break;
        }
        work += exec.poll_sessions();
        work += exec.poll_gpu();
        if !exec.gpu_waiters.borrow().is_empty() {
            // A copy is running: keep spinning so that its completion is taken at once.
            last_work = Instant::now();
        }
        {
            let mut core = exec.core.borrow_mut();
            work += core.poll_ssd();
            work += core.maintain();
        }
        if work > 0 {
            last_work = Instant::now();
            beat(iteration, LoopStage::YieldAfterWork);
            if shards > 1 {
                // Through the reactor: a plain yield keeps running this executor's tasks and
                // polls the reactor only when glommio's preemption timer fires (100 ms), so
                // mesh messages would wait behind a busy shard.
                glommio::timer::sleep(Duration::from_micros(1)).await;
            } else {
                glommio::executor().yield_now().await;
            }
            continue;
        }
        let idle = last_work.elapsed();
        if idle < spin_window {
            beat(iteration, LoopStage::YieldSpinning);
            if shards > 1 {
                // Spin through glommio's reactor: requests and replies from other shards are
                // only seen when it is polled, which a plain yield does not do.
                glommio::timer::sleep(Duration::from_micros(1)).await;
            } else {
                glommio::executor().yield_now().await;
            }
        } else if exec.active.get() == 0 && exec.core.borrow().ssd_inflight() == 0 {
            let e = &exec;
            e.deep_sleeps.set(e.deep_sleeps.get() + 1);
            beat(iteration, LoopStage::Sleeping);
            if e.shared.doorbells.sleep(id, DEEP_SLEEP, || e.has_work(control)) {
                e.doorbell_wakeups.set(e.doorbell_wakeups.get() + 1);
                last_work = Instant::now();
            }
            beat(iteration, LoopStage::YieldAfterSleep);
            // Go through glommio's reactor (a plain yield may not poll it): mesh messages that
            // arrived while this thread was blocked are only seen there.
            glommio::timer::sleep(Duration::from_micros(1)).await;
        } else {
            let nap = (idle / 4).clamp(Duration::from_micros(20), idle_poll_max);
            beat(iteration, LoopStage::Napping);
            exec.naps.set(exec.naps.get() + 1);
            // A control message ends the nap (its sender rings the doorbell): a lookup waiting
            // for a peer read takes the chunks as they land, a grant is answered at once.
            let woken = doorbells.nap(id, || !control.is_empty());
            futures_lite::future::or(glommio::timer::sleep(nap), woken).await;
        }
    }
    beat(iteration, LoopStage::Stopped);
    doorbells.disarm_nudge(id);
}

/// A task that never ends: each poll leaves its waker where the watchdog thread finds it
/// (see [`crate::doorbell::watch`]). Waking it from that thread is what gets a stalled
/// executor out of its park.
struct NudgeTarget {
    doorbells: Arc<Doorbells>,
    shard: usize,
}

impl Future for NudgeTarget {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.doorbells.arm_nudge(self.shard, cx.waker());
        Poll::Pending
    }
}

impl Exec {
    /// Handles one control message; false means stop. One arm per message kind (the whole
    /// control protocol of a shard in one place), so it runs past the usual length.
    fn handle_control(self: &Rc<Self>, msg: ControlMsg) -> bool {
        match msg {
            ControlMsg::OpenSession { session, service, reply } => {
                let max_inflight = self.shared.settings.config.max_inflight_per_session;
                let result =
                    ipc::create_session_service(&self.node, &service, max_inflight).map(|port| {
                        self.sessions.borrow_mut().insert(
                            session,
                            Rc::new(SessionState {
                                port: RefCell::new(Some(port)),
                                leases: Cell::new(0),
                                reservations: Cell::new(0),
                                inflight: Cell::new(0),
                                namespaces: RefCell::new(Default::default()),
                            }),
                        );
                    });
                let _ = reply.send(result);
            }
            ControlMsg::CloseSession { session } => {
                let state = self.sessions.borrow().get(&session).cloned();
                if state.is_none() {
                    // Never opened here: nothing to reclaim, only the listing to end.
                    self.shared
                        .sessions
                        .lock()
                        .expect("session table lock is never poisoned")
                        .remove(&session);
                }
                if let Some(state) = state {
                    // Stop new requests now; reclaim once in-flight requests of the session
                    // are finished, so no op of it can reach a shard after the reclaim.
                    state.port.borrow_mut().take();
                    let orphaned = state.inflight.get() as u64;
                    self.orphaned_requests.set(self.orphaned_requests.get() + orphaned);
                    let e = Rc::clone(self);
                    e.active.set(e.active.get() + 1);
                    glommio::spawn_local(async move {
                        while state.inflight.get() > 0 {
                            glommio::timer::sleep(Duration::from_micros(100)).await;
                        }
                        let (leases, reservations) = e.close_everywhere(session).await;
                        if let Some(gpu) = e.shared.gpu_service.get() {
                            let n = gpu.drop_session(session);
                            if n > 0 {
                                tracing::info!(
                                    session,
                                    registrations = n,
                                    "GPU registrations of a closed session dropped"
                                );
                            }
                        }
                        e.sessions.borrow_mut().remove(&session);
                        e.shared
                            .sessions
                            .lock()
                            .expect("session table lock is never poisoned")
                            .remove(&session);
                        // Never here: iceoryx2's cleanup can block (ipc::Janitor).
                        e.shared.ipc_janitor.request();
                        tracing::info!(
                            session,
                            leases,
                            reservations,
                            orphaned,
                            "session closed and reclaimed"
                        );
                        e.active.set(e.active.get() - 1);
                    })
                    .detach();
                }
            }
            ControlMsg::Audit { reply } => {
                let _ = reply.send(self.core.borrow().audit());
            }
            ControlMsg::Stats { reply } => {
                let stats = self.core.borrow().stats();
                let _ = reply.send(ShardSnapshot {
                    stats,
                    core: self.cpu,
                    sessions: self.sessions.borrow().len() as u64,
                    dropped_replies: self.dropped_replies.get(),
                    orphaned_requests: self.orphaned_requests.get(),
                    rejected_requests: self.rejected.get(),
                    deep_sleeps: self.deep_sleeps.get(),
                    doorbell_wakeups: self.doorbell_wakeups.get(),
                    naps: self.naps.get(),
                });
            }
            ControlMsg::Evict { namespace, reply } => {
                let (exec, id) = (Rc::clone(self), self.id);
                // Answered once the deletion is on SSD; the loop goes on meanwhile.
                glommio::spawn_local(async move {
                    let summary = exec.evict_namespace(namespace).await;
                    tracing::info!(
                        shard = id,
                        namespace = ?namespace,
                        removed = summary.removed,
                        busy = summary.busy,
                        not_durable = summary.not_durable,
                        "evicted on request"
                    );
                    let _ = reply.send(summary);
                })
                .detach();
            }
            ControlMsg::Peer(msg) => {
                let fetched = msg.apply(&mut self.core.borrow_mut());
                if let Some(key) = fetched {
                    self.peer_fetched(&key);
                }
            }
            ControlMsg::Stop => return false,
        }
        true
    }

    /// True when something is queued for this shard (checked after its doorbell word is set).
    fn has_work(&self, control: &Receiver<ControlMsg>) -> bool {
        !control.is_empty()
            || self.shared.doorbells.mesh_pending(self.id) > 0
            || self.shared.gpu_service.get().is_some_and(|g| g.has_completions(self.id))
            || self.sessions.borrow().values().any(|s| {
                s.port
                    .borrow()
                    .as_ref()
                    .is_some_and(|(_, server)| server.has_requests().unwrap_or(true))
            })
    }

    /// Receives and dispatches requests of every session homed here; returns how many.
    fn poll_sessions(self: &Rc<Self>) -> usize {
        let sessions: Vec<(SessionId, Rc<SessionState>)> =
            self.sessions.borrow().iter().map(|(k, v)| (*k, Rc::clone(v))).collect();
        let max_inflight = self.shared.settings.config.max_inflight_per_session;
        let mut n = 0;
        for (id, state) in sessions {
            for _ in 0..REQUESTS_PER_ROUND {
                let received = match state.port.borrow().as_ref() {
                    Some((_, server)) => {
                        ipc::receive_within(server, state.inflight.get(), max_inflight)
                    }
                    None => break,
                };
                match received {
                    Ok(Some(req)) => {
                        n += 1;
                        state.inflight.set(state.inflight.get() + 1);
                        self.dispatch(id, &state, req);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(session = id, error = ?e, "receive failed; closing session port");
                        state.port.borrow_mut().take();
                        break;
                    }
                }
            }
        }
        n
    }

    /// Sends a reply to `peer` over the reply mesh; false when the mesh is gone.
    async fn reply_to(&self, peer: usize, rid: u64, reply: ShardReply) -> bool {
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
    async fn evict(&self, keys: &[ChunkKey]) -> Vec<ChunkOutcome> {
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
    async fn evict_namespace(&self, namespace: Option<u64>) -> EvictSummary {
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
    async fn wait_tombstones(&self, started: Vec<StartedTombstone>) -> Vec<StartedTombstone> {
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
    async fn wait_moving_in(&self, keys: impl Iterator<Item = ChunkKey>) {
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
    fn peer_fetched(&self, key: &ChunkKey) {
        if let Some(waiters) = self.peer_waiters.borrow_mut().remove(key) {
            for tx in waiters {
                let _ = tx.try_send(());
            }
        }
    }

    /// Hands the peer reads a lookup started to the peer thread; a read that cannot be queued
    /// (no peering, or its queue full) ends at once as a miss.
    fn hand_peer_fetches(&self) {
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
    fn hashes_long(&self, op: &ShardOp) -> bool {
        matches!(op, ShardOp::Commit { .. } | ShardOp::CommitSummed { .. })
            && self.core.borrow().hash_ranges(op).iter().map(|r| r.len).sum::<u64>() >= HASH_PIECE
    }

    /// The checksums of `ranges` of this shard's arena, hashed [`HASH_PIECE`] bytes at a time
    /// with this shard's other work between the pieces: ops from other shards included, which
    /// arrive through glommio's reactor. In one go, an 8 MiB chunk (a commit's check of a GPU
    /// save's checksum) held the shard for about a millisecond, and a save's next
    /// reservations, which need every shard, waited behind it while the GPU ran out of jobs.
    async fn hash_in_pieces(&self, ranges: &[HashRange]) -> Vec<(HashRange, u64)> {
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

    /// Hands finished GPU copies to the requests waiting for them; returns how many.
    fn poll_gpu(&self) -> usize {
        let Some(gpu) = self.shared.gpu_service.get() else { return 0 };
        let mut n = 0;
        while let Some(done) = gpu.completion(self.id) {
            n += 1;
            match self.gpu_waiters.borrow_mut().remove(&done.id) {
                Some(tx) => {
                    let _ = tx.try_send(done.result);
                }
                None => tracing::error!(
                    shard = self.id,
                    id = done.id,
                    "GPU completion without a waiter"
                ),
            }
        }
        n
    }

    /// Broadcasts `SessionClosed` to every shard and sums what they reclaimed.
    async fn close_everywhere(&self, session: SessionId) -> (u64, u64) {
        let mut total = (0, 0);
        for shard in 0..self.shards {
            if let ShardReply::Closed { leases, reservations } =
                self.exec_on(shard, ShardOp::SessionClosed { session }).await
            {
                total.0 += leases;
                total.1 += reservations;
            }
        }
        total
    }

    /// Sends a response for `req`, counting it as dropped when the client is gone.
    pub(crate) fn respond(&self, req: crate::ipc::ActiveRequest, bytes: &[u8]) {
        let sent = req
            .loan_slice_uninit(bytes.len())
            .map_err(|e| format!("{e:?}"))
            .and_then(|r| r.write_from_slice(bytes).send().map_err(|e| format!("{e:?}")));
        if let Err(e) = sent {
            self.dropped_replies.set(self.dropped_replies.get() + 1);
            tracing::debug!(shard = self.id, error = %e, "response not delivered");
        }
    }

    fn dispatch(
        self: &Rc<Self>,
        session: SessionId,
        state: &Rc<SessionState>,
        req: crate::ipc::ActiveRequest,
    ) {
        crate::router::dispatch(self, session, SessionCounters(Rc::clone(state)), req);
    }
}

/// Lease and reservation counters of one session (for the per-session bounds) plus its
/// in-flight request count.
pub(crate) struct SessionCounters(Rc<SessionState>);

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
