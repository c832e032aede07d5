//! What a Manager needs to join a cluster, as validated from the options (`--etcd` and the
//! rest of the cluster section); `orbitkv-peer` acts on it.

use std::net::SocketAddr;
use std::time::Duration;

/// What a Manager needs to join a cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://host:port`).
    pub etcd: Vec<String>,
    /// The cluster's name (the key prefix).
    pub cluster: String,
    /// This node's id, unique in the cluster.
    pub node_id: String,
    /// Where peers reach this node.
    pub peer_addr: SocketAddr,
    /// Its shard count.
    pub shards: usize,
    /// The member key's lease TTL.
    pub lease_ttl: Duration,
    /// A Transfer Engine build's shared library to use through its C API; none: the wheel's
    /// engine in builds with `te-python`, else no peering.
    pub te_library: Option<std::path::PathBuf>,
    /// The transports of the engine of `te_library`.
    pub te_transport: crate::TeTransport,
    /// Cores for the peer thread, its blocking pool and the Transfer Engine's threads (the
    /// server gives the allowed cores after its pinned shards'); empty: wherever the process
    /// may run.
    pub cpus: Vec<usize>,
}

impl ClusterConfig {
    /// The cluster's etcd key prefix, `/orbitkv/<cluster>/`.
    pub fn key_prefix(&self) -> String {
        format!("/orbitkv/{}/", self.cluster)
    }
}
