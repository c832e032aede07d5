//! The admin socket's answers: one line, a JSON object with `"ok"`. The server writes these
//! types and the clients read them, so each field is named here only; docs/operations.md says
//! what they mean. `stats` is the exception: the server assembles it from its metrics
//! (docs/operations.md's `stats --json` tables are its reference), and [`StatsReply`] reads
//! the part of it that programs act on.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The server's state, as `health`, `drain`, `resume` and `stats` name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerState {
    /// Populating its arena, registering it, starting its shards: not serving yet.
    Starting,
    /// Admitting sessions and writes.
    Serving,
    /// Refusing new sessions and writes; writes admitted before still in flight.
    Draining,
    /// Draining, and no write in flight or reserved anywhere.
    Drained,
}

impl ServerState {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Serving => "serving",
            Self::Draining => "draining",
            Self::Drained => "drained",
        }
    }
}

impl std::fmt::Display for ServerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the server refused a request, where a program may act on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    /// The caller's uid may not run the command (the message names the flags that allow it).
    PermissionDenied,
    /// The server is starting: ask again once `health` says ready.
    Starting,
}

/// An `"ok": false` answer: the request was malformed, refused, or cannot run now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Always false.
    pub ok: bool,
    /// What went wrong, in words.
    pub error: String,
    /// Why, for programs (absent for a malformed request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<RefusalCode>,
    /// While starting: how far the start got.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting: Option<StartingProgress>,
}

impl ErrorReply {
    /// An error without a code.
    pub fn new(error: impl Into<String>) -> Self {
        Self { ok: false, error: error.into(), code: None, starting: None }
    }

    /// An error with its code.
    pub fn with_code(error: impl Into<String>, code: RefusalCode) -> Self {
        Self { code: Some(code), ..Self::new(error) }
    }
}

/// How far a starting server got (`health`'s `starting`, and the `starting` refusals').
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StartingProgress {
    /// The step under way: `populate_arena`, `register_cuda`, `start_shards` (`serving` once
    /// done).
    pub phase: String,
    /// Percent of the arena populated (100 past that step).
    pub percent: u32,
    /// Arena bytes populated.
    pub populated_bytes: u64,
    /// The arena's size.
    pub arena_bytes: u64,
    /// Seconds since the process started.
    pub seconds: f64,
    /// Engine hellos told to come back later.
    pub told_to_wait: u64,
}

/// `health`: whether the server accepts engine work, and what is impaired.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HealthReply {
    /// True: the answer itself is fine (readiness is `ready`).
    pub ok: bool,
    /// Accepting engine work: serving, every shard answering.
    pub ready: bool,
    /// Serving, draining, drained, or starting.
    pub state: ServerState,
    /// Why (not) ready, in words (while starting: how far along).
    pub reason: String,
    /// Serving, but impaired: one line per problem.
    pub degraded: Vec<String>,
    /// Cluster mode: membership, reported apart from local readiness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterStatus>,
    /// While starting: how far the start got.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting: Option<StartingProgress>,
}

/// Where cluster membership stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterState {
    /// Not joined yet (the first attempt runs).
    Joining,
    /// A member.
    Joined,
    /// etcd cannot be reached, or the membership was lost; retrying.
    Unavailable,
    /// The node id is held by another process.
    Conflict,
}

impl ClusterState {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Joining => "joining",
            Self::Joined => "joined",
            Self::Unavailable => "unavailable",
            Self::Conflict => "conflict",
        }
    }
}

impl std::fmt::Display for ClusterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Cluster membership as `health` (its `cluster`) and `peers` show it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// Joined.
    pub available: bool,
    /// Joining, joined, unavailable or in conflict.
    pub state: ClusterState,
    /// Why unavailable or in conflict; empty otherwise.
    pub reason: String,
    /// Seconds since `state` last changed.
    pub since_s: f64,
    /// The cluster's name.
    pub cluster: String,
    /// This node's id.
    pub node_id: String,
    /// This process's epoch, once obtained.
    pub epoch: Option<u64>,
    /// The members as last read (this one included).
    pub members: Vec<ClusterMember>,
}

