//! Per-shard counters and latency recorders, merged by the server on demand.

use hdrhistogram::Histogram;
use orbitkv_proto::ErrorCode;

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

/// The latencies of one operation kind: a histogram of 2 significant digits (quantiles
/// within 1%) from 1 ns to 60 s (longer ones count as 60 s), and the exact sum. Recorded on
/// its shard's core; a snapshot is a copy (about 30 KiB), merged and read on the control
/// thread.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    histogram: Histogram<u64>,
    sum_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            histogram: Histogram::new_with_bounds(1, Self::MAX_NS, 2)
                .expect("static histogram bounds are valid"),
            sum_ns: 0,
        }
    }
}

impl LatencyHistogram {
    /// The largest latency recorded as itself.
    pub const MAX_NS: u64 = 60_000_000_000;

    /// Records one operation of `nanos`.
    pub fn record(&mut self, nanos: u64) {
        self.histogram.saturating_record(nanos.clamp(1, Self::MAX_NS));
        self.sum_ns = self.sum_ns.saturating_add(nanos);
    }

    /// Operations recorded.
    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    /// The sum of their latencies.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// Adds `other`'s operations (another shard's, for a server-wide view).
    pub fn merge(&mut self, other: &LatencyHistogram) {
        self.histogram.add(&other.histogram).expect("histograms of equal bounds merge");
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
    }

    /// Its quantiles.
    pub fn summary(&self) -> LatencySummary {
        let h = &self.histogram;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            p50_ns: h.value_at_quantile(0.5),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
        }
    }

    /// Operations at or below each of `bounds_ns` (ascending), not cumulated: the counts of
    /// `(previous bound, bound]`, then the count above the last bound. One pass over the
    /// recorded values.
    pub fn bucket_counts(&self, bounds_ns: &[u64]) -> Vec<u64> {
        let mut counts = vec![0u64; bounds_ns.len() + 1];
        for v in self.histogram.iter_recorded() {
            // A recorded value stands for its bucket's values (within 1%): counted at the
            // highest of them.
            let i = bounds_ns.partition_point(|&b| b < v.value_iterated_to());
            counts[i] += v.count_at_value();
        }
        counts
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
    pub ssd: Option<crate::ssd::store::SsdStats>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_count_each_value_once_at_its_bound() {
        let mut h = LatencyHistogram::default();
        for ns in [500, 1_000, 1_500, 40_000, 2_000_000, 90_000_000_000] {
            h.record(ns);
        }
        let counts = h.bucket_counts(&[1_000, 10_000, 1_000_000]);
        // 500 and 1000 at or below 1 us (1000 within the histogram's 1%), 1500 below 10 us,
        // none up to 1 ms, two above (90 s counted as the 60 s ceiling).
        assert_eq!(counts.iter().sum::<u64>(), 6);
        assert_eq!(counts[0] + counts[1], 3);
        assert_eq!(counts[2], 1);
        assert_eq!(counts[3], 2);
        assert_eq!(h.sum_ns(), 500 + 1_000 + 1_500 + 40_000 + 2_000_000 + 90_000_000_000);
    }

    #[test]
    fn merged_histograms_give_the_quantiles_of_all_values() {
        let (mut a, mut b) = (LatencyHistogram::default(), LatencyHistogram::default());
        (1..=900).for_each(|i| a.record(i * 1_000));
        (901..=1000).for_each(|i| b.record(i * 1_000));
        a.merge(&b);
        let s = a.summary();
        assert_eq!(s.count, 1000);
        let near = |got: u64, want: u64| got.abs_diff(want) * 100 <= want;
        assert!(near(s.p50_ns, 500_000), "{s:?}");
        assert!(near(s.p99_ns, 990_000), "{s:?}");
        assert!(near(s.max_ns, 1_000_000), "{s:?}");
        assert_eq!(LatencyHistogram::default().summary(), LatencySummary::default());
    }
}
