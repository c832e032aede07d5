//! The region log of one shard's SSD file: where records go, which are live, what recovery
//! finds. Pure bookkeeping; the I/O is done by the caller (the shard's io_uring ring).
//!
//! Regions are written one at a time, front to back. When the active region is full the next
//! free region becomes active; when none is free the oldest sealed region is reclaimed whole
//! (its records leave the index) unless a read is still using it. Every (re)use of a region
//! gets a new generation, stamped into each record, so leftovers of an earlier use are never
//! mistaken for current records.

use std::collections::{HashMap, VecDeque};

use orbitkv_proto::ChunkKey;

use super::format::{FormatError, RecordHeader, RecordKind, Superblock, RECORD_HEADER_BYTES};
use orbitkv_proto::PAGE_SIZE;

/// Free regions at or below which the records a namespace's SSD guarantee keeps are moved
/// out of the oldest region ([`RegionLog::relocation_candidate`]): its reclaim is near.
pub const RELOCATE_AT_FREE_REGIONS: usize = 2;

/// Bytes of SSD records each namespace keeps through region reclaim
/// (`--namespace-ssd-guarantee`, a shard's share).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SsdGuarantees {
    /// Of a namespace not in `by_namespace`.
    pub default: u64,
    /// Of these namespaces.
    pub by_namespace: HashMap<u64, u64>,
}

impl SsdGuarantees {
    /// Namespace `ns`'s.
    pub fn of(&self, ns: u64) -> u64 {
        self.by_namespace.get(&ns).copied().unwrap_or(self.default)
    }

    /// Whether any namespace has one.
    pub fn any(&self) -> bool {
        self.default > 0 || self.by_namespace.values().any(|&g| g > 0)
    }
}

/// Where a live record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdEntry {
    /// Region index.
    pub region: u32,
    /// File offset of the record's header block; the payload follows it.
    pub offset: u64,
    /// Payload bytes.
    pub len: u64,
    /// xxh3-64 of the payload.
    pub checksum: u64,
    /// Write order.
    pub sequence: u64,
}

impl SsdEntry {
    /// File offset of the payload.
    pub fn payload_offset(&self) -> u64 {
        self.offset + RECORD_HEADER_BYTES
    }

    /// Bytes the record takes on disk, its header included.
    pub fn disk_bytes(&self) -> u64 {
        RECORD_HEADER_BYTES + self.len.div_ceil(PAGE_SIZE) * PAGE_SIZE
    }
}

/// A place handed out for one record, not visible until [`RegionLog::complete_write`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The header to write (already filled in).
    pub header: RecordHeader,
    /// Region index.
    pub region: u32,
    /// File offset of the header block.
    pub offset: u64,
}

/// Why a record could not be placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// The record is larger than a region.
    #[error("record larger than a region")]
    TooLarge,
    /// Every region is in use by reads or writes in flight.
    #[error("no region can be reclaimed now")]
    Busy,
}

#[derive(Clone, Debug, Default)]
struct Region {
    generation: u64,
    /// Bytes handed out from the region's start.
    used: u64,
    /// Keys whose live record is here (for reclaim).
    keys: Vec<ChunkKey>,
    /// Reads and writes in flight.
    pins: u32,
    /// The region's first record of this generation is not on disk yet: until it is, no
    /// other record goes into the region (recovery reads a region's generation from its
    /// first block, so nothing may land behind a first block still holding old data).
    opening: bool,
}

/// What recovery found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Records now in the index.
    pub kept: u64,
    /// Records superseded by a newer record of the same key.
    pub superseded: u64,
    /// Header blocks that failed validation where a record was expected.
    pub dropped: u64,
    /// Records deleted by a later tombstone (of their key, namespace, or everything).
    pub deleted: u64,
    /// Regions left out because a later record says they had been reclaimed (their first
    /// write after the reclaim never landed).
    pub reclaimed: u64,
}

