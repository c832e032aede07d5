//! Per-shard counters and latency recorders, merged by the server on demand.

use orbitkv_proto::{ErrorCode, LatencyHistogram};

/// Operations whose latency is recorded (a bounded label set). An engine's put is a
/// `Reserve` then a `Commit`, its get a leased `Lookup` then a `Release`; `Save` and `Load` are
/// GPU requests (the whole request, copies included); `SsdRead` and `SsdWrite` are the SSD
/// tier's promotions and demotions, from submission to completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Leased or plain lookup.
    Lookup,
    /// Reserve.
    Reserve,
    /// Commit.
    Commit,
    /// Release.
    Release,
    /// GPU save.
    Save,
    /// GPU load.
    Load,
    /// SSD read (a promotion).
    SsdRead,
    /// SSD write (a demotion).
    SsdWrite,
    /// Everything else (register, abort, evict, ping).
    Other,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 9] = [
        OpKind::Lookup,
        OpKind::Reserve,
        OpKind::Commit,
        OpKind::Release,
        OpKind::Save,
        OpKind::Load,
        OpKind::SsdRead,
        OpKind::SsdWrite,
        OpKind::Other,
    ];

    /// Stable label.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Lookup => "lookup",
            OpKind::Reserve => "reserve",
            OpKind::Commit => "commit",
            OpKind::Release => "release",
            OpKind::Save => "save",
            OpKind::Load => "load",
            OpKind::SsdRead => "ssd_read",
            OpKind::SsdWrite => "ssd_write",
            OpKind::Other => "other",
        }
    }
}

/// Counters a shard keeps; everything is a plain integer bumped on the shard's own core.
#[derive(Debug)]
pub struct ShardMetrics {
    /// Lookup keys found.
    pub hits: u64,
    /// Lookup keys not found.
    pub misses: u64,
    /// Chunks evicted to make room.
    pub evictions: u64,
    /// Chunks removed by explicit evict requests.
    pub removals: u64,
    /// Reservations refused with `QuotaExceeded` (a namespace at its DRAM limit).
    pub quota_refusals: u64,
    /// Victims dropped instead of demoted: their namespace at its SSD limit.
    pub ssd_quota_drops: u64,
    /// Chunks committed.
    pub commits: u64,
    /// Bytes committed.
    pub bytes_committed: u64,
    /// Commits whose checksum came with them (computed on the GPU during a save).
    pub given_checksums: u64,
    /// Given checksums the shard checked against the bytes.
    pub given_checksums_verified: u64,
    /// ... and found wrong: the chunk was dropped (`DeviceError`), not committed.
    pub given_checksum_mismatches: u64,
    /// Sessions whose holdings were reclaimed on close.
    pub sessions_reclaimed: u64,
    /// Lookups that found a chunk on SSD (and promoted it).
    pub ssd_hits: u64,
    /// Chunks written to SSD and dropped from DRAM.
    pub demotions: u64,
    /// Chunks read back from SSD into DRAM.
    pub promotions: u64,
    /// DRAM victims the SSD admission filter turned away.
    pub admission_rejections: u64,
    /// Lookups that found a chunk only in a peer's inventory (and fetched it).
    pub peer_hits: u64,
    /// Chunks read from peers and stored here.
    pub peer_fetches: u64,
    /// Their bytes.
    pub peer_bytes: u64,
    /// Peer reads that failed (the owner no longer had the chunk, refused, or the read or
    /// its checksum failed): the lookup answered a miss.
    pub peer_fetch_failures: u64,
    /// ... of which the bytes read differed from the owner's checksum.
    pub peer_checksum_mismatches: u64,
    /// Chunks leased here for peers' reads.
    pub peer_grants: u64,
    /// Errors returned, by code.
    pub errors: [u64; ErrorCode::ALL.len()],
    latency: Vec<LatencyHistogram>,
}

