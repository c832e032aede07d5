//! DRAM <-> SSD movement of one shard: demotion of SIEVE victims through an admission filter,
//! promotion of SSD hits back into DRAM, and the completions of both.
//!
//! Admission policy: a DRAM victim is written to SSD if it was read at least once since it was
//! stored (reuse evidence), or while the SSD tier is less than half full. Victims already on
//! SSD are dropped from DRAM without a write. Everything else is dropped and counted in
//! `admission_rejections`.
//!
//! Demotion runs ahead of need: whenever less than [`FREE_TARGET_PERCENT`] of the shard's
//! slice is free, victims are written out (their DRAM slot stays allocated until the write
//! completes). A reservation that still finds no room evicts without demotion.

use orbitkv_proto::{ChunkKey, Hit, Tier};

use crate::core::ShardCore;
use crate::entries::EntryState;
use crate::ops::SessionId;
use orbitkv_ssd::log::PlaceError;
use orbitkv_ssd::store::{SsdEvent, SsdStore};

/// Demote while less than this share of the slice is free.
pub const FREE_TARGET_PERCENT: u64 = 10;
/// Owner of a reservation that a promotion fills (never a session id).
const PROMOTER: SessionId = SessionId::MAX;

/// The first pass of a lookup on a tiered shard.
#[derive(Debug)]
pub struct TieredLookup {
    /// DRAM hits, in key order (promoted keys are filled in by [`ShardCore::finish_lookup`]).
    pub hits: Vec<Option<Hit>>,
    /// Positions whose chunk is being promoted from SSD.
    pub pending: Vec<usize>,
    /// Generation of each pending position's promotion entry, which this lookup pins so the
    /// promoted chunk cannot be evicted before [`ShardCore::finish_lookup`] takes it.
    pins: Vec<u64>,
    /// Where each pending position's chunk comes from (`Ssd` or `Peer`).
    tiers: Vec<Tier>,
}

impl ShardCore {
    /// Gives the shard its SSD store.
    pub fn attach_ssd(&mut self, mut store: SsdStore) {
        store.set_guarantees(self.quotas.ssd_guarantees());
        self.ssd = Some(store);
    }

    /// True when the shard has an SSD tier.
    pub fn has_ssd(&self) -> bool {
        self.ssd.is_some()
    }

    /// True when a lookup may have to wait for a chunk moving in (from SSD or a peer).
    pub fn tiered(&self) -> bool {
        self.ssd.is_some() || self.has_catalog()
    }

    /// SSD operations in flight.
    pub fn ssd_inflight(&self) -> usize {
        self.ssd.as_ref().map_or(0, SsdStore::inflight)
    }

    /// Looks keys up in DRAM; a key found only on SSD, or only in a peer's inventory, starts
    /// (or joins) its promotion and is listed in `pending`.
    pub fn lookup_start(
        &mut self,
        session: SessionId,
        keys: &[ChunkKey],
        lease: bool,
    ) -> TieredLookup {
        let hits = self.lookup(session, keys, lease);
        let (mut pending, mut pins, mut tiers) = (Vec::new(), Vec::new(), Vec::new());
        if self.ssd.is_none() && !self.has_catalog() {
            return TieredLookup { hits, pending, pins, tiers };
        }
        for (i, key) in keys.iter().enumerate() {
            if hits[i].is_some() {
                continue;
            }
            // A hit of that tier from now on (a miss again if the promotion fails:
            // finish_lookup).
            let tier = if self.promotion_pending(key) || self.start_promotion(key) {
                self.metrics.ssd_hits += 1;
                Tier::Ssd
            } else if self.peer_promotion_pending(key) || self.start_peer_promotion(key) {
                self.metrics.peer_hits += 1;
                Tier::Peer
            } else {
                continue;
            };
            self.metrics.misses -= 1;
            let idx = self.entries.find(key).expect("a pending promotion has its entry");
            let e = self.entries.get_mut(idx);
            e.leases += 1;
            pins.push(e.generation);
            pending.push(i);
            tiers.push(tier);
        }
        TieredLookup { hits, pending, pins, tiers }
    }

