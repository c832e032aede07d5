//! `orbitkv-perf soak`: many client processes against one server for a set time, with random
//! client SIGKILLs, mixed value sizes, a working set beyond DRAM and SSD, and evictions, drains
//! and audits from the admin socket meanwhile; then every client is killed and the server must
//! come back to rest: no session, lease or reservation left, every shard's full scan
//! (`audit`) consistent, its RSS grown by a bounded amount. Every byte read is verified.
//!
//! The clients are this executable again (`orbitkv-perf soak-client`, one process each), so
//! that a SIGKILL takes a real session away in the middle of whatever it was doing. Each
//! prints its counters as a JSON line four times a second; a killed client's last line counts.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use orbitkv_client::{ChunkKey, Client, ClientOptions, ErrorCode};
use orbitkv_proto::admin::EvictTarget;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::admin;
use crate::args::{SoakArgs, SoakClientArgs};
use crate::embedded::{EmbeddedServer, Options};
use crate::error::Error;
use crate::report::Report;
use crate::workload::{fill_value, first_mismatch, namespace, KeySpace};

/// How often a client prints its counters.
const REPORT_EVERY: Duration = Duration::from_millis(250);
/// Keys per put or get request of a client, at most.
const MAX_BATCH: u64 = 8;
/// How long the server may take to close the sessions of the clients killed at the end.
const SETTLE: Duration = Duration::from_secs(20);
/// RSS growth of the server over the run that still passes (the arena is populated at start:
/// what grows is bookkeeping).
const RSS_GROWTH_BOUND: u64 = 64 << 20;
/// Seed of the key space every client shares (they read each other's values).
const KEY_SEED: u64 = 0x50a4;

/// One client's counters (its JSON line).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Counters {
    /// Chunks put (stored or already present).
    pub puts: u64,
    /// Chunks found and verified byte for byte.
    pub hits: u64,
    /// Chunks looked up and not found.
    pub misses: u64,
    /// Bytes verified.
    pub bytes_verified: u64,
    /// Chunks evicted by the client.
    pub evicts: u64,
    /// Requests refused for a reason the workload provokes (draining, busy, no space, lease
    /// limit): counted, not failures.
    pub refused: u64,
    /// Sessions reopened (after a drain refused the session, or on purpose).
    pub reconnects: u64,
    /// Errors the workload should never see.
    pub errors: u64,
    /// Bytes that differed from their key's value: any is a failure.
    pub mismatches: u64,
}

impl Counters {
    fn add(&mut self, o: &Counters) {
        self.puts += o.puts;
        self.hits += o.hits;
        self.misses += o.misses;
        self.bytes_verified += o.bytes_verified;
        self.evicts += o.evicts;
        self.refused += o.refused;
        self.reconnects += o.reconnects;
        self.errors += o.errors;
        self.mismatches += o.mismatches;
    }
}

/// What a soak run did and found.
#[derive(Debug, Serialize)]
pub(crate) struct SoakReport {
    /// Seconds the clients ran.
    pub duration_s: f64,
    /// Client processes at once.
    pub clients: usize,
    /// Value sizes, in bytes.
    pub value_sizes: Vec<u64>,
    /// Bytes of all keys' values together (the working set).
    pub working_set_bytes: u64,
    /// The server's DRAM and SSD capacity.
    pub capacity_bytes: u64,
    /// Every client's counters, summed (killed ones up to their last report).
    pub totals: Counters,
    /// Clients killed with SIGKILL during the run (all are at its end, besides).
    pub client_kills: u64,
    /// Admin actions: namespace evictions, drain-and-resume cycles, audits.
    pub admin_evicts: u64,
    /// Drains (each followed by a resume).
    pub drains: u64,
    /// Audits during the run.
    pub audits: u64,
    /// Problems the audits during the run found.
    pub audit_problems: Vec<String>,
    /// Once every client was killed: sessions, leases, reservations, pins left.
    pub final_sessions: u64,
    /// Leases left.
    pub final_leases: u64,
    /// Reservations left.
    pub final_reservations: u64,
    /// Lookup pins left.
    pub final_pins: u64,
    /// Problems the final audit found.
    pub final_problems: Vec<String>,
    /// The server's counters at the end: DRAM evictions for room, demotions to SSD, SSD
    /// hits, SSD records dropped by region reclaim, tombstones written (the working set
    /// beyond DRAM and SSD shows in the first and the fourth).
    pub server_evictions: u64,
    /// Demotions to SSD.
    pub server_demotions: u64,
    /// SSD hits.
    pub server_ssd_hits: u64,
    /// SSD records dropped by region reclaim.
    pub server_ssd_reclaimed: u64,
    /// Tombstones written.
    pub server_tombstones: u64,
    /// Server RSS once the clients had run a tenth of the time, and at the end.
    pub rss_start_bytes: u64,
    /// At the end.
    pub rss_end_bytes: u64,
    /// What failed (empty: passed).
    pub failures: Vec<String>,
}

