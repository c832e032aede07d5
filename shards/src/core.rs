//! [`ShardCore`]: the synchronous state machine of one shard.

use std::collections::{HashMap, HashSet};

use orbitkv_proto::{
    ChunkKey, ChunkOutcome, ErrorCode, Hit, NamespaceDescriptor, Reservation, SlotRef, Tier,
};

use crate::alloc::{Extent, ExtentAllocator};
use crate::arena::ArenaSlice;
use crate::entries::{Entries, EntryIdx, EntryState};
use crate::metrics::{OpKind, ShardMetrics, ShardStats};
use crate::ops::{SessionId, ShardOp, ShardReply};
use orbitkv_proto::LatencyHistogram;
use orbitkv_ssd::format::RecordKind;

/// Static parameters of one shard.
#[derive(Clone, Debug, Default)]
pub struct ShardConfig {
    /// This shard's id.
    pub id: usize,
    /// Largest chunk any namespace may declare (`--max-chunk-size`).
    pub max_chunk_bytes: u64,
    /// Most namespaces held at once (`--max-namespaces`).
    pub max_namespaces: usize,
    /// The quota of every namespace whose model has none of its own
    /// (`--namespace-dram-limit` and the like, this shard's share).
    pub quota: NamespaceQuota,
    /// Quotas of the namespaces of these models (`--model-quota`, this shard's share); each
    /// replaces `quota` whole.
    pub model_quotas: Vec<(String, NamespaceQuota)>,
}

/// What one namespace may hold on one shard (each value this shard's share; 0: no bound).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NamespaceQuota {
    /// Most arena pages it may hold. A reservation past it evicts the namespace's own chunks
    /// first, and is refused with `QuotaExceeded` when they do not make room.
    pub dram_limit_pages: u64,
    /// Arena pages of it that eviction for room and demotion leave alone: another
    /// namespace's writes cannot push it below them.
    pub dram_guarantee_pages: u64,
    /// Most bytes its records may take in the shard's SSD file. A victim of a namespace at
    /// it is dropped from DRAM instead of written to SSD (counted as `ssd_quota_drops`).
    pub ssd_limit_bytes: u64,
    /// Bytes of its SSD records that region reclaim keeps: records of a namespace below it
    /// are rewritten at the log's head before their region is reclaimed.
    pub ssd_guarantee_bytes: u64,
}

/// The quota of each namespace: its model's own (`ShardConfig::model_quotas`), fixed when it
/// registers, else the default.
#[derive(Debug, Default)]
pub(crate) struct Quotas {
    default: NamespaceQuota,
    by_model: Vec<(String, NamespaceQuota)>,
    by_namespace: HashMap<u64, NamespaceQuota>,
}

impl Quotas {
    fn new(cfg: &ShardConfig) -> Self {
        Self {
            default: cfg.quota,
            by_model: cfg.model_quotas.clone(),
            by_namespace: HashMap::new(),
        }
    }

    /// Fixes the quota of namespace `id` of `model`.
    fn register(&mut self, id: u64, model: &str) {
        let quota = self.by_model.iter().find(|(m, _)| m == model).map_or(self.default, |q| q.1);
        if quota != self.default {
            self.by_namespace.insert(id, quota);
        }
    }

    /// The SSD guarantee of every namespace, for the SSD log.
    pub(crate) fn ssd_guarantees(&self) -> orbitkv_ssd::log::SsdGuarantees {
        orbitkv_ssd::log::SsdGuarantees {
            default: self.default.ssd_guarantee_bytes,
            by_namespace: self
                .by_namespace
                .iter()
                .map(|(&ns, q)| (ns, q.ssd_guarantee_bytes))
                .collect(),
        }
    }

    /// The quota of namespace `ns` (the default for one not registered in this run, such as
    /// the owner of SSD records recovered at start).
    pub(crate) fn of(&self, ns: u64) -> NamespaceQuota {
        if self.by_namespace.is_empty() {
            return self.default; // no model quota: no lookup per eviction candidate
        }
        self.by_namespace.get(&ns).copied().unwrap_or(self.default)
    }
}

/// A chunk a commit hashes ([`ShardCore::hash_ranges`]): its key and its bytes' place in the
/// shard's slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashRange {
    /// The chunk.
    pub key: ChunkKey,
    /// Its reservation's generation.
    pub generation: u64,
    /// Slice-relative offset of its bytes.
    pub offset: u64,
    /// Its length.
    pub len: u64,
}

/// Most victims one reservation may evict (more when the chunk spans more pages).
const MAX_EVICTIONS_PER_RESERVATION: u64 = 64;

/// Adjacent slots of one size, allocated as one extent for a reservation of several chunks
/// (`ShardCore::reserve_run`) and handed out front to back.
#[derive(Debug)]
struct SlotRun {
    /// First page not handed out yet.
    next: u64,
    /// End of the extent (exclusive).
    end: u64,
    /// Pages per slot.
    each: u64,
}

