//! State shared by the control threads (bootstrap, admin, signals) and read by shards.
//! Nothing here is touched on the data path except the `state` atomic.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{bounded, Sender};
use orbitkv_shards::{Audit, EvictSummary, SessionId};

use crate::config::Settings;
use crate::shard::doorbell::Doorbells;
use crate::shard::ipc::IpcNames;
use crate::shard::messages::{ControlMsg, ShardSnapshot};

/// Serving state of the whole server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ServeState {
    /// Admitting sessions and writes.
    Serving = 0,
    /// Refusing new sessions and writes; reads and commits of open reservations continue.
    Draining = 1,
}

/// What `ctl sessions` shows of one session.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    /// Session id.
    pub id: SessionId,
    /// Peer pid (SO_PEERCRED).
    pub pid: i32,
    /// Peer uid.
    pub uid: u32,
    /// Client-provided name.
    pub name: String,
    /// Home shard.
    pub home_shard: usize,
    /// When it opened.
    pub opened: SystemTime,
    /// Its socket has closed; it is listed until the server has reclaimed what it held
    /// (after its requests in flight, GPU copies included, have finished).
    pub closing: bool,
}

/// The shared control-plane state.
#[derive(Debug)]
pub struct Shared {
    /// Validated settings.
    pub settings: Settings,
    state: AtomicU8,
    /// Writes (reserves, GPU saves) admitted and not yet answered: a drain is done only once
    /// none is left, since an admitted one may not have reached its shards yet.
    writes_admitted: AtomicU64,
    /// Control queue of each shard (send with [`Shared::send_control`], which rings).
    shard_tx: Vec<Sender<ControlMsg>>,
    /// Shard doorbells.
    pub doorbells: Arc<Doorbells>,
    /// GPU save/load, when a GPU is in use (set once at start).
    pub gpu_service: OnceLock<Arc<crate::gpu::GpuService>>,
    /// Who may open sessions and run admin commands.
    pub access: crate::control::access::Access,
    /// The uid that owns each namespace registered in this run (shared models aside).
    pub namespace_owners: crate::control::access::NamespaceOwners,
    /// Cluster membership, in cluster mode (`--etcd`).
    pub cluster: OnceLock<Arc<orbitkv_peer::Cluster>>,
    /// Where shards queue their peer reads, once peering runs.
    pub peer_fetches: OnceLock<orbitkv_peer::FetchQueue>,
    /// What `--gpu` found (None with `--gpu off`).
    pub gpu: Option<orbitkv_gpu::Probe>,
    /// Open sessions.
    pub sessions: Mutex<BTreeMap<SessionId, SessionInfo>>,
    next_session: AtomicU64,
    /// Sessions refused (permission, version, draining, limits).
    pub refused_sessions: AtomicU64,
    /// Process start.
    pub started: Instant,
    /// Whether the arena is locked in memory.
    pub arena_locked: bool,
    /// How the arena was populated: seconds (wall clock) and each shard's slice.
    pub arena_populate_seconds: f64,
    /// Each shard's slice as it was populated (core, NUMA node, seconds).
    pub arena_parts: Vec<orbitkv_shards::Populated>,
    /// Seconds each shard's slice took to register with CUDA (its own thread, on its core);
    /// empty without a GPU in use.
    pub arena_register_seconds: Vec<f64>,
    /// The pages backing the arena.
    pub arena_pages: orbitkv_shards::PageSize,
    /// The memfds the arena is made of.
    pub arena_memfds: usize,
    /// iceoryx2 root path and shm prefix given to clients.
    pub ipc: IpcNames,
    /// Prefix of session service names (unique per server run).
    pub service_prefix: String,
    /// Cleans up after dead clients off the shards' threads.
    pub ipc_janitor: crate::shard::ipc::Janitor,
}

/// What the start made, for `Shared::new`: the arena and the record of the steps.
pub struct StartState {
    /// Locked in memory.
    pub locked: bool,
    /// Seconds populating took (wall clock, every slice at once).
    pub populate_seconds: f64,
    /// Each shard's slice as it was populated.
    pub parts: Vec<orbitkv_shards::Populated>,
    /// Seconds each slice took to register with CUDA (empty without a GPU).
    pub register_seconds: Vec<f64>,
    /// The pages backing it.
    pub pages: orbitkv_shards::PageSize,
    /// The memfds it is made of.
    pub memfds: usize,
}

