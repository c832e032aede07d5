//! What one benchmark client counts, and how clients' counts add up.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Latencies of one operation, in nanoseconds (1 ns to 100 s, 3 significant digits).
#[derive(Clone, Debug)]
pub(crate) struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Self(
            Histogram::new_with_bounds(1, 100_000_000_000, 3)
                .expect("constant histogram bounds 1 ns..100 s at 3 digits are valid"),
        )
    }
}

impl Latency {
    /// Records one operation.
    pub fn record(&mut self, d: Duration) {
        self.0.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Adds another client's latencies.
    pub fn merge(&mut self, other: &Latency) {
        // Same bounds on both sides, so adding cannot fail; saturate rather than lose counts.
        if self.0.add(&other.0).is_err() {
            for v in other.0.iter_recorded() {
                self.0.saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }

    /// Number of operations.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The latency at `q` (0..=1), in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        self.0.value_at_quantile(q) as f64 / 1e3
    }

    /// The mean latency, in microseconds (0 when empty).
    pub fn mean_us(&self) -> f64 {
        self.0.mean() / 1e3
    }

    /// The largest latency, in microseconds.
    pub fn max_us(&self) -> f64 {
        self.0.max() as f64 / 1e3
    }
}

/// Errors by kind, with the first message of each kind (to show what went wrong).
#[derive(Clone, Debug, Default)]
pub(crate) struct ErrorCounts {
    /// Count per kind.
    pub counts: BTreeMap<String, u64>,
    /// First message per kind.
    pub first: BTreeMap<String, String>,
}

impl ErrorCounts {
    /// Counts a client-library error.
    pub fn client(&mut self, op: &str, e: &orbitkv_client::Error) {
        self.add(error_kind(e), || format!("{op}: {e}"));
    }

    /// Counts a failure the server reported for one chunk.
    pub fn code(&mut self, op: &str, code: orbitkv_client::ErrorCode) {
        self.add(code.as_str().to_string(), || format!("{op}: {code}"));
    }

    /// Counts `n` failures of deferred requests of `op`.
    pub fn count(&mut self, op: &str, n: u64) {
        if n > 0 {
            let kind = format!("{op}_deferred");
            self.first
                .entry(kind.clone())
                .or_insert_with(|| format!("{op}: {n} deferred requests failed"));
            *self.counts.entry(kind).or_default() += n;
        }
    }

    fn add(&mut self, kind: String, message: impl FnOnce() -> String) {
        if !self.first.contains_key(&kind) {
            self.first.insert(kind.clone(), message());
        }
        *self.counts.entry(kind).or_default() += 1;
    }

    /// All errors.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Adds another client's errors.
    pub fn merge(&mut self, other: &ErrorCounts) {
        for (k, n) in &other.counts {
            *self.counts.entry(k.clone()).or_default() += n;
        }
        for (k, m) in &other.first {
            self.first.entry(k.clone()).or_insert_with(|| m.clone());
        }
    }
}

/// A stable snake_case kind for a client error: the wire code when the server produced it,
/// else the error's variant name.
pub(crate) fn error_kind(e: &orbitkv_client::Error) -> String {
    if let Some(code) = e.code() {
        return code.as_str().to_string();
    }
    // The variant name, from the derived Debug output, so new variants need no change here.
    let debug = format!("{e:?}");
    let name: String = debug.chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
    let mut kind = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                kind.push('_');
            }
            kind.push(c.to_ascii_lowercase());
        } else {
            kind.push(c);
        }
    }
    if kind.is_empty() {
        kind.push_str("other");
    }
    kind
}