impl SlotRun {
    /// The next slot for a chunk of `len` bytes, if the run has one left of that size.
    fn take(&mut self, len: u64) -> Option<Extent> {
        let fits = ExtentAllocator::pages_for(len) == self.each;
        (fits && self.next + self.each <= self.end).then(|| {
            let e = Extent { start_page: self.next, pages: self.each };
            self.next += self.each;
            e
        })
    }

    /// What was not handed out (chunks refused on their own merits), to be freed.
    fn rest(self) -> Option<Extent> {
        (self.next < self.end)
            .then_some(Extent { start_page: self.next, pages: self.end - self.next })
    }
}

#[derive(Debug, Default)]
struct Holdings {
    leases: HashMap<EntryIdx, u32>,
    reservations: HashSet<EntryIdx>,
}

#[derive(Debug)]
struct Namespace {
    descriptor: NamespaceDescriptor,
    max_chunk_bytes: u64,
}

/// One shard's index, allocator, eviction, leases and reservations over its arena slice.
///
/// Guarantees: only committed chunks are visible; a leased or reserved chunk is never evicted
/// or reused; a commit, abort or release quoting a stale generation or another session's slot
/// is refused and changes nothing.
/// What [`ShardCore::evict_namespace`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictSummary {
    /// Chunks removed from every tier.
    pub removed: u64,
    /// Chunks left in place: leased, or being moved between tiers (or on SSD while its
    /// tier could not start the deletion's record).
    pub busy: u64,
    /// Chunks removed whose deletion the SSD tier failed to record (they may come back after
    /// a restart); set by the caller once the tombstones have landed.
    pub not_durable: u64,
}

/// What [`ShardCore::audit`] found: the counts a full scan gives, and every inconsistency (the
/// admin socket's `audit` answers it as it is).
pub use orbitkv_proto::admin::ShardAudit as Audit;

/// A tombstone write an eviction started: until it lands, the deletion of what it covers is
/// not durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartedTombstone {
    /// The SSD tier's ticket ([`ShardCore::tombstone_result`]).
    pub ticket: u64,
    /// The key evicted (a namespace tombstone: a key of its namespace, digest zero).
    pub key: ChunkKey,
    /// Chunks on SSD whose deletion it records.
    pub covers: u64,
}

#[derive(Debug)]
pub struct ShardCore {
    pub(crate) cfg: ShardConfig,
    pub(crate) slice: ArenaSlice,
    pub(crate) alloc: ExtentAllocator,
    pub(crate) entries: Entries,
    namespaces: HashMap<u64, Namespace>,
    /// The quota of each namespace.
    pub(crate) quotas: Quotas,
    sessions: HashMap<SessionId, Holdings>,
    next_generation: u64,
    leases: u64,
    reservations: u64,
    /// The SSD tier, when configured.
    pub(crate) ssd: Option<orbitkv_ssd::store::SsdStore>,
    /// Entries being written to SSD.
    pub(crate) demoting: u64,
    /// Arena pages of those entries, free once their writes land (`maintain` counts them).
    pub(crate) demoting_pages: u64,
    /// Whether a chunk too large for an SSD region has been reported (once per shard).
    pub(crate) warned_too_large: bool,
    /// Counters and latency recorders of this shard.
    pub metrics: ShardMetrics,
    /// The catalog of peers' chunks and the peer reads to start (cluster mode).
    pub(crate) peering: crate::inventory::Peering,
    /// Tombstone writes in flight or landed and not yet asked for: None until they land.
    tombstones: HashMap<u64, Option<bool>>,
    /// Tombstones started since the caller last took them.
    started_tombstones: Vec<StartedTombstone>,
}

impl ShardCore {
    /// A shard over `slice` with nothing in it.
    pub fn new(cfg: ShardConfig, slice: ArenaSlice) -> Self {
        let pages = slice.len() / crate::PAGE_SIZE;
        let quotas = Quotas::new(&cfg);
        Self {
            cfg,
            slice,
            alloc: ExtentAllocator::new(pages),
            entries: Entries::default(),
            namespaces: HashMap::new(),
            quotas,
            sessions: HashMap::new(),
            next_generation: 1,
            leases: 0,
            reservations: 0,
            ssd: None,
            demoting: 0,
            demoting_pages: 0,
            warned_too_large: false,
            metrics: ShardMetrics::default(),
            peering: Default::default(),
            tombstones: HashMap::new(),
            started_tombstones: Vec::new(),
        }
    }

