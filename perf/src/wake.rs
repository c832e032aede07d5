//! `orbitkv-perf wake`: how long the first request after a pause takes. A shard spins for
//! `--spin-window` after work, then sleeps on its doorbell (or naps, with work in flight); an
//! engine's next step often comes a few milliseconds after its last request, so the answer
//! time after each pause length is what it sees. Each sample: one round trip (the shard is
//! busy), the pause, then the timed round trip.

use std::io::Write;
use std::time::{Duration, Instant};

use orbitkv_client::{Client, ClientOptions};
use serde::Serialize;

use crate::args::{socket_or_default, WakeArgs};
use crate::error::{invalid, Error};
use crate::stats::Latency;
use crate::{admin, placement};

/// Most samples per pause.
const MAX_SAMPLES: u32 = 100_000;
/// Untimed round trips before the first sample.
const WARM_UP: u32 = 100;
/// Longest pause (a sample takes at least that long).
const MAX_GAP: Duration = Duration::from_secs(10);

/// The round trips after one pause length.
#[derive(Debug, Serialize)]
pub(crate) struct WakeRow {
    /// The pause before each timed round trip, in microseconds.
    pub gap_us: f64,
    /// Timed round trips.
    pub samples: u64,
    /// Quantiles and the largest, in microseconds.
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

/// The result of `wake`.
#[derive(Debug, Serialize)]
pub(crate) struct WakeReport {
    /// One row per `--gaps` entry, in its order.
    pub rows: Vec<WakeRow>,
    /// Whether this thread ran on CPUs no shard is pinned to (false when the server's shards
    /// are not pinned or every CPU has one).
    pub pinned: bool,
}

impl crate::report::Report for WakeReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let placed = if self.pinned { "off the shards' cores" } else { "unpinned" };
        writeln!(out, "round trip after a pause (one session, home shard; client {placed})")?;
        writeln!(
            out,
            "{:>12} {:>8} {:>10} {:>10} {:>10} {:>10}",
            "pause", "samples", "p50", "p90", "p99", "max"
        )?;
        for r in &self.rows {
            writeln!(
                out,
                "{:>12} {:>8} {:>8.1}us {:>8.1}us {:>8.1}us {:>8.1}us",
                format!("{:?}", Duration::from_secs_f64(r.gap_us / 1e6)),
                r.samples,
                r.p50_us,
                r.p90_us,
                r.p99_us,
                r.max_us
            )?;
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        true
    }
}

/// Checks the flags before anything connects.
fn check(a: &WakeArgs) -> Result<(), Error> {
    if a.gaps.is_empty() {
        return Err(invalid("--gaps", "give at least one pause (0 for none)"));
    }
    if let Some(g) = a.gaps.iter().find(|g| **g > MAX_GAP) {
        return Err(invalid("--gaps", format!("{g:?} is longer than the {MAX_GAP:?} allowed")));
    }
    if a.samples == 0 || a.samples > MAX_SAMPLES {
        return Err(invalid("--samples", format!("must be 1 to {MAX_SAMPLES}, not {}", a.samples)));
    }
    Ok(())
}

/// Times `--samples` round trips after each pause of `--gaps`.
pub(crate) fn run(a: &WakeArgs) -> Result<WakeReport, Error> {
    check(a)?;
    let socket = socket_or_default(&a.socket);
    // Off the shards' cores, as `serve`'s clients: woken from its pause on a core where a shard
    // spins, this thread would wait for the scheduler to take that core back (2-2.6 ms stalls
    // on the development VM) and measure the scheduler instead of the server.
    let cpus = placement::free_cpus(&admin::shard_cores(&socket).unwrap_or_default());
    let pinned = placement::pin_current_thread(&cpus);
    let client_err = |source| Error::Client { client: 0, source };
    let mut client = Client::connect(ClientOptions {
        name: "orbitkv-perf-wake".into(),
        ..ClientOptions::with_socket(&socket)
    })
    .map_err(client_err)?;
    // The session's first round trips set things up on both sides; not what is measured.
    for _ in 0..WARM_UP {
        client.ping().map_err(client_err)?;
    }
    let mut rows = Vec::with_capacity(a.gaps.len());
    for &gap in &a.gaps {
        let mut lat = Latency::default();
        for _ in 0..a.samples {
            client.ping().map_err(client_err)?;
            std::thread::sleep(gap);
            let t = Instant::now();
            client.ping().map_err(client_err)?;
            lat.record(t.elapsed());
        }
        rows.push(WakeRow {
            gap_us: gap.as_secs_f64() * 1e6,
            samples: lat.count(),
            p50_us: lat.quantile_us(0.5),
            p90_us: lat.quantile_us(0.9),
            p99_us: lat.quantile_us(0.99),
            max_us: lat.max_us(),
        });
    }
    Ok(WakeReport { rows, pinned })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(gaps: &[Duration], samples: u32) -> WakeArgs {
        WakeArgs { socket: None, gaps: gaps.to_vec(), samples, json: false }
    }

    #[test]
    fn bad_flags_are_named_before_connecting() {
        let one = [Duration::ZERO];
        let why = |a: WakeArgs| check(&a).unwrap_err().to_string();
        assert!(why(args(&[], 5)).contains("--gaps"));
        assert!(why(args(&[Duration::from_secs(11)], 5)).contains("--gaps"));
        assert!(why(args(&one, 0)).contains("--samples"));
        assert!(why(args(&one, MAX_SAMPLES + 1)).contains("--samples"));
        assert!(check(&args(&[Duration::ZERO, MAX_GAP], MAX_SAMPLES)).is_ok());
    }
}
