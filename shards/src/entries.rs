//! The shard's entry table: a slab of entries, the key index, and the SIEVE eviction queue.
//!
//! SIEVE: ready entries sit in a FIFO (newest at the head). A hit sets `visited`. To evict, a
//! hand walks from the tail toward the head: a visited entry has its bit cleared and is kept,
//! the first unvisited one is the victim, and the hand stays where it stopped. Leased entries
//! are skipped without clearing anything: they can never be victims. Reserved entries are not
//! in the queue at all.

use std::collections::HashMap;

use orbitkv_proto::ChunkKey;

use crate::alloc::Extent;
use crate::inventory::InventoryLog;
use crate::ops::SessionId;
use orbitkv_proto::{InventoryChunk, InventoryDelta};

/// Index of an entry in the slab.
pub(crate) type EntryIdx = u32;

const NIL: EntryIdx = EntryIdx::MAX;

/// Lifecycle of a slot: only `Ready` entries are visible to lookups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EntryState {
    /// Being written by `owner`; invisible.
    Reserved { owner: SessionId },
    /// Committed and visible.
    Ready,
    /// Visible, being written to SSD: out of the SIEVE queue until the write completes.
    Demoting,
}

impl EntryState {
    /// Whether lookups see the entry.
    pub fn visible(self) -> bool {
        matches!(self, EntryState::Ready | EntryState::Demoting)
    }
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub key: ChunkKey,
    pub state: EntryState,
    pub extent: Extent,
    pub len: u64,
    pub generation: u64,
    pub checksum: u64,
    pub leases: u32,
    /// Lookups that hit this entry (saturating): reuse evidence for SSD admission.
    pub reads: u32,
    visited: bool,
    prev: EntryIdx,
    next: EntryIdx,
}

#[derive(Debug, Default)]
pub(crate) struct Entries {
    slab: Vec<Option<Entry>>,
    free_slots: Vec<EntryIdx>,
    index: HashMap<ChunkKey, EntryIdx>,
    head: Option<EntryIdx>,
    tail: Option<EntryIdx>,
    hand: Option<EntryIdx>,
    ready: u64,
    /// Arena pages held per namespace (every entry, any state): quotas and guarantees.
    ns_pages: HashMap<u64, u64>,
    /// The DRAM inventory's change log, in cluster mode (see `peering`).
    pub log: Option<InventoryLog>,
}

impl Entries {
    pub fn find(&self, key: &ChunkKey) -> Option<EntryIdx> {
        self.index.get(key).copied()
    }

    pub fn get(&self, idx: EntryIdx) -> &Entry {
        self.slab[idx as usize].as_ref().expect("live index points at a live entry")
    }

    pub fn get_mut(&mut self, idx: EntryIdx) -> &mut Entry {
        self.slab[idx as usize].as_mut().expect("live index points at a live entry")
    }

