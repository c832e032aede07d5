//! The admin socket (`<socket>.admin`): one JSON request line in, one JSON answer line out.
//! The requests ([`AdminRequest`]) and the answers ([`HealthReply`], ..., [`ErrorReply`]) are
//! defined here once, for the server that reads and writes them and for [`AdminClient`], the
//! one client (`orbitkv-ctl`, `orbitkv-perf` and the tests use it). The commands and their
//! answers, for operators: docs/operations.md.

mod client;
mod reply;
mod request;

pub use client::{AdminClient, AdminError, ADMIN_TIMEOUT, MAX_ANSWER};
pub use reply::{
    AuditReply, ClusterMember, ClusterState, ClusterStatus, ErrorReply, EvictReply, HealthReply,
    PeerLink, PeersReply, RefusalCode, ServerState, SessionInfo, SessionsReply, ShardAnswer,
    ShardAudit, ShardEvict, ShardStats, StartingProgress, StateReply, StatsReply,
};
pub use request::{
    AdminRequest, AdminRequestError, AdminRequestLine, EvictTarget, EvictTargetError,
};
