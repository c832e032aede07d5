//! What `serve` reports: one JSON object, or a table for people.

use std::collections::BTreeMap;
use std::io::Write;

use orbitkv_proto::format_bytes;
use serde::Serialize;

use crate::stats::Latency;

/// A benchmark result that can be printed both ways.
pub(crate) trait Report: Serialize {
    /// Writes the human table.
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()>;
    /// Whether the run verified (exit status 0 rather than 1).
    fn passed(&self) -> bool;
}

/// Count and latency quantiles of one operation, in microseconds.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct OpSummary {
    /// Operations.
    pub count: u64,
    /// Mean (what throughput per client follows; above the median by the tail's weight).
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Slowest.
    pub max_us: f64,
}

impl From<&Latency> for OpSummary {
    fn from(l: &Latency) -> Self {
        Self {
            count: l.count(),
            mean_us: l.mean_us(),
            p50_us: l.quantile_us(0.5),
            p90_us: l.quantile_us(0.9),
            p99_us: l.quantile_us(0.99),
            p999_us: l.quantile_us(0.999),
            max_us: l.max_us(),
        }
    }
}

/// The batched-lookup phase.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct LookupSummary {
    /// Keys per lookup.
    pub batch: usize,
    /// Keys in each client's lookup set.
    pub set_keys: usize,
    /// Batches and their latency.
    #[serde(flatten)]
    pub latency: OpSummary,
    /// Batches per second, all clients.
    pub batches_per_s: f64,
    /// Keys per second, all clients.
    pub keys_per_s: f64,
    /// Keys per second per server shard (when the shard count is known).
    pub keys_per_s_per_shard: Option<f64>,
    /// Batches that found fewer keys than asked.
    pub lookup_short: u64,
    /// Lookup-set keys that were still missing when the phase started.
    pub setup_missing: u64,
    /// Wall time of the phase.
    pub wall_s: f64,
}

/// The result of `serve`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ServeReport {
    /// Server socket measured.
    pub socket: String,
    /// CPUs the clients and the memcpy baseline ran on (those no shard is pinned to); empty
    /// when every CPU runs a shard (then they were not pinned).
    pub client_cpus: Vec<usize>,
    /// Whether the server was started by this run.
    pub embedded: bool,
    /// Whether the run only read (`--verify-only`): misses were not put.
    pub verify_only: bool,
    /// Clients (threads and sessions).
    pub clients: usize,
    /// Requested length of each phase.
    pub duration_s: f64,
    /// Bytes per value.
    pub value_size: u64,
    /// Bytes of all keys.
    pub working_set: u64,
    /// Keys.
    pub nkeys: u64,
    /// Seed of keys and values.
    pub seed: u64,
    /// Key popularity (`uniform` or `zipf`).
    pub keys: &'static str,
    /// Zipf exponent, for `zipf`.
    pub zipf_theta: Option<f64>,
    /// Server shard count (admin stats), when reachable.
    pub shards: Option<usize>,
    /// Server evictions during the run (admin stats delta), when reachable.
    pub evictions: Option<u64>,
    /// Gets that found their key.
    pub hits: u64,
    /// Gets that did not (each followed by a put, unless `verify_only`).
    pub misses: u64,
    /// hits / (hits + misses).
    pub hit_ratio: f64,
    /// Failed calls, all kinds.
    pub errors: u64,
    /// Failed calls by kind.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Gets whose bytes were not the value that was put, or not what the lease's checksum
    /// says.
    pub verify_failures: u64,
    /// Puts refused with `NoSpace` or `Busy`.
    pub put_rejected: u64,
    /// Puts stored.
    pub put_stored: u64,
    /// Puts that found the key already present.
    pub put_already_present: u64,
    /// Keys per get (`--get-batch`).
    pub get_batch: usize,
    /// Gets that hit (at least one key of the batch): lookup with lease + copy + release.
    pub get: OpSummary,
    /// Puts after a miss.
    pub put: OpSummary,
    /// The batched-lookup phase, when it ran.
    pub lookup_batch: Option<LookupSummary>,
    /// Single-thread memcpy of value-sized blocks, GB/s: the better of the measurements
    /// before and after the run.
    pub memcpy_gbps: f64,
    /// The memcpy measurement before the run.
    pub memcpy_gbps_before: f64,
    /// The memcpy measurement after the run.
    pub memcpy_gbps_after: f64,
    /// Get bytes / time spent inside gets (per-thread throughput), GB/s.
    pub get_gbps: f64,
    /// Get bytes / time spent copying out of leased chunks (the get minus its round trips),
    /// GB/s.
    pub get_copy_gbps: f64,
    /// Get bytes / wall time of the main phase, GB/s.
    pub get_gbps_aggregate: f64,
    /// get_gbps / memcpy_gbps.
    pub ratio_get_vs_memcpy: f64,
    /// The yardstick's copies made with the client's copy routine
    /// (`orbitkv_client::copy_chunk`, which gets copy chunks with; faster than memcpy where it
    /// prefetches), the better of before and after the run, GB/s.
    pub copy_chunk_gbps: f64,
    /// get_gbps / copy_chunk_gbps: the gets against their own copy alone.
    pub ratio_get_vs_copy_chunk: f64,
    /// `--baseline-every`, in seconds (null without it).
    pub baseline_every_s: Option<f64>,
    /// With `--baseline-every`: the median over `bracketed_ratios` (null without it, or
    /// when no interval had gets).
    pub ratio_get_vs_memcpy_bracketed: Option<f64>,
    /// With `--baseline-every`: per interval of each client between two of its windows of the
    /// yardstick, its get GB/s over the mean of those two windows' GB/s.
    pub bracketed_ratios: Vec<f64>,
    /// With `--baseline-every`: GB/s of every window, each client's in order, one client
    /// after another.
    pub baseline_windows_gbps: Vec<f64>,
    /// Wall time of the main phase (without the windows of `--baseline-every`).
    pub main_wall_s: f64,
}

