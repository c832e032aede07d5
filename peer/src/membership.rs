//! Membership: each Manager of a cluster holds a member key in etcd under a lease it keeps
//! alive, and a persistent epoch per node id, incremented at every start by compare-and-swap.
//!
//! Keys, under `/orbitkv/<cluster>/`:
//! - `members/<node id>`: the member's [`Member`] as JSON, attached to its lease (it goes when
//!   the member stops keeping the lease alive: at most the lease TTL after it died);
//! - `epochs/<node id>`: the node's last epoch, decimal; never deleted.
//!
//! A node id is held by one live process: a member key is only created where none exists, so a
//! second process with the same id is refused until the first's key is gone.
//!
//! etcd unreachable: the server keeps serving locally; the cluster is reported unavailable
//! and the thread keeps trying, rejoining (same epoch) when etcd is back.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::etcd::{self, Etcd, EtcdError};

pub use orbitkv_config::ClusterConfig;

/// One member of the cluster, as its key in etcd says (the admin socket's `peers` lists the
/// same type).
pub use orbitkv_proto::admin::ClusterMember as Member;

/// Where membership stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Not yet joined (the first attempt runs).
    Joining,
    /// The member key is held and kept alive.
    Joined,
    /// etcd cannot be reached, or the key was lost; retrying.
    Unavailable(String),
    /// Another live process holds this node id; retrying until its key is gone.
    Conflict(String),
}

/// What the server reads about the cluster.
#[derive(Clone, Debug)]
pub struct Status {
    pub cluster: String,
    pub node_id: String,
    pub state: State,
    /// This process's epoch, once obtained.
    pub epoch: Option<u64>,
    /// The members as last read (this one included), by node id.
    pub members: Vec<Member>,
    /// When `state` last changed.
    pub since: Instant,
}

/// Why joining failed at start.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The peer address could not be bound.
    #[error("--peer-addr {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The Transfer Engine could not be started.
    #[error("{0}")]
    TransferEngine(String),
    /// Another live process holds the node id.
    #[error("--node-id {node_id}: held by a live member ({holder}); stop it or pick another id")]
    Conflict {
        /// The id.
        node_id: String,
        /// Who holds it.
        holder: String,
    },
    /// An argument etcd or its client refused.
    #[error("--etcd: {0}")]
    Invalid(String),
    /// The thread could not be started.
    #[error("starting the orbitkv-peer thread: {0}")]
    Thread(std::io::Error),
}

/// The handle the server keeps: the thread's view of the cluster, and its runtime.
#[derive(Debug)]
pub struct Cluster {
    pub(crate) cfg: ClusterConfig,
    status: Mutex<Status>,
    stop: tokio::sync::Notify,
    /// The `orbitkv-peer` thread's runtime (current-thread: tasks spawned here run there).
    pub(crate) runtime: tokio::runtime::Handle,
    /// The peer RPC's listener, bound at start, served once peering starts.
    pub(crate) listener: Mutex<Option<std::net::TcpListener>>,
    /// This node's Transfer Engine (builds with a TE route).
    pub(crate) te: Option<crate::Engine>,
    /// What peering knows of each peer, for `ctl peers` (empty until peering starts).
    pub(crate) peers: Mutex<std::collections::BTreeMap<String, crate::PeerView>>,
}

/// Restricts the calling thread to `cpus` (none: left as it is); a refusal is a warning.
fn pin_to(cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    let mut set = nix::sched::CpuSet::new();
    for &c in cpus {
        if set.set(c).is_err() {
            tracing::warn!(cpu = c, "peer threads: core out of range; left unpinned");
            return;
        }
    }
    if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
        tracing::warn!(error = %e, ?cpus, "peer threads: could not be pinned; they run anywhere");
    }
}

/// Runs `f` on a new thread restricted to `cpus`, and waits for it.
fn on_cores<T: Send + 'static>(
    cpus: &[usize],
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    let cpus = cpus.to_vec();
    std::thread::Builder::new()
        .name("orbitkv-peer-start".into())
        .spawn(move || {
            pin_to(&cpus);
            f()
        })?
        .join()
        .map_err(|_| std::io::Error::other("starting the Transfer Engine panicked"))
}