/// The region log; see the module docs.
#[derive(Debug)]
pub struct RegionLog {
    sb: Superblock,
    regions: Vec<Region>,
    active: Option<u32>,
    sealed: VecDeque<u32>,
    free: VecDeque<u32>,
    index: HashMap<ChunkKey, SsdEntry>,
    next_sequence: u64,
    next_generation: u64,
    used_bytes: u64,
    /// Bytes on disk of the live records of each namespace (headers included).
    ns_bytes: HashMap<u64, u64>,
    /// Bytes of records each namespace keeps through reclaim.
    guarantees: SsdGuarantees,
    /// A region (and its generation) whose hold was given up ([`RegionLog::abandon_hold`]):
    /// its reclaim goes ahead.
    abandoned: Option<(u32, u64)>,
    /// Bumped by every change of the index or the regions (a cache key for callers).
    changes: u64,
    /// Live records dropped by region reclaim.
    reclaimed: u64,
}

impl RegionLog {
    /// An empty log over the file described by `sb`.
    pub fn new(sb: Superblock) -> Self {
        Self {
            sb,
            regions: vec![Region::default(); sb.region_count as usize],
            active: None,
            sealed: VecDeque::new(),
            free: (0..sb.region_count as u32).collect(),
            index: HashMap::new(),
            next_sequence: 1,
            next_generation: 1,
            used_bytes: 0,
            ns_bytes: HashMap::new(),
            guarantees: SsdGuarantees::default(),
            abandoned: None,
            changes: 0,
            reclaimed: 0,
        }
    }

    /// A count that changes whenever records or regions do.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Sets the bytes of records each namespace keeps through reclaim. With any, one free
    /// region is kept for the rewrites that keep them (and for tombstones): ordinary records
    /// reclaim the oldest region rather than take it.
    pub fn set_guarantees(&mut self, guarantees: SsdGuarantees) {
        self.guarantees = guarantees;
        self.changes += 1;
    }

    /// Whether the oldest sealed region `r` is held from reclaim: it has records that an SSD
    /// guarantee keeps and that are not rewritten elsewhere yet.
    fn held(&self, r: u32) -> bool {
        self.sealed.front() == Some(&r) && self.relocation_candidate(&HashMap::new()).is_some()
    }

    /// Gives up the hold of the oldest region: a rewrite found no room without reclaiming it
    /// (the records it still had to move go with it).
    pub fn abandon_hold(&mut self) {
        if let Some(&r) = self.sealed.front() {
            self.abandoned = Some((r, self.regions[r as usize].generation));
            self.changes += 1;
        }
    }

    /// Whether a rewrite of `len` payload bytes can only be placed by reclaiming the held
    /// oldest region: the active region lacks room (one still opening will have it once its
    /// first record lands) and no region is free.
    pub fn rewrite_needs_held(&self, len: u64) -> bool {
        let bytes = RECORD_HEADER_BYTES + len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let active_fits = self.active.is_some_and(|r| {
            let r = &self.regions[r as usize];
            r.opening || r.used + bytes <= self.sb.region_bytes
        });
        let oldest_held = self.sealed.front().is_some_and(|&r| self.held(r));
        oldest_held && !active_fits && self.free.is_empty()
    }

    /// The file's superblock.
    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// Live records.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no record is live.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes of a region: the largest record it holds, header included.
    pub fn region_bytes(&self) -> u64 {
        self.sb.region_bytes
    }

    /// Bytes of regions in use (never more than the file's region area).
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Every live record (in no particular order).
    pub fn iter(&self) -> impl Iterator<Item = (&ChunkKey, &SsdEntry)> {
        self.index.iter()
    }