fn op_line(out: &mut dyn Write, name: &str, op: &OpSummary) -> std::io::Result<()> {
    writeln!(
        out,
        "{name:<14} {:>10} ops   mean {:>9.1} us   p50 {:>9.1} us   p90 {:>9.1} us   p99 {:>9.1} us   p999 {:>9.1} us   max {:>9.1} us",
        op.count, op.mean_us, op.p50_us, op.p90_us, op.p99_us, op.p999_us, op.max_us
    )
}

fn or_unknown<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "?".to_string(), |v| v.to_string())
}

impl ServeReport {
    /// The table's first lines: the run's settings and the server.
    fn write_setup(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let keys = match self.zipf_theta {
            Some(t) => format!("zipf {t}"),
            None => self.keys.to_string(),
        };
        writeln!(
            out,
            "orbitkv-perf serve{}: {} client(s), {:.1} s, values {}, working set {} ({} keys, {keys}), seed {}",
            if self.verify_only { " (verify only, no puts)" } else { "" },
            self.clients,
            self.duration_s,
            format_bytes(self.value_size),
            format_bytes(self.working_set),
            self.nkeys,
            self.seed
        )?;
        writeln!(
            out,
            "server {}{}: {} shards, {} evictions during the run",
            self.socket,
            if self.embedded { " (embedded)" } else { "" },
            or_unknown(self.shards),
            or_unknown(self.evictions)
        )?;
        Ok(())
    }

    /// The gets' GB/s against the yardstick: memcpy, the client's copy routine and, with
    /// `--baseline-every`, the windows around each interval.
    fn write_throughput(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "get throughput {:.2} GB/s per thread ({:.2} x memcpy {:.2} GB/s), {:.2} GB/s aggregate, {} key(s) per get",
            self.get_gbps, self.ratio_get_vs_memcpy, self.memcpy_gbps, self.get_gbps_aggregate, self.get_batch
        )?;
        writeln!(
            out,
            "{:<14} {:.2} GB/s copying out of leased chunks alone; gets at {:.2} x the client's \
             copy routine ({:.2} GB/s)",
            "", self.get_copy_gbps, self.ratio_get_vs_copy_chunk, self.copy_chunk_gbps
        )?;
        if let Some(every) = self.baseline_every_s {
            let (lo, hi) = self
                .bracketed_ratios
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
            writeln!(
                out,
                "{:<14} {} x memcpy windows around each interval (median of {}, {}), a window every {every:.1} s",
                "",
                self.ratio_get_vs_memcpy_bracketed.map_or("?".to_string(), |r| format!("{r:.2}")),
                self.bracketed_ratios.len(),
                if self.bracketed_ratios.is_empty() {
                    "none".to_string()
                } else {
                    format!("{lo:.2} to {hi:.2}")
                }
            )?;
        }
        Ok(())
    }
}

impl Report for ServeReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        self.write_setup(out)?;
        op_line(out, "get", &self.get)?;
        op_line(out, "put", &self.put)?;
        if let Some(l) = &self.lookup_batch {
            op_line(out, &format!("lookup x{}", l.batch), &l.latency)?;
            writeln!(
                out,
                "{:<14} {:.0} batches/s, {:.0} keys/s, {} keys/s per shard, {} short",
                "",
                l.batches_per_s,
                l.keys_per_s,
                l.keys_per_s_per_shard.map_or_else(|| "?".to_string(), |k| format!("{k:.0}")),
                l.lookup_short
            )?;
        }
        writeln!(
            out,
            "hits {}   misses {}   hit ratio {:.3}",
            self.hits, self.misses, self.hit_ratio
        )?;
        self.write_throughput(out)?;
        writeln!(
            out,
            "errors {}   verify failures {}   puts rejected {}",
            self.errors, self.verify_failures, self.put_rejected
        )?;
        for (kind, n) in &self.errors_by_kind {
            writeln!(out, "  {kind}: {n}")?;
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        self.verify_failures == 0
    }
}
