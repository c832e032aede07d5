//! What one shard shares with cluster peers and takes from them.
//!
//! - **Inventory** (owner side): a bounded log of the changes to the set of chunks this shard
//!   holds in DRAM (a chunk becomes visible, or leaves DRAM), drained by the peer thread. When
//!   the log fills before a drain, it stops recording and says so; the drainer then takes a
//!   snapshot, which starts the log afresh.
//! - **Catalog** (requester side): the chunks of this shard's key range that peers hold, as
//!   their inventories say; a lookup that misses DRAM and SSD and finds a key here starts a
//!   *peer promotion*: a reserved slot the peer thread fills by reading the owner's bytes, made
//!   ready only if their checksum is the one the owner announced.

use orbitkv_proto::{ChunkKey, ErrorCode, InventoryChunk, PeerFetch};

use crate::core::ShardCore;
use crate::entries::EntryState;
use crate::inventory::{InventoryDrain, InventoryLog, RemoteChunk, PEER_PROMOTER};
use crate::ops::SessionId;

impl ShardCore {
    /// Starts keeping the DRAM inventory log (cluster mode), bounded to `cap` changes between
    /// drains.
    pub fn enable_inventory(&mut self, cap: usize) {
        self.entries.log = Some(InventoryLog::new(cap));
    }

    /// The chunks in DRAM now; restarts the change log from here.
    pub fn inventory_snapshot(&mut self) -> Vec<InventoryChunk> {
        if let Some(log) = self.entries.log.as_mut() {
            log.deltas.clear();
            log.overflowed = false;
        }
        self.entries.visible_chunks()
    }

    /// The changes since the last drain or snapshot.
    pub fn inventory_drain(&mut self) -> InventoryDrain {
        match self.entries.log.as_mut() {
            Some(log) => InventoryDrain {
                deltas: std::mem::take(&mut log.deltas).into(),
                overflowed: std::mem::take(&mut log.overflowed),
            },
            None => InventoryDrain::default(),
        }
    }

    /// Adds to (or replaces in) the catalog what peer `peer` holds, and forgets what it no
    /// longer holds. Keys of namespaces not registered here are kept too (an engine may
    /// register later); a key held here is never fetched (the lookup finds it first).
    pub fn catalog_apply(&mut self, peer: u32, added: &[InventoryChunk], removed: &[ChunkKey]) {
        let catalog = &mut self.peering.catalog;
        for c in added {
            catalog.insert(c.key, RemoteChunk { peer, len: c.len, checksum: c.checksum });
        }
        for k in removed {
            if catalog.get(k).is_some_and(|r| r.peer == peer) {
                catalog.remove(k);
            }
        }
    }

    /// Forgets everything peer `peer` holds (its stream ended, it left, or it restarted).
    pub fn catalog_drop(&mut self, peer: u32) -> usize {
        let before = self.peering.catalog.len();
        self.peering.catalog.retain(|_, r| r.peer != peer);
        before - self.peering.catalog.len()
    }

    /// Entries in this shard's slice of the catalog.
    pub fn catalog_len(&self) -> usize {
        self.peering.catalog.len()
    }

    /// True when this shard has catalog entries (a lookup may fetch from peers).
    pub fn has_catalog(&self) -> bool {
        !self.peering.catalog.is_empty()
    }

    /// Starts a peer promotion of `key` if the catalog lists it and a slot can be had: a
    /// reserved entry (so concurrent lookups of the key join this one), and a [`PeerFetch`]
    /// for [`ShardCore::take_peer_fetches`]. False when the key is not listed, its namespace is
    /// not registered here or its length does not fit it, or no slot is free.
    pub(crate) fn start_peer_promotion(&mut self, key: &ChunkKey) -> bool {
        if self.entries.find(key).is_some() {
            return false;
        }
        let Some(remote) = self.peering.catalog.get(key).copied() else { return false };
        if self
            .max_chunk_bytes_of(key.namespace)
            .is_none_or(|max| remote.len > max || remote.len == 0)
        {
            return false;
        }
        let Ok(extent) = self.allocate(key.namespace, remote.len) else { return false };
        let generation = self.next_generation();
        let idx = self.entries.insert_reserved(*key, PEER_PROMOTER, extent, remote.len, generation);
        self.entries.get_mut(idx).checksum = remote.checksum;
        self.peering.fetches.push(PeerFetch {
            shard: self.id(),
            key: *key,
            peer: remote.peer,
            offset: self.slice.offset() + extent.offset(),
            len: remote.len,
            generation,
            queued: std::time::Instant::now(),
        });
        true
    }