    /// What a full scan of the log's bookkeeping finds wrong (empty when it is consistent):
    /// every indexed record inside its region's used bytes and listed by it, the regions'
    /// used bytes summing to `used_bytes`, every region free, active or sealed exactly once.
    pub fn audit(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for (key, e) in &self.index {
            let r = &self.regions[e.region as usize];
            let start = self.sb.region_offset(u64::from(e.region));
            let end = e.payload_offset() + e.len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
            if e.offset < start || end > start + r.used {
                problems
                    .push(format!("record {e:?} lies outside its region's {} used bytes", r.used));
            }
            if !r.keys.contains(key) {
                problems.push(format!("region {} does not list a record it holds", e.region));
            }
        }
        let listed: usize = self.regions.iter().map(|r| r.keys.len()).sum();
        if listed != self.index.len() {
            problems.push(format!("regions list {listed} records, the index {}", self.index.len()));
        }
        let used: u64 = self.regions.iter().map(|r| r.used).sum();
        if used != self.used_bytes {
            problems.push(format!("regions use {used} bytes, the log counts {}", self.used_bytes));
        }
        let mut by_ns: HashMap<u64, u64> = HashMap::new();
        for (k, e) in &self.index {
            *by_ns.entry(k.namespace).or_default() += e.disk_bytes();
        }
        if by_ns != self.ns_bytes {
            problems.push("the bytes counted per namespace differ from the records'".into());
        }
        let mut seen = vec![0u32; self.regions.len()];
        for r in self.free.iter().chain(&self.sealed).chain(self.active.iter()) {
            seen[*r as usize] += 1;
        }
        if let Some(r) = seen.iter().position(|&n| n != 1) {
            problems.push(format!("region {r} is free, active or sealed {} times", seen[r]));
        }
        problems
    }

    /// The live record of `key`.
    pub fn get(&self, key: &ChunkKey) -> Option<SsdEntry> {
        self.index.get(key).copied()
    }

    /// Keeps the region of `entry` from being reclaimed while a read uses it.
    pub fn pin(&mut self, region: u32) {
        self.regions[region as usize].pins += 1;
    }

    /// Ends a [`RegionLog::pin`].
    pub fn unpin(&mut self, region: u32) {
        let r = &mut self.regions[region as usize];
        debug_assert!(r.pins > 0, "unpin without pin");
        r.pins -= 1;
    }

    /// Forgets a record (its payload failed its checksum, or it was promoted and removed).
    pub fn remove(&mut self, key: &ChunkKey) -> Option<SsdEntry> {
        let e = self.index.remove(key)?;
        self.changes += 1;
        self.regions[e.region as usize].keys.retain(|k| k != key);
        self.uncount(key.namespace, &e);
        Some(e)
    }

    /// Bytes on disk of namespace `ns`'s live records (headers included).
    pub fn namespace_bytes(&self, ns: u64) -> u64 {
        self.ns_bytes.get(&ns).copied().unwrap_or(0)
    }

    fn uncount(&mut self, ns: u64, e: &SsdEntry) {
        if let Some(b) = self.ns_bytes.get_mut(&ns) {
            *b -= e.disk_bytes();
            if *b == 0 {
                self.ns_bytes.remove(&ns);
            }
        }
    }

    /// Finds room for a record of `len` bytes and pins its region until
    /// [`RegionLog::complete_write`] or [`RegionLog::abort_write`]. May reclaim the oldest
    /// region: the keys it drops are returned so the caller can count them.
    pub fn place(
        &mut self,
        key: ChunkKey,
        len: u64,
        checksum: u64,
    ) -> Result<(Placement, Vec<ChunkKey>), PlaceError> {
        self.place_record(RecordKind::Chunk, key, len, checksum, false)
    }

    /// [`RegionLog::place`] for a record rewritten to keep an SSD guarantee: it may take the
    /// last free region while the oldest is held.
    pub fn place_rewrite(
        &mut self,
        key: ChunkKey,
        len: u64,
        checksum: u64,
    ) -> Result<(Placement, Vec<ChunkKey>), PlaceError> {
        self.place_record(RecordKind::Chunk, key, len, checksum, true)
    }

    /// Finds room for a tombstone (a header block alone) as [`RegionLog::place`] does. A
    /// tombstone deletes only records written before it: its key's (`Tombstone`), its key's
    /// namespace's (`NamespaceTombstone`) or all (`EverythingTombstone`). It outlives every
    /// record it deletes: those lie in its region or in older ones, and regions are
    /// reclaimed oldest first.
    pub fn place_tombstone(
        &mut self,
        kind: RecordKind,
        key: ChunkKey,
    ) -> Result<(Placement, Vec<ChunkKey>), PlaceError> {
        debug_assert_ne!(kind, RecordKind::Chunk, "a tombstone");
        self.place_record(kind, key, 0, 0, true)
    }