/// One member of the cluster: its member key's JSON in etcd, as the admin socket's `peers`
/// shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMember {
    /// Its node id (`--node-id`).
    pub node_id: String,
    /// Its peer RPC address.
    pub peer_addr: String,
    /// Its Transfer Engine segment.
    pub te_segment: String,
    /// Its shard count.
    pub shards: usize,
    /// Its epoch (a restart gets a new one).
    pub epoch: u64,
    /// Its process id.
    pub pid: u32,
    /// When it started, Unix seconds.
    pub started_unix_s: u64,
}

/// `peers`: membership, and what peering knows of each peer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeersReply {
    /// True.
    pub ok: bool,
    /// Where membership stands (its members on the wire beside `ok`).
    #[serde(flatten)]
    pub cluster: ClusterStatus,
    /// Whether this node reads from peers (false: membership only).
    pub peering: bool,
    /// By node id: what this node knows of each peer it has streamed from.
    pub peers: BTreeMap<String, PeerLink>,
}

/// What this node knows of one peer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerLink {
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
    /// Chunks read from the peer.
    pub chunks_read: u64,
    /// Bytes read from the peer.
    pub bytes_read: u64,
    /// Reads from the peer that failed.
    pub read_failures: u64,
    /// Groups of reads (one grant, one Transfer Engine batch each).
    pub group_reads: u64,
    /// Per group, mean microseconds its first read waited in the queue.
    pub queue_us_mean: f64,
    /// Per group, mean microseconds of the grant's round trip.
    pub grant_us_mean: f64,
    /// Per group, mean microseconds of the Transfer Engine reads.
    pub te_read_us_mean: f64,
    /// Per group, mean microseconds handing the results to the shards.
    pub handoff_us_mean: f64,
}

/// `drain` and `resume`: the state after the command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateReply {
    /// True.
    pub ok: bool,
    /// The state after the command (`drain`: draining, or drained already).
    pub state: ServerState,
}

/// `sessions`: the open sessions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionsReply {
    /// True.
    pub ok: bool,
    /// In session id order.
    pub sessions: Vec<SessionInfo>,
}

/// One open session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// The session id.
    pub id: u64,
    /// The engine process (`SO_PEERCRED`).
    pub pid: i32,
    /// The engine's uid (`SO_PEERCRED`).
    pub uid: u32,
    /// The name the client gave.
    pub name: String,
    /// The shard its requests go to first.
    pub home_shard: usize,
    /// Its socket closed; listed until what it held is reclaimed.
    pub closing: bool,
    /// When it opened, Unix seconds.
    pub opened_unix_s: u64,
}

/// One shard's part of an answer that asks every shard: its answer, or None when it did not
/// answer in time (`{"id": N, "answering": false}` on the wire).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    from = "ShardAnswerWire<T>",
    into = "ShardAnswerWire<T>",
    bound(serialize = "T: Serialize + Clone", deserialize = "T: Deserialize<'de>")
)]
pub struct ShardAnswer<T> {
    /// The shard.
    pub id: usize,
    /// Its answer; None when it did not answer in time.
    pub answer: Option<T>,
}

/// [`ShardAnswer`] as it travels.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum ShardAnswerWire<T> {
    Answered {
        id: usize,
        #[serde(flatten)]
        answer: T,
    },
    Silent {
        id: usize,
        answering: bool,
    },
}

impl<T> From<ShardAnswerWire<T>> for ShardAnswer<T> {
    fn from(w: ShardAnswerWire<T>) -> Self {
        match w {
            ShardAnswerWire::Answered { id, answer } => Self { id, answer: Some(answer) },
            ShardAnswerWire::Silent { id, answering: _ } => Self { id, answer: None },
        }
    }
}

impl<T> From<ShardAnswer<T>> for ShardAnswerWire<T> {
    fn from(a: ShardAnswer<T>) -> Self {
        match a.answer {
            Some(answer) => Self::Answered { id: a.id, answer },
            None => Self::Silent { id: a.id, answering: false },
        }
    }
}