impl Cluster {
    /// Starts the `orbitkv-peer` thread and waits up to `first` for its first attempt: an
    /// error if the node id is held by another live member (or the endpoints are invalid);
    /// otherwise the handle, joined or retrying in the background (etcd unreachable).
    pub fn start(cfg: ClusterConfig, first: Duration) -> Result<Arc<Cluster>, JoinError> {
        let listener = std::net::TcpListener::bind(cfg.peer_addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| JoinError::Bind { addr: cfg.peer_addr, source })?;
        // Made on a thread on the peer cores: the engine's own threads inherit them.
        let (host, library, transport) =
            (cfg.peer_addr.ip().to_string(), cfg.te_library.clone(), cfg.te_transport);
        let te =
            on_cores(&cfg.cpus, move || crate::Engine::start(&host, library.as_deref(), transport))
                .map_err(JoinError::Thread)?
                .map_err(JoinError::TransferEngine)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(JoinError::Thread)?;
        let cluster = Arc::new(Cluster {
            cfg: cfg.clone(),
            status: Mutex::new(Status {
                cluster: cfg.cluster.clone(),
                node_id: cfg.node_id.clone(),
                state: State::Joining,
                epoch: None,
                members: Vec::new(),
                since: Instant::now(),
            }),
            stop: tokio::sync::Notify::new(),
            runtime: runtime.handle().clone(),
            listener: Mutex::new(Some(listener)),
            te,
            peers: Mutex::new(Default::default()),
        });
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(), JoinError>>(1);
        let c = Arc::clone(&cluster);
        let cpus = cfg.cpus.clone();
        std::thread::Builder::new()
            .name("orbitkv-peer".into())
            .spawn(move || {
                // Its blocking pool's threads are started from here and inherit the cores.
                pin_to(&cpus);
                runtime.block_on(run(&c, tx))
            })
            .map_err(JoinError::Thread)?;
        match rx.recv_timeout(first) {
            Ok(Err(e)) => Err(e),
            // Joined, or still trying (etcd slow or away): the server serves locally meanwhile.
            Ok(Ok(())) | Err(_) => Ok(cluster),
        }
    }