    /// The peer reads started since the last call, for the peer thread.
    pub fn take_peer_fetches(&mut self) -> Vec<PeerFetch> {
        std::mem::take(&mut self.peering.fetches)
    }

    /// Ends a peer promotion: with `read` the bytes have landed and are made visible if their
    /// checksum is the owner's; otherwise (or on a mismatch) the slot is freed and the key
    /// leaves the catalog (the owner no longer has it, or it could not be read). Returns why
    /// the chunk was not stored, if it was not.
    pub fn finish_peer_fetch(&mut self, fetch: &PeerFetch, read: bool) -> Result<(), ErrorCode> {
        let Some(idx) = self.entries.find(&fetch.key) else { return Err(ErrorCode::NotFound) };
        let e = self.entries.get(idx);
        if e.state != (EntryState::Reserved { owner: PEER_PROMOTER })
            || e.generation != fetch.generation
        {
            return Err(ErrorCode::StaleGeneration);
        }
        let (expected, offset, len) = (e.checksum, e.extent.offset(), e.len);
        let outcome = if !read {
            Err(ErrorCode::NotFound)
        } else if orbitkv_proto::chunk_checksum(self.slice.bytes(offset, len)) != expected {
            tracing::error!(
                shard = self.id(),
                len,
                "a chunk read from a peer differs from the checksum its owner announced; dropped"
            );
            self.metrics.peer_checksum_mismatches += 1;
            Err(ErrorCode::ChecksumMismatch)
        } else {
            Ok(())
        };
        match outcome {
            Ok(()) => {
                self.entries.make_ready(idx, expected);
                self.metrics.peer_fetches += 1;
                self.metrics.peer_bytes += len;
            }
            Err(_) => {
                let e = self.entries.remove(idx);
                self.alloc.free(e.extent);
                if self.peering.catalog.get(&fetch.key).is_some_and(|r| r.peer == fetch.peer) {
                    self.peering.catalog.remove(&fetch.key);
                }
                self.metrics.peer_fetch_failures += 1;
            }
        }
        outcome
    }

    /// Leases `keys` for a peer's grant (`session` is the grant holder's): DRAM hits only,
    /// counted as grants rather than as lookups.
    pub fn lease_for_peer(
        &mut self,
        session: SessionId,
        keys: &[ChunkKey],
    ) -> Vec<Option<orbitkv_proto::Hit>> {
        let (hits, misses) = (self.metrics.hits, self.metrics.misses);
        let found = self.lookup(session, keys, true);
        self.metrics.hits = hits;
        self.metrics.misses = misses;
        self.metrics.peer_grants += found.iter().filter(|h| h.is_some()).count() as u64;
        found
    }

    /// Gives back what [`ShardCore::lease_for_peer`] leased for `session` (its answer `hits`
    /// for `keys`): for a grant whose answer nobody waits for any more.
    pub fn return_peer_leases(
        &mut self,
        session: SessionId,
        keys: &[ChunkKey],
        hits: &[Option<orbitkv_proto::Hit>],
    ) {
        let slots: Vec<orbitkv_proto::SlotRef> = keys
            .iter()
            .zip(hits)
            .filter_map(|(k, h)| {
                h.map(|h| orbitkv_proto::SlotRef { key: *k, generation: h.generation })
            })
            .collect();
        if !slots.is_empty() {
            self.apply(crate::ShardOp::Release { session, slots });
        }
    }

