//! Per-shard counters and latency recorders, merged by the server on demand.

use hdrhistogram::Histogram;
use orbitkv_proto::ErrorCode;

/// Operations whose latency is recorded (a bounded label set).
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
    /// Everything else (register, abort, evict, ping).
    Other,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 5] =
        [OpKind::Lookup, OpKind::Reserve, OpKind::Commit, OpKind::Release, OpKind::Other];

    /// Stable label.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Lookup => "lookup",
            OpKind::Reserve => "reserve",
            OpKind::Commit => "commit",
            OpKind::Release => "release",
            OpKind::Other => "other",
        }
    }
}

/// Latency quantiles of one operation kind, in nanoseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencySummary {
    /// Requests recorded.
    pub count: u64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// 99.9th percentile.
    pub p999_ns: u64,
    /// Maximum.
    pub max_ns: u64,
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
    /// Errors returned, by code.
    pub errors: [u64; ErrorCode::ALL.len()],
    latency: Vec<Histogram<u64>>,
}

impl Default for ShardMetrics {
    fn default() -> Self {
        Self {
            hits: 0,
            misses: 0,
            evictions: 0,
            removals: 0,
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
            errors: [0; ErrorCode::ALL.len()],
            latency: OpKind::ALL
                .iter()
                .map(|_| {
                    Histogram::new_with_bounds(1, 60_000_000_000, 3)
                        .expect("static histogram bounds are valid")
                })
                .collect(),
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
        let h = &mut self.latency[op as usize];
        h.saturating_record(nanos.max(1));
    }

    /// Quantiles of every op kind.
    pub fn latency_summaries(&self) -> Vec<(OpKind, LatencySummary)> {
        OpKind::ALL
            .iter()
            .zip(&self.latency)
            .map(|(&op, h)| {
                let s = if h.is_empty() {
                    LatencySummary::default()
                } else {
                    LatencySummary {
                        count: h.len(),
                        p50_ns: h.value_at_quantile(0.5),
                        p99_ns: h.value_at_quantile(0.99),
                        p999_ns: h.value_at_quantile(0.999),
                        max_ns: h.max(),
                    }
                };
                (op, s)
            })
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
    pub ssd: Option<crate::ssd::store::SsdStats>,
    /// Lookups served from SSD.
    pub ssd_hits: u64,
    /// Demotions to SSD.
    pub demotions: u64,
    /// Promotions from SSD.
    pub promotions: u64,
    /// SSD admission rejections.
    pub admission_rejections: u64,
    /// Errors by code, only non-zero ones.
    pub errors: Vec<(ErrorCode, u64)>,
    /// Request latency by op, for requests whose home is this shard.
    pub latency: Vec<(OpKind, LatencySummary)>,
}
