//! `orbitkv-perf arena`: how fast a server starts with a large arena. For each size, one
//! thread `memset`s that many bytes of fresh memory (page faults and zeroing: the work of
//! populating, on one core), then for each shard count a private server is started with that
//! arena and its start steps read back from `stats` (`startup`, `arena_populate`). The limit of
//! a start that populates each shard's slice on its own core at once is bytes / (shards x the
//! memset rate); `vs_limit` is the populate step's seconds over it. Whether the host scales
//! that far is measured too: as many threads as shards, on the shards' cores, each memsetting
//! its share of the bytes of fresh memory at once (`memset_parallel_gbps`; `vs_parallel`);
//! with `--one-memfd`, what the server's memfd per shard gains: the same bytes in one memfd,
//! populated at once by as many threads on those cores (`one_memfd_gbps`; `vs_one_memfd`).

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use orbitkv_proto::admin::AdminRequest;
use orbitkv_proto::format_bytes;
use orbitkv_shards::{Arena, PageSize};
use serde::Serialize;
use serde_json::Value;

use crate::admin;
use crate::args::ArenaArgs;
use crate::embedded::{self, EmbeddedServer};
use crate::error::{invalid, Error};

const GIB: f64 = (1u64 << 30) as f64;

/// The result of `arena`.
#[derive(Debug, Serialize)]
pub(crate) struct ArenaReport {
    /// CPUs this process may run on.
    pub cpus: usize,
    /// The host's transparent huge page setting for anonymous memory (what the memset's
    /// fresh memory gets), as `/sys/kernel/mm/transparent_hugepage/enabled` says.
    pub thp_anon: String,
    /// The servers' `--hugepages` and `--gpu`.
    pub hugepages: String,
    pub gpu: String,
    /// The servers' `--arena-memfds`.
    pub arena_memfds: String,
    /// One per size, in the order asked.
    pub sizes: Vec<SizeRows>,
}

/// One arena size: the memset baseline and a row per start.
#[derive(Debug, Serialize)]
pub(crate) struct SizeRows {
    /// Arena bytes (`--dram`).
    pub bytes: u64,
    /// One thread writing `bytes` of fresh memory, GB/s (10^9 bytes/s).
    pub memset_fresh_gbps: f64,
    /// The same thread writing them again (the pages present), GB/s.
    pub memset_warm_gbps: f64,
    /// One row per start.
    pub rows: Vec<StartRow>,
}

/// One server start.
#[derive(Debug, Serialize)]
pub(crate) struct StartRow {
    pub shards: usize,
    /// The pages the arena got (`arena_pages`).
    pub pages: String,
    /// Locked in memory.
    pub locked: bool,
    /// The populate step, seconds.
    pub populate_s: f64,
    /// `populate_s` per GiB of arena.
    pub s_per_gib: f64,
    /// bytes / (shards x memset_fresh rate), seconds.
    pub limit_s: f64,
    /// `populate_s` / `limit_s` (goal: <= 1.5).
    pub vs_limit: f64,
    /// As many threads as shards, pinned to the shards' cores, each memsetting its share of
    /// the bytes of fresh memory at once: GB/s of all together.
    pub memset_parallel_gbps: f64,
    /// `populate_s` / (bytes / `memset_parallel_gbps`).
    pub vs_parallel: f64,
    /// With `--one-memfd`: the same bytes in one memfd (whatever the server's
    /// `--arena-memfds`), populated (and locked as the server's) in as many parts at once, each by a thread on a
    /// shard's core: GB/s of all together.
    pub one_memfd_gbps: Option<f64>,
    /// `populate_s` / (bytes / `one_memfd_gbps`).
    pub vs_one_memfd: Option<f64>,
    /// The slowest slice's seconds, and the fastest's.
    pub slice_s: (f64, f64),
    /// The longest `mlock` call of a slice, seconds (part of its seconds; 0 when not locking;
    /// the pages are locked as they are faulted in, so their share is in the faults).
    pub lock_s: f64,
    /// The NUMA nodes the slices landed on (empty where the kernel does not say).
    pub numa_nodes: Vec<u64>,
    /// The CUDA registration step, seconds (with a GPU in use).
    pub register_cuda_s: Option<f64>,
    /// Process start to serving, seconds.
    pub total_s: f64,
}

