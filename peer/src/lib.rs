//! OrbitKV cluster mode. The `orbitkv-peer` thread runs a tokio current-thread runtime for
//! etcd (its v3 gRPC API, see `etcd`) and the peer control RPC (tonic); the server reads what it knows through a
//! [`Cluster`] handle and hands it its shards through a [`LocalNode`].
//!
//! - Membership ([`Cluster::start`]): a leased member key and a persistent epoch per node in
//!   etcd; see `membership`.
//! - Peering ([`Cluster::start_peering`]): each node serves its DRAM inventory (a snapshot,
//!   then deltas) and grants on its chunks over gRPC, and keeps a bounded catalog of what the
//!   others hold, split over its shards; a lookup that finds a key only there has it read with
//!   Mooncake Transfer Engine into a local slot (see `owner` and `requester`).
//!
//! Peering needs a Transfer Engine: the C API of a TE build's library named by the operator
//! ([`te_c`], through `mooncake-sys`), or in builds with the feature `te-python` the
//! `mooncake-transfer-engine-non-cuda` wheel through an embedded interpreter ([`te`]).
//! Without either a node joins the cluster (membership only) and neither serves nor reads
//! peers.

#![deny(unsafe_code)]

mod eager;
mod engine;
mod etcd;
mod hot;
mod membership;
mod node;
mod owner;
mod requester;
pub mod rpc;
mod start;
#[cfg(feature = "te-python")]
pub mod te;
pub mod te_c;

pub use engine::{Engine, EngineError};
pub use membership::{Cluster, ClusterConfig, JoinError, Member, State, Status};
pub use node::{
    FetchQueue, Later, LocalNode, PeerView, PeeringConfig, PeeringError, FETCHES_PER_MESSAGE,
};
pub use te_c::TeTransport;