impl Shared {
    /// Builds the shared state; starts the iceoryx2 janitor thread (the error is its start's).
    pub fn new(
        settings: Settings,
        shard_tx: Vec<Sender<ControlMsg>>,
        doorbells: Arc<Doorbells>,
        gpu: Option<orbitkv_gpu::Probe>,
        arena: StartState,
        ipc: IpcNames,
        service_prefix: String,
    ) -> std::io::Result<Arc<Self>> {
        let ipc_janitor = crate::shard::ipc::Janitor::spawn(ipc.clone())?;
        Ok(Arc::new(Self {
            access: crate::control::access::Access::new(
                &settings.config,
                nix::unistd::getuid().as_raw(),
            ),
            namespace_owners: crate::control::access::NamespaceOwners::new(
                settings.config.shared_model.clone(),
            ),
            settings,
            state: AtomicU8::new(ServeState::Serving as u8),
            writes_admitted: AtomicU64::new(0),
            shard_tx,
            doorbells,
            gpu_service: OnceLock::new(),
            cluster: OnceLock::new(),
            peer_fetches: OnceLock::new(),
            gpu,
            sessions: Mutex::new(BTreeMap::new()),
            next_session: AtomicU64::new(1),
            refused_sessions: AtomicU64::new(0),
            started: Instant::now(),
            arena_locked: arena.locked,
            arena_populate_seconds: arena.populate_seconds,
            arena_parts: arena.parts,
            arena_register_seconds: arena.register_seconds,
            arena_pages: arena.pages,
            arena_memfds: arena.memfds,
            ipc,
            service_prefix,
            ipc_janitor,
        }))
    }

    /// Current state.
    pub fn state(&self) -> ServeState {
        // SeqCst, as the admitted writes' count: a write counted before it saw `Serving` is
        // seen by any drain that set `Draining` after (see `admit_write`).
        if self.state.load(Ordering::SeqCst) == ServeState::Draining as u8 {
            ServeState::Draining
        } else {
            ServeState::Serving
        }
    }

    /// Switches state.
    pub fn set_state(&self, s: ServeState) {
        self.state.store(s as u8, Ordering::SeqCst);
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.shard_tx.len()
    }

    /// As [`Shared::send_control`] without waiting: false (and the message dropped) when the
    /// queue is full.
    pub fn try_send_control(&self, shard: usize, msg: ControlMsg) -> bool {
        self.try_send_control_back(shard, msg).is_ok()
    }

    /// As [`Shared::try_send_control`], giving the message back when the queue is full or the
    /// shard is gone.
    pub fn try_send_control_back(&self, shard: usize, msg: ControlMsg) -> Result<(), ControlMsg> {
        match self.shard_tx[shard].try_send(msg) {
            Ok(()) => {
                self.doorbells.ring(shard);
                Ok(())
            }
            Err(e) => Err(e.into_inner()),
        }
    }

    /// Queues a control message for `shard` and wakes it; false if the queue stayed full for
    /// `timeout` or the shard is gone.
    pub fn send_control(&self, shard: usize, msg: ControlMsg, timeout: Duration) -> bool {
        let sent = self.shard_tx[shard].send_timeout(msg, timeout).is_ok();
        self.doorbells.ring(shard);
        sent
    }