impl Default for ShardMetrics {
    fn default() -> Self {
        Self {
            hits: 0,
            misses: 0,
            evictions: 0,
            removals: 0,
            quota_refusals: 0,
            ssd_quota_drops: 0,
            commits: 0,
            bytes_committed: 0,
            given_checksums: 0,
            given_checksums_verified: 0,
            given_checksum_mismatches: 0,
            sessions_reclaimed: 0,
            ssd_hits: 0,
            demotions: 0,
            promotions: 0,
            admission_rejections: 0,
            peer_hits: 0,
            peer_fetches: 0,
            peer_bytes: 0,
            peer_fetch_failures: 0,
            peer_checksum_mismatches: 0,
            peer_grants: 0,
            errors: [0; ErrorCode::ALL.len()],
            latency: OpKind::ALL.iter().map(|_| LatencyHistogram::default()).collect(),
        }
    }
}

impl ShardMetrics {
    /// Counts one error reply or per-chunk failure.
    pub fn count_error(&mut self, code: ErrorCode) {
        self.errors[code.index()] += 1;
    }

    /// Records the latency of one request handled with this shard as home.
    pub fn record_latency(&mut self, op: OpKind, nanos: u64) {
        self.latency[op as usize].record(nanos);
    }

    /// The histograms of the kinds recorded at least once.
    pub fn latencies(&self) -> Vec<(OpKind, LatencyHistogram)> {
        OpKind::ALL
            .iter()
            .zip(&self.latency)
            .filter(|(_, h)| h.count() > 0)
            .map(|(&op, h)| (op, h.clone()))
            .collect()
    }
}

/// A snapshot of one shard for `ctl stats`.
#[derive(Clone, Debug, Default)]
pub struct ShardStats {
    /// Shard id.
    pub id: usize,
    /// Slice capacity in bytes.
    pub dram_capacity_bytes: u64,
    /// Bytes allocated (ready and reserved chunks, page-rounded).
    pub dram_used_bytes: u64,
    /// Visible (ready) chunks.
    pub entries: u64,
    /// Reservations not yet committed or aborted.
    pub reservations: u64,
    /// Leases held.
    pub leases: u64,
    /// Namespaces registered.
    pub namespaces: u64,
    /// Lookup hits.
    pub hits: u64,
    /// Lookup misses.
    pub misses: u64,
    /// Evictions for space.
    pub evictions: u64,
    /// Explicit removals.
    pub removals: u64,
    /// Reservations refused at a namespace's DRAM limit.
    pub quota_refusals: u64,
    /// Victims dropped, not demoted, at a namespace's SSD limit.
    pub ssd_quota_drops: u64,
    /// Commits.
    pub commits: u64,
    /// Bytes committed.
    pub bytes_committed: u64,
    /// Commits whose checksum came computed on the GPU.
    pub given_checksums: u64,
    /// ... of which checked against the bytes.
    pub given_checksums_verified: u64,
    /// ... and found wrong.
    pub given_checksum_mismatches: u64,
    /// The SSD tier's counters, when configured.
    pub ssd: Option<orbitkv_ssd::store::SsdStats>,
    /// Lookups served from SSD.
    pub ssd_hits: u64,
    /// Demotions to SSD.
    pub demotions: u64,
    /// Promotions from SSD.
    pub promotions: u64,
    /// SSD admission rejections.
    pub admission_rejections: u64,
    /// Lookups served by reading a peer's chunk.
    pub peer_hits: u64,
    /// Chunks read from peers.
    pub peer_fetches: u64,
    /// Their bytes.
    pub peer_bytes: u64,
    /// Peer reads that failed (answered as misses).
    pub peer_fetch_failures: u64,
    /// ... of which for a checksum mismatch.
    pub peer_checksum_mismatches: u64,
    /// Chunks leased here for peers' reads.
    pub peer_grants: u64,
    /// Entries in this shard's slice of the peer catalog.
    pub catalog_entries: u64,
    /// Errors by code, only non-zero ones.
    pub errors: Vec<(ErrorCode, u64)>,
    /// Latency by op, of the kinds recorded at least once: requests whose home is this shard,
    /// and this shard's SSD operations.
    pub latency: Vec<(OpKind, LatencyHistogram)>,
}
