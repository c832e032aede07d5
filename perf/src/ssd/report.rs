//! What `ssd` reports: one JSON object, or a table for people.

use std::io::Write;

use orbitkv_proto::format_bytes;
use serde::Serialize;

use crate::report::{OpSummary, Report};
use crate::ssd::fio::FioResult;

/// The result of `ssd`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct SsdReport {
    /// The test file.
    pub file: String,
    /// Bytes of it the run used.
    pub file_size: u64,
    /// Whether this run created the file.
    pub file_created: bool,
    /// Seconds this run spent filling the file before measuring; null when an earlier run's
    /// fill was reused.
    pub fill_s: Option<f64>,
    /// `read`, `write`, `randread` or `randwrite`.
    pub mode: &'static str,
    /// Payload bytes per operation.
    pub block_size: u64,
    /// Operations in flight.
    pub qd: u32,
    /// Requested length of the run.
    pub duration_s: f64,
    /// Seed of random offsets.
    pub seed: u64,
    /// Operations that moved all their bytes.
    pub ops: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// From the first submission to the last completion.
    pub wall_s: f64,
    /// Payload GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// Operations per second.
    pub iops: f64,
    /// Submission-to-completion latency of every successful operation.
    pub latency: OpSummary,
    /// Operations that failed or moved fewer bytes than asked.
    pub errors: u64,
    /// The first of those.
    pub first_error: Option<String>,
    /// fio on the same file with the same parameters; null when fio is not on PATH, was
    /// skipped (`--no-fio`) or failed (see `fio_error`).
    pub fio: Option<FioResult>,
    /// Why fio's result is missing, when it was tried and failed.
    pub fio_error: Option<String>,
    /// fio's GB/s.
    pub fio_gbps: Option<f64>,
    /// gbps / fio_gbps (payload against payload).
    pub ratio_vs_fio: Option<f64>,
    /// What to keep in mind reading the numbers.
    pub notes: Vec<String>,
}

impl Report for SsdReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "orbitkv-perf ssd: {} of {} blocks, qd {}, {:.1} s, on {} ({}{})",
            self.mode,
            format_bytes(self.block_size),
            self.qd,
            self.duration_s,
            self.file,
            format_bytes(self.file_size),
            match (self.file_created, self.fill_s) {
                (true, Some(s)) => format!(", created and filled in {s:.1} s"),
                (false, Some(s)) => format!(", filled in {s:.1} s"),
                _ => ", reused".to_string(),
            }
        )?;
        writeln!(
            out,
            "{:<8} {:>10} ops {:>8.3} GB/s {:>10.0} IOPS   p50 {:>9.1} us   p99 {:>9.1} us   p999 {:>9.1} us",
            "SsdRing",
            self.ops,
            self.gbps,
            self.iops,
            self.latency.p50_us,
            self.latency.p99_us,
            self.latency.p999_us
        )?;
        match (&self.fio, &self.fio_error) {
            (Some(f), _) => writeln!(
                out,
                "{:<8} {:>10} ops {:>8.3} GB/s {:>10.0} IOPS   p50 {:>9.1} us   p99 {:>9.1} us   p999 {:>9.1} us   (SsdRing {:.2} x fio)",
                "fio",
                f.ops,
                f.gbps,
                f.iops,
                f.p50_us,
                f.p99_us,
                f.p999_us,
                self.ratio_vs_fio.unwrap_or(0.0)
            )?,
            (None, Some(e)) => writeln!(out, "fio      failed: {e}")?,
            (None, None) => writeln!(out, "fio      not run")?,
        }
        writeln!(out, "errors {}", self.errors)?;
        if let Some(e) = &self.first_error {
            writeln!(out, "  first: {e}")?;
        }
        for n in &self.notes {
            writeln!(out, "note: {n}")?;
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        self.errors == 0
    }
}