    fn place_record(
        &mut self,
        kind: RecordKind,
        key: ChunkKey,
        len: u64,
        checksum: u64,
        reserved: bool,
    ) -> Result<(Placement, Vec<ChunkKey>), PlaceError> {
        let mut header = RecordHeader {
            kind,
            key,
            len,
            checksum,
            sequence: 0,
            region_generation: 0,
            reclaimed_below: 0,
        };
        let bytes = header.disk_bytes();
        if bytes > self.sb.region_bytes {
            return Err(PlaceError::TooLarge);
        }
        let mut dropped = Vec::new();
        let fits = |log: &Self, r: u32| log.regions[r as usize].used + bytes <= log.sb.region_bytes;
        let region = match self.active {
            Some(r) if self.regions[r as usize].opening => return Err(PlaceError::Busy),
            Some(r) if fits(self, r) => r,
            _ => {
                // With SSD guarantees one free region is kept for rewrites and tombstones:
                // an ordinary record refills it first, and reclaims the oldest region rather
                // than take it (unless no region is sealed: a log too small to keep one).
                let spare = usize::from(self.guarantees.any() && !reserved);
                if self.free.len() < spare {
                    let oldest = self.reclaimable_oldest()?;
                    dropped = self.reclaim(oldest);
                    self.free.push_back(oldest);
                }
                let next = if self.free.len() > spare || self.sealed.is_empty() {
                    self.free.pop_front().ok_or(PlaceError::Busy)?
                } else {
                    let oldest = self.reclaimable_oldest()?;
                    dropped.extend(self.reclaim(oldest));
                    oldest
                };
                if let Some(old) = self.active.replace(next) {
                    self.sealed.push_back(old);
                }
                let r = &mut self.regions[next as usize];
                r.generation = self.next_generation;
                self.next_generation += 1;
                r.used = 0;
                r.opening = true;
                next
            }
        };
        let r = &mut self.regions[region as usize];
        header.sequence = self.next_sequence;
        self.next_sequence += 1;
        header.region_generation = r.generation;
        let offset = self.sb.region_offset(region as u64) + r.used;
        header.reclaimed_below = self.oldest_generation_in_use();
        let r = &mut self.regions[region as usize];
        r.used += bytes;
        r.pins += 1;
        self.used_bytes += bytes;
        self.changes += 1;
        Ok((Placement { header, region, offset }, dropped))
    }

    /// The generation of the oldest region holding records (sealed, or the active one):
    /// every older generation was reclaimed.
    fn oldest_generation_in_use(&self) -> u64 {
        let generation = |r: u32| self.regions[r as usize].generation;
        let sealed = self.sealed.front().map(|&r| generation(r));
        let active = self.active.map(generation);
        sealed.into_iter().chain(active).min().unwrap_or(0)
    }

    /// Takes the oldest sealed region out of the sealed list for reclaim; `Busy` when there is
    /// none, or a read or write is using it, or an SSD guarantee still holds it.
    fn reclaimable_oldest(&mut self) -> Result<u32, PlaceError> {
        let oldest = *self.sealed.front().ok_or(PlaceError::Busy)?;
        if self.regions[oldest as usize].pins > 0 || self.held(oldest) {
            return Err(PlaceError::Busy);
        }
        self.sealed.pop_front();
        Ok(oldest)
    }

    fn reclaim(&mut self, region: u32) -> Vec<ChunkKey> {
        self.changes += 1;
        let r = &mut self.regions[region as usize];
        let keys = std::mem::take(&mut r.keys);
        self.used_bytes -= r.used;
        r.used = 0;
        for k in &keys {
            if let Some(e) = self.index.remove(k) {
                self.uncount(k.namespace, &e);
                self.reclaimed += 1;
            }
        }
        keys
    }