    /// A full scan of the shard's bookkeeping against its counters: the entries' extents are
    /// disjoint and, with the free extents, tile the slice; the allocator's used pages, the
    /// leases and reservations counted, the sessions' holdings and the index all agree with
    /// the entries; the SSD log is consistent ([`orbitkv_ssd::log::RegionLog::audit`]).
    pub fn audit(&self) -> Audit {
        let mut a = Audit::default();
        let mut extents: Vec<Extent> = self.alloc.free_extents().collect();
        let mut session_reserved = 0u64;
        let mut by_ns: HashMap<u64, u64> = HashMap::new();
        for e in self.entries.all() {
            *by_ns.entry(e.key.namespace).or_default() += e.extent.pages;
            a.entries += 1;
            a.entry_pages += e.extent.pages;
            a.leases += u64::from(e.leases);
            // Promoters (SSD and peer reads) reserve under ids above every session's.
            if matches!(e.state, EntryState::Reserved { owner } if owner < crate::inventory::PEER_PROMOTER)
            {
                session_reserved += 1;
            }
            extents.push(e.extent);
        }
        a.reservations = session_reserved;
        extents.sort_by_key(|x| x.start_page);
        let mut next = 0;
        for x in &extents {
            if x.start_page != next {
                a.problems
                    .push(format!("pages {next}..{} are neither free nor held", x.start_page));
            }
            next = x.start_page + x.pages;
        }
        if next != self.alloc.capacity_pages() {
            a.problems
                .push(format!("extents end at page {next} of {}", self.alloc.capacity_pages()));
        }
        if a.entry_pages != self.alloc.used_pages() {
            a.problems.push(format!(
                "entries hold {} pages, the allocator counts {} used",
                a.entry_pages,
                self.alloc.used_pages()
            ));
        }
        if &by_ns != self.entries.pages_by_namespace() {
            a.problems.push("the pages counted per namespace differ from the entries'".into());
        }
        if a.entries != self.entries.indexed() as u64 {
            a.problems.push(format!("{} entries, {} indexed", a.entries, self.entries.indexed()));
        }
        let held: u64 =
            self.sessions.values().flat_map(|h| h.leases.values()).map(|&n| u64::from(n)).sum();
        // Beyond the sessions' leases, entries carry the pins of lookups waiting for a tier.
        if held != self.leases || a.leases < held {
            a.problems.push(format!(
                "entries carry {} leases, sessions hold {held}, the shard counts {}",
                a.leases, self.leases
            ));
        }
        a.pins = a.leases.saturating_sub(held);
        let reserved: u64 = self.sessions.values().map(|h| h.reservations.len() as u64).sum();
        if reserved != self.reservations || reserved != session_reserved {
            a.problems.push(format!(
                "sessions hold {reserved} reservations, entries show {session_reserved}, the shard counts {}",
                self.reservations
            ));
        }
        if let Some(ssd) = &self.ssd {
            a.ssd_records = ssd.keys().count() as u64;
            a.problems.extend(ssd.audit());
        }
        a
    }

    /// The tombstones evictions started since the last call: the caller answers an evict
    /// only once they have landed ([`ShardCore::tombstone_result`]).
    pub fn take_started_tombstones(&mut self) -> Vec<StartedTombstone> {
        std::mem::take(&mut self.started_tombstones)
    }

    /// Whether tombstone `ticket` landed (`Some(true)`), failed (`Some(false)`: what it
    /// deleted may come back after a restart) or is still being written (None). Given once.
    pub fn tombstone_result(&mut self, ticket: u64) -> Option<bool> {
        let done = (*self.tombstones.get(&ticket)?)?;
        self.tombstones.remove(&ticket);
        Some(done)
    }

    /// Records that an eviction started tombstone `ticket` covering `covers` chunks.
    fn started_tombstone(&mut self, ticket: u64, key: ChunkKey, covers: u64) {
        self.tombstones.insert(ticket, None);
        self.started_tombstones.push(StartedTombstone { ticket, key, covers });
    }

    /// A tombstone write landed or failed.
    pub(crate) fn tombstone_done(&mut self, ticket: u64, stored: bool) {
        if let Some(slot) = self.tombstones.get_mut(&ticket) {
            *slot = Some(stored);
        }
    }

    /// This shard's id.
    pub fn id(&self) -> usize {
        self.cfg.id
    }

    /// Leases held on this shard.
    pub fn leases(&self) -> u64 {
        self.leases
    }

    /// Reservations outstanding on this shard.
    pub fn reservations(&self) -> u64 {
        self.reservations
    }

    /// Executes one op.
    pub fn apply(&mut self, op: ShardOp) -> ShardReply {
        match op {
            ShardOp::Register { descriptor } => ShardReply::Registered(self.register(descriptor)),
            ShardOp::Lookup { session, keys, lease } => {
                ShardReply::Hits(self.lookup(session, &keys, lease))
            }
            ShardOp::Reserve { session, keys, lens } => {
                ShardReply::Reserved(self.reserve(session, &keys, &lens))
            }
            op @ (ShardOp::Commit { .. } | ShardOp::CommitSummed { .. }) => {
                self.apply_hashed(op, &[])
            }
            ShardOp::Abort { session, slots } => {
                ShardReply::Outcomes(self.each(&slots, |s, slot| s.abort(session, slot)))
            }
            ShardOp::Release { session, slots } => {
                ShardReply::Outcomes(self.each(&slots, |s, slot| s.release(session, slot)))
            }
            ShardOp::Evict { keys } => ShardReply::Outcomes(self.each(&keys, Self::evict)),
            ShardOp::SessionClosed { session } => {
                let (leases, reservations) = self.close_session(session);
                ShardReply::Closed { leases, reservations }
            }
        }
    }