impl crate::report::Report for ArenaReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "arena start: --hugepages {} --gpu {} --arena-memfds {}; {} CPUs; anonymous THP {}",
            self.hugepages, self.gpu, self.arena_memfds, self.cpus, self.thp_anon
        )?;
        for s in &self.sizes {
            writeln!(
                out,
                "{}: one-thread memset {:.2} GB/s fresh, {:.2} GB/s warm",
                format_bytes(s.bytes),
                s.memset_fresh_gbps,
                s.memset_warm_gbps
            )?;
            writeln!(
                out,
                "  shards  pages  locked  populate s  s/GiB  limit s  vs limit  par GB/s  vs par  1 memfd GB/s  slices s      lock s  cuda s  total s  nodes"
            )?;
            for r in &s.rows {
                writeln!(
                    out,
                    "  {:>6}  {:>5}  {:>6}  {:>10.3}  {:>5.3}  {:>7.3}  {:>8.2}  {:>8.2}  {:>6.2}  {:>12}  {:>5.2}-{:<5.2}  {:>6.2}  {:>6}  {:>7.2}  {:?}",
                    r.shards,
                    r.pages,
                    r.locked,
                    r.populate_s,
                    r.s_per_gib,
                    r.limit_s,
                    r.vs_limit,
                    r.memset_parallel_gbps,
                    r.vs_parallel,
                    r.one_memfd_gbps.map_or("-".into(), |g| format!("{g:.2}")),
                    r.slice_s.1,
                    r.slice_s.0,
                    r.lock_s,
                    r.register_cuda_s.map_or("-".into(), |s| format!("{s:.2}")),
                    r.total_s,
                    r.numa_nodes
                )?;
            }
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        true
    }
}

/// Runs the starts; a server that does not start is an error.
pub(crate) fn run(a: &ArenaArgs) -> Result<ArenaReport, Error> {
    check(a)?;
    let thp_anon = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let mut sizes = Vec::new();
    for &bytes in &a.sizes {
        let (memset_fresh_gbps, memset_warm_gbps) = memset(bytes);
        let mut rows = Vec::new();
        for &shards in &a.shards {
            for _ in 0..a.repeat {
                rows.push(start(a, bytes, shards, memset_fresh_gbps)?);
            }
        }
        sizes.push(SizeRows { bytes, memset_fresh_gbps, memset_warm_gbps, rows });
    }
    Ok(ArenaReport {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        thp_anon,
        hugepages: a.hugepages.clone(),
        arena_memfds: a.arena_memfds.clone(),
        gpu: a.gpu.clone(),
        sizes,
    })
}

fn check(a: &ArenaArgs) -> Result<(), Error> {
    if a.sizes.is_empty() || a.sizes.contains(&0) {
        return Err(invalid("--sizes", "give one or more sizes above 0"));
    }
    if a.shards.is_empty() || a.shards.contains(&0) {
        return Err(invalid("--shards", "give one or more shard counts above 0"));
    }
    if a.repeat == 0 {
        return Err(invalid("--repeat", "at least 1"));
    }
    for (flag, v, allowed) in [
        ("--hugepages", &a.hugepages, &["auto", "on", "off"][..]),
        ("--gpu", &a.gpu, &["auto", "required", "off"][..]),
        ("--arena-memfds", &a.arena_memfds, &["one", "per-shard"][..]),
    ] {
        if !allowed.contains(&v.as_str()) {
            return Err(invalid(flag, format!("{v:?}: one of {}", allowed.join(", "))));
        }
    }
    Ok(())
}

/// One thread writing `bytes` of fresh memory, then again: GB/s of each pass.
fn memset(bytes: u64) -> (f64, f64) {
    let n = bytes as usize;
    let mut v: Vec<u8> = Vec::with_capacity(n);
    let started = Instant::now();
    v.resize(n, 0x5a);
    let fresh = gbps(bytes, started.elapsed());
    black_box(&v);
    let started = Instant::now();
    v.fill(0xa5);
    let warm = gbps(bytes, started.elapsed());
    black_box(&v);
    (fresh, warm)
}

/// `threads` threads, the i-th pinned to `cores[i]` where given, each writing its share of
/// `bytes` of fresh memory, started together: GB/s of all, first start to last finish.
fn memset_parallel(bytes: u64, threads: usize, cores: &[usize]) -> f64 {
    let share = (bytes / threads as u64) as usize;
    let ready = std::sync::Barrier::new(threads + 1);
    let (start, done) = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..threads)
            .map(|i| {
                let (ready, core) = (&ready, cores.get(i).copied());
                scope.spawn(move || {
                    if let Some(c) = core {
                        crate::placement::pin_current_thread(&[c]);
                    }
                    let mut v: Vec<u8> = Vec::with_capacity(share);
                    ready.wait();
                    v.resize(share, 0x5a);
                    let done = Instant::now();
                    black_box(&v);
                    done
                })
            })
            .collect();
        ready.wait();
        let start = Instant::now();
        let done = threads.into_iter().filter_map(|t| t.join().ok()).max();
        (start, done.unwrap_or_else(Instant::now))
    });
    gbps(share as u64 * threads as u64, done.saturating_duration_since(start))
}