    /// True while `key` is being read from a peer into DRAM.
    pub fn peer_promotion_pending(&self, key: &ChunkKey) -> bool {
        self.entries.find(key).is_some_and(|idx| {
            self.entries.get(idx).state == EntryState::Reserved { owner: PEER_PROMOTER }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use orbitkv_proto::{
        ChunkOutcome, Dtype, InventoryDelta, NamespaceDescriptor, Reservation, SlotRef, Tier,
    };

    use super::*;
    use crate::{Arena, ShardConfig, ShardOp, ShardReply};

    const LEN: u64 = 8192;

    fn shard() -> (ShardCore, u64) {
        let arena = Arc::new(Arena::create(64 * crate::PAGE_SIZE, false).unwrap());
        let slice = arena.split(1).pop().unwrap();
        let mut core = ShardCore::new(
            ShardConfig {
                id: 0,
                max_chunk_bytes: 1 << 20,
                max_namespaces: 4,
                ..Default::default()
            },
            slice,
        );
        let descriptor = NamespaceDescriptor {
            model: "peering".into(),
            dtype: Dtype::Fp32,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 512,
            kv_tensors: 2,
            tokens_per_chunk: 2,
            layout_version: 1,
            tp_rank: 0,
            tp_world_size: 1,
        };
        let ns = descriptor.id();
        assert!(matches!(
            core.apply(ShardOp::Register { descriptor }),
            ShardReply::Registered(Ok(_))
        ));
        (core, ns)
    }

    fn key(ns: u64, i: u8) -> ChunkKey {
        ChunkKey::new(ns, [i; 32])
    }

    fn bytes(i: u8) -> Vec<u8> {
        (0..LEN).map(|b| (b as u8).wrapping_mul(7).wrapping_add(i)).collect()
    }

    fn put(core: &mut ShardCore, k: ChunkKey, i: u8) {
        let ShardReply::Reserved(r) =
            core.apply(ShardOp::Reserve { session: 1, keys: vec![k], lens: vec![LEN] })
        else {
            panic!()
        };
        let Reservation::Slot { offset, generation, .. } = r[0] else { panic!("{r:?}") };
        core.slice.write(offset - core.slice.offset(), &bytes(i));
        let ShardReply::Outcomes(o) =
            core.apply(ShardOp::Commit { session: 1, slots: vec![SlotRef { key: k, generation }] })
        else {
            panic!()
        };
        assert_eq!(o, vec![ChunkOutcome::Done]);
    }

    #[test]
    fn inventory_logs_visible_changes_and_resyncs_after_overflow() {
        let (mut core, ns) = shard();
        put(&mut core, key(ns, 1), 1);
        assert!(core.inventory_drain().deltas.is_empty(), "no log outside cluster mode");
        core.enable_inventory(3);
        put(&mut core, key(ns, 2), 2);
        let ShardReply::Outcomes(o) = core.apply(ShardOp::Evict { keys: vec![key(ns, 1)] }) else {
            panic!()
        };
        assert_eq!(o, vec![ChunkOutcome::Done]);
        let d = core.inventory_drain();
        assert!(!d.overflowed);
        let sum = orbitkv_proto::chunk_checksum(&bytes(2));
        assert_eq!(
            d.deltas,
            vec![
                InventoryDelta::Added(InventoryChunk { key: key(ns, 2), len: LEN, checksum: sum }),
                InventoryDelta::Removed(key(ns, 1)),
            ]
        );
        // A reservation that is aborted never was visible: nothing logged.
        let ShardReply::Reserved(r) =
            core.apply(ShardOp::Reserve { session: 1, keys: vec![key(ns, 3)], lens: vec![LEN] })
        else {
            panic!()
        };
        let Reservation::Slot { generation, .. } = r[0] else { panic!() };
        core.apply(ShardOp::Abort {
            session: 1,
            slots: vec![SlotRef { key: key(ns, 3), generation }],
        });
        assert!(core.inventory_drain().deltas.is_empty());
        // Four changes into a log of three: lost, said, and a snapshot starts afresh.
        for i in 10..14 {
            put(&mut core, key(ns, i), i);
        }
        let d = core.inventory_drain();
        assert!(d.overflowed && d.deltas.is_empty(), "{d:?}");
        let mut snap: Vec<u8> = core.inventory_snapshot().iter().map(|c| c.key.digest[0]).collect();
        snap.sort_unstable();
        assert_eq!(snap, vec![2, 10, 11, 12, 13]);
        put(&mut core, key(ns, 20), 20);
        let d = core.inventory_drain();
        assert!(!d.overflowed);
        assert_eq!(d.deltas.len(), 1);
    }

    /// Plays the peer thread: the owner's bytes into the reserved slot (or not).
    fn serve_fetch(core: &mut ShardCore, with: Option<Vec<u8>>) -> Result<(), ErrorCode> {
        let fetches = core.take_peer_fetches();
        assert_eq!(fetches.len(), 1, "{fetches:?}");
        let f = fetches[0];
        if let Some(b) = &with {
            core.slice.write(f.offset - core.slice.offset(), b);
        }
        core.finish_peer_fetch(&f, with.is_some())
    }

    #[test]
    fn peer_leases_nobody_waits_for_go_back() {
        let (mut core, ns) = shard();
        let (k, absent) = (key(ns, 3), key(ns, 4));
        put(&mut core, k, 3);
        let hits = core.lease_for_peer(77, &[k, absent, k]);
        assert!(hits[0].is_some() && hits[1].is_none() && hits[2].is_some(), "{hits:?}");
        assert_eq!(core.leases(), 2);
        core.return_peer_leases(77, &[k, absent, k], &hits);
        assert_eq!(core.leases(), 0);
        assert_eq!(core.stats().peer_grants, 2);
    }

    #[test]
    fn a_catalog_hit_is_fetched_verified_then_served_as_peer_then_dram() {
        let (mut core, ns) = shard();
        let k = key(ns, 5);
        let sum = orbitkv_proto::chunk_checksum(&bytes(5));
        core.catalog_apply(7, &[InventoryChunk { key: k, len: LEN, checksum: sum }], &[]);
        assert_eq!(core.catalog_len(), 1);
        let first = core.lookup_start(9, &[k], true);
        assert_eq!(first.pending, vec![0]);
        // A second lookup meanwhile joins the same read: no second fetch.
        let second = core.lookup_start(9, &[k], false);
        assert_eq!(second.pending, vec![0]);
        assert!(core.moving_in(&k));
        // Being read into: an evict must wait.
        let ShardReply::Outcomes(o) = core.apply(ShardOp::Evict { keys: vec![k] }) else {
            panic!()
        };
        assert_eq!(o, vec![ChunkOutcome::Failed(ErrorCode::Busy)]);
        serve_fetch(&mut core, Some(bytes(5))).unwrap();
        let hits = core.finish_lookup(9, &[k], true, first);
        let hit = hits[0].expect("fetched");
        assert_eq!(hit.tier, Tier::Peer);
        assert_eq!(hit.checksum, sum);
        assert_eq!(core.slice.bytes(hit.offset - core.slice.offset(), LEN), &bytes(5)[..]);
        assert!(core.finish_lookup(9, &[k], false, second)[0].is_some());
        assert_eq!(core.leases(), 1, "the leased lookup holds one lease, the pins are gone");
        let again = core.lookup_start(9, &[k], false);
        assert!(again.pending.is_empty());
        assert_eq!(again.hits[0].map(|h| h.tier), Some(Tier::Dram));
        let s = core.stats();
        assert_eq!((s.peer_hits, s.peer_fetches, s.peer_bytes), (2, 1, LEN));
    }

    #[test]
    fn a_bad_or_failed_peer_read_is_a_miss_and_leaves_the_catalog() {
        let (mut core, ns) = shard();
        let used = core.stats().dram_used_bytes;
        for (i, with) in [(1u8, Some(bytes(99))), (2, None)] {
            let k = key(ns, i);
            let sum = orbitkv_proto::chunk_checksum(&bytes(i));
            core.catalog_apply(3, &[InventoryChunk { key: k, len: LEN, checksum: sum }], &[]);
            let first = core.lookup_start(9, &[k], true);
            let mismatch = with.is_some();
            let got = serve_fetch(&mut core, with);
            assert_eq!(
                got,
                Err(if mismatch { ErrorCode::ChecksumMismatch } else { ErrorCode::NotFound })
            );
            assert_eq!(core.finish_lookup(9, &[k], true, first), vec![None]);
            assert_eq!(core.catalog_len(), 0, "a failed key leaves the catalog");
            assert!(core.lookup_start(9, &[k], false).pending.is_empty());
        }
        let s = core.stats();
        assert_eq!((s.peer_hits, s.peer_fetch_failures, s.peer_checksum_mismatches), (0, 2, 1));
        assert_eq!((s.dram_used_bytes, s.leases), (used, 0), "nothing held");
    }

    #[test]
    fn catalog_forgets_a_peer_and_ignores_other_peers_removals() {
        let (mut core, ns) = shard();
        let c = |i| InventoryChunk { key: key(ns, i), len: LEN, checksum: 1 };
        core.catalog_apply(1, &[c(1), c(2)], &[]);
        core.catalog_apply(2, &[c(3)], &[key(ns, 1)]);
        assert_eq!(core.catalog_len(), 3, "peer 2 cannot remove peer 1's entry");
        core.catalog_apply(1, &[], &[key(ns, 1)]);
        assert_eq!(core.catalog_drop(1), 1);
        assert_eq!(core.catalog_len(), 1);
        // Unknown namespace or a length over it: listed, never fetched.
        core.catalog_apply(
            2,
            &[InventoryChunk { key: key(ns ^ 1, 4), len: LEN, checksum: 1 }],
            &[],
        );
        core.catalog_apply(
            2,
            &[InventoryChunk { key: key(ns, 5), len: 1 << 30, checksum: 1 }],
            &[],
        );
        assert!(core.lookup_start(9, &[key(ns ^ 1, 4), key(ns, 5)], false).pending.is_empty());
        assert!(core.take_peer_fetches().is_empty());
    }
}