    /// True while `key` is being read into DRAM, from SSD or from a peer.
    pub fn moving_in(&self, key: &ChunkKey) -> bool {
        self.promotion_pending(key) || self.peer_promotion_pending(key)
    }

    /// True while `key` is being read from SSD into DRAM.
    pub fn promotion_pending(&self, key: &ChunkKey) -> bool {
        self.entries.find(key).is_some_and(|idx| {
            self.entries.get(idx).state == EntryState::Reserved { owner: PROMOTER }
        })
    }

    /// Second pass: the promoted keys of `first` are looked up again in DRAM (leased if asked)
    /// and reported with the tier they came from. A promotion that failed is a miss.
    pub fn finish_lookup(
        &mut self,
        session: SessionId,
        keys: &[ChunkKey],
        lease: bool,
        mut first: TieredLookup,
    ) -> Vec<Option<Hit>> {
        let again: Vec<ChunkKey> = first.pending.iter().map(|&i| keys[i]).collect();
        let (hits, misses) = (self.metrics.hits, self.metrics.misses);
        let found = self.lookup(session, &again, lease);
        // The first pass already counted these keys.
        self.metrics.hits = hits;
        self.metrics.misses = misses;
        for ((&i, hit), &tier) in first.pending.iter().zip(found).zip(&first.tiers) {
            if hit.is_none() {
                // The promotion failed (checksum or read): a miss after all.
                match tier {
                    Tier::Peer => self.metrics.peer_hits -= 1,
                    _ => self.metrics.ssd_hits -= 1,
                }
                self.metrics.misses += 1;
            }
            first.hits[i] = hit.map(|h| Hit { tier, ..h });
        }
        // Drop this lookup's pins (a failed promotion's entry is already gone).
        for (&i, &generation) in first.pending.iter().zip(&first.pins) {
            if let Some(idx) = self.entries.find(&keys[i]) {
                let e = self.entries.get_mut(idx);
                if e.generation == generation {
                    e.leases -= 1;
                }
            }
        }
        first.hits
    }

    fn start_promotion(&mut self, key: &ChunkKey) -> bool {
        if self.entries.find(key).is_some() {
            return false; // already in DRAM in some state: never two entries for one key
        }
        let Some(entry) = self.ssd.as_ref().and_then(|s| s.get(key)) else { return false };
        if !self.ssd.as_ref().is_some_and(SsdStore::has_room) {
            return false;
        }
        let Ok(extent) = self.allocate(key.namespace, entry.len) else { return false };
        let generation = self.next_generation();
        let idx = self.entries.insert_reserved(*key, PROMOTER, extent, entry.len, generation);
        self.entries.get_mut(idx).checksum = entry.checksum;
        let started =
            self.ssd.as_mut().is_some_and(|ssd| ssd.promote(*key, &self.slice, extent.offset()));
        if !started {
            let e = self.entries.remove(idx);
            self.alloc.free(e.extent);
        }
        started
    }

    /// Applies finished SSD operations; returns how many.
    pub fn poll_ssd(&mut self) -> usize {
        let Some(ssd) = self.ssd.as_mut() else { return 0 };
        let events = ssd.poll(&self.slice);
        let n = events.len();
        for event in events {
            match event {
                SsdEvent::Demoted { key, stored } => {
                    self.demoting -= 1;
                    // A demoting entry is neither evicted nor deleted (both answer `Busy`).
                    let Some(idx) = self.entries.find(&key) else { continue };
                    self.demoting_pages -= self.entries.get(idx).extent.pages;
                    if stored && self.entries.get(idx).leases == 0 {
                        let e = self.entries.remove(idx);
                        self.alloc.free(e.extent);
                        self.metrics.demotions += 1;
                    } else {
                        // Leased meanwhile, or the write failed: it stays in DRAM.
                        self.entries.end_demotion(idx);
                    }
                }
                SsdEvent::Tombstoned { ticket, stored } => self.tombstone_done(ticket, stored),
                SsdEvent::Promoted { key, verified } => {
                    let Some(idx) = self.entries.find(&key) else { continue };
                    if verified {
                        let checksum = self.entries.get(idx).checksum;
                        self.entries.make_ready(idx, checksum);
                        self.metrics.promotions += 1;
                    } else {
                        let e = self.entries.remove(idx);
                        self.alloc.free(e.extent);
                    }
                }
            }
        }
        n
    }

