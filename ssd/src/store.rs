//! One shard's SSD store: its file (opened O_DIRECT, preallocated to its share of the cap),
//! its region log and its io_uring ring; demotions (arena slot -> file) and promotions
//! (file -> arena slot, checksum verified) as asynchronous operations.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use orbitkv_proto::chunk_checksum;
use orbitkv_proto::ChunkKey;

use super::format::{
    RecordKind, Superblock, FORMAT_VERSION, RECORD_HEADER_BYTES, SUPERBLOCK_BYTES,
};
use super::log::{PlaceError, Placement, RecoveryReport, RegionLog, SsdEntry, SsdGuarantees};
use super::ring::{AlignedBlock, SsdRing};
use crate::memory::SlotMemory;
use orbitkv_proto::LatencyHistogram;
use orbitkv_proto::PAGE_SIZE;

/// Where and how big one shard's SSD store is.
#[derive(Clone, Debug)]
pub struct SsdConfig {
    /// Directory of the per-shard files.
    pub dir: PathBuf,
    /// This shard.
    pub shard_id: u32,
    /// Shards of this server run.
    pub shard_count: u32,
    /// This shard's share of the cap, in bytes (the file never exceeds it).
    pub capacity_bytes: u64,
    /// Region size (reclaim granularity).
    pub region_bytes: u64,
    /// io_uring depth.
    pub ring_depth: u32,
    /// Fault injection: delay before every I/O after recovery (zero: none).
    pub inject_delay: Duration,
    /// Fault injection: every n-th I/O after recovery fails (zero: none).
    pub inject_errors_every: u64,
    /// Fault injection: every n-th write after recovery fails with `ENOSPC` (zero: none).
    pub inject_no_space_every: u64,
}

/// Errors opening the store.
#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The configuration cannot work.
    #[error("{0}")]
    Config(String),
}

/// What opening found.
#[derive(Clone, Debug)]
pub struct OpenReport {
    /// Records kept, superseded and dropped by recovery.
    pub recovery: RecoveryReport,
    /// Why the file was started afresh (another shard count, format or geometry), if it was.
    pub rebuilt: Option<String>,
    /// How long opening and recovery took.
    pub elapsed: Duration,
}

/// Counters of the SSD tier of one shard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SsdStats {
    /// Bytes of the file's region area (the cap actually used).
    pub capacity_bytes: u64,
    /// Bytes of regions holding records.
    pub used_bytes: u64,
    /// Records live.
    pub records: u64,
    /// Payload reads completed.
    pub reads: u64,
    /// Record writes completed.
    pub writes: u64,
    /// Reads or writes that failed with an I/O error.
    pub io_errors: u64,
    /// Reads whose payload did not match its checksum (dropped, never served).
    pub checksum_failures: u64,
    /// Records dropped by region reclaim.
    pub reclaimed: u64,
    /// Tombstones written (explicit evictions of chunks on SSD).
    pub tombstones: u64,
    /// Reads and writes submitted and not yet completed.
    pub in_flight: u64,
    /// Records rewritten at the log's head before their region's reclaim, to keep their
    /// namespace's SSD guarantee.
    pub relocated: u64,
    /// Times a region had to be reclaimed with records an SSD guarantee kept (no room to
    /// rewrite them).
    pub relocations_abandoned: u64,
}

/// A finished SSD operation, for the shard to act on.
#[derive(Debug, PartialEq, Eq)]
pub enum SsdEvent {
    /// A demotion finished: the arena slot may be freed; `stored` says whether the record is
    /// on SSD now.
    Demoted {
        /// The chunk.
        key: ChunkKey,
        /// Whether the write succeeded.
        stored: bool,
    },
    /// A promotion finished: on `verified`, the arena slot holds the chunk's exact bytes;
    /// otherwise its contents are garbage and the record was dropped.
    Promoted {
        /// The chunk.
        key: ChunkKey,
        /// Whether the bytes passed their checksum.
        verified: bool,
    },
    /// A tombstone write finished: on `stored`, what it deletes never comes back at
    /// recovery.
    Tombstoned {
        /// The ticket [`SsdStore::tombstone`] gave.
        ticket: u64,
        /// Whether the write succeeded.
        stored: bool,
    },
}