    /// Live records dropped by region reclaim so far.
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed
    }

    /// A record of the oldest sealed region to rewrite at the head before that region is
    /// reclaimed, once at most `RELOCATE_AT_FREE_REGIONS` regions are free: one of a
    /// namespace whose records elsewhere (counting `moving`, records being rewritten) hold
    /// less than its guarantee. None when no record needs it, when that region's hold was
    /// given up, or when the guarantees of the namespaces present would take more than the
    /// log less two regions (they cannot all be kept: reclaim goes on as without them).
    pub fn relocation_candidate(
        &self,
        moving: &HashMap<ChunkKey, SsdEntry>,
    ) -> Option<(ChunkKey, SsdEntry)> {
        if !self.guarantees.any() {
            return None;
        }
        let guarantee = |ns| self.guarantees.of(ns);
        if self.free.len() > RELOCATE_AT_FREE_REGIONS {
            return None;
        }
        let oldest = *self.sealed.front()?;
        if self.abandoned == Some((oldest, self.regions[oldest as usize].generation)) {
            return None;
        }
        let keys = &self.regions[oldest as usize].keys;
        // Bytes of each namespace in the oldest region, less those already being moved.
        let mut here: HashMap<u64, u64> = HashMap::new();
        for k in keys {
            if let (Some(e), false) = (self.index.get(k), moving.contains_key(k)) {
                *here.entry(k.namespace).or_default() += e.disk_bytes();
            }
        }
        let needy = |k: &ChunkKey| {
            let g = guarantee(k.namespace);
            g > 0 && self.namespace_bytes(k.namespace) - here[&k.namespace] < g
        };
        let pick = keys.iter().find(|k| !moving.contains_key(k) && needy(k))?;
        let kept: u64 = self.ns_bytes.iter().map(|(&ns, &b)| b.min(guarantee(ns))).sum();
        let room = (self.sb.region_count.saturating_sub(2)) * self.sb.region_bytes;
        if kept > room {
            return None;
        }
        Some((*pick, self.index[pick]))
    }

    /// The record at `p` is on disk: make it the key's live record.
    pub fn complete_write(&mut self, p: &Placement) {
        self.complete_write_over(p, None);
    }

    /// The record at `p` is on disk: make it the key's live record, if `over` is None or
    /// still the key's live record (a rewrite of a record deleted, failed or promoted
    /// meanwhile is not brought back; recovery sees it older than the tombstone of a
    /// deletion, and the bytes of any other record of the key are the same).
    pub fn complete_write_over(&mut self, p: &Placement, over: Option<SsdEntry>) {
        self.unpin(p.region);
        self.changes += 1;
        if p.offset == self.sb.region_offset(p.region as u64) {
            self.regions[p.region as usize].opening = false;
        }
        if self.regions[p.region as usize].generation != p.header.region_generation {
            return; // reclaimed meanwhile (cannot happen while pinned; kept for safety)
        }
        if p.header.kind != RecordKind::Chunk {
            // A tombstone on disk: what it deletes left the index when it was placed (and a
            // record of its key written since is newer than it).
            return;
        }
        if over.is_some_and(|o| self.index.get(&p.header.key) != Some(&o)) {
            return;
        }
        let entry = SsdEntry {
            region: p.region,
            offset: p.offset,
            len: p.header.len,
            checksum: p.header.checksum,
            sequence: p.header.sequence,
        };
        if let Some(old) = self.index.insert(p.header.key, entry) {
            self.regions[old.region as usize].keys.retain(|k| *k != p.header.key);
            self.uncount(p.header.key.namespace, &old);
        }
        *self.ns_bytes.entry(p.header.key.namespace).or_default() += entry.disk_bytes();
        self.regions[p.region as usize].keys.push(p.header.key);
    }

    /// The write at `p` failed: its space stays used until the region is reclaimed.
    pub fn abort_write(&mut self, p: &Placement) {
        self.unpin(p.region);
        self.changes += 1;
        if p.offset == self.sb.region_offset(p.region as u64) {
            // The region's first block may still hold an earlier generation: write nothing
            // more into it; the next record opens another region.
            let r = &mut self.regions[p.region as usize];
            r.opening = false;
            self.used_bytes += self.sb.region_bytes - r.used;
            r.used = self.sb.region_bytes;
        }
    }

    /// Rebuilds the log from the file. `read` reads `len` bytes at a file offset (the caller
    /// does the I/O). Each region is scanned from its start; the records of its newest
    /// generation are kept, a newer record of a key supersedes an older one, and a block
    /// that fails validation or belongs to an earlier use of the region is skipped (a torn
    /// record, or a write that failed: the scan probes the following blocks for further
    /// records of the same generation).
    pub fn recover(
        sb: Superblock,
        mut read: impl FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<(Self, RecoveryReport)> {
        let mut log = Self::new(sb);
        let mut report = RecoveryReport::default();
        let mut scan = RegionScan {
            reader: BlockReader::new(&mut read),
            block: vec![0u8; RECORD_HEADER_BYTES as usize],
            max_sequence: 0,
            max_generation: 0,
            reclaimed_below: 0,
        };
        let mut found: Vec<(u32, u64, Vec<Placement>, u64)> = Vec::new();
        for region in 0..sb.region_count as u32 {
            if let Some((g, records, end)) = scan.region(sb, region, &mut report)? {
                found.push((region, g, records, end));
            }
        }
        // A region still showing a generation that a later record says was reclaimed: its
        // first write after the reclaim never landed. What it holds was dropped (and may
        // have been deleted since, by a tombstone reclaimed in turn): it stays free.
        found.retain(|(_, g, _, _)| {
            let keep = *g >= scan.reclaimed_below;
            report.reclaimed += u64::from(!keep);
            keep
        });
        let found = found
            .into_iter()
            .map(|(region, g, records, end)| {
                log.regions[region as usize].used = end;
                log.used_bytes += end;
                (region, g, records)
            })
            .collect();
        log.install(found, &mut report);
        // Every recovered region stays sealed: new records go to a fresh region (a new
        // generation), never after possible leftovers of the crashed run.
        log.active = None;
        log.next_sequence = log.next_sequence.max(scan.max_sequence + 1);
        log.next_generation = log.next_generation.max(scan.max_generation + 1);
        report.kept = log.index.len() as u64;
        Ok((log, report))
    }

    /// Seals the recovered regions, oldest generation first, and indexes their records in
    /// sequence order (a later record of a key supersedes an earlier one; a tombstone deletes
    /// what came before it).
    fn install(&mut self, mut found: Vec<(u32, u64, Vec<Placement>)>, report: &mut RecoveryReport) {
        // Oldest generation first: sealed order, and later records win.
        found.sort_by_key(|(_, g, _)| *g);
        let mut all: Vec<Placement> = Vec::new();
        for (region, g, records) in &found {
            let r = &mut self.regions[*region as usize];
            r.generation = *g;
            self.free.retain(|f| f != region);
            self.sealed.push_back(*region);
            self.next_generation = self.next_generation.max(g + 1);
            all.extend(records.iter().copied());
        }
        all.sort_by_key(|p| p.header.sequence);
        for p in &all {
            self.next_sequence = self.next_sequence.max(p.header.sequence + 1);
            let key = p.header.key;
            let deleted: Vec<ChunkKey> = match p.header.kind {
                RecordKind::Chunk => {
                    self.regions[p.region as usize].pins += 1; // complete_write unpins
                    if self.index.contains_key(&key) {
                        report.superseded += 1;
                    }
                    self.complete_write(p);
                    continue;
                }
                RecordKind::Tombstone => {
                    self.index.contains_key(&key).then_some(key).into_iter().collect()
                }
                RecordKind::NamespaceTombstone => {
                    self.index.keys().filter(|k| k.namespace == key.namespace).copied().collect()
                }
                RecordKind::EverythingTombstone => self.index.keys().copied().collect(),
            };
            report.deleted += deleted.len() as u64;
            for k in &deleted {
                self.remove(k);
            }
        }
    }
}