/// Counts of the main (read-through) phase.
#[derive(Clone, Debug, Default)]
pub(crate) struct MainStats {
    /// Timed gets (lookup with lease, copy, release) that hit.
    pub get: Latency,
    /// Timed puts after a miss.
    pub put: Latency,
    /// Bytes copied out by gets.
    pub get_bytes: u64,
    /// Time spent inside gets.
    pub get_time: Duration,
    /// Of which copying out of leased chunks.
    pub copy_time: Duration,
    /// Lookups that found the key.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Gets whose bytes were not the expected value (or whose lease carried a checksum
    /// that does not match them).
    pub verify_failures: u64,
    /// Puts stored.
    pub put_stored: u64,
    /// Puts that found the key already present (another client was faster).
    pub put_already_present: u64,
    /// Puts refused with `NoSpace` or `Busy`.
    pub put_rejected: u64,
    /// When this client finished the phase.
    pub ended: Option<Instant>,
    /// `--baseline-every`: the windows and ratios of every client, one after another.
    pub bracketed: crate::baseline::Bracketed,
}

impl MainStats {
    /// Adds another client's counts.
    pub fn merge(&mut self, o: &MainStats) {
        self.get.merge(&o.get);
        self.put.merge(&o.put);
        self.get_bytes += o.get_bytes;
        self.get_time += o.get_time;
        self.bracketed.windows.extend_from_slice(&o.bracketed.windows);
        self.bracketed.ratios.extend_from_slice(&o.bracketed.ratios);
        self.bracketed.time += o.bracketed.time;
        self.copy_time += o.copy_time;
        self.hits += o.hits;
        self.misses += o.misses;
        self.verify_failures += o.verify_failures;
        self.put_stored += o.put_stored;
        self.put_already_present += o.put_already_present;
        self.put_rejected += o.put_rejected;
        self.ended = self.ended.max(o.ended);
    }
}

/// Counts of the batched-lookup phase.
#[derive(Clone, Debug, Default)]
pub(crate) struct LookupStats {
    /// Timed batched lookups.
    pub batch: Latency,
    /// Keys looked up in timed batches.
    pub keys: u64,
    /// Batches that found fewer keys than they asked for.
    pub short: u64,
    /// Keys of the lookup set still missing after setup.
    pub setup_missing: u64,
    /// When this client finished the phase.
    pub ended: Option<Instant>,
}

impl LookupStats {
    /// Adds another client's counts.
    pub fn merge(&mut self, o: &LookupStats) {
        self.batch.merge(&o.batch);
        self.keys += o.keys;
        self.short += o.short;
        self.setup_missing += o.setup_missing;
        self.ended = self.ended.max(o.ended);
    }
}

/// Everything one client counted.
#[derive(Clone, Debug, Default)]
pub(crate) struct ClientStats {
    /// The main phase.
    pub main: MainStats,
    /// The lookup phase, when it ran.
    pub lookup: LookupStats,
    /// Errors of both phases.
    pub errors: ErrorCounts,
}

impl ClientStats {
    /// Adds another client's counts.
    pub fn merge(&mut self, o: &ClientStats) {
        self.main.merge(&o.main);
        self.lookup.merge(&o.lookup);
        self.errors.merge(&o.errors);
    }
}

/// Median of `v` (None when empty).
pub(crate) fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn error_kinds_are_snake_case_names() {
        assert_eq!(error_kind(&orbitkv_client::Error::Stale), "stale");
        assert_eq!(
            error_kind(&orbitkv_client::Error::BufferTooSmall { needed: 2, got: 1 }),
            "buffer_too_small"
        );
        assert_eq!(
            error_kind(&orbitkv_client::Error::Server {
                code: orbitkv_client::ErrorCode::NoSpace,
                message: "full".into()
            }),
            "no_space"
        );
    }

    #[test]
    fn merging_adds_counts_and_latencies() {
        let mut a = ClientStats::default();
        let mut b = ClientStats::default();
        a.main.get.record(Duration::from_micros(10));
        b.main.get.record(Duration::from_micros(30));
        b.main.hits = 2;
        b.errors.client("get", &orbitkv_client::Error::Stale);
        a.merge(&b);
        assert_eq!(a.main.get.count(), 2);
        assert_eq!(a.main.hits, 2);
        assert_eq!(a.errors.total(), 1);
        assert!(a.main.get.max_us() >= 29.0);
    }
}