    /// Starts demotions while free DRAM, counting the pages of demotions already under way
    /// (freed when their writes land), is below target; returns how many started.
    pub fn maintain(&mut self) -> usize {
        let Some(ssd) = self.ssd.as_ref() else { return 0 };
        let target = self.alloc.capacity_pages() * FREE_TARGET_PERCENT / 100;
        let half_full = ssd.stats().used_bytes * 2 >= ssd.stats().capacity_bytes;
        let region_bytes = ssd.region_bytes();
        let mut started = 0;
        while self.alloc.capacity_pages() - self.alloc.used_pages() + self.demoting_pages < target {
            if !self.ssd.as_ref().is_some_and(SsdStore::has_room) {
                break;
            }
            let quotas = &self.quotas;
            let guarantee = |ns| quotas.of(ns).dram_guarantee_pages;
            let Some(victim) = self.entries.pick_victim_sparing(guarantee, None) else { break };
            let (key, len, checksum, extent, reads) = {
                let e = self.entries.get(victim);
                (e.key, e.len, e.checksum, e.extent, e.reads)
            };
            let on_ssd = self
                .ssd
                .as_ref()
                .is_some_and(|s| s.get(&key).is_some_and(|r| r.checksum == checksum));
            // A namespace at its SSD share: its victims are dropped, not written.
            let limit = self.quotas.of(key.namespace).ssd_limit_bytes;
            let page = crate::PAGE_SIZE;
            let record = orbitkv_ssd::format::RECORD_HEADER_BYTES + len.div_ceil(page) * page;
            let over = !on_ssd
                && limit > 0
                && self
                    .ssd
                    .as_ref()
                    .is_some_and(|s| s.namespace_bytes(key.namespace) + record > limit);
            if on_ssd || over || (reads == 0 && half_full) {
                if over {
                    self.metrics.ssd_quota_drops += 1;
                } else if !on_ssd {
                    self.metrics.admission_rejections += 1;
                }
                let e = self.entries.remove(victim);
                self.alloc.free(e.extent);
                self.metrics.evictions += 1;
                continue;
            }
            let Some(ssd) = self.ssd.as_mut() else { break };
            match ssd.demote(key, len, checksum, &self.slice, extent.offset()) {
                // Nothing runs between the write's submission and this (one thread per
                // shard): the entry is out of the queue before anything could evict it.
                Ok(()) => self.entries.start_demotion(victim),
                Err(PlaceError::TooLarge) => {
                    // No region holds it: evicted as an admission refusal, said once.
                    if !self.warned_too_large {
                        self.warned_too_large = true;
                        tracing::warn!(
                            chunk_bytes = len,
                            region_bytes,
                            "a chunk larger than an SSD region (less its 4 KiB header) is \
                             evicted instead of demoted; raise --ssd-region-size above \
                             --max-chunk-size to keep such chunks"
                        );
                    }
                    self.metrics.admission_rejections += 1;
                    let e = self.entries.remove(victim);
                    self.alloc.free(e.extent);
                    self.metrics.evictions += 1;
                    continue;
                }
                // Not now (the ring or every region busy): the victim stays where it is.
                Err(PlaceError::Busy) => break,
            }
            self.demoting += 1;
            self.demoting_pages += extent.pages;
            started += 1;
        }
        while self.ssd.as_mut().is_some_and(SsdStore::relocate) {
            started += 1;
        }
        started
    }
}

#[cfg(test)]
mod tests;