    /// The chunks `op` hashes when applied (a commit computing its checksums, or verifying
    /// given ones), for a caller that hashes them a piece at a time with other work between
    /// the pieces (through [`ShardCore::reader`]) and then applies `op` with
    /// [`ShardCore::apply_hashed`]. Slots that are not the session's reservations hash nothing
    /// (their commit fails).
    pub fn hash_ranges(&self, op: &ShardOp) -> Vec<HashRange> {
        let (session, hashed): (SessionId, Vec<&SlotRef>) = match op {
            ShardOp::Commit { session, slots } => (*session, slots.iter().collect()),
            ShardOp::CommitSummed { session, slots } => {
                (*session, slots.iter().filter(|s| s.2).map(|s| &s.0).collect())
            }
            _ => return Vec::new(),
        };
        hashed
            .into_iter()
            .filter_map(|slot| {
                let e = self.entries.get(self.owned_reservation(session, slot).ok()?);
                Some(HashRange {
                    key: slot.key,
                    generation: slot.generation,
                    offset: e.extent.offset(),
                    len: e.len,
                })
            })
            .collect()
    }

    /// Read access to this shard's slice that outlives a borrow of the shard.
    pub fn reader(&self) -> crate::arena::SliceReader {
        self.slice.reader()
    }

    /// Applies `op` as [`ShardCore::apply`] does, taking the checksums `hashed` names (of the
    /// ranges [`ShardCore::hash_ranges`] gave) as the bytes' own. A range that is no longer
    /// the slot's (the reservation went away and came back meanwhile) is hashed again here.
    pub fn apply_hashed(&mut self, op: ShardOp, hashed: &[(HashRange, u64)]) -> ShardReply {
        let own = |s: &Self, slot: &SlotRef, offset: u64, len: u64| {
            let this = HashRange { key: slot.key, generation: slot.generation, offset, len };
            hashed
                .iter()
                .find(|(r, _)| *r == this)
                .map_or_else(|| Self::hash_here(s, slot, offset, len), |h| h.1)
        };
        match op {
            ShardOp::Commit { session, slots } => ShardReply::Outcomes(
                self.each(&slots, |s, slot| s.commit(session, slot, None, own)),
            ),
            ShardOp::CommitSummed { session, slots } => {
                ShardReply::Outcomes(self.each(&slots, |s, (slot, sum, verify)| {
                    s.commit(session, slot, Some((*sum, *verify)), own)
                }))
            }
            op => self.apply(op),
        }
    }

    fn each<T>(
        &mut self,
        items: &[T],
        mut f: impl FnMut(&mut Self, &T) -> Result<(), ErrorCode>,
    ) -> Vec<ChunkOutcome> {
        items
            .iter()
            .map(|item| match f(self, item) {
                Ok(()) => ChunkOutcome::Done,
                Err(code) => {
                    self.metrics.count_error(code);
                    ChunkOutcome::Failed(code)
                }
            })
            .collect()
    }

