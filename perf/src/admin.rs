//! The server's admin socket, through the one admin client (`orbitkv_proto::admin`), and what
//! the benchmarks read of it.

use std::path::Path;

use orbitkv_proto::admin::{AdminClient, StatsReply};

use crate::error::Error;

/// The admin client of the server whose bootstrap socket is `socket`.
pub(crate) fn client(socket: &Path) -> AdminClient {
    AdminClient::new(orbitkv_proto::admin_socket_path(socket))
}

/// What the benchmark needs to know about the server, from `stats`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ServerFacts {
    /// The server's process id.
    pub pid: u32,
    /// Shard count.
    pub shards: usize,
    /// DRAM arena bytes.
    pub arena_bytes: u64,
    /// Evictions so far, summed over the shards that answered.
    pub evictions: u64,
}

impl ServerFacts {
    fn of(stats: &StatsReply) -> Self {
        Self {
            pid: stats.pid,
            shards: stats.shards.len(),
            arena_bytes: stats.arena_bytes,
            evictions: stats.sum(|s| s.evictions),
        }
    }
}

/// The CPUs the server's shards are pinned to (none when they run unpinned).
pub(crate) fn shard_cores(socket: &Path) -> Result<Vec<usize>, Error> {
    Ok(client(socket).stats()?.shards.iter().filter_map(|s| s.core).collect())
}

/// Reads [`ServerFacts`] from `stats`.
pub(crate) fn facts(socket: &Path) -> Result<ServerFacts, Error> {
    Ok(ServerFacts::of(&client(socket).stats()?))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn facts_sum_evictions_over_answering_shards() {
        let v = json!({"ok": true, "state": "serving", "sessions": 0, "pid": 42, "arena_bytes": 1024,
            "shards": [{"id": 0, "evictions": 3}, {"id": 1, "answering": false},
                       {"id": 2, "evictions": 4}]});
        assert_eq!(
            ServerFacts::of(&serde_json::from_value(v).unwrap()),
            ServerFacts { pid: 42, shards: 3, arena_bytes: 1024, evictions: 7 }
        );
        assert!(serde_json::from_value::<StatsReply>(json!({"ok": true})).is_err());
    }
}
