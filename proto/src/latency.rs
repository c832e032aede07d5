//! Latency recorders and their quantiles: what every process that reports request or I/O
//! latencies (the shards, the SSD tier, the server's stats and metrics) records and merges.

use hdrhistogram::Histogram;

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
/// the core that owns it; a snapshot is a copy (about 30 KiB), merged and read on the server's
/// control thread.
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