/// Recovery's scan of the regions, one after another.
struct RegionScan<'a, F> {
    reader: BlockReader<'a, F>,
    /// A header block's bytes.
    block: Vec<u8>,
    /// Highest sequence and generation of any valid header, kept or not: new writes must
    /// never reuse them, or a leftover could later pass for a current record.
    max_sequence: u64,
    max_generation: u64,
    /// Highest `reclaimed_below` of any valid header: regions of older generations were
    /// reclaimed.
    reclaimed_below: u64,
}

impl<F: FnMut(u64, &mut [u8]) -> std::io::Result<()>> RegionScan<'_, F> {
    /// Scans `region` from its start: its newest generation, that generation's records in
    /// order and where they end; None for a region never written.
    fn region(
        &mut self,
        sb: Superblock,
        region: u32,
        report: &mut RecoveryReport,
    ) -> std::io::Result<Option<(u64, Vec<Placement>, u64)>> {
        let base = sb.region_offset(region as u64);
        let mut at = 0u64;
        let mut generation = None;
        let mut last_seq = 0u64;
        let mut records = Vec::new();
        let mut end = 0u64;
        let mut scanning = false;
        while at + RECORD_HEADER_BYTES <= sb.region_bytes {
            self.reader.block(base + at, base + sb.region_bytes, scanning, &mut self.block)?;
            scanning = true; // until a record is found below
            let decoded = RecordHeader::decode(&self.block);
            if let Ok(h) = &decoded {
                self.max_sequence = self.max_sequence.max(h.sequence);
                self.max_generation = self.max_generation.max(h.region_generation);
                self.reclaimed_below = self.reclaimed_below.max(h.reclaimed_below);
            }
            match decoded {
                Ok(h)
                    if generation.is_none_or(|g| g == h.region_generation)
                        && h.sequence > last_seq
                        && at.checked_add(h.disk_bytes()).is_some_and(|e| e <= sb.region_bytes) =>
                {
                    generation = Some(h.region_generation);
                    last_seq = h.sequence;
                    records.push(Placement { header: h, region, offset: base + at });
                    at += h.disk_bytes();
                    end = at;
                    scanning = false;
                }
                // An earlier use of the region: where this generation's log ends, or
                // where one of its writes failed (its block never written) with later
                // records after it. Look further, as past a torn record.
                Ok(_) => at += PAGE_SIZE,
                Err(FormatError::BadMagic) if generation.is_none() => break, // never written
                // Unwritten space, or a payload block: look further for records that
                // completed after a torn one.
                Err(FormatError::BadMagic) => at += PAGE_SIZE,
                Err(_) => {
                    // One of our header blocks, torn or corrupted.
                    report.dropped += 1;
                    at += PAGE_SIZE;
                }
            }
        }
        Ok(generation.map(|g| (g, records, end)))
    }
}

