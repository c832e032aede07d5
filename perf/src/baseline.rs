//! The yardstick measured in every run: one thread copying value-sized blocks out of a source
//! too large to stay in cache. Measured before and after the run, and with `--baseline-every`
//! also inside each client's main phase, bracketing the gets between its windows
//! ([`Bracket`]): on a machine whose memory bandwidth drifts while a run goes on, the gets are
//! then compared with copies made just before and just after them, on the same thread.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Smallest source buffer: far beyond any last-level cache.
const MIN_SOURCE: usize = 256 << 20;
/// Bytes copied between clock reads.
const CHECK_EVERY: usize = 16 << 20;
/// Length of one window of `--baseline-every`.
pub(crate) const WINDOW: Duration = Duration::from_millis(500);

/// The blocks the yardstick copies from; shared read-only by the clients.
pub(crate) struct Source {
    data: Vec<u8>,
    block: usize,
    blocks: usize,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source").field("block", &self.block).field("blocks", &self.blocks).finish()
    }
}

impl Source {
    /// A source of `block`-byte blocks.
    pub(crate) fn new(block: usize) -> Self {
        let block = block.max(1);
        let blocks = MIN_SOURCE.max(block.saturating_mul(4)).div_ceil(block);
        // A non-zero fill makes the kernel back every page (zero pages would all share one
        // frame and sit in cache).
        Self { data: vec![0xa5u8; blocks * block], block, blocks }
    }

    /// Copies blocks into `dst` (one block long) for about `duration`, from block `*next` on
    /// (advanced); GB/s (10^9 bytes/s).
    fn copy_for(&self, dst: &mut [u8], next: &mut usize, duration: Duration) -> f64 {
        self.copy_with(dst, next, duration, |d, s| d.copy_from_slice(s))
    }

    /// As [`Source::copy_for`], each block copied by `copy`.
    fn copy_with(
        &self,
        dst: &mut [u8],
        next: &mut usize,
        duration: Duration,
        copy: impl Fn(&mut [u8], &[u8]),
    ) -> f64 {
        let per_check = (CHECK_EVERY / self.block).max(1);
        let mut copied = 0u64;
        let start = Instant::now();
        loop {
            for _ in 0..per_check {
                let at = *next * self.block;
                copy(dst, &self.data[at..at + self.block]);
                black_box(&mut *dst);
                *next = (*next + 1) % self.blocks;
            }
            copied += (per_check * self.block) as u64;
            let elapsed = start.elapsed();
            if elapsed >= duration {
                return copied as f64 / elapsed.as_secs_f64() / 1e9;
            }
        }
    }
}

/// Single-thread memcpy throughput in GB/s (10^9 bytes/s), copying `block`-byte blocks for
/// about `duration`.
pub(crate) fn memcpy_gbps(block: usize, duration: Duration) -> f64 {
    copy_gbps(block, duration, |d, s| d.copy_from_slice(s))
}

/// The same with the client's own copy routine (`orbitkv_client::copy_chunk`, what a get
/// copies a chunk out of the arena with): how much of the gets' time is the service rather
/// than the copy.
pub(crate) fn copy_chunk_gbps(block: usize, duration: Duration) -> f64 {
    copy_gbps(block, duration, orbitkv_client::copy_chunk)
}

/// One thread copying `block`-byte blocks with `copy` for about `duration`, GB/s.
fn copy_gbps(block: usize, duration: Duration, copy: impl Fn(&mut [u8], &[u8])) -> f64 {
    let source = Source::new(block);
    let mut dst = vec![0x5au8; source.block];
    source.copy_with(&mut dst, &mut 0, duration, copy)
}

/// `--baseline-every`: what one client's thread bracketed.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bracketed {
    /// GB/s of each window, in order.
    pub windows: Vec<f64>,
    /// Per interval between two windows with gets in it: get GB/s (bytes over the time inside
    /// gets) over the mean of the two windows around it.
    pub ratios: Vec<f64>,
    /// Time spent in the windows.
    pub time: Duration,
}

/// One client's windows of the yardstick between its gets: a window first, then one whenever
/// `every` has passed since the last (between two gets), and a last one at the end.
pub(crate) struct Bracket<'a> {
    source: &'a Source,
    every: Duration,
    dst: Vec<u8>,
    next: usize,
    due: Instant,
    /// Get bytes and time since the last window.
    bytes: u64,
    got: Duration,
    /// (get bytes, time inside gets) of each closed interval.
    intervals: Vec<(u64, Duration)>,
    out: Bracketed,
}