    fn register(&mut self, descriptor: NamespaceDescriptor) -> Result<u64, (ErrorCode, String)> {
        descriptor.validate().map_err(|e| (ErrorCode::InvalidArgument, e.to_string()))?;
        let id = descriptor.id();
        if let Some(ns) = self.namespaces.get(&id) {
            return if ns.descriptor == descriptor {
                Ok(ns.max_chunk_bytes)
            } else {
                Err((
                    ErrorCode::NamespaceConflict,
                    format!("namespace id {id:#018x} is registered with a different descriptor"),
                ))
            };
        }
        let max = descriptor.max_chunk_bytes().expect("validated descriptors have a chunk size");
        if max > self.cfg.max_chunk_bytes {
            return Err((
                ErrorCode::TooLarge,
                format!(
                    "namespace chunks of {max} bytes exceed --max-chunk-size ({} bytes)",
                    self.cfg.max_chunk_bytes
                ),
            ));
        }
        if max > self.slice.len() {
            return Err((
                ErrorCode::TooLarge,
                format!(
                    "namespace chunks of {max} bytes exceed one shard's arena slice ({} bytes): \
                     raise --dram or lower --shards",
                    self.slice.len()
                ),
            ));
        }
        if self.namespaces.len() >= self.cfg.max_namespaces {
            return Err((
                ErrorCode::NoSpace,
                format!("namespace table is full (--max-namespaces {})", self.cfg.max_namespaces),
            ));
        }
        self.quotas.register(id, &descriptor.model);
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.set_guarantees(self.quotas.ssd_guarantees());
        }
        self.namespaces.insert(id, Namespace { descriptor, max_chunk_bytes: max });
        Ok(max)
    }

    /// The largest chunk of a registered namespace, or None when it is not registered here.
    pub(crate) fn max_chunk_bytes_of(&self, namespace: u64) -> Option<u64> {
        self.namespaces.get(&namespace).map(|n| n.max_chunk_bytes)
    }

    fn hit(&self, idx: EntryIdx) -> Hit {
        let e = self.entries.get(idx);
        Hit {
            offset: self.slice.offset() + e.extent.offset(),
            len: e.len,
            generation: e.generation,
            checksum: e.checksum,
            tier: Tier::Dram,
        }
    }

    pub(crate) fn lookup(
        &mut self,
        session: SessionId,
        keys: &[ChunkKey],
        lease: bool,
    ) -> Vec<Option<Hit>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let found = self.entries.find(key).filter(|&idx| self.entries.get(idx).state.visible());
            match found {
                Some(idx) if lease && self.entries.get(idx).leases == u32::MAX => {
                    // The per-entry lease counter is full: report a miss rather than wrap.
                    self.metrics.count_error(ErrorCode::LeaseLimit);
                    out.push(None);
                }
                Some(idx) => {
                    self.metrics.hits += 1;
                    self.entries.touch(idx);
                    if lease {
                        self.entries.get_mut(idx).leases += 1;
                        *self
                            .sessions
                            .entry(session)
                            .or_default()
                            .leases
                            .entry(idx)
                            .or_default() += 1;
                        self.leases += 1;
                    }
                    out.push(Some(self.hit(idx)));
                }
                None => {
                    self.metrics.misses += 1;
                    out.push(None);
                }
            }
        }
        out
    }

    fn reserve(&mut self, session: SessionId, keys: &[ChunkKey], lens: &[u64]) -> Vec<Reservation> {
        // A run is possible only for several chunks of one length. Then only the chunks that
        // can be reserved now, each key once, count towards it and draw from it (a refused
        // request must not evict anything, and a key refused here whose entry the run then
        // evicted must not take a slot sized for others). A single put costs nothing more.
        let mut fresh = Vec::new();
        let mut run = None;
        if let Some((&len, rest)) = lens.split_first() {
            if !rest.is_empty() && rest.iter().all(|&l| l == len) {
                let mut seen = HashSet::with_capacity(keys.len());
                fresh = keys
                    .iter()
                    .map(|key| self.check_new(key, len).is_ok() && seen.insert(*key))
                    .collect();
                run = self.reserve_run(len, fresh.iter().filter(|&&f| f).count() as u64);
            }
        }
        let out = keys
            .iter()
            .zip(lens)
            .enumerate()
            .map(|(i, (key, &len))| {
                let run = if fresh.get(i) == Some(&true) { run.as_mut() } else { None };
                match self.reserve_one(session, key, len, run) {
                    Ok(r) => r,
                    Err(code) => {
                        self.metrics.count_error(code);
                        Reservation::Failed(code)
                    }
                }
            })
            .collect();
        if let Some(rest) = run.and_then(SlotRun::rest) {
            self.alloc.free(rest);
        }
        out
    }

    /// For a reservation of several chunks of one size (a GPU job's part on this shard, a
    /// batched put): one extent for all of them, so that their slots sit side by side in the
    /// arena and a GPU copy moves them as one host run instead of one per chunk (runs under a
    /// megabyte copy a few percent slower). Victims are evicted only while the free pages are
    /// fewer than the chunks need, as the chunk-by-chunk path would; when no run fits, that
    /// path places the chunks (None). `count` chunks of `len` bytes; a run is for two or more.
    fn reserve_run(&mut self, len: u64, count: u64) -> Option<SlotRun> {
        if count < 2 || len == 0 {
            return None;
        }
        let each = ExtentAllocator::pages_for(len);
        let total = each.checked_mul(count)?;
        if total > self.alloc.capacity_pages() {
            return None;
        }
        loop {
            if let Some(extent) = self.alloc.alloc(total) {
                return Some(SlotRun {
                    next: extent.start_page,
                    end: extent.start_page + total,
                    each,
                });
            }
            if self.alloc.capacity_pages() - self.alloc.used_pages() >= total {
                // Enough room, in pieces: the chunks go there one by one.
                return None;
            }
            self.evict_one()?;
        }
    }

    fn reserve_one(
        &mut self,
        session: SessionId,
        key: &ChunkKey,
        len: u64,
        run: Option<&mut SlotRun>,
    ) -> Result<Reservation, ErrorCode> {
        self.check_new(key, len)?;
        self.quota_room(key.namespace, ExtentAllocator::pages_for(len))?;
        let extent = match run.and_then(|r| r.take(len)) {
            Some(extent) => extent,
            None => self.allocate(key.namespace, len)?,
        };
        let generation = self.next_generation();
        let idx = self.entries.insert_reserved(*key, session, extent, len, generation);
        self.sessions.entry(session).or_default().reservations.insert(idx);
        self.reservations += 1;
        Ok(Reservation::Slot { offset: self.slice.offset() + extent.offset(), len, generation })
    }

    /// Why `key` cannot be reserved with `len` bytes now, if it cannot.
    fn check_new(&self, key: &ChunkKey, len: u64) -> Result<(), ErrorCode> {
        let ns = self.namespaces.get(&key.namespace).ok_or(ErrorCode::UnknownNamespace)?;
        if len == 0 {
            return Err(ErrorCode::InvalidArgument);
        }
        if len > ns.max_chunk_bytes {
            return Err(ErrorCode::TooLarge);
        }
        if let Some(idx) = self.entries.find(key) {
            return Err(match self.entries.get(idx).state {
                EntryState::Ready | EntryState::Demoting => ErrorCode::AlreadyPresent,
                EntryState::Reserved { .. } => ErrorCode::Busy,
            });
        }
        if self.ssd.as_ref().is_some_and(|ssd| ssd.get(key).is_some()) {
            return Err(ErrorCode::AlreadyPresent);
        }
        Ok(())
    }

    /// Allocates an extent for `len` bytes, evicting SIEVE victims if needed (a bounded number
    /// per call: when leased entries fragment the slice, emptying the cache could still not
    /// make room).
    pub(crate) fn allocate(
        &mut self,
        namespace: u64,
        len: u64,
    ) -> Result<crate::alloc::Extent, ErrorCode> {
        let pages = ExtentAllocator::pages_for(len);
        if pages > self.alloc.capacity_pages() {
            return Err(ErrorCode::NoSpace);
        }
        self.quota_room(namespace, pages)?;
        let mut budget = MAX_EVICTIONS_PER_RESERVATION.max(2 * pages);
        loop {
            if let Some(extent) = self.alloc.alloc(pages) {
                return Ok(extent);
            }
            if budget == 0 {
                return Err(ErrorCode::NoSpace);
            }
            budget -= 1;
            self.evict_one().ok_or(ErrorCode::NoSpace)?;
        }
    }

    /// Makes `namespace` fit `pages` more under its limit by evicting its own victims;
    /// `QuotaExceeded` (counted) when they do not make room.
    fn quota_room(&mut self, namespace: u64, pages: u64) -> Result<(), ErrorCode> {
        let limit = self.quotas.of(namespace).dram_limit_pages;
        if limit == 0 {
            return Ok(());
        }
        while self.entries.namespace_pages(namespace) + pages > limit {
            let Some(victim) = self.entries.pick_victim_sparing(|_| 0, Some(namespace)) else {
                self.metrics.quota_refusals += 1;
                return Err(ErrorCode::QuotaExceeded);
            };
            let e = self.entries.remove(victim);
            self.alloc.free(e.extent);
            self.metrics.evictions += 1;
        }
        Ok(())
    }

    /// Evicts the next victim and frees its extent (None when nothing can be evicted), sparing
    /// namespaces at their guarantee.
    fn evict_one(&mut self) -> Option<()> {
        let quotas = &self.quotas;
        let victim =
            self.entries.pick_victim_sparing(|ns| quotas.of(ns).dram_guarantee_pages, None)?;
        let evicted = self.entries.remove(victim);
        self.alloc.free(evicted.extent);
        self.metrics.evictions += 1;
        Some(())
    }

    /// A fresh slot generation.
    pub(crate) fn next_generation(&mut self) -> u64 {
        let g = self.next_generation;
        self.next_generation += 1;
        g
    }

    /// Finds the reservation `slot` of `session`, or says why it is not one.
    fn owned_reservation(&self, session: SessionId, slot: &SlotRef) -> Result<EntryIdx, ErrorCode> {
        let idx = self.entries.find(&slot.key).ok_or(ErrorCode::NotFound)?;
        let e = self.entries.get(idx);
        if e.state != (EntryState::Reserved { owner: session }) {
            return Err(ErrorCode::NotFound);
        }
        if e.generation != slot.generation {
            return Err(ErrorCode::StaleGeneration);
        }
        Ok(idx)
    }

    fn drop_reservation(&mut self, session: SessionId, idx: EntryIdx) {
        if let Some(h) = self.sessions.get_mut(&session) {
            h.reservations.remove(&idx);
        }
        self.reservations -= 1;
    }

    /// The checksum of a slot's bytes (at a slice offset, of a length), hashed now.
    fn hash_here(&self, _slot: &SlotRef, offset: u64, len: u64) -> u64 {
        orbitkv_proto::chunk_checksum(self.slice.bytes(offset, len))
    }

    /// Commits a reservation. `summed`: a checksum computed elsewhere (the GPU) and whether to
    /// verify it against the bytes; without one, the shard computes it. `own` gives the
    /// checksum of the slot's bytes (at a slice offset, of a length): [`ShardCore::hash_here`],
    /// or one hashed before.
    fn commit(
        &mut self,
        session: SessionId,
        slot: &SlotRef,
        summed: Option<(u64, bool)>,
        own: impl Fn(&Self, &SlotRef, u64, u64) -> u64,
    ) -> Result<(), ErrorCode> {
        let idx = self.owned_reservation(session, slot)?;
        let (offset, len) = {
            let e = self.entries.get(idx);
            (e.extent.offset(), e.len)
        };
        let checksum = match summed {
            None => own(self, slot, offset, len),
            Some((sum, verify)) => {
                if verify {
                    self.metrics.given_checksums_verified += 1;
                    let own = own(self, slot, offset, len);
                    if own != sum {
                        // The writer (the GPU, or an engine) hashed its pages, this the bytes
                        // that landed: either is wrong, and a cache can afford the miss. Not
                        // stored.
                        self.metrics.given_checksum_mismatches += 1;
                        tracing::error!(
                            shard = self.cfg.id,
                            len,
                            given = sum,
                            computed = own,
                            "a checksum given with a commit differs from the chunk's bytes in the arena; chunk dropped"
                        );
                        self.abort(session, slot)?;
                        return Err(ErrorCode::ChecksumMismatch);
                    }
                }
                self.metrics.given_checksums += 1;
                sum
            }
        };
        self.entries.make_ready(idx, checksum);
        self.drop_reservation(session, idx);
        self.metrics.commits += 1;
        self.metrics.bytes_committed += len;
        Ok(())
    }

    fn abort(&mut self, session: SessionId, slot: &SlotRef) -> Result<(), ErrorCode> {
        let idx = self.owned_reservation(session, slot)?;
        let e = self.entries.remove(idx);
        self.alloc.free(e.extent);
        self.drop_reservation(session, idx);
        Ok(())
    }

    fn release(&mut self, session: SessionId, slot: &SlotRef) -> Result<(), ErrorCode> {
        let idx = self.entries.find(&slot.key).ok_or(ErrorCode::NotFound)?;
        if self.entries.get(idx).generation != slot.generation {
            return Err(ErrorCode::StaleGeneration);
        }
        let holdings = self.sessions.get_mut(&session).ok_or(ErrorCode::NotFound)?;
        let count = holdings.leases.get_mut(&idx).ok_or(ErrorCode::NotFound)?;
        *count -= 1;
        if *count == 0 {
            holdings.leases.remove(&idx);
        }
        self.entries.get_mut(idx).leases -= 1;
        self.leases -= 1;
        Ok(())
    }

    /// Removes a chunk from every tier; leased or demoting chunks answer `Busy`. Its SSD
    /// record is deleted by a tombstone (started here; see
    /// [`ShardCore::take_started_tombstones`]), so that it never comes back at recovery;
    /// `Busy` when the SSD tier cannot start one now.
    fn evict(&mut self, key: &ChunkKey) -> Result<(), ErrorCode> {
        self.evict_key(key, true)
    }

    /// [`ShardCore::evict`]; without `tombstone` the caller has deleted its SSD record
    /// durably already (a namespace tombstone) or will not.
    fn evict_key(&mut self, key: &ChunkKey, tombstone: bool) -> Result<(), ErrorCode> {
        let on_ssd = self.ssd.as_ref().is_some_and(|ssd| ssd.get(key).is_some());
        let in_dram = match self.entries.find(key).map(|idx| (idx, self.entries.get(idx))) {
            // Demoting (a write reads the slot), promoting (a read fills it) or leased.
            Some((_, e))
                if e.state == EntryState::Demoting
                    || e.state == (EntryState::Reserved { owner: SessionId::MAX })
                    || e.state
                        == (EntryState::Reserved { owner: crate::inventory::PEER_PROMOTER })
                    || (e.state.visible() && e.leases > 0) =>
            {
                return Err(ErrorCode::Busy)
            }
            Some((idx, e)) if e.state == EntryState::Ready => Some(idx),
            _ if !on_ssd => return Err(ErrorCode::NotFound),
            _ => None,
        };
        if let Some(ssd) = self.ssd.as_mut().filter(|_| on_ssd) {
            if tombstone {
                let ticket =
                    ssd.tombstone(RecordKind::Tombstone, *key).map_err(|_| ErrorCode::Busy)?;
                self.started_tombstone(ticket, *key, 1);
            } else {
                ssd.remove(key);
            }
        }
        if let Some(idx) = in_dram {
            let e = self.entries.remove(idx);
            self.alloc.free(e.extent);
        }
        self.metrics.removals += 1;
        Ok(())
    }

    /// Removes every chunk of namespace `namespace` (of every namespace with None) from every
    /// tier, as [`ShardOp::Evict`] does key by key. Chunks that are leased, or that a tier
    /// is moving, stay and are counted as busy; writes not yet committed are left alone.
    pub fn evict_namespace(&mut self, namespace: Option<u64>) -> EvictSummary {
        self.evict_namespace_once(namespace).0
    }

    /// [`ShardCore::evict_namespace`], and how many of the chunks it left stayed because the
    /// SSD tier could not start the namespace's tombstone now (its queue full, or a region
    /// being opened): evict again once the tombstones in flight have landed.
    pub fn evict_namespace_once(&mut self, namespace: Option<u64>) -> (EvictSummary, u64) {
        let wanted = |k: &&ChunkKey| namespace.is_none_or(|n| k.namespace == n);
        let mut keys: HashSet<ChunkKey> = self.entries.keys().filter(wanted).copied().collect();
        let on_ssd: HashSet<ChunkKey> =
            self.ssd.iter().flat_map(|ssd| ssd.keys().filter(wanted).copied()).collect();
        keys.extend(&on_ssd);
        // One tombstone for the namespace (or everything) deletes its SSD records durably.
        let mut recorded = false;
        if let Some(ssd) = self.ssd.as_mut().filter(|_| !on_ssd.is_empty()) {
            let (kind, key) = match namespace {
                Some(n) => (RecordKind::NamespaceTombstone, ChunkKey::new(n, [0; 32])),
                None => (RecordKind::EverythingTombstone, ChunkKey::new(0, [0; 32])),
            };
            if let Ok(ticket) = ssd.tombstone(kind, key) {
                self.started_tombstone(ticket, key, on_ssd.len() as u64);
                recorded = true;
            }
        }
        let mut summary = EvictSummary::default();
        let mut unrecorded = 0;
        for key in keys {
            if on_ssd.contains(&key) && !recorded {
                // Its deletion could not be recorded now: it stays, to be evicted again.
                summary.busy += 1;
                unrecorded += 1;
                continue;
            }
            match self.evict_key(&key, false) {
                Ok(()) => summary.removed += 1,
                // On SSD only: the tombstone took it.
                Err(ErrorCode::NotFound) if on_ssd.contains(&key) => {
                    self.metrics.removals += 1;
                    summary.removed += 1;
                }
                Err(ErrorCode::Busy) => summary.busy += 1,
                // A reservation not yet committed: not a chunk yet.
                Err(_) => {}
            }
        }
        (summary, unrecorded)
    }

    /// Drops every lease and reservation of `session`; returns (leases, reservations) dropped.
    fn close_session(&mut self, session: SessionId) -> (u64, u64) {
        let Some(h) = self.sessions.remove(&session) else {
            return (0, 0);
        };
        let mut leases = 0;
        for (idx, count) in h.leases {
            self.entries.get_mut(idx).leases -= count;
            leases += count as u64;
        }
        let reservations = h.reservations.len() as u64;
        for idx in h.reservations {
            let e = self.entries.remove(idx);
            self.alloc.free(e.extent);
        }
        self.leases -= leases;
        self.reservations -= reservations;
        self.metrics.sessions_reclaimed += 1;
        (leases, reservations)
    }

    /// A snapshot for `ctl stats`.
    pub fn stats(&self) -> ShardStats {
        let m = &self.metrics;
        ShardStats {
            id: self.cfg.id,
            dram_capacity_bytes: self.slice.len(),
            dram_used_bytes: self.alloc.used_pages() * crate::PAGE_SIZE,
            entries: self.entries.ready_count() + self.demoting,
            ssd: self.ssd.as_ref().map(|s| s.stats()),
            ssd_hits: m.ssd_hits,
            demotions: m.demotions,
            promotions: m.promotions,
            admission_rejections: m.admission_rejections,
            peer_hits: m.peer_hits,
            peer_fetches: m.peer_fetches,
            peer_bytes: m.peer_bytes,
            peer_fetch_failures: m.peer_fetch_failures,
            peer_checksum_mismatches: m.peer_checksum_mismatches,
            peer_grants: m.peer_grants,
            catalog_entries: self.catalog_len() as u64,
            reservations: self.reservations,
            leases: self.leases,
            namespaces: self.namespaces.len() as u64,
            hits: m.hits,
            misses: m.misses,
            evictions: m.evictions,
            quota_refusals: m.quota_refusals,
            ssd_quota_drops: m.ssd_quota_drops,
            removals: m.removals,
            commits: m.commits,
            bytes_committed: m.bytes_committed,
            given_checksums: m.given_checksums,
            given_checksums_verified: m.given_checksums_verified,
            given_checksum_mismatches: m.given_checksum_mismatches,
            errors: ErrorCode::ALL
                .into_iter()
                .filter(|c| m.errors[c.index()] > 0)
                .map(|c| (c, m.errors[c.index()]))
                .collect(),
            latency: self.latencies(),
        }
    }

    /// The request latencies recorded here, and the SSD tier's.
    fn latencies(&self) -> Vec<(OpKind, LatencyHistogram)> {
        let mut all = self.metrics.latencies();
        if let Some(ssd) = &self.ssd {
            let (reads, writes) = ssd.latencies();
            for (op, h) in [(OpKind::SsdRead, reads), (OpKind::SsdWrite, writes)] {
                if h.count() > 0 {
                    all.push((op, h.clone()));
                }
            }
        }
        all
    }
}

#[cfg(test)]
mod tests;
