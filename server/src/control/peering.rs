//! The server as cluster peering sees it ([`orbitkv_peer::LocalNode`]): the shards reached
//! through their control queues, each call waiting for the shards' answers. Grants are leases
//! held by a session id of their own per requester (never a client's), so that the shards'
//! lease accounting, eviction and reclaim treat them as any other holder's.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use orbitkv_peer::{Later, LocalNode};
use orbitkv_proto::{ChunkKey, Hit, InventoryChunk, InventoryDelta, PeerFetch, SlotRef};
use orbitkv_shards::SessionId;

use crate::control::shared::Shared;
use crate::shard::messages::{ControlMsg, PeerMsg};

/// Session ids of grant holders: `GRANT_SESSIONS + holder` (clients' ids count up from 1).
const GRANT_SESSIONS: SessionId = 1 << 62;
/// How long a call waits for a shard.
const SHARD_WAIT: Duration = Duration::from_secs(5);

/// The shards, for the peer thread.
pub struct Node(pub Arc<Shared>);

impl Node {
    fn send(&self, shard: usize, msg: PeerMsg) -> bool {
        let sent = self.0.send_control(shard, ControlMsg::Peer(msg), SHARD_WAIT);
        if !sent {
            tracing::warn!(shard, "peering: a shard's control queue stayed full");
        }
        sent
    }

    fn ask<T>(&self, shard: usize, make: impl FnOnce(Sender<T>) -> PeerMsg) -> Option<T> {
        let (tx, rx) = bounded(1);
        if !self.send(shard, make(tx)) {
            return None;
        }
        rx.recv_timeout(SHARD_WAIT).ok()
    }

    /// `items` split by the shard of their key, in order within each shard.
    fn by_shard<T>(&self, items: Vec<T>, key: impl Fn(&T) -> ChunkKey) -> Vec<Vec<(usize, T)>> {
        let n = self.0.shards();
        let mut out: Vec<Vec<(usize, T)>> = (0..n).map(|_| Vec::new()).collect();
        for (i, item) in items.into_iter().enumerate() {
            out[key(&item).shard(n)].push((i, item));
        }
        out
    }
}

impl LocalNode for Node {
    fn shards(&self) -> usize {
        self.0.shards()
    }

    fn inventory_snapshot(&self, shard: usize) -> Option<Vec<InventoryChunk>> {
        self.ask(shard, PeerMsg::Snapshot)
    }

    fn inventory_drain(&self, shard: usize) -> Option<(Vec<InventoryDelta>, bool)> {
        self.ask(shard, PeerMsg::Drain)
    }

    fn grant(&self, holder: u64, keys: &[ChunkKey]) -> Later<Vec<Option<Hit>>> {
        let session = GRANT_SESSIONS + holder;
        let count = keys.len();
        // Every shard concerned is asked before any answer is awaited: they lease in parallel.
        let mut asked = Vec::new();
        for (shard, part) in self.by_shard(keys.to_vec(), |k| *k).into_iter().enumerate() {
            if part.is_empty() {
                continue;
            }
            let (at, keys): (Vec<usize>, Vec<ChunkKey>) = part.into_iter().unzip();
            let (reply, answer) = tokio::sync::oneshot::channel();
            let msg = ControlMsg::Peer(PeerMsg::Grant { session, keys, reply });
            if let Err(msg) = self.0.try_send_control_back(shard, msg) {
                // The queue is full: wait for room off the runtime.
                let shared = Arc::clone(&self.0);
                tokio::task::spawn_blocking(move || {
                    if !shared.send_control(shard, msg, SHARD_WAIT) {
                        tracing::warn!(shard, "peering: a grant could not be queued for a shard (its control queue stayed full, or it stopped)");
                    }
                });
            }
            asked.push((at, answer));
        }
        Box::pin(async move {
            let mut out = vec![None; count];
            let until = tokio::time::Instant::now() + SHARD_WAIT;
            for (at, answer) in asked {
                // A shard that does not answer in time (or dropped the message) grants nothing.
                if let Ok(Ok(hits)) = tokio::time::timeout_at(until, answer).await {
                    for (i, hit) in at.into_iter().zip(hits) {
                        out[i] = hit;
                    }
                }
            }
            out
        })
    }

    fn release(&self, holder: u64, slots: &[SlotRef]) {
        let session = GRANT_SESSIONS + holder;
        for (shard, part) in self.by_shard(slots.to_vec(), |s| s.key).into_iter().enumerate() {
            if !part.is_empty() {
                let slots = part.into_iter().map(|(_, s)| s).collect();
                self.send(shard, PeerMsg::Release { session, slots });
            }
        }
    }

    fn release_all(&self, holder: u64) {
        let session = GRANT_SESSIONS + holder;
        for shard in 0..self.0.shards() {
            self.send(shard, PeerMsg::ReleaseAll { session });
        }
    }

    fn catalog_apply(&self, peer: u32, added: Vec<InventoryChunk>, removed: Vec<ChunkKey>) {
        let n = self.0.shards();
        let mut adds: Vec<Vec<InventoryChunk>> = vec![Vec::new(); n];
        let mut removes: Vec<Vec<ChunkKey>> = vec![Vec::new(); n];
        for c in added {
            adds[c.key.shard(n)].push(c);
        }
        for k in removed {
            removes[k.shard(n)].push(k);
        }
        for (shard, (added, removed)) in adds.into_iter().zip(removes).enumerate() {
            if !added.is_empty() || !removed.is_empty() {
                self.send(shard, PeerMsg::Catalog { peer, added, removed });
            }
        }
    }

    fn catalog_drop(&self, peer: u32) {
        for shard in 0..self.0.shards() {
            self.send(shard, PeerMsg::Forget { peer });
        }
    }

    fn fetched(&self, fetch: PeerFetch, read: bool) {
        self.send(fetch.shard, PeerMsg::Fetched { fetch, read });
    }

    fn fetched_now(&self, fetch: PeerFetch, read: bool) -> bool {
        self.0.try_send_control(fetch.shard, ControlMsg::Peer(PeerMsg::Fetched { fetch, read }))
    }
}