impl<'a> Bracket<'a> {
    /// Starts with a window. Each client starts at its own block of the source.
    pub(crate) fn start(source: &'a Source, every: Duration, client: usize) -> Self {
        let next = client.wrapping_mul(7919) % source.blocks;
        let mut b = Self {
            source,
            every,
            dst: vec![0x5au8; source.block],
            next,
            due: Instant::now(),
            bytes: 0,
            got: Duration::ZERO,
            intervals: Vec::new(),
            out: Bracketed::default(),
        };
        b.window();
        b
    }

    fn window(&mut self) {
        let start = Instant::now();
        let gbps = self.source.copy_for(&mut self.dst, &mut self.next, WINDOW);
        self.out.windows.push(gbps);
        let now = Instant::now();
        self.out.time += now - start;
        self.due = now + self.every;
    }

    /// A get's bytes and the time it took.
    pub(crate) fn got(&mut self, bytes: u64, took: Duration) {
        self.bytes += bytes;
        self.got += took;
    }

    /// Between two gets: a window when one is due and it ends before `end`.
    pub(crate) fn between(&mut self, end: Instant) {
        let now = Instant::now();
        if now >= self.due && now + WINDOW <= end {
            self.close_interval();
            self.window();
        }
    }

    fn close_interval(&mut self) {
        self.intervals.push((self.bytes, self.got));
        self.bytes = 0;
        self.got = Duration::ZERO;
    }

    /// The last window, then what was measured.
    pub(crate) fn finish(mut self) -> Bracketed {
        self.close_interval();
        self.window();
        self.out.ratios = ratios(&self.out.windows, &self.intervals);
        self.out
    }
}

/// Interval i lies between windows i and i + 1: its get GB/s over their mean. Intervals
/// without gets, or next to a window that measured nothing, give no ratio.
pub(crate) fn ratios(windows: &[f64], intervals: &[(u64, Duration)]) -> Vec<f64> {
    intervals
        .iter()
        .enumerate()
        .filter_map(|(i, &(bytes, time))| {
            let (&before, &after) = (windows.get(i)?, windows.get(i + 1)?);
            let base = (before + after) / 2.0;
            let secs = time.as_secs_f64();
            (bytes > 0 && secs > 0.0 && before > 0.0 && after > 0.0)
                .then(|| bytes as f64 / secs / 1e9 / base)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_something() {
        let gbps = super::memcpy_gbps(4096, std::time::Duration::from_millis(10));
        assert!(gbps.is_finite() && gbps > 0.0);
        let gbps = super::copy_chunk_gbps(1 << 20, std::time::Duration::from_millis(10));
        assert!(gbps.is_finite() && gbps > 0.0);
    }

    #[test]
    fn each_interval_is_against_the_windows_around_it() {
        let s = Duration::from_secs(1);
        // Windows 20, 10, 20 GB/s; gets at 12 and 15 GB/s between them: 12 / 15 and 15 / 15.
        let r = ratios(&[20.0, 10.0, 20.0], &[(12_000_000_000, s), (15_000_000_000, s)]);
        assert_eq!(r.len(), 2);
        assert!((r[0] - 0.8).abs() < 1e-12 && (r[1] - 1.0).abs() < 1e-12, "{r:?}");
        // No gets, no time, a window that measured nothing, or no window after: no ratio.
        let r = ratios(
            &[20.0, 0.0, 20.0, 20.0],
            &[(1, s), (1, s), (0, s), (1, Duration::ZERO), (1, s)],
        );
        assert!(r.is_empty(), "{r:?}");
    }

    #[test]
    fn a_bracket_opens_and_closes_with_a_window() {
        let source = Source::new(1 << 20);
        let mut b = Bracket::start(&source, Duration::from_secs(3600), 3);
        b.got(1 << 20, Duration::from_micros(100));
        // Not due: no window in between.
        b.between(Instant::now() + Duration::from_secs(10));
        let out = b.finish();
        assert_eq!(out.windows.len(), 2, "{out:?}");
        assert!(out.windows.iter().all(|w| *w > 0.0));
        assert_eq!(out.ratios.len(), 1, "{out:?}");
        assert!(out.time >= 2 * WINDOW);
        // Due, but the window would run past the phase's end: none.
        let mut b = Bracket::start(&source, Duration::ZERO, 0);
        b.between(Instant::now() + WINDOW / 2);
        assert_eq!(b.out.windows.len(), 1);
        b.between(Instant::now() + 3 * WINDOW);
        assert_eq!(b.out.windows.len(), 2);
        // An interval without gets gives no ratio.
        assert!(b.finish().ratios.is_empty());
    }
}