    /// A fresh session id.
    pub fn next_session_id(&self) -> SessionId {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The shard with the fewest sessions (lowest id on ties).
    pub fn pick_home_shard(&self) -> usize {
        let sessions = self.sessions.lock().expect("session table lock is never poisoned");
        let mut counts = vec![0usize; self.shards()];
        for s in sessions.values() {
            counts[s.home_shard] += 1;
        }
        counts.iter().enumerate().min_by_key(|&(i, c)| (*c, i)).map_or(0, |(i, _)| i)
    }

    /// Snapshots of every shard (in shard order), or `None` for a shard that did not answer
    /// within `timeout`.
    pub fn snapshots(&self, timeout: Duration) -> Vec<Option<ShardSnapshot>> {
        self.ask_all(|reply| ControlMsg::Stats { reply }, timeout)
    }

    /// Every shard's audit, in shard order (`None` for a shard that did not answer within
    /// `timeout`).
    pub fn audits(&self, timeout: Duration) -> Vec<Option<Audit>> {
        self.ask_all(|reply| ControlMsg::Audit { reply }, timeout)
    }

    /// Removes the chunks of `namespace` (of every namespace with None) on every shard: each
    /// shard's summary in shard order, or `None` for a shard that did not answer within
    /// `timeout` (it may still do the work).
    pub fn evict(&self, namespace: Option<u64>, timeout: Duration) -> Vec<Option<EvictSummary>> {
        self.ask_all(|reply| ControlMsg::Evict { namespace, reply }, timeout)
    }

    /// Sends every shard the message `make` builds around a reply channel and gathers the
    /// answers in shard order (`None` where none came within `timeout`).
    fn ask_all<T>(
        &self,
        make: impl Fn(Sender<T>) -> ControlMsg,
        timeout: Duration,
    ) -> Vec<Option<T>> {
        let replies: Vec<_> = (0..self.shards())
            .map(|shard| {
                let (reply, rx) = bounded(1);
                let sent = self.send_control(shard, make(reply), timeout);
                (sent, rx)
            })
            .collect();
        let deadline = Instant::now() + timeout;
        replies
            .into_iter()
            .map(|(sent, rx)| {
                if !sent {
                    return None;
                }
                rx.recv_deadline(deadline).ok()
            })
            .collect()
    }

    /// Counts a write (a reserve or a GPU save) as admitted, before its check of the state:
    /// it is counted until the guard drops, when the request has been answered.
    pub fn admit_write(self: &Arc<Self>) -> AdmittedWrite {
        self.writes_admitted.fetch_add(1, Ordering::SeqCst);
        AdmittedWrite(Arc::clone(self))
    }

    /// True when no admitted write is left to answer and no shard holds an uncommitted
    /// reservation (`snaps`, taken after this count is read, as `drained` does).
    pub fn writes_settled(&self, snaps: &[Option<ShardSnapshot>]) -> bool {
        snaps.iter().all(|s| s.as_ref().is_some_and(|s| s.stats.reservations == 0))
    }

    /// True when draining, no admitted write is left, and no shard holds an uncommitted
    /// reservation.
    pub fn drained(&self, timeout: Duration) -> bool {
        self.state() == ServeState::Draining
            && self.writes_admitted.load(Ordering::SeqCst) == 0
            && self.writes_settled(&self.snapshots(timeout))
    }

    /// Admitted writes not yet answered.
    pub fn writes_admitted(&self) -> u64 {
        self.writes_admitted.load(Ordering::SeqCst)
    }
}

/// A write counted by [`Shared::admit_write`]; uncounted when dropped.
pub struct AdmittedWrite(Arc<Shared>);

impl Drop for AdmittedWrite {
    fn drop(&mut self) {
        self.0.writes_admitted.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drain is not done while a write admitted before it is unanswered, even with no
    /// reservation on any shard yet (the write may not have reached them).
    #[test]
    fn a_drain_waits_for_admitted_writes() {
        let settings = crate::config::ServerConfig::default().validate().expect("defaults");
        let arena = Arc::new(orbitkv_shards::Arena::create(1 << 20, false).expect("arena"));
        let doorbells = Arc::new(Doorbells::new(arena, 0).expect("doorbells"));
        let ipc = IpcNames { root: "/tmp/orbitkv-test-root".into(), prefix: "t".into() };
        let shared = Shared::new(
            settings,
            Vec::new(),
            doorbells,
            None,
            StartState {
                locked: false,
                populate_seconds: 0.0,
                parts: Vec::new(),
                register_seconds: Vec::new(),
                pages: orbitkv_shards::PageSize::Small,
                memfds: 1,
            },
            ipc,
            "t".into(),
        )
        .expect("janitor thread");
        let write = shared.admit_write();
        shared.set_state(ServeState::Draining);
        assert_eq!(shared.writes_admitted(), 1);
        assert!(!shared.drained(Duration::from_millis(10)));
        drop(write);
        assert_eq!(shared.writes_admitted(), 0);
        assert!(shared.drained(Duration::from_millis(10)));
    }
}