enum Pending {
    Demote(Placement),
    Tombstone(Placement),
    Promote {
        key: ChunkKey,
        entry: SsdEntry,
        slot_offset: u64,
    },
    /// A record being read whole, to be rewritten at the head ([`SsdStore::relocate`]).
    RelocateRead {
        key: ChunkKey,
        from: SsdEntry,
    },
    /// Its rewrite.
    RelocateWrite {
        placement: Placement,
        from: SsdEntry,
    },
}

/// Most records one shard rewrites at once for the SSD guarantees.
const MAX_RELOCATIONS: usize = 2;

/// One shard's SSD store.
pub struct SsdStore {
    path: PathBuf,
    file: File,
    log: RegionLog,
    ring: SsdRing,
    /// Operations submitted and not yet completed, with when they were submitted.
    pending: HashMap<u64, (Instant, Pending)>,
    /// Records being rewritten at the head, with their place before (their region pinned).
    moving: HashMap<ChunkKey, SsdEntry>,
    /// The log's change count when no record needed a rewrite (nothing to look for until
    /// it changes).
    settled_at: Option<u64>,
    stats: SsdStats,
    /// Latencies of reads (promotions) and writes (demotions), submission to completion.
    read_latency: LatencyHistogram,
    write_latency: LatencyHistogram,
}

impl std::fmt::Debug for SsdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdStore").field("path", &self.path).finish_non_exhaustive()
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SsdError + 'a {
    move |source| SsdError::Io { op, path: path.to_owned(), source }
}

/// Why a shard file whose superblock reads `block` (the file being `len` bytes) cannot be
/// used as it is and is started afresh; None when it matches `sb`.
fn why_rebuild(sb: &Superblock, block: &[u8], len: u64) -> Option<String> {
    match Superblock::decode(block) {
        Ok(found) if found == *sb && len >= sb.file_bytes() => None,
        Ok(found) if found == *sb => {
            Some(format!("the file is {len} bytes, its geometry needs {}", sb.file_bytes()))
        }
        Ok(found) => Some(format!(
            "written with {} shards, regions of {} x {} bytes; now {} shards, {} x {}",
            found.shard_count,
            found.region_count,
            found.region_bytes,
            sb.shard_count,
            sb.region_count,
            sb.region_bytes
        )),
        Err(e) => Some(format!("superblock unreadable ({e})")),
    }
}

/// Starts a shard file afresh: drops every old byte (so no old record can ever be read as
/// current), then preallocates the new geometry and writes the superblock.
fn format_file(
    file: &File,
    path: &Path,
    ring: &mut SsdRing,
    sb: &Superblock,
) -> Result<(), SsdError> {
    file.set_len(0).map_err(io_err("truncating", path))?;
    nix::fcntl::fallocate(
        file,
        nix::fcntl::FallocateFlags::empty(),
        0,
        sb.file_bytes() as libc::off_t,
    )
    .map_err(|e| io_err("preallocating", path)(e.into()))?;
    let mut block = AlignedBlock::new();
    block.bytes_mut().copy_from_slice(&sb.encode());
    let id = ring.write_block(file, 0, block).map_err(io_err("writing", path))?;
    wait_for(ring, id).map_err(io_err("writing superblock of", path))?;
    Ok(())
}

/// Rebuilds a shard's log from its file. Recovery runs before the shard serves: plain
/// positioned reads of any length (scans read 1 MiB windows), and the page cache is dropped
/// afterwards.
fn recover_file(path: &Path, sb: Superblock) -> Result<(RegionLog, RecoveryReport), SsdError> {
    let plain = File::open(path).map_err(io_err("opening", path))?;
    // Headers are read one by one far apart: readahead would only read payloads.
    let _ =
        nix::fcntl::posix_fadvise(&plain, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_RANDOM);
    let recovered = RegionLog::recover(sb, |at, buf| plain.read_exact_at(buf, at))
        .map_err(io_err("recovering", path))?;
    let _ = nix::fcntl::posix_fadvise(
        &plain,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    );
    Ok(recovered)
}