/// `evict`: what every shard removed. `ok` is false (with `error`) when a shard did not
/// answer in time; the others' counts are there all the same.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvictReply {
    /// False when a shard did not answer in time.
    pub ok: bool,
    /// The namespace, None (null) for every chunk.
    pub namespace: Option<u64>,
    /// Summed over the shards that answered.
    pub removed: u64,
    /// Summed over the shards that answered: chunks left in place (leased, or being moved).
    pub busy: u64,
    /// Summed over the shards that answered: chunks removed whose deletion the SSD tier failed to record.
    pub not_durable: u64,
    /// Each shard's part.
    pub shards: Vec<ShardAnswer<ShardEvict>>,
    /// Which shards did not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One shard's `evict`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEvict {
    /// Chunks removed from every tier.
    pub removed: u64,
    /// Chunks left in place: leased, or being moved between tiers.
    pub busy: u64,
    /// Chunks removed whose deletion the SSD tier failed to record.
    pub not_durable: u64,
}

/// `audit`: every shard's full scan against its counters. `ok` is false (with `error`, the
/// count and the first problem) when anything does not add up or a shard did not answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditReply {
    /// False when anything does not add up or a shard did not answer.
    pub ok: bool,
    /// Sessions in the server's table.
    pub sessions: usize,
    /// Every problem found, `shard N: ...`.
    pub problems: Vec<String>,
    /// Each shard's scan.
    pub shards: Vec<ShardAnswer<ShardAudit>>,
    /// The count of problems and the first (when `ok` is false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One shard's `audit`: the counts its full scan gives, and every inconsistency.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardAudit {
    /// Entries in its index (any state).
    pub entries: u64,
    /// Arena pages the entries hold.
    pub entry_pages: u64,
    /// Leases the entries carry.
    pub leases: u64,
    /// Of the leases, pins of lookups waiting for a tier.
    pub pins: u64,
    /// Entries reserved by sessions.
    pub reservations: u64,
    /// Records in its SSD index.
    pub ssd_records: u64,
    /// What does not add up (empty when consistent).
    pub problems: Vec<String>,
}

/// What programs read of `stats`: the server's identity and state, and each shard's core and
/// the counters they act on. The whole answer is a JSON object of many more keys
/// (docs/operations.md, `stats --json`); ask with [`AdminRequest::Stats`](crate::admin::AdminRequest)
/// for all of it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct StatsReply {
    /// Serving, draining or drained.
    pub state: ServerState,
    /// The server's process id.
    pub pid: u32,
    /// Sessions open (or closing).
    pub sessions: u64,
    /// The DRAM arena's bytes.
    pub arena_bytes: u64,
    /// Every shard, in id order.
    pub shards: Vec<ShardStats>,
}

/// What programs read of one shard in `stats` (the counters as docs/operations.md's per-shard
/// table says). A shard that did not answer has its id and `answering: false` only: the
/// counters read 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ShardStats {
    /// The shard.
    pub id: usize,
    /// False for a shard that did not answer in time.
    pub answering: bool,
    /// The core it is pinned to (None: unpinned, or not answering).
    pub core: Option<usize>,
    /// Entries in its index.
    pub entries: u64,
    /// Leases held on its entries.
    pub leases: u64,
    /// Reservations not yet committed or aborted.
    pub reservations: u64,
    /// DRAM evictions.
    pub evictions: u64,
    /// Chunks demoted from DRAM to SSD.
    pub demotions: u64,
    /// Its SSD tier's capacity.
    pub ssd_capacity_bytes: u64,
    /// Lookups answered from SSD.
    pub ssd_hits: u64,
    /// SSD records dropped by region reclaim.
    pub ssd_reclaimed: u64,
    /// SSD tombstones written (explicit evictions of chunks that had an SSD record).
    pub ssd_tombstones: u64,
}

impl StatsReply {
    /// A per-shard counter summed over the shards.
    pub fn sum(&self, counter: impl Fn(&ShardStats) -> u64) -> u64 {
        self.shards.iter().map(counter).sum()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    /// `reply` on the wire is `wire`, and `wire` reads back as `reply`.
    fn wire<T>(reply: &T, wire: Value)
    where
        T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        assert_eq!(serde_json::to_value(reply).unwrap(), wire);
        assert_eq!(&serde_json::from_value::<T>(wire).unwrap(), reply);
    }