/// An arena of `bytes` in one memfd (no server), populated (and locked with `lock`) in
/// `shards` parts at once, each by a thread on the matching entry of `cores` (unpinned unless
/// every shard has one): GB/s of all.
fn one_memfd(bytes: u64, cores: &[usize], shards: usize, lock: bool) -> Result<f64, Error> {
    let mut arena = Arena::create_unpopulated(bytes, PageSize::Small, 1)
        .map_err(|e| Error::Setup(format!("--one-memfd baseline: {e}")))?;
    let pinned = (cores.len() == shards).then_some(cores);
    let started = Instant::now();
    arena.populate(shards, pinned, lock, &|_| ());
    Ok(gbps(bytes, started.elapsed()))
}

fn gbps(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9
}

/// Starts a server with a `bytes` arena on `shards` shards and reads its start back.
fn start(a: &ArenaArgs, bytes: u64, shards: usize, memset_gbps: f64) -> Result<StartRow, Error> {
    let extra = ["--hugepages", &a.hugepages, "--gpu", &a.gpu, "--arena-memfds", &a.arena_memfds]
        .map(String::from)
        .to_vec();
    // A generous bound: 60 s plus 5 s per GiB.
    let ready_timeout = Duration::from_secs(60 + 5 * (bytes >> 30));
    let server = EmbeddedServer::start(embedded::Options {
        dram: bytes,
        shards,
        no_lock_arena: a.no_lock_arena,
        ssd: None,
        extra,
        ready_timeout: Some(ready_timeout),
    })?;
    let admin = admin::client(server.socket());
    let stats = admin.request(&AdminRequest::Stats)?;
    let missing = |what: &str| {
        Error::Setup(format!(
            "admin socket {}: stats has no {what}: {stats}",
            admin.path().display()
        ))
    };
    let steps = &stats["startup"]["steps_s"];
    let populate_s = steps["populate_arena"].as_f64().ok_or_else(|| missing("populate step"))?;
    let total_s = stats["startup"]["total_s"].as_f64().ok_or_else(|| missing("startup total"))?;
    let slices = stats["arena_populate"]["slices"]
        .as_array()
        .ok_or_else(|| missing("arena_populate.slices"))?;
    let secs: Vec<f64> = slices.iter().filter_map(|s| s["seconds"].as_f64()).collect();
    let lock_s = slices.iter().filter_map(|s| s["lock_seconds"].as_f64()).fold(0.0, f64::max);
    let mut numa_nodes: Vec<u64> = slices.iter().filter_map(|s| s["numa_node"].as_u64()).collect();
    numa_nodes.sort_unstable();
    numa_nodes.dedup();
    let limit_s = bytes as f64 / (shards as f64 * memset_gbps * 1e9);
    let cores: Vec<usize> =
        slices.iter().filter_map(|s| s["core"].as_u64()).map(|c| c as usize).collect();
    drop(server);
    let memset_parallel_gbps = memset_parallel(bytes, shards, &cores);
    let one_memfd_gbps =
        if a.one_memfd { Some(one_memfd(bytes, &cores, shards, !a.no_lock_arena)?) } else { None };
    Ok(StartRow {
        shards,
        pages: stats["arena_pages"].as_str().unwrap_or("?").to_string(),
        locked: stats["arena_locked"] == Value::Bool(true),
        populate_s,
        s_per_gib: populate_s / (bytes as f64 / GIB),
        limit_s,
        vs_limit: populate_s / limit_s,
        memset_parallel_gbps,
        vs_parallel: populate_s / (bytes as f64 / (memset_parallel_gbps * 1e9)),
        one_memfd_gbps,
        vs_one_memfd: one_memfd_gbps.map(|g| populate_s / (bytes as f64 / (g * 1e9))),
        slice_s: (
            secs.iter().copied().fold(0.0, f64::max),
            secs.iter().copied().fold(f64::INFINITY, f64::min),
        ),
        lock_s,
        numa_nodes,
        register_cuda_s: steps["register_cuda"].as_f64(),
        total_s,
    })
}