impl SsdStore {
    /// The geometry `cfg` gives: regions that fit the shard's share after the superblock.
    pub fn superblock(cfg: &SsdConfig) -> Result<Superblock, SsdError> {
        if cfg.region_bytes == 0 || !cfg.region_bytes.is_multiple_of(PAGE_SIZE) {
            return Err(SsdError::Config(format!(
                "--ssd-region-size {} is not a positive multiple of 4 KiB",
                cfg.region_bytes
            )));
        }
        let regions = cfg.capacity_bytes.saturating_sub(SUPERBLOCK_BYTES) / cfg.region_bytes;
        if regions < 2 {
            return Err(SsdError::Config(format!(
                "each shard's share of --ssd ({} bytes) holds fewer than two regions of \
                 --ssd-region-size {} bytes",
                cfg.capacity_bytes, cfg.region_bytes
            )));
        }
        Ok(Superblock {
            format_version: FORMAT_VERSION,
            shard_id: cfg.shard_id,
            shard_count: cfg.shard_count,
            region_bytes: cfg.region_bytes,
            region_count: regions,
        })
    }

    /// Opens (or creates) this shard's file and rebuilds its index from it. A file written
    /// with another shard count, format or geometry is started afresh (never misread).
    pub fn open(cfg: &SsdConfig) -> Result<(Self, OpenReport), SsdError> {
        let started = Instant::now();
        let sb = Self::superblock(cfg)?;
        let path = cfg.dir.join(format!("shard-{}.okv", cfg.shard_id));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .map_err(io_err("opening", &path))?;
        let mut ring =
            SsdRing::new(cfg.ring_depth.max(2)).map_err(io_err("io_uring for", &path))?;
        let existing_len = file.metadata().map_err(io_err("stat", &path))?.len();
        let rebuilt = if existing_len < SUPERBLOCK_BYTES {
            None
        } else {
            let mut block = vec![0u8; SUPERBLOCK_BYTES as usize];
            ring.read_block_sync(&file, 0, &mut block).map_err(io_err("reading", &path))?;
            why_rebuild(&sb, &block, existing_len)
        };
        let (log, recovery) = if existing_len < SUPERBLOCK_BYTES || rebuilt.is_some() {
            format_file(&file, &path, &mut ring, &sb)?;
            (RegionLog::new(sb), RecoveryReport::default())
        } else {
            recover_file(&path, sb)?
        };
        ring.inject_delay(cfg.inject_delay);
        ring.inject_errors_every(cfg.inject_errors_every);
        ring.inject_no_space_every(cfg.inject_no_space_every);
        let stats = SsdStats {
            capacity_bytes: sb.region_count * sb.region_bytes,
            used_bytes: log.used_bytes(),
            records: log.len() as u64,
            ..SsdStats::default()
        };
        let store = Self {
            path,
            file,
            log,
            ring,
            pending: HashMap::new(),
            moving: HashMap::new(),
            settled_at: None,
            stats,
            read_latency: LatencyHistogram::default(),
            write_latency: LatencyHistogram::default(),
        };
        Ok((store, OpenReport { recovery, rebuilt, elapsed: started.elapsed() }))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Counters.
    pub fn stats(&self) -> SsdStats {
        SsdStats {
            used_bytes: self.log.used_bytes(),
            records: self.log.len() as u64,
            in_flight: self.pending.len() as u64,
            reclaimed: self.log.reclaimed(),
            ..self.stats
        }
    }

    /// Latencies of its reads and of its writes.
    pub fn latencies(&self) -> (&LatencyHistogram, &LatencyHistogram) {
        (&self.read_latency, &self.write_latency)
    }

    /// The SSD record of `key`, if any.
    pub fn get(&self, key: &ChunkKey) -> Option<SsdEntry> {
        self.log.get(key)
    }

    /// True when another operation can start now.
    pub fn has_room(&self) -> bool {
        self.ring.has_room()
    }

    /// The largest record a region holds, header included: chunks longer than this less the
    /// header never go to SSD.
    pub fn region_bytes(&self) -> u64 {
        self.log.region_bytes()
    }

    /// Operations in flight.
    pub fn inflight(&self) -> usize {
        self.ring.inflight()
    }

    /// Starts writing the chunk in the arena slot at `slot_offset` of `slice` (page-rounded
    /// length) to SSD. The slot must stay allocated and unmodified until
    /// [`SsdEvent::Demoted`] for this key. `Busy` when it cannot start now (the ring or every
    /// region in use, or the write not submitted); `TooLarge` when the chunk with its header
    /// is larger than a region, so that it never can.
    pub fn demote(
        &mut self,
        key: ChunkKey,
        len: u64,
        checksum: u64,
        slice: &impl SlotMemory,
        slot_offset: u64,
    ) -> Result<(), PlaceError> {
        if !self.ring.has_room() {
            return Err(PlaceError::Busy);
        }
        let (placement, _) = self.log.place(key, len, checksum)?;
        let mut header = AlignedBlock::new();
        placement.header.encode_into(header.bytes_mut());
        let rounded = len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        match self.ring.write_record(
            &self.file,
            placement.offset,
            header,
            slice,
            slot_offset,
            rounded,
        ) {
            Ok(id) => {
                self.pending.insert(id, (Instant::now(), Pending::Demote(placement)));
                Ok(())
            }
            Err(e) => {
                self.log.abort_write(&placement);
                self.stats.io_errors += 1;
                tracing::warn!(path = %self.path.display(), error = %e, "SSD write not submitted");
                Err(PlaceError::Busy)
            }
        }
    }

    /// Starts writing a tombstone: of `key` (`RecordKind::Tombstone`), of `key.namespace`
    /// (`NamespaceTombstone`) or of everything (`EverythingTombstone`), deleting at recovery
    /// every record written before it; what it deletes leaves the index now (a key's record,
    /// or every record of the namespace, or all). A ticket for [`SsdEvent::Tombstoned`];
    /// `Busy` when it cannot start now (nothing changed then).
    pub fn tombstone(&mut self, kind: RecordKind, key: ChunkKey) -> Result<u64, PlaceError> {
        if !self.ring.has_room() {
            return Err(PlaceError::Busy);
        }
        let (placement, _) = self.log.place_tombstone(kind, key)?;
        let mut header = AlignedBlock::new();
        placement.header.encode_into(header.bytes_mut());
        match self.ring.write_whole_record(&self.file, placement.offset, header) {
            Ok(id) => {
                self.pending.insert(id, (Instant::now(), Pending::Tombstone(placement)));
                let gone: Vec<ChunkKey> = match kind {
                    RecordKind::Chunk | RecordKind::Tombstone => vec![key],
                    RecordKind::NamespaceTombstone => {
                        self.keys().filter(|k| k.namespace == key.namespace).copied().collect()
                    }
                    RecordKind::EverythingTombstone => self.keys().copied().collect(),
                };
                for k in &gone {
                    self.log.remove(k);
                }
                self.stats.tombstones += 1;
                Ok(id)
            }
            Err(e) => {
                self.log.abort_write(&placement);
                self.stats.io_errors += 1;
                tracing::warn!(path = %self.path.display(), error = %e, "SSD tombstone not submitted");
                Err(PlaceError::Busy)
            }
        }
    }

    /// Starts reading `key`'s record into the arena slot at `slot_offset` of `slice` (at least
    /// the record's length, page-rounded). The slot must stay reserved until
    /// [`SsdEvent::Promoted`]. Returns false when the key is not on SSD or the ring is full.
    pub fn promote(&mut self, key: ChunkKey, slice: &impl SlotMemory, slot_offset: u64) -> bool {
        let Some(entry) = self.log.get(&key) else { return false };
        if !self.ring.has_room() {
            return false;
        }
        let rounded = entry.len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        match self.ring.read_into_slot(
            &self.file,
            entry.payload_offset(),
            slice,
            slot_offset,
            rounded,
        ) {
            Ok(id) => {
                self.log.pin(entry.region);
                self.pending
                    .insert(id, (Instant::now(), Pending::Promote { key, entry, slot_offset }));
                true
            }
            Err(e) => {
                self.stats.io_errors += 1;
                tracing::warn!(path = %self.path.display(), error = %e, "SSD read not submitted");
                false
            }
        }
    }

    /// Sets the bytes of SSD records each namespace keeps through reclaim
    /// ([`RegionLog::set_guarantees`]).
    pub fn set_guarantees(&mut self, guarantees: SsdGuarantees) {
        self.log.set_guarantees(guarantees);
    }

    /// Starts rewriting at the log's head one record that region reclaim would drop below its
    /// namespace's SSD guarantee, once reclaim is near ([`RegionLog::relocation_candidate`]).
    /// The record is read whole, checked against its checksum and written again; its region
    /// stays pinned (not reclaimed) until then. True when one started.
    pub fn relocate(&mut self) -> bool {
        // No room to start one: nothing to look for (the hold on the oldest region is the
        // log's own, whether or not this looks).
        if self.moving.len() >= MAX_RELOCATIONS
            || !self.ring.has_room()
            || self.settled_at == Some(self.log.changes())
        {
            return false;
        }
        let Some((key, from)) = self.log.relocation_candidate(&self.moving) else {
            self.settled_at = Some(self.log.changes());
            return false;
        };
        let block = AlignedBlock::with_pages(from.disk_bytes() / PAGE_SIZE);
        match self.ring.read_into(&self.file, from.offset, block) {
            Ok(id) => {
                self.log.pin(from.region);
                self.moving.insert(key, from);
                self.pending.insert(id, (Instant::now(), Pending::RelocateRead { key, from }));
                true
            }
            Err(e) => {
                self.stats.io_errors += 1;
                tracing::warn!(path = %self.path.display(), error = %e, "SSD read not submitted");
                false
            }
        }
    }

    /// A record read whole for its rewrite (`block`, when the read returned every byte):
    /// written at the head when its bytes are right and it is still live.
    fn relocation_read(&mut self, key: ChunkKey, from: SsdEntry, block: Option<AlignedBlock>) {
        let Some(mut block) = block else {
            // The disk failed the read: its region is not held any longer (trying again and
            // again would keep every demotion waiting on a failing disk).
            self.stats.io_errors += 1;
            self.abandon(&from);
            return self.relocation_done(&key, &from);
        };
        let header = RECORD_HEADER_BYTES as usize;
        if chunk_checksum(&block.bytes()[header..header + from.len as usize]) != from.checksum {
            self.stats.checksum_failures += 1;
            tracing::warn!(path = %self.path.display(), offset = from.offset, "SSD record failed its checksum; dropped");
            if self.log.get(&key) == Some(from) {
                self.log.remove(&key);
            }
            return self.relocation_done(&key, &from);
        }
        if self.log.get(&key) != Some(from) {
            return self.relocation_done(&key, &from); // deleted or promoted meanwhile
        }
        let placement = match self.log.place_rewrite(key, from.len, from.checksum) {
            Ok((p, _)) => p,
            Err(_) => {
                if self.log.rewrite_needs_held(from.len) {
                    // No room but the held region's own: what it still had to keep goes
                    // with it.
                    self.abandon(&from);
                }
                return self.relocation_done(&key, &from); // else tried again later
            }
        };
        placement.header.encode_into(&mut block.bytes_mut()[..header]);
        match self.ring.write_whole_record(&self.file, placement.offset, block) {
            Ok(id) => {
                let op = Pending::RelocateWrite { placement, from };
                self.pending.insert(id, (Instant::now(), op));
            }
            Err(e) => {
                self.log.abort_write(&placement);
                self.stats.io_errors += 1;
                tracing::warn!(path = %self.path.display(), error = %e, "SSD write not submitted");
                self.relocation_done(&key, &from);
            }
        }
    }

    /// Gives up keeping the records of `from`'s region (the oldest) that are not rewritten
    /// yet: it is reclaimed as without a guarantee. Counted and logged.
    fn abandon(&mut self, from: &SsdEntry) {
        self.log.abandon_hold();
        self.stats.relocations_abandoned += 1;
        tracing::warn!(
            path = %self.path.display(),
            region = from.region,
            "SSD records a --namespace-ssd-guarantee keeps could not be rewritten (no room, or \
             a failed read); their region is reclaimed anyway"
        );
    }

    /// A rewrite is over (done or given up): its old region may be reclaimed.
    fn relocation_done(&mut self, key: &ChunkKey, from: &SsdEntry) {
        self.log.unpin(from.region);
        self.moving.remove(key);
        self.settled_at = None;
    }

    /// Collects finished operations (never blocks). Promoted bytes are checksum-verified here;
    /// a bad record is dropped and reported unverified.
    pub fn poll(&mut self, slice: &impl SlotMemory) -> Vec<SsdEvent> {
        let mut events = Vec::new();
        for c in self.ring.poll() {
            let Some((submitted, op)) = self.pending.remove(&c.id) else { continue };
            let took = submitted.elapsed().as_nanos() as u64;
            match op {
                Pending::Demote(p) => {
                    self.write_latency.record(took);
                    let ok = matches!(c.result, Ok(n) if n == RECORD_HEADER_BYTES + p.header.len.div_ceil(PAGE_SIZE) * PAGE_SIZE);
                    if ok {
                        self.log.complete_write(&p);
                        self.stats.writes += 1;
                    } else {
                        self.log.abort_write(&p);
                        self.stats.io_errors += 1;
                        tracing::warn!(path = %self.path.display(), result = ?c.result, "SSD write failed");
                    }
                    events.push(SsdEvent::Demoted { key: p.header.key, stored: ok });
                }
                Pending::Tombstone(p) => {
                    self.write_latency.record(took);
                    let ok = matches!(c.result, Ok(n) if n == RECORD_HEADER_BYTES);
                    if ok {
                        self.log.complete_write(&p);
                    } else {
                        self.log.abort_write(&p);
                        self.stats.io_errors += 1;
                        tracing::error!(path = %self.path.display(), result = ?c.result, "SSD tombstone write failed: what it deleted may come back after a restart");
                    }
                    events.push(SsdEvent::Tombstoned { ticket: c.id, stored: ok });
                }
                Pending::RelocateRead { key, from } => {
                    self.read_latency.record(took);
                    let whole = matches!(c.result, Ok(n) if n == from.disk_bytes());
                    if whole {
                        self.stats.reads += 1;
                    }
                    self.relocation_read(key, from, c.header.filter(|_| whole));
                }
                Pending::RelocateWrite { placement, from } => {
                    self.write_latency.record(took);
                    let key = placement.header.key;
                    if matches!(c.result, Ok(n) if n == from.disk_bytes()) {
                        self.log.complete_write_over(&placement, Some(from));
                        self.stats.writes += 1;
                        self.stats.relocated += 1;
                    } else {
                        self.log.abort_write(&placement);
                        self.stats.io_errors += 1;
                        tracing::warn!(path = %self.path.display(), result = ?c.result, "SSD write failed");
                        self.abandon(&from);
                    }
                    self.relocation_done(&key, &from);
                }
                Pending::Promote { key, entry, slot_offset } => {
                    self.read_latency.record(took);
                    self.log.unpin(entry.region);
                    let read_ok = matches!(c.result, Ok(n) if n >= entry.len);
                    let verified = read_ok
                        && chunk_checksum(slice.bytes(slot_offset, entry.len)) == entry.checksum;
                    if read_ok {
                        self.stats.reads += 1;
                    } else {
                        self.stats.io_errors += 1;
                    }
                    if read_ok && !verified {
                        self.stats.checksum_failures += 1;
                        tracing::warn!(path = %self.path.display(), offset = entry.offset, "SSD record failed its checksum; dropped");
                    }
                    // A record that failed its checksum is dropped; one whose read failed
                    // stays (its bytes on SSD may be intact: the next lookup reads again).
                    if read_ok && !verified && self.log.get(&key) == Some(entry) {
                        self.log.remove(&key);
                    }
                    events.push(SsdEvent::Promoted { key, verified });
                }
            }
        }
        events
    }

    /// Bytes on disk of namespace `ns`'s records.
    pub fn namespace_bytes(&self, ns: u64) -> u64 {
        self.log.namespace_bytes(ns)
    }

    /// What a full scan of the log finds wrong ([`RegionLog::audit`]).
    pub fn audit(&self) -> Vec<String> {
        self.log.audit()
    }

    /// Every key with a record, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &ChunkKey> {
        self.log.iter().map(|(k, _)| k)
    }

    /// Forgets `key`'s record (it was promoted into DRAM and will be demoted again if evicted).
    pub fn remove(&mut self, key: &ChunkKey) {
        self.log.remove(key);
    }
}

fn wait_for(ring: &mut SsdRing, id: u64) -> std::io::Result<()> {
    loop {
        for c in ring.wait()? {
            if c.id == id {
                return c.result.map(drop);
            }
        }
    }
}

#[cfg(test)]
mod tests;