    fn progress() -> StartingProgress {
        StartingProgress {
            phase: "populate_arena".into(),
            percent: 42,
            populated_bytes: 42 << 20,
            arena_bytes: 100 << 20,
            seconds: 1.5,
            told_to_wait: 3,
        }
    }

    fn cluster() -> ClusterStatus {
        ClusterStatus {
            available: false,
            state: ClusterState::Unavailable,
            reason: "etcd lease grant: timed out".into(),
            since_s: 0.25,
            cluster: "prod".into(),
            node_id: "a".into(),
            epoch: None,
            members: vec![ClusterMember {
                node_id: "a".into(),
                peer_addr: "10.0.0.1:7000".into(),
                te_segment: "a-te".into(),
                shards: 4,
                epoch: 3,
                pid: 11,
                started_unix_s: 1_700_000_000,
            }],
        }
    }

    fn cluster_json() -> Value {
        json!({"available": false, "state": "unavailable", "reason": "etcd lease grant: timed out",
               "since_s": 0.25, "cluster": "prod", "node_id": "a", "epoch": null,
               "members": [{"node_id": "a", "peer_addr": "10.0.0.1:7000", "te_segment": "a-te",
                            "shards": 4, "epoch": 3, "pid": 11, "started_unix_s": 1_700_000_000}]})
    }

    #[test]
    fn errors_carry_a_code_only_when_they_have_one() {
        wire(
            &ErrorReply::new("unknown command \"x\""),
            json!({"ok": false, "error": "unknown command \"x\""}),
        );
        wire(
            &ErrorReply::with_code("uid 7 may not drain", RefusalCode::PermissionDenied),
            json!({"ok": false, "error": "uid 7 may not drain", "code": "permission_denied"}),
        );
        let starting = ErrorReply {
            starting: Some(progress()),
            ..ErrorReply::with_code("wait", RefusalCode::Starting)
        };
        wire(
            &starting,
            json!({"ok": false, "error": "wait", "code": "starting", "starting": {
                "phase": "populate_arena", "percent": 42, "populated_bytes": 42 << 20,
                "arena_bytes": 100 << 20, "seconds": 1.5, "told_to_wait": 3}}),
        );
    }

    #[test]
    fn health_has_cluster_and_starting_only_when_there_are() {
        let serving = HealthReply {
            ok: true,
            ready: true,
            state: ServerState::Serving,
            reason: "serving".into(),
            degraded: vec!["shard 1: 2 SSD I/O errors".into()],
            cluster: None,
            starting: None,
        };
        wire(
            &serving,
            json!({"ok": true, "ready": true, "state": "serving", "reason": "serving",
                   "degraded": ["shard 1: 2 SSD I/O errors"]}),
        );
        let clustered = HealthReply { cluster: Some(cluster()), ..serving };
        let mut v = json!({"ok": true, "ready": true, "state": "serving", "reason": "serving",
                           "degraded": ["shard 1: 2 SSD I/O errors"]});
        v["cluster"] = cluster_json();
        wire(&clustered, v);
        let starting = HealthReply {
            ok: true,
            ready: false,
            state: ServerState::Starting,
            reason: "populating the arena: 42%".into(),
            degraded: vec![],
            cluster: None,
            starting: Some(progress()),
        };
        let v = serde_json::to_value(&starting).unwrap();
        assert_eq!(
            (&v["state"], &v["starting"]["phase"]),
            (&json!("starting"), &json!("populate_arena"))
        );
        assert!(v.get("cluster").is_none(), "{v}");
    }