impl Report for SoakReport {
    fn write_table(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        let t = &self.totals;
        writeln!(
            out,
            "soak {:.0} s, {} clients, values {:?} bytes, working set {} MiB over {} MiB of DRAM and SSD",
            self.duration_s,
            self.clients,
            self.value_sizes,
            self.working_set_bytes >> 20,
            self.capacity_bytes >> 20
        )?;
        writeln!(
            out,
            "  puts {}  hits {} ({} MiB verified)  misses {}  evicts {}  refused {}  reconnects {}",
            t.puts,
            t.hits,
            t.bytes_verified >> 20,
            t.misses,
            t.evicts,
            t.refused,
            t.reconnects
        )?;
        writeln!(
            out,
            "  client kills {}  admin evicts {}  drains {}  audits {}  errors {}  mismatches {}",
            self.client_kills, self.admin_evicts, self.drains, self.audits, t.errors, t.mismatches
        )?;
        writeln!(
            out,
            "  server: DRAM evictions {}  demotions {}  SSD hits {}  SSD records reclaimed {}  tombstones {}",
            self.server_evictions,
            self.server_demotions,
            self.server_ssd_hits,
            self.server_ssd_reclaimed,
            self.server_tombstones
        )?;
        writeln!(
            out,
            "  at rest: sessions {} leases {} reservations {} pins {}; audit problems {}; RSS {} -> {} MiB",
            self.final_sessions,
            self.final_leases,
            self.final_reservations,
            self.final_pins,
            self.final_problems.len() + self.audit_problems.len(),
            self.rss_start_bytes >> 20,
            self.rss_end_bytes >> 20
        )?;
        for f in &self.failures {
            writeln!(out, "  FAILED: {f}")?;
        }
        if self.failures.is_empty() {
            writeln!(out, "  passed")?;
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The value size of key `i` (fixed per key: a read checks its length too).
fn size_of(sizes: &[u64], i: u64) -> u64 {
    sizes[(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize % sizes.len()]
}

/// A client process and the counters it last reported.
struct Runner {
    child: Child,
    last: Arc<Mutex<Counters>>,
}

fn spawn_client(socket: &Path, a: &SoakArgs, seed: u64) -> Result<Runner, Error> {
    let exe = std::env::current_exe().map_err(|source| Error::Io {
        op: "locating",
        path: "the orbitkv-perf executable".into(),
        source,
    })?;
    let sizes: Vec<String> = a.value_sizes.iter().map(u64::to_string).collect();
    let mut child = Command::new(&exe)
        .arg("soak-client")
        .arg("--socket")
        .arg(socket)
        .args(["--seed", &seed.to_string(), "--keys", &a.keys.to_string()])
        .args(["--value-sizes", &sizes.join(",")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|source| Error::Io { op: "starting", path: exe.clone(), source })?;
    let last = Arc::new(Mutex::new(Counters::default()));
    let out = child.stdout.take().expect("stdout is piped");
    let sink = Arc::clone(&last);
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(c) = serde_json::from_str::<Counters>(&line) {
                *sink.lock().expect("counters lock is never poisoned") = c;
            }
        }
    });
    Ok(Runner { child, last })
}

/// Kills a client with SIGKILL and returns its last counters.
fn kill_client(mut r: Runner) -> Counters {
    let _ = kill(Pid::from_raw(r.child.id() as i32), Signal::SIGKILL);
    let _ = r.child.wait();
    // Its reader thread has read what was written before the kill.
    std::thread::sleep(Duration::from_millis(20));
    *r.last.lock().expect("counters lock is never poisoned")
}

fn rss_bytes(pid: u64) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// Runs the soak; see the module docs.
pub(crate) fn run(a: &SoakArgs) -> Result<SoakReport, Error> {
    for (bad, flag, what) in [
        (a.value_sizes.is_empty(), "--value-sizes", "at least one value size"),
        (a.value_sizes.contains(&0), "--value-sizes", "sizes of at least one byte"),
        (a.clients == 0, "--clients", "at least one client"),
        (a.keys == 0, "--keys", "at least one key"),
    ] {
        if bad {
            return Err(crate::error::invalid(flag, format!("the soak needs {what}")));
        }
    }
    let embedded = match &a.socket {
        Some(_) => None,
        None => Some(EmbeddedServer::start(Options {
            dram: a.dram,
            shards: a.shards,
            no_lock_arena: true,
            ssd: Some((a.ssd, a.ssd_region_size)),
            extra: Vec::new(),
            ready_timeout: None,
        })?),
    };
    let socket: PathBuf = match (&a.socket, &embedded) {
        (Some(s), _) => s.clone(),
        (None, Some(e)) => e.socket().to_path_buf(),
        (None, None) => unreachable!("one or the other"),
    };
    let max = *a.value_sizes.iter().max().expect("checked non-empty");
    let descriptor = namespace(max).map_err(|e| crate::error::invalid("--value-sizes", e))?;
    let mut registrar = Client::connect(ClientOptions::with_socket(&socket))
        .map_err(|source| Error::Client { client: 0, source })?;
    let ns = registrar
        .register_namespace(&descriptor)
        .map_err(|source| Error::Client { client: 0, source })?
        .id;
    drop(registrar);
    let stats = admin::client(&socket).stats()?;
    let pid = u64::from(stats.pid);
    let capacity = stats.arena_bytes + stats.sum(|s| s.ssd_capacity_bytes);
    let working_set: u64 = (0..a.keys).map(|i| size_of(&a.value_sizes, i)).sum();

    let mut rng = SmallRng::seed_from_u64(a.seed);
    let mut next_seed = a.seed.wrapping_mul(1000);
    let mut seed = || {
        next_seed += 1;
        next_seed
    };
    let mut runners: Vec<Runner> =
        (0..a.clients).map(|_| spawn_client(&socket, a, seed())).collect::<Result<_, _>>()?;
    let mut retired = Counters::default();
    let mut report = SoakReport {
        duration_s: 0.0,
        clients: a.clients,
        value_sizes: a.value_sizes.clone(),
        working_set_bytes: working_set,
        capacity_bytes: capacity,
        totals: Counters::default(),
        client_kills: 0,
        admin_evicts: 0,
        drains: 0,
        audits: 0,
        audit_problems: Vec::new(),
        final_sessions: 0,
        final_leases: 0,
        final_reservations: 0,
        final_pins: 0,
        final_problems: Vec::new(),
        server_evictions: 0,
        server_demotions: 0,
        server_ssd_hits: 0,
        server_ssd_reclaimed: 0,
        server_tombstones: 0,
        rss_start_bytes: 0,
        rss_end_bytes: 0,
        failures: Vec::new(),
    };
    let start = Instant::now();
    let (mut next_kill, mut next_admin) = (start + a.kill_every, start + a.admin_every);
    while start.elapsed() < a.duration {
        std::thread::sleep(Duration::from_millis(20));
        let now = Instant::now();
        if report.rss_start_bytes == 0 && start.elapsed() >= a.duration / 10 {
            report.rss_start_bytes = rss_bytes(pid);
        }
        if !a.kill_every.is_zero() && now >= next_kill {
            next_kill = now + a.kill_every;
            let victim = runners.swap_remove(rng.gen_range(0..runners.len()));
            retired.add(&kill_client(victim));
            report.client_kills += 1;
            runners.push(spawn_client(&socket, a, seed())?);
        }
        if !a.admin_every.is_zero() && now >= next_admin {
            next_admin = now + a.admin_every;
            admin_action(&socket, ns, &mut rng, &mut report)?;
        }
        // A client that exited by itself found a wrong byte or could not go on.
        for r in &mut runners {
            if let Ok(Some(status)) = r.child.try_wait() {
                report.failures.push(format!("a client exited by itself ({status})"));
            }
        }
        if !report.failures.is_empty() {
            break;
        }
    }
    report.duration_s = start.elapsed().as_secs_f64();
    for r in runners {
        retired.add(&kill_client(r));
    }
    report.totals = retired;
    settle(&socket, &mut report)?;
    report.rss_end_bytes = rss_bytes(pid);
    judge(&mut report);
    Ok(report)
}

/// One admin action at random: evict the namespace, drain for a moment and resume, or audit.
fn admin_action(
    socket: &Path,
    ns: u64,
    rng: &mut SmallRng,
    report: &mut SoakReport,
) -> Result<(), Error> {
    let admin = admin::client(socket);
    match rng.gen_range(0..3) {
        0 => {
            admin.evict(EvictTarget::Namespace(ns))?;
            report.admin_evicts += 1;
        }
        1 => {
            admin.drain()?;
            std::thread::sleep(Duration::from_millis(200));
            admin.resume()?;
            report.drains += 1;
        }
        _ => {
            let v = admin.audit()?;
            report.audits += 1;
            report.audit_problems.extend(v.problems);
        }
    }
    Ok(())
}

/// Waits until the killed clients' sessions are closed, then takes the final counts and audit.
fn settle(socket: &Path, report: &mut SoakReport) -> Result<(), Error> {
    let deadline = Instant::now() + SETTLE;
    let admin = admin::client(socket);
    loop {
        let stats = admin.stats()?;
        if stats.sessions == 0 || Instant::now() > deadline {
            report.final_sessions = stats.sessions;
            report.final_leases = stats.sum(|s| s.leases);
            report.final_reservations = stats.sum(|s| s.reservations);
            report.server_evictions = stats.sum(|s| s.evictions);
            report.server_demotions = stats.sum(|s| s.demotions);
            report.server_ssd_hits = stats.sum(|s| s.ssd_hits);
            report.server_ssd_reclaimed = stats.sum(|s| s.ssd_reclaimed);
            report.server_tombstones = stats.sum(|s| s.ssd_tombstones);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let v = admin.audit()?;
    report.final_problems = v.problems;
    let scans: Vec<_> = v.shards.iter().filter_map(|s| s.answer.as_ref()).collect();
    report.final_pins = scans.iter().map(|s| s.pins).sum();
    let audited_leases: u64 = scans.iter().map(|s| s.leases).sum();
    let audited_reserved: u64 = scans.iter().map(|s| s.reservations).sum();
    report.final_leases = report.final_leases.max(audited_leases);
    report.final_reservations = report.final_reservations.max(audited_reserved);
    Ok(())
}

fn judge(r: &mut SoakReport) {
    let t = r.totals;
    let mut fail = |cond: bool, what: String| {
        if cond {
            r.failures.push(what);
        }
    };
    fail(t.mismatches > 0, format!("{} chunks read with wrong bytes", t.mismatches));
    fail(t.errors > 0, format!("{} unexpected errors (the clients' stderr says which)", t.errors));
    fail(t.hits == 0, "no chunk was ever read back".into());
    fail(r.final_sessions != 0, format!("{} sessions left", r.final_sessions));
    fail(r.final_leases != 0, format!("{} leases left", r.final_leases));
    fail(r.final_reservations != 0, format!("{} reservations left", r.final_reservations));
    fail(r.final_pins != 0, format!("{} lookup pins left", r.final_pins));
    let problems: Vec<String> = r.audit_problems.iter().chain(&r.final_problems).cloned().collect();
    fail(!problems.is_empty(), format!("audits found: {}", problems.join("; ")));
    let growth = r.rss_end_bytes.saturating_sub(r.rss_start_bytes);
    fail(
        r.rss_start_bytes > 0 && growth > RSS_GROWTH_BOUND,
        format!("server RSS grew by {} MiB (bound {} MiB)", growth >> 20, RSS_GROWTH_BOUND >> 20),
    );
}

/// The client process: puts, leased gets (every byte verified), evictions and reconnects at
/// random over the shared key space until killed; its counters on stdout as JSON lines.
/// Exits 3 at the first wrong byte.
pub(crate) fn client(a: &SoakClientArgs) -> Result<bool, Error> {
    let max =
        *a.value_sizes.iter().max().ok_or_else(|| {
            crate::error::invalid("--value-sizes", "need at least one value size")
        })?;
    let descriptor = namespace(max).map_err(|e| crate::error::invalid("--value-sizes", e))?;
    let mut rng = SmallRng::seed_from_u64(a.seed);
    let mut c = Counters::default();
    let mut session: Option<(Client, KeySpace)> = None;
    let mut last_report = Instant::now();
    let mut buf = Vec::new();
    loop {
        if last_report.elapsed() >= REPORT_EVERY {
            println!("{}", serde_json::to_string(&c).expect("counters serialize"));
            last_report = Instant::now();
        }
        let (client, space) = match session.as_mut() {
            Some(s) => s,
            None => {
                match Client::connect(ClientOptions::with_socket(&a.socket))
                    .and_then(|mut cl| cl.register_namespace(&descriptor).map(|n| (cl, n.id)))
                {
                    Ok((cl, ns)) => {
                        session = Some((cl, KeySpace { namespace: ns, seed: KEY_SEED }))
                    }
                    Err(_) => {
                        // Draining, or the server busy: try again shortly.
                        c.reconnects += 1;
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                continue;
            }
        };
        let first = rng.gen_range(0..a.keys);
        let n = rng.gen_range(1..=MAX_BATCH).min(a.keys);
        let ids: Vec<u64> = (0..n).map(|j| (first + j) % a.keys).collect();
        let keys: Vec<ChunkKey> = ids.iter().map(|&i| space.key(i)).collect();
        let outcome = match rng.gen_range(0..100) {
            0..40 => put(client, &keys, &ids, &a.value_sizes, &mut buf, &mut c),
            40..95 => get(client, &keys, &ids, &a.value_sizes, &mut c),
            95..98 => client.evict(&keys[..1]).map(|_| c.evicts += 1),
            _ => {
                session = None;
                c.reconnects += 1;
                continue;
            }
        };
        if c.mismatches > 0 {
            println!("{}", serde_json::to_string(&c).expect("counters serialize"));
            std::process::exit(3);
        }
        match outcome {
            Ok(()) => {}
            Err(orbitkv_client::Error::Server { code, .. }) if expected(code) => c.refused += 1,
            Err(orbitkv_client::Error::Server { code: ErrorCode::UnknownNamespace, .. })
            | Err(orbitkv_client::Error::Disconnected(_)) => session = None,
            Err(e) => {
                eprintln!("orbitkv-perf soak-client: {e}");
                c.errors += 1;
                session = None;
            }
        }
    }
}

/// Refusals the soak provokes on purpose.
fn expected(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::Draining | ErrorCode::Busy | ErrorCode::NoSpace | ErrorCode::LeaseLimit
    )
}

fn put(
    client: &mut Client,
    keys: &[ChunkKey],
    ids: &[u64],
    sizes: &[u64],
    buf: &mut Vec<Vec<u8>>,
    c: &mut Counters,
) -> Result<(), orbitkv_client::Error> {
    buf.resize_with(keys.len(), Vec::new);
    for ((k, &i), v) in keys.iter().zip(ids).zip(buf.iter_mut()) {
        v.resize(size_of(sizes, i) as usize, 0);
        fill_value(&k.digest, v);
    }
    let items: Vec<(ChunkKey, &[u8])> =
        keys.iter().copied().zip(buf.iter().map(Vec::as_slice)).collect();
    let out = client.put(&items)?;
    c.puts +=
        out.iter().filter(|o| !matches!(o, orbitkv_client::PutOutcome::Failed(_))).count() as u64;
    c.refused +=
        out.iter().filter(|o| matches!(o, orbitkv_client::PutOutcome::Failed(_))).count() as u64;
    Ok(())
}

fn get(
    client: &mut Client,
    keys: &[ChunkKey],
    ids: &[u64],
    sizes: &[u64],
    c: &mut Counters,
) -> Result<(), orbitkv_client::Error> {
    let leases = client.lookup_leased(keys)?;
    let mut verified = Ok(());
    for (l, (k, &i)) in leases.iter().zip(keys.iter().zip(ids)) {
        let bytes = match client.chunk(l) {
            Ok(b) => b,
            Err(e) => {
                verified = Err(e);
                break;
            }
        };
        if bytes.len() as u64 != size_of(sizes, i) || first_mismatch(&k.digest, bytes).is_some() {
            eprintln!(
                "orbitkv-perf soak-client: chunk {i} read {} bytes, not its value ({} bytes)",
                bytes.len(),
                size_of(sizes, i)
            );
            c.mismatches += 1;
        } else {
            c.hits += 1;
            c.bytes_verified += bytes.len() as u64;
        }
    }
    c.misses += (keys.len() - leases.len()) as u64;
    client.release(&leases)?;
    verified
}
