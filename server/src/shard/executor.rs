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
use glommio::{LocalExecutorBuilder, Placement};
use iceoryx2::prelude::*;
use orbitkv_shards::{SessionId, ShardCore, ShardOp, ShardReply};
use orbitkv_ssd::store::{SsdConfig, SsdStore};

use crate::control::shared::Shared;
use crate::error::ShardStartError;
use crate::shard::context::{Exec, MeshReply, MeshRequest, SessionCounters, SessionState};
use crate::shard::doorbell::{Doorbells, LoopStage};
use crate::shard::ipc::{self, IpcNames, IpcService};
use crate::shard::messages::{ControlMsg, ShardSnapshot};

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
/// (see [`crate::shard::doorbell::watch`]). Waking it from that thread is what gets a stalled
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

    fn dispatch(
        self: &Rc<Self>,
        session: SessionId,
        state: &Rc<SessionState>,
        req: crate::shard::ipc::ActiveRequest,
    ) {
        crate::requests::router::dispatch(self, session, SessionCounters(Rc::clone(state)), req);
    }
}