    #[test]
    fn peers_is_the_membership_with_the_peers_beside_it() {
        let link = PeerLink {
            epoch: 7,
            stream: "live".into(),
            complete: true,
            catalog_entries: 3,
            grants_held: 1,
            grants_given: 2,
            chunks_read: 8,
            bytes_read: 524_288,
            read_failures: 0,
            group_reads: 2,
            queue_us_mean: 1.5,
            grant_us_mean: 20.0,
            te_read_us_mean: 100.25,
            handoff_us_mean: 0.5,
        };
        let reply = PeersReply {
            ok: true,
            cluster: cluster(),
            peering: true,
            peers: BTreeMap::from([("b".to_string(), link)]),
        };
        let mut v = cluster_json();
        v["ok"] = json!(true);
        v["peering"] = json!(true);
        v["peers"] = json!({"b": {"epoch": 7, "stream": "live", "complete": true,
            "catalog_entries": 3, "grants_held": 1, "grants_given": 2, "chunks_read": 8,
            "bytes_read": 524_288, "read_failures": 0, "group_reads": 2, "queue_us_mean": 1.5,
            "grant_us_mean": 20.0, "te_read_us_mean": 100.25, "handoff_us_mean": 0.5}});
        wire(&reply, v);
    }

    #[test]
    fn a_shard_that_did_not_answer_says_so() {
        let reply = EvictReply {
            ok: false,
            namespace: None,
            removed: 3,
            busy: 1,
            not_durable: 0,
            shards: vec![
                ShardAnswer {
                    id: 0,
                    answer: Some(ShardEvict { removed: 3, busy: 1, not_durable: 0 }),
                },
                ShardAnswer { id: 1, answer: None },
            ],
            error: Some("evict: shard(s) 1 did not answer".into()),
        };
        wire(
            &reply,
            json!({"ok": false, "namespace": null, "removed": 3, "busy": 1, "not_durable": 0,
                   "shards": [{"id": 0, "removed": 3, "busy": 1, "not_durable": 0},
                              {"id": 1, "answering": false}],
                   "error": "evict: shard(s) 1 did not answer"}),
        );
        let audit = AuditReply {
            ok: true,
            sessions: 2,
            problems: vec![],
            shards: vec![ShardAnswer {
                id: 0,
                answer: Some(ShardAudit {
                    entries: 20,
                    entry_pages: 40,
                    leases: 1,
                    pins: 0,
                    reservations: 0,
                    ssd_records: 5,
                    problems: vec![],
                }),
            }],
            error: None,
        };
        wire(
            &audit,
            json!({"ok": true, "sessions": 2, "problems": [], "shards": [{"id": 0, "entries": 20,
                   "entry_pages": 40, "leases": 1, "pins": 0, "reservations": 0, "ssd_records": 5,
                   "problems": []}]}),
        );
    }

    #[test]
    fn sessions_and_states_are_plain() {
        wire(
            &StateReply { ok: true, state: ServerState::Draining },
            json!({"ok": true, "state": "draining"}),
        );
        let s = SessionInfo {
            id: 1,
            pid: 4242,
            uid: 1000,
            name: "engine".into(),
            home_shard: 1,
            closing: false,
            opened_unix_s: 1_700_000_000,
        };
        wire(
            &SessionsReply { ok: true, sessions: vec![s] },
            json!({"ok": true, "sessions": [{"id": 1, "pid": 4242, "uid": 1000, "name": "engine",
                   "home_shard": 1, "closing": false, "opened_unix_s": 1_700_000_000}]}),
        );
    }

    #[test]
    fn stats_reads_what_programs_need_and_leaves_the_rest() {
        let v = json!({"ok": true, "state": "serving", "pid": 42, "sessions": 1, "arena_bytes": 1024,
            "uptime_s": 3.5, "latency": {},
            "shards": [{"id": 0, "answering": true, "core": 3, "evictions": 3, "leases": 1, "hits": 9},
                       {"id": 1, "answering": false, "loop_iteration": 7, "loop_stage": "working"},
                       {"id": 2, "answering": true, "core": null, "evictions": 4}]});
        let s: StatsReply = serde_json::from_value(v).unwrap();
        assert_eq!(
            (s.pid, s.state, s.sessions, s.arena_bytes),
            (42, ServerState::Serving, 1, 1024)
        );
        assert_eq!(s.shards.len(), 3);
        assert_eq!(s.sum(|x| x.evictions), 7);
        assert_eq!(s.shards.iter().map(|x| x.core).collect::<Vec<_>>(), [Some(3), None, None]);
        assert!(!s.shards[1].answering && s.shards[2].answering);
        assert!(serde_json::from_value::<StatsReply>(json!({"ok": true})).is_err());
    }
}