    /// What the thread knows now.
    pub fn status(&self) -> Status {
        self.status.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// This process's epoch, once joined.
    pub fn epoch(&self) -> Option<u64> {
        self.status.lock().unwrap_or_else(|e| e.into_inner()).epoch
    }

    /// This node's Transfer Engine segment (empty in builds without a TE route).
    pub fn te_segment(&self) -> String {
        self.te.as_ref().map_or_else(String::new, |t| t.segment().to_owned())
    }

    /// Leaves the cluster (revokes the lease, so the member key goes at once) and stops the
    /// thread; returns when done or after `timeout`.
    pub fn leave(&self, timeout: Duration) {
        self.stop.notify_one();
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline && self.status().state != State::Unavailable("left".into())
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn set(&self, f: impl FnOnce(&mut Status)) {
        let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let before = s.state.clone();
        f(&mut s);
        if s.state != before {
            s.since = Instant::now();
            match &s.state {
                State::Joined => tracing::info!(epoch = ?s.epoch, "cluster: joined"),
                State::Unavailable(why) => tracing::warn!(%why, "cluster: unavailable"),
                State::Conflict(why) => tracing::error!(%why, "cluster: node id held elsewhere"),
                State::Joining => {}
            }
        }
    }
}

fn member_key(cfg: &ClusterConfig) -> String {
    format!("{}members/{}", cfg.key_prefix(), cfg.node_id)
}

fn epoch_key(cfg: &ClusterConfig) -> String {
    format!("{}epochs/{}", cfg.key_prefix(), cfg.node_id)
}

/// How long one etcd call may take before the cluster counts as unavailable.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The thread's loop: join, then keep the lease alive and read the members every third of
/// the TTL; on any failure report unavailable and start again after a pause.
async fn run(cluster: &Cluster, first: std::sync::mpsc::SyncSender<Result<(), JoinError>>) {
    let cfg = cluster.cfg.clone();
    let mut first = Some(first);
    let mut epoch: Option<u64> = None;
    let started_unix_s = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let tick = (cfg.lease_ttl / 3).max(Duration::from_millis(200));
    loop {
        let outcome = tokio::select! {
            o = session(&cfg, cluster, &mut epoch, started_unix_s, tick, &mut first) => o,
            () = cluster.stop.notified() => Outcome::Stop,
        };
        match outcome {
            Outcome::Stop => break,
            Outcome::Fatal(e) => {
                if let Some(tx) = first.take() {
                    let _ = tx.send(Err(e));
                    return;
                }
                tracing::error!(error = %e, "cluster: giving up");
                return;
            }
            Outcome::Retry(state) => {
                cluster.set(|s| s.state = state.clone());
                if let (Some(tx), State::Conflict(holder)) = (first.take(), &state) {
                    let _ = tx.send(Err(JoinError::Conflict {
                        node_id: cfg.node_id.clone(),
                        holder: holder.clone(),
                    }));
                    return;
                }
                // etcd away at start: the server starts; this thread keeps trying.
                if let Some(tx) = first.take() {
                    let _ = tx.send(Ok(()));
                }
                tokio::select! {
                    () = tokio::time::sleep(tick) => {}
                    () = cluster.stop.notified() => break,
                }
            }
        }
    }
    // Leaving: the member key goes with the lease at once (best effort).
    if let Ok(mut client) = connect(&cfg).await {
        let key = member_key(&cfg);
        let _ = tokio::time::timeout(CALL_TIMEOUT, client.delete(&key)).await;
    }
    cluster.set(|s| s.state = State::Unavailable("left".into()));
}

enum Outcome {
    Stop,
    Retry(State),
    Fatal(JoinError),
}

async fn connect(cfg: &ClusterConfig) -> Result<Etcd, EtcdError> {
    Etcd::connect(&cfg.etcd, CALL_TIMEOUT).await
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Outcome {
    Outcome::Retry(State::Unavailable(format!("etcd {what}: {e}")))
}

/// One connection's life: epoch (first time only), lease, member key, then keep-alive and
/// member reads until something fails.
async fn session(
    cfg: &ClusterConfig,
    cluster: &Cluster,
    epoch: &mut Option<u64>,
    started_unix_s: u64,
    tick: Duration,
    first: &mut Option<std::sync::mpsc::SyncSender<Result<(), JoinError>>>,
) -> Outcome {
    let mut client = match connect(cfg).await {
        Ok(c) => c,
        Err(EtcdError::InvalidEndpoint(e)) => return Outcome::Fatal(JoinError::Invalid(e)),
        Err(e) => return unavailable("connect", e),
    };
    let ttl = cfg.lease_ttl.as_secs().max(1) as i64;
    let lease = match tokio::time::timeout(CALL_TIMEOUT, client.lease_grant(ttl)).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => return unavailable("lease grant", e),
        Err(_) => return unavailable("lease grant", "timed out"),
    };
    let me = Member {
        node_id: cfg.node_id.clone(),
        peer_addr: cfg.peer_addr.to_string(),
        te_segment: cluster.te_segment(),
        shards: cfg.shards,
        epoch: epoch.unwrap_or(0),
        pid: std::process::id(),
        started_unix_s,
    };
    let claimed = match *epoch {
        // The first join: the member key and the next epoch in one transaction.
        None => first_claim(&mut client, cfg, me, lease).await,
        // A rejoin (etcd was away): the same epoch.
        Some(e) => claim(&mut client, cfg, &me, lease).await.map(|()| e),
    };
    match claimed {
        Ok(e) => {
            *epoch = Some(e);
            cluster.set(|s| s.epoch = Some(e));
        }
        Err(o) => {
            let _ = client.lease_revoke(lease).await;
            return o;
        }
    }
    cluster.set(|s| s.state = State::Joined);
    if let Some(tx) = first.take() {
        let _ = tx.send(Ok(()));
    }
    let keep_alive = tokio::time::timeout(CALL_TIMEOUT, client.lease_keep_alive(lease)).await;
    let (keeper, mut replies) = match keep_alive {
        Ok(Ok(k)) => k,
        Ok(Err(e)) => return unavailable("lease keep-alive", e),
        Err(_) => return unavailable("lease keep-alive", "timed out"),
    };
    loop {
        // The answer to the last keep-alive; a TTL of 0 means etcd let the lease expire.
        let kept = tokio::time::timeout(CALL_TIMEOUT, replies.message()).await;
        match kept {
            Ok(Ok(Some(r))) if r.ttl > 0 => {}
            Ok(Ok(_)) => return unavailable("lease", "expired (this member was away too long)"),
            Ok(Err(e)) => return unavailable("lease keep-alive", e),
            Err(_) => return unavailable("lease keep-alive", "timed out"),
        }
        match read_members(&mut client, cfg).await {
            Ok(members) => cluster.set(|s| {
                s.members = members;
                s.state = State::Joined;
            }),
            Err(o) => return o,
        }
        tokio::time::sleep(tick).await;
        if let Err(e) = keeper.keep_alive().await {
            return unavailable("lease keep-alive", e);
        }
    }
}

/// Joins for the first time: in one transaction, creates this member's key under `lease`
/// (only where none exists) and increments the node's epoch by compare-and-swap. Two
/// processes with one node id cannot both win, and the loser moves no epoch. The new epoch.
async fn first_claim(
    client: &mut Etcd,
    cfg: &ClusterConfig,
    mut me: Member,
    lease: i64,
) -> Result<u64, Outcome> {
    let (member, epoch_key) = (member_key(cfg), epoch_key(cfg));
    loop {
        let got = tokio::time::timeout(CALL_TIMEOUT, client.get(&epoch_key))
            .await
            .map_err(|_| unavailable("epoch read", "timed out"))?
            .map_err(|e| unavailable("epoch read", e))?;
        let (epoch_unchanged, next) = match got {
            None => (etcd::absent(&epoch_key), 1),
            Some(kv) => {
                let current: u64 =
                    std::str::from_utf8(&kv.value).ok().and_then(|v| v.parse().ok()).unwrap_or(0);
                (etcd::mod_revision_is(&epoch_key, kv.mod_revision), current + 1)
            }
        };
        me.epoch = next;
        let value = serde_json::to_string(&me).expect("a member serializes");
        let txn = etcd::pb::TxnRequest {
            compare: vec![etcd::absent(&member), epoch_unchanged],
            success: vec![
                etcd::put(&member, &value, lease),
                etcd::put(&epoch_key, &next.to_string(), 0),
            ],
            failure: vec![etcd::read(&member)],
        };
        let done = tokio::time::timeout(CALL_TIMEOUT, client.txn(txn))
            .await
            .map_err(|_| unavailable("join", "timed out"))?
            .map_err(|e| unavailable("join", e))?;
        if done.succeeded {
            return Ok(next);
        }
        if let Some((holder, _)) = holder_of(&done) {
            return Err(Outcome::Retry(State::Conflict(holder)));
        }
        // The epoch moved meanwhile (another start of this id raced us): read again.
    }
}

/// Who holds the member key, from a transaction's `else` read: (a description, its mod
/// revision and member), or None when the key is absent.
fn holder_of(done: &etcd::pb::TxnResponse) -> Option<(String, (i64, Option<Member>))> {
    let kv = etcd::first_read(done)?.first()?;
    let m: Option<Member> = serde_json::from_slice(&kv.value).ok();
    let who = match &m {
        Some(m) => format!("pid {} at {}, epoch {}", m.pid, m.peer_addr, m.epoch),
        None => "a member key that is not OrbitKV's".into(),
    };
    Some((who, (kv.mod_revision, m)))
}

/// Rejoins: creates this member's key under `lease`, only where no key exists; its own key
/// from before the reconnect (same pid and epoch) is taken over.
async fn claim(
    client: &mut Etcd,
    cfg: &ClusterConfig,
    me: &Member,
    lease: i64,
) -> Result<(), Outcome> {
    let key = member_key(cfg);
    let value = serde_json::to_string(me).expect("a member serializes");
    let put = etcd::put(&key, &value, lease);
    let txn = etcd::pb::TxnRequest {
        compare: vec![etcd::absent(&key)],
        success: vec![put.clone()],
        failure: vec![etcd::read(&key)],
    };
    let done = tokio::time::timeout(CALL_TIMEOUT, client.txn(txn))
        .await
        .map_err(|_| unavailable("member claim", "timed out"))?
        .map_err(|e| unavailable("member claim", e))?;
    if done.succeeded {
        return Ok(());
    }
    match holder_of(&done) {
        // Our own key from before a reconnect: move it onto the new lease.
        Some((_, (rev, Some(m)))) if m.pid == me.pid && m.epoch == me.epoch => {
            let txn = etcd::pb::TxnRequest {
                compare: vec![etcd::mod_revision_is(&key, rev)],
                success: vec![put],
                failure: Vec::new(),
            };
            match tokio::time::timeout(CALL_TIMEOUT, client.txn(txn)).await {
                Ok(Ok(r)) if r.succeeded => Ok(()),
                Ok(Ok(_)) => Err(unavailable("member claim", "the key changed meanwhile")),
                Ok(Err(e)) => Err(unavailable("member claim", e)),
                Err(_) => Err(unavailable("member claim", "timed out")),
            }
        }
        Some((holder, _)) => Err(Outcome::Retry(State::Conflict(holder))),
        // Gone between the two reads: try again.
        None => Err(unavailable("member claim", "the key changed meanwhile")),
    }
}

/// The cluster's members, by node id.
async fn read_members(client: &mut Etcd, cfg: &ClusterConfig) -> Result<Vec<Member>, Outcome> {
    let members_prefix = format!("{}members/", cfg.key_prefix());
    let got = tokio::time::timeout(CALL_TIMEOUT, client.get_prefix(&members_prefix))
        .await
        .map_err(|_| unavailable("member read", "timed out"))?
        .map_err(|e| unavailable("member read", e))?;
    let mut members: Vec<Member> = got
        .iter()
        .filter_map(|kv| match serde_json::from_slice(&kv.value) {
            Ok(m) => Some(m),
            Err(e) => {
                let key = String::from_utf8_lossy(&kv.key);
                tracing::warn!(key = %key, error = %e, "cluster: a member key that does not parse; skipped");
                None
            }
        })
        .collect();
    members.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    Ok(members)
}
