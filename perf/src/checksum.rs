//! `orbitkv-perf checksum`: how fast this host's cores compute chunk checksums (xxh3-64, the
//! function the shards run when they checksum a commit themselves, `--gpu-checksums cpu`), one
//! to several threads at a time, against a single-thread memcpy measured in the same run. The
//! chunks come from a buffer far larger than the caches, as a save's chunks come from arena
//! memory the copy engines have just written.

use std::hint::black_box;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use orbitkv_proto::format_bytes;
use serde::Serialize;

use crate::args::ChecksumArgs;
use crate::baseline;
use crate::error::{invalid, Error};

/// Most threads one row may ask for.
const MAX_THREADS: usize = 1024;

/// The result of `checksum`.
#[derive(Debug, Serialize)]
pub(crate) struct ChecksumReport {
    /// Bytes per chunk hashed.
    pub value_size: u64,
    /// Bytes of the buffer the chunks come from.
    pub working_set: u64,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// One thread copying value-sized blocks out of a large buffer, GB/s (10^9 bytes/s).
    pub memcpy_gbps: f64,
    /// One row per thread count, in the order asked.
    pub rows: Vec<ChecksumRow>,
}

/// The hashing rate with `threads` threads at once.
#[derive(Debug, Serialize)]
pub(crate) struct ChecksumRow {
    /// Threads hashing.
    pub threads: usize,
    /// Chunks hashed in all.
    pub chunks: u64,
    /// Bytes hashed over the window, all threads together, GB/s.
    pub gbps: f64,
    /// `gbps` / threads.
    pub gbps_per_thread: f64,
    /// `gbps_per_thread` / `memcpy_gbps`.
    pub per_thread_vs_memcpy: f64,
}

impl crate::report::Report for ChecksumReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "xxh3-64 of {} chunks from a {} buffer; single-thread memcpy {:.2} GB/s; {} CPUs",
            format_bytes(self.value_size),
            format_bytes(self.working_set),
            self.memcpy_gbps,
            self.cpus
        )?;
        writeln!(
            out,
            "{:>7} {:>10} {:>12} {:>14} {:>12}",
            "threads", "GB/s", "per thread", "/ memcpy", "chunks"
        )?;
        for r in &self.rows {
            writeln!(
                out,
                "{:>7} {:>10.2} {:>12.2} {:>14.3} {:>12}",
                r.threads, r.gbps, r.gbps_per_thread, r.per_thread_vs_memcpy, r.chunks
            )?;
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        true
    }
}

/// Checks the flags, fills the buffer, measures the baseline, then each thread count.
pub(crate) fn run(a: &ChecksumArgs) -> Result<ChecksumReport, Error> {
    let (value, chunks) = shape(a)?;
    let bytes = value * chunks;
    if let Some(free) = mem_available() {
        if bytes as u64 > free / 2 {
            return Err(invalid(
                "--working-set",
                format!(
                    "{} is more than half of the memory available here ({})",
                    format_bytes(bytes as u64),
                    format_bytes(free)
                ),
            ));
        }
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut buffer: Vec<u8> = Vec::new();
    buffer.try_reserve_exact(bytes).map_err(|e| {
        invalid(
            "--working-set",
            format!("{} could not be allocated: {e}", format_bytes(bytes as u64)),
        )
    })?;
    // A non-zero pattern that differs between chunks: every page is backed (zero pages share
    // one frame), and no two chunks are alike.
    buffer.extend((0..bytes).map(|i| (i as u64).wrapping_mul(0x9e37) as u8));
    let memcpy_gbps = baseline::memcpy_gbps(value, a.duration.min(Duration::from_secs(1)));
    let rows = a.threads.iter().map(|&t| row(&buffer, value, t, a.duration, memcpy_gbps)).collect();
    Ok(ChecksumReport {
        value_size: value as u64,
        working_set: (value * chunks) as u64,
        cpus,
        memcpy_gbps,
        rows,
    })
}

/// Bytes per chunk and chunks in the buffer; an error naming the flag that is out of range.
fn shape(a: &ChecksumArgs) -> Result<(usize, usize), Error> {
    if a.value_size == 0 {
        return Err(invalid("--value-size", "must be at least 1 byte"));
    }
    let value = usize::try_from(a.value_size)
        .map_err(|_| invalid("--value-size", "larger than this machine's address space"))?;
    let chunks = usize::try_from(a.working_set / a.value_size)
        .ok()
        .filter(|c| c.checked_mul(value).is_some())
        .ok_or_else(|| invalid("--working-set", "larger than this machine's address space"))?;
    if let Some(&t) = a.threads.iter().find(|&&t| t == 0 || t > MAX_THREADS) {
        return Err(invalid("--threads", format!("{t}: each count must be 1 to {MAX_THREADS}")));
    }
    if a.threads.is_empty() {
        return Err(invalid("--threads", "give at least one thread count"));
    }
    let most = *a.threads.iter().max().expect("not empty");
    if chunks < most {
        return Err(invalid(
            "--working-set",
            format!(
                "{} holds {chunks} chunks of --value-size {}; {most} threads need at least one each",
                format_bytes(a.working_set),
                format_bytes(a.value_size)
            ),
        ));
    }
    if a.duration.is_zero() {
        return Err(invalid("--duration", "must be longer than zero"));
    }
    Ok((value, chunks))
}

/// MemAvailable of /proc/meminfo in bytes (None where it cannot be read).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `threads` threads hashing chunks for `window`: thread t takes chunks t, t + threads, ...
/// round the buffer, so that they read different memory.
fn row(
    buffer: &[u8],
    value: usize,
    threads: usize,
    window: Duration,
    memcpy_gbps: f64,
) -> ChecksumRow {
    let chunks = buffer.len() / value;
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let hashed: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let stop = &stop;
                s.spawn(move || {
                    let mut done = 0u64;
                    let mut next = t;
                    while !stop.load(Ordering::Relaxed) {
                        let c = &buffer[next * value..(next + 1) * value];
                        black_box(orbitkv_proto::chunk_checksum(black_box(c)));
                        done += 1;
                        next = (next + threads) % chunks;
                    }
                    done
                })
            })
            .collect();
        std::thread::sleep(window);
        stop.store(true, Ordering::Relaxed);
        workers.into_iter().map(|w| w.join().expect("a hashing thread panicked")).sum()
    });
    rates(threads, hashed, value as u64, started.elapsed().as_secs_f64(), memcpy_gbps)
}

