//! Totals over the spans of staged batches ([`CopyEngine::take_timeline`]): how long the
//! host-side copies ran, how long their stream stood idle between them, and how long the
//! kernels ran. Pure arithmetic, so it is tested without a GPU.
//!
//! [`CopyEngine::take_timeline`]: super::CopyEngine::take_timeline

use super::BatchSpan;

/// What a run of staged batches did on the GPU, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct SpanTotals {
    /// Batches.
    pub batches: u64,
    /// Their bytes.
    pub bytes: u64,
    /// From the first batch's start to the last copy's or kernel's end.
    pub span_us: f64,
    /// When the first copy started.
    pub first_copy_start_us: f64,
    /// From the last copy's end to the span's end (a load's last scatter).
    pub after_last_copy_us: f64,
    /// Sum of the batches' host-side copy times.
    pub copy_busy_us: f64,
    /// Sum of the copy stream's idle time between consecutive copies.
    pub copy_gaps_us: f64,
    /// The longest of those gaps.
    pub copy_gap_max_us: f64,
    /// Sum of the kernels' times.
    pub kernel_busy_us: f64,
    /// The longest kernel.
    pub kernel_max_us: f64,
}

impl SpanTotals {
    /// The totals of `spans` (in any order).
    pub fn of(spans: &[BatchSpan]) -> Self {
        let mut copies: Vec<(f64, f64)> =
            spans.iter().map(|s| (s.copy_start_us, s.copy_end_us)).collect();
        copies.sort_by(|a, b| a.0.total_cmp(&b.0));
        let gaps = copies.windows(2).map(|w| (w[1].0 - w[0].1).max(0.0));
        let kernels = spans.iter().map(|s| s.kernel_end_us - s.kernel_start_us);
        let span_us = spans.iter().map(|s| s.copy_end_us.max(s.kernel_end_us)).fold(0.0, f64::max);
        let last_copy_end = copies.iter().map(|c| c.1).fold(0.0, f64::max);
        Self {
            batches: spans.len() as u64,
            bytes: spans.iter().map(|s| s.bytes).sum(),
            span_us,
            first_copy_start_us: copies.first().map_or(0.0, |c| c.0),
            after_last_copy_us: if copies.is_empty() { 0.0 } else { span_us - last_copy_end },
            copy_busy_us: copies.iter().map(|c| c.1 - c.0).sum(),
            copy_gaps_us: gaps.clone().sum(),
            copy_gap_max_us: gaps.fold(0.0, f64::max),
            kernel_busy_us: kernels.clone().sum(),
            kernel_max_us: kernels.fold(0.0, f64::max),
        }
    }

    /// Bytes over the copy busy time, GB/s (10^9 bytes/s): the copies' own rate, gaps left
    /// out (0 without copies).
    pub fn copy_gbps(&self) -> f64 {
        if self.copy_busy_us > 0.0 {
            self.bytes as f64 / self.copy_busy_us / 1e3
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(bytes: u64, kernel: (f64, f64), copy: (f64, f64)) -> BatchSpan {
        BatchSpan {
            bytes,
            runs: 1,
            kernel_start_us: kernel.0,
            kernel_end_us: kernel.1,
            copy_start_us: copy.0,
            copy_end_us: copy.1,
        }
    }

    #[test]
    fn totals_add_copies_gaps_and_kernels_in_copy_order() {
        // Given out of order; a copy that starts before the previous one ended is no gap.
        let spans = [
            span(2000, (110.0, 120.0), (125.0, 200.0)),
            span(1000, (0.0, 10.0), (10.0, 100.0)),
            span(1000, (95.0, 130.0), (199.0, 230.0)),
        ];
        let t = SpanTotals::of(&spans);
        assert_eq!((t.batches, t.bytes), (3, 4000));
        assert_eq!(t.span_us, 230.0);
        assert_eq!(t.first_copy_start_us, 10.0);
        assert_eq!(t.after_last_copy_us, 0.0, "a save ends with its last copy");
        assert_eq!(t.copy_busy_us, 90.0 + 75.0 + 31.0);
        assert_eq!(t.copy_gaps_us, 25.0, "100 -> 125, then none (199 < 200)");
        assert_eq!(t.copy_gap_max_us, 25.0);
        assert_eq!(t.kernel_busy_us, 10.0 + 10.0 + 35.0);
        assert_eq!(t.kernel_max_us, 35.0);
        assert!((t.copy_gbps() - 4000.0 / 196.0 / 1e3).abs() < 1e-12);
        // A load's last kernel may end after its last copy.
        let load = [span(10, (50.0, 90.0), (0.0, 40.0))];
        assert_eq!(SpanTotals::of(&load).span_us, 90.0);
        assert_eq!(SpanTotals::of(&load).after_last_copy_us, 50.0);
    }

    #[test]
    fn no_spans_total_nothing() {
        let t = SpanTotals::of(&[]);
        assert_eq!(t, SpanTotals::default());
        assert_eq!(t.copy_gbps(), 0.0);
    }
}