/// Bytes read at once while recovery scans block by block past a gap.
const SCAN_WINDOW: u64 = 1 << 20;

/// Reads header blocks for recovery: one block where a record is expected, a window of
/// [`SCAN_WINDOW`] bytes while scanning block by block (unwritten space, or past a torn
/// record), so a scan costs one read per window rather than one per block.
struct BlockReader<'a, F> {
    read: &'a mut F,
    window: Vec<u8>,
    window_at: u64,
}

impl<'a, F: FnMut(u64, &mut [u8]) -> std::io::Result<()>> BlockReader<'a, F> {
    fn new(read: &'a mut F) -> Self {
        Self { read, window: Vec::new(), window_at: 0 }
    }

    /// Fills `out` (one block) with the bytes at `at`; `limit` is where the region ends.
    fn block(
        &mut self,
        at: u64,
        limit: u64,
        scanning: bool,
        out: &mut [u8],
    ) -> std::io::Result<()> {
        let n = out.len() as u64;
        if at >= self.window_at && at + n <= self.window_at + self.window.len() as u64 {
            let from = (at - self.window_at) as usize;
            out.copy_from_slice(&self.window[from..from + out.len()]);
            return Ok(());
        }
        if !scanning {
            return (self.read)(at, out);
        }
        let len = SCAN_WINDOW.min(limit - at).max(n) / n * n;
        self.window.resize(len as usize, 0);
        (self.read)(at, &mut self.window)?;
        self.window_at = at;
        out.copy_from_slice(&self.window[..out.len()]);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