/// The row of `threads` threads that hashed `chunks` chunks of `value` bytes in `seconds`.
fn rates(threads: usize, chunks: u64, value: u64, seconds: f64, memcpy_gbps: f64) -> ChecksumRow {
    let gbps = (chunks * value) as f64 / seconds / 1e9;
    let per_thread = gbps / threads as f64;
    ChecksumRow {
        threads,
        chunks,
        gbps,
        gbps_per_thread: per_thread,
        per_thread_vs_memcpy: per_thread / memcpy_gbps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(value: &str, set: &str, threads: &[usize]) -> ChecksumArgs {
        ChecksumArgs {
            value_size: orbitkv_proto::parse_size(value).unwrap(),
            working_set: orbitkv_proto::parse_size(set).unwrap(),
            threads: threads.to_vec(),
            duration: Duration::from_millis(10),
            json: true,
        }
    }

    #[test]
    fn rates_are_bytes_over_time_and_per_thread() {
        let r = rates(4, 1000, 2 << 20, 0.5, 10.0);
        let gbps = 1000.0 * (2u64 << 20) as f64 / 0.5 / 1e9;
        assert!((r.gbps - gbps).abs() < 1e-9);
        assert!((r.gbps_per_thread - gbps / 4.0).abs() < 1e-9);
        assert!((r.per_thread_vs_memcpy - gbps / 40.0).abs() < 1e-9);
    }

    #[test]
    fn out_of_range_flags_are_named() {
        let e = shape(&args("0", "1MiB", &[1])).unwrap_err().to_string();
        assert!(e.contains("--value-size"), "{e}");
        let e = shape(&args("64KiB", "1MiB", &[0])).unwrap_err().to_string();
        assert!(e.contains("--threads"), "{e}");
        let e = shape(&args("64KiB", "1MiB", &[2000])).unwrap_err().to_string();
        assert!(e.contains("--threads"), "{e}");
        let e = shape(&args("64KiB", "1MiB", &[])).unwrap_err().to_string();
        assert!(e.contains("--threads"), "{e}");
        // 16 chunks of 64 KiB: 17 threads cannot each have one.
        let e = shape(&args("64KiB", "1MiB", &[1, 17])).unwrap_err().to_string();
        assert!(e.contains("--working-set") && e.contains("16 chunks"), "{e}");
        assert_eq!(shape(&args("64KiB", "1MiB", &[1, 16])).unwrap(), (64 << 10, 16));
    }

    #[test]
    fn every_thread_hashes_its_own_chunks() {
        let buffer = vec![7u8; 8 << 10];
        let r = row(&buffer, 1024, 3, Duration::from_millis(20), 1.0);
        assert_eq!(r.threads, 3);
        assert!(r.chunks >= 3 && r.gbps > 0.0, "{r:?}");
    }
}
