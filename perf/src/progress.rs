//! Live counters for the progress bar of long runs on a terminal (off when stderr is not a
//! terminal or `--json` is given).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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

/// Sleeps until `end`; when `show` is set, shows a progress bar of the phase on stderr
/// (indicatif), updated every second and cleared at the end.
pub(crate) fn wait_until(end: Instant, phase: &str, progress: &Progress, show: bool) {
    let start = Instant::now();
    let total_ms = end.saturating_duration_since(start).as_millis() as u64;
    let bar = if show {
        let bar = ProgressBar::with_draw_target(Some(total_ms), ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{prefix:>6} {elapsed:>4} {bar:30} {msg}")
            .expect("a valid template");
        bar.set_style(style);
        bar.set_prefix(phase.to_string());
        bar
    } else {
        ProgressBar::hidden()
    };
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        std::thread::sleep((end - now).min(Duration::from_secs(1)));
        if show {
            bar.set_position(start.elapsed().as_millis() as u64);
            bar.set_message(progress.line(phase));
        }
    }
    bar.finish_and_clear();
}

impl Progress {
    /// What the bar says after the counters so far.
    fn line(&self, phase: &str) -> String {
        let ops = self.ops.load(Ordering::Relaxed);
        let hits = self.hits.load(Ordering::Relaxed);
        if phase == "lookup" {
            format!("{} batches", self.batches.load(Ordering::Relaxed))
        } else {
            let ratio = if ops == 0 { 0.0 } else { hits as f64 / ops as f64 };
            format!("{ops} ops, hit ratio {ratio:.3}")
        }
    }
}

/// Runs `work`; when `show` is set, a spinner on stderr names the phase and counts its time
/// (against the `expected` length, when known) meanwhile (indicatif's ticker thread draws it).
pub(crate) fn during<T>(
    phase: &str,
    expected: Option<Duration>,
    show: bool,
    work: impl FnOnce() -> T,
) -> T {
    if !show {
        return work();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    let template = match expected {
        Some(_) => "{spinner} {prefix} {elapsed} of {msg}",
        None => "{spinner} {prefix} {elapsed}",
    };
    bar.set_style(ProgressStyle::with_template(template).expect("a valid template"));
    bar.set_prefix(phase.to_string());
    if let Some(e) = expected {
        bar.set_message(format!("{:.0}s", e.as_secs_f64()));
    }
    bar.enable_steady_tick(Duration::from_millis(250));
    let out = work();
    bar.finish_and_clear();
    out
}
