//! Live counters for the once-a-second progress line on a terminal.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Counters the clients bump after each operation (outside the timed region).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// Gets (hit or miss) of the main phase.
    pub ops: AtomicU64,
    /// Of which hits.
    pub hits: AtomicU64,
    /// Batched lookups of the lookup phase.
    pub batches: AtomicU64,
}

impl Progress {
    /// Counts one main-phase operation.
    pub fn op(&self, hit: bool) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        if hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one batched lookup.
    pub fn batch(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
    }
}

/// Sleeps until `end`; when `show` is set, rewrites a progress line on stderr every second.
pub(crate) fn wait_until(end: Instant, phase: &str, progress: &Progress, show: bool) {
    let start = Instant::now();
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        std::thread::sleep((end - now).min(Duration::from_secs(1)));
        if show {
            let ops = progress.ops.load(Ordering::Relaxed);
            let hits = progress.hits.load(Ordering::Relaxed);
            let batches = progress.batches.load(Ordering::Relaxed);
            let ratio = if ops == 0 { 0.0 } else { hits as f64 / ops as f64 };
            let line = if phase == "lookup" {
                format!("{batches} batches")
            } else {
                format!("{ops} ops, hit ratio {ratio:.3}")
            };
            let mut err = std::io::stderr().lock();
            // Progress is cosmetic: a closed stderr must not stop the benchmark.
            let _ = write!(err, "\r\x1b[K[{phase} {:>5.1}s] {line}", start.elapsed().as_secs_f64());
            let _ = err.flush();
        }
    }
    if show {
        let _ = write!(std::io::stderr().lock(), "\r\x1b[K");
    }
}