    /// Every key held, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &ChunkKey> {
        self.index.keys()
    }

    pub fn ready_count(&self) -> u64 {
        self.ready
    }

    /// Every entry (an audit's full scan).
    pub fn all(&self) -> impl Iterator<Item = &Entry> {
        self.slab.iter().flatten()
    }

    /// Keys indexed (an audit compares them with the entries).
    pub fn indexed(&self) -> usize {
        self.index.len()
    }

    /// Every visible chunk (ready or demoting), for a peer's inventory snapshot.
    pub fn visible_chunks(&self) -> Vec<InventoryChunk> {
        self.slab
            .iter()
            .flatten()
            .filter(|e| e.state.visible())
            .map(|e| InventoryChunk { key: e.key, len: e.len, checksum: e.checksum })
            .collect()
    }

    /// Inserts a reserved entry (not yet evictable or visible).
    pub fn insert_reserved(
        &mut self,
        key: ChunkKey,
        owner: SessionId,
        extent: Extent,
        len: u64,
        generation: u64,
    ) -> EntryIdx {
        *self.ns_pages.entry(key.namespace).or_default() += extent.pages;
        let entry = Entry {
            key,
            state: EntryState::Reserved { owner },
            extent,
            len,
            generation,
            checksum: 0,
            leases: 0,
            reads: 0,
            visited: false,
            prev: NIL,
            next: NIL,
        };
        let idx = match self.free_slots.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(entry);
                i
            }
            None => {
                self.slab.push(Some(entry));
                EntryIdx::try_from(self.slab.len() - 1).expect("fewer than 2^32 entries per shard")
            }
        };
        let previous = self.index.insert(key, idx);
        debug_assert!(previous.is_none(), "callers check the key is absent");
        idx
    }

    /// Makes a reserved entry ready and puts it at the head of the SIEVE queue.
    pub fn make_ready(&mut self, idx: EntryIdx, checksum: u64) {
        self.enqueue(idx, checksum);
        if let Some(log) = self.log.as_mut() {
            let e = self.slab[idx as usize].as_ref().expect("live index points at a live entry");
            log.record(InventoryDelta::Added(InventoryChunk { key: e.key, len: e.len, checksum }));
        }
    }

    /// Marks an entry ready and puts it at the head of the SIEVE queue.
    fn enqueue(&mut self, idx: EntryIdx, checksum: u64) {
        let old_head = self.head;
        {
            let e = self.get_mut(idx);
            debug_assert!(matches!(e.state, EntryState::Reserved { .. }));
            e.state = EntryState::Ready;
            e.checksum = checksum;
            e.prev = NIL;
            e.next = old_head.unwrap_or(NIL);
        }
        if let Some(h) = old_head {
            self.get_mut(h).prev = idx;
        }
        self.head = Some(idx);
        if self.tail.is_none() {
            self.tail = Some(idx);
        }
        self.ready += 1;
    }

    /// Marks a hit for SIEVE.
    pub fn touch(&mut self, idx: EntryIdx) {
        let e = self.get_mut(idx);
        e.visited = true;
        e.reads = e.reads.saturating_add(1);
    }

    /// Takes a ready entry out of the SIEVE queue while it is written to SSD.
    pub fn start_demotion(&mut self, idx: EntryIdx) {
        debug_assert_eq!(self.get(idx).state, EntryState::Ready);
        self.unlink(idx);
        self.get_mut(idx).state = EntryState::Demoting;
    }

    /// Puts a demoting entry back in the queue (it stays in DRAM).
    pub fn end_demotion(&mut self, idx: EntryIdx) {
        debug_assert_eq!(self.get(idx).state, EntryState::Demoting);
        let checksum = self.get(idx).checksum;
        self.get_mut(idx).state = EntryState::Reserved { owner: SessionId::MAX };
        // Visible throughout: nothing for the inventory.
        self.enqueue(idx, checksum);
    }

    fn unlink(&mut self, idx: EntryIdx) {
        let (prev, next) = {
            let e = self.get(idx);
            (e.prev, e.next)
        };
        if self.hand == Some(idx) {
            self.hand = (prev != NIL).then_some(prev);
        }
        if prev != NIL {
            self.get_mut(prev).next = next;
        } else {
            self.head = (next != NIL).then_some(next);
        }
        if next != NIL {
            self.get_mut(next).prev = prev;
        } else {
            self.tail = (prev != NIL).then_some(prev);
        }
        let e = self.get_mut(idx);
        e.prev = NIL;
        e.next = NIL;
        self.ready -= 1;
    }

    /// Removes an entry (ready or reserved) and returns it; its extent is the caller's to free.
    pub fn remove(&mut self, idx: EntryIdx) -> Entry {
        let (state, key) = {
            let e = self.get(idx);
            (e.state, e.key)
        };
        if state == EntryState::Ready {
            self.unlink(idx);
        }
        if state.visible() {
            if let Some(log) = self.log.as_mut() {
                log.record(InventoryDelta::Removed(key));
            }
        }
        self.index.remove(&key);
        self.free_slots.push(idx);
        let e = self.slab[idx as usize].take().expect("removing a live entry");
        if let Some(p) = self.ns_pages.get_mut(&key.namespace) {
            *p -= e.extent.pages;
            if *p == 0 {
                self.ns_pages.remove(&key.namespace);
            }
        }
        e
    }

    /// Arena pages the entries of namespace `ns` hold.
    pub fn namespace_pages(&self, ns: u64) -> u64 {
        self.ns_pages.get(&ns).copied().unwrap_or(0)
    }

    /// Arena pages per namespace (an audit compares them with the entries).
    pub fn pages_by_namespace(&self) -> &HashMap<u64, u64> {
        &self.ns_pages
    }

    /// Picks the SIEVE victim: an unvisited, unleased ready entry. `None` when every ready entry
    /// is leased (or there is none).
    #[cfg(test)]
    pub fn pick_victim(&mut self) -> Option<EntryIdx> {
        self.pick_victim_sparing(|_| 0, None)
    }

    /// [`Entries::pick_victim`] among the entries of namespace `only` (all with None), sparing
    /// an entry whose namespace `ns` would fall below `guarantee(ns)` pages without it.
    pub fn pick_victim_sparing(
        &mut self,
        guarantee: impl Fn(u64) -> u64,
        only: Option<u64>,
    ) -> Option<EntryIdx> {
        // Two full passes suffice: the first clears every visited bit it passes.
        let budget = self.ready.saturating_mul(2).saturating_add(1);
        let mut cur = self.hand.or(self.tail)?;
        for _ in 0..budget {
            let (leases, visited, prev, ns, pages) = {
                let e = self.get(cur);
                (e.leases, e.visited, e.prev, e.key.namespace, e.extent.pages)
            };
            let spared = only.is_some_and(|n| n != ns) || {
                let g = guarantee(ns);
                g > 0 && self.namespace_pages(ns) - pages < g
            };
            if leases == 0 && !visited && !spared {
                self.hand = (prev != NIL).then_some(prev);
                return Some(cur);
            }
            if leases == 0 {
                self.get_mut(cur).visited = false;
            }
            cur = if prev != NIL { prev } else { self.tail? };
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> ChunkKey {
        ChunkKey::new(1, [i; 32])
    }

    fn ready(entries: &mut Entries, i: u8) -> EntryIdx {
        let idx =
            entries.insert_reserved(key(i), 9, Extent { start_page: i as u64, pages: 1 }, 1, 1);
        entries.make_ready(idx, 0);
        idx
    }

    #[test]
    fn sieve_evicts_oldest_unvisited_and_spares_visited_and_leased() {
        let mut e = Entries::default();
        let a = ready(&mut e, 1);
        let b = ready(&mut e, 2);
        let c = ready(&mut e, 3);
        e.touch(a);
        e.get_mut(b).leases = 1;
        // a (oldest) was visited: spared; b is leased: skipped; c is the victim.
        assert_eq!(e.pick_victim(), Some(c));
        e.remove(c);
        // a lost its visited bit in the first pass; b is still leased.
        assert_eq!(e.pick_victim(), Some(a));
        e.remove(a);
        assert_eq!(e.pick_victim(), None, "only a leased entry remains");
        e.get_mut(b).leases = 0;
        assert_eq!(e.pick_victim(), Some(b));
        e.remove(b);
        assert_eq!(e.pick_victim(), None);
        assert_eq!(e.ready_count(), 0);
    }

    #[test]
    fn reserved_entries_are_never_victims() {
        let mut e = Entries::default();
        e.insert_reserved(key(1), 9, Extent { start_page: 0, pages: 1 }, 1, 1);
        assert_eq!(e.pick_victim(), None);
        assert!(e.find(&key(1)).is_some());
    }
}
