//! `orbitkv-perf serve`: sets up the run (server, plan, clients), times the phases, and turns
//! the clients' counts into a [`ServeReport`].

use std::io::IsTerminal;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::admin::{self, ServerFacts};
use crate::args::{socket_or_default, KeyDist, ServeArgs};
use crate::baseline;
use crate::embedded::{self, EmbeddedServer};
use crate::error::{invalid, Error};
use crate::gate::Gate;
use crate::placement;
use crate::progress::{self, Progress};
use crate::report::{LookupSummary, OpSummary, ServeReport};
use crate::sampler::{KeyPicker, Zipf};
use crate::stats::ClientStats;
use crate::worker::{self, Gates, LookupPlan, Plan};
use crate::workload;

/// Default DRAM of the embedded server.
const EMBEDDED_DRAM: u64 = 1 << 30;
/// Most keys in a client's lookup set.
const LOOKUP_SET_MAX: u64 = 4096;
/// Bytes per lookup-set value.
const LOOKUP_VALUE_LEN: usize = 4096;
/// Lookup sets of all clients together take at most this share of the arena.
const LOOKUP_ARENA_SHARE: u64 = 4;
/// Length of the memcpy baseline.
const BASELINE: Duration = Duration::from_secs(1);
/// Most keys per get (`--get-batch`): each client holds two value buffers per key.
const MAX_GET_BATCH: u64 = 4096;
/// Runs longer than this show a progress bar on a terminal (not with `--json`).
const PROGRESS_AFTER: Duration = Duration::from_secs(3);
/// Most clients.
const MAX_CLIENTS: usize = 4096;

/// Runs the benchmark; setup failures are errors, failures during the run are counted.
pub(crate) fn run(a: &ServeArgs) -> Result<ServeReport, Error> {
    let checked = check(a)?;
    let server = if a.embedded {
        Some(EmbeddedServer::start(embedded::Options {
            dram: a.embedded_dram.unwrap_or(EMBEDDED_DRAM),
            shards: a.embedded_shards.unwrap_or(0),
            no_lock_arena: a.no_lock_arena,
            ssd: None,
            extra: a.embedded_server_arg.clone(),
            ready_timeout: None,
        })?)
    } else {
        None
    };
    let socket = match &server {
        Some(s) => s.socket().to_owned(),
        None => socket_or_default(&a.socket),
    };
    let facts = match admin::facts(&socket) {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("orbitkv-perf: note: {e}; shard count and evictions are not reported");
            None
        }
    };
    let lookup = lookup_plan(a, checked.nkeys, facts)?;
    let most = checked.nkeys.min(MAX_GET_BATCH);
    if a.get_batch == 0 || a.get_batch as u64 > most {
        return Err(invalid(
            "--get-batch",
            format!("must be between 1 and {most} (the key count, at most {MAX_GET_BATCH})"),
        ));
    }
    let plan = Arc::new(Plan {
        socket: socket.clone(),
        namespace: checked.namespace,
        seed: a.seed,
        value_size: checked.value_size,
        picker: checked.picker,
        verify_only: a.verify_only,
        lookup,
        get_batch: a.get_batch,
        nkeys: checked.nkeys,
        // Allocated (and touched) before the clients start, shared by all of them.
        baseline: a
            .baseline_every
            .map(|every| (every, Arc::new(baseline::Source::new(checked.value_size)))),
    });
    let report = measure(a, &plan, &socket, facts, checked.nkeys)?;
    // The server (if embedded) stops here, after every client session closed.
    drop(server);
    Ok(report)
}

/// Flags turned into what the run needs.
struct Checked {
    value_size: usize,
    nkeys: u64,
    namespace: orbitkv_client::NamespaceDescriptor,
    picker: KeyPicker,
}

fn check(a: &ServeArgs) -> Result<Checked, Error> {
    if a.clients == 0 || a.clients > MAX_CLIENTS {
        return Err(invalid("--clients", format!("{} is not in 1..={MAX_CLIENTS}", a.clients)));
    }
    if a.duration.is_zero() {
        return Err(invalid("--duration", "must be positive"));
    }
    if a.value_size == 0 {
        return Err(invalid("--value-size", "must be positive"));
    }
    if let Some(every) = a.baseline_every {
        if every.is_zero() || every > a.duration {
            return Err(invalid(
                "--baseline-every",
                format!("must be positive and at most --duration ({:?})", a.duration),
            ));
        }
    }
    let value_size = usize::try_from(a.value_size)
        .map_err(|_| invalid("--value-size", "does not fit in memory"))?;
    let nkeys = a.working_set / a.value_size;
    if nkeys == 0 {
        return Err(invalid(
            "--working-set",
            format!("{} bytes hold no value of {} bytes", a.working_set, a.value_size),
        ));
    }
    let namespace = workload::namespace(a.value_size).map_err(|e| invalid("--value-size", e))?;
    let picker = match a.keys {
        KeyDist::Uniform => KeyPicker::Uniform { n: nkeys },
        KeyDist::Zipf => {
            KeyPicker::Zipf(Zipf::new(nkeys, a.zipf_theta).map_err(|e| invalid("--zipf-theta", e))?)
        }
    };
    Ok(Checked { value_size, nkeys, namespace, picker })
}

fn lookup_plan(
    a: &ServeArgs,
    nkeys: u64,
    facts: Option<ServerFacts>,
) -> Result<Option<LookupPlan>, Error> {
    if a.lookup_batch == 0 {
        return Ok(None);
    }
    let mut set_len = nkeys.min(LOOKUP_SET_MAX);
    // Keep every client's set resident: together they take a fraction of the arena.
    if let Some(f) = facts {
        let fits = f.arena_bytes / LOOKUP_ARENA_SHARE / a.clients as u64 / LOOKUP_VALUE_LEN as u64;
        set_len = set_len.min(fits);
    }
    let set_len = set_len as usize;
    if a.lookup_batch > set_len {
        return Err(invalid(
            "--lookup-batch",
            format!(
                "{} is more than the {set_len} keys of each client's lookup set \
                 (min of the key count, {LOOKUP_SET_MAX}, and what a quarter of the arena holds)",
                a.lookup_batch
            ),
        ));
    }
    Ok(Some(LookupPlan { batch: a.lookup_batch, set_len, value_len: LOOKUP_VALUE_LEN }))
}

/// Client threads, with the means to call them off.
struct Clients {
    gates: Arc<Gates>,
    handles: Vec<JoinHandle<ClientStats>>,
}

impl Clients {
    fn gone(&self) -> bool {
        self.handles.iter().any(JoinHandle::is_finished)
    }

    /// Waits for every client at `gate`; on any setup failure calls the run off.
    fn wait_at(&mut self, gate: impl Fn(&Gates) -> &Gate) -> Result<(), Error> {
        let failures = gate(&self.gates).wait_arrivals(|| self.gone());
        let first = match failures {
            Ok(f) => {
                let n = f.len();
                match f.into_iter().next() {
                    None => return Ok(()),
                    Some(e) if n == 1 => e,
                    Some(e) => Error::Setup(format!("{e} (and {} more clients failed)", n - 1)),
                }
            }
            Err(e) => e,
        };
        self.call_off();
        Err(first)
    }

    /// Releases every waiting client with "stop" and joins them all.
    fn call_off(&mut self) {
        self.gates.main.open(None);
        if let Some(g) = &self.gates.lookup {
            g.open(None);
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }

    fn join(mut self) -> Result<ClientStats, Error> {
        let mut total = ClientStats::default();
        for (id, h) in self.handles.drain(..).enumerate() {
            let s =
                h.join().map_err(|_| Error::Setup(format!("benchmark client {id} panicked")))?;
            total.merge(&s);
        }
        Ok(total)
    }
}

fn spawn(
    plan: &Arc<Plan>,
    clients: usize,
    progress: &Arc<Progress>,
    cpus: &[usize],
) -> Result<Clients, Error> {
    let gates = Arc::new(Gates {
        main: Gate::new(clients),
        lookup: plan.lookup.map(|_| Gate::new(clients)),
    });
    let mut c = Clients { gates, handles: Vec::with_capacity(clients) };
    for id in 0..clients {
        let (plan, gates, progress) = (plan.clone(), c.gates.clone(), progress.clone());
        // One free CPU per client, round robin (several clients may share one).
        let cpu: Vec<usize> = cpus.get(id % cpus.len().max(1)).copied().into_iter().collect();
        let spawned =
            std::thread::Builder::new().name(format!("perf-client-{id}")).spawn(move || {
                placement::pin_current_thread(&cpu);
                worker::run(id, &plan, &gates, &progress)
            });
        match spawned {
            Ok(h) => c.handles.push(h),
            Err(e) => {
                c.call_off();
                return Err(Error::Setup(format!(
                    "cannot start benchmark client thread {id}: {e}"
                )));
            }
        }
    }
    Ok(c)
}

/// The yardstick: memcpy and `copy_chunk` GB/s at the value size.
#[derive(Clone, Copy)]
struct Yardstick {
    memcpy_gbps: f64,
    copy_chunk_gbps: f64,
}

impl Yardstick {
    /// Measures memcpy, then `copy_chunk`, of `value_size` for [`BASELINE`] each.
    fn measure(value_size: usize) -> Self {
        let memcpy_gbps = baseline::memcpy_gbps(value_size, BASELINE);
        let copy_chunk_gbps = baseline::copy_chunk_gbps(value_size, BASELINE);
        Self { memcpy_gbps, copy_chunk_gbps }
    }
}

/// What [`run_phases`] saw: the clients' counts, the CPUs they were pinned to, when each
/// phase began, and the yardstick and the server's facts before and after the phases.
struct Phases {
    total: ClientStats,
    client_cpus: Vec<usize>,
    main_start: Instant,
    lookup_start: Option<Instant>,
    before: Yardstick,
    after: Yardstick,
    evictions_before: Option<ServerFacts>,
    evictions_after: Option<ServerFacts>,
}

/// Starts the clients, measures the yardstick once they are all at the start line, runs the
/// main phase (and the lookup phase), joins the clients and measures the yardstick again.
fn run_phases(
    a: &ServeArgs,
    plan: &Arc<Plan>,
    socket: &Path,
    facts: Option<ServerFacts>,
) -> Result<Phases, Error> {
    let progress = Arc::new(Progress::default());
    // Clients (and the memcpy baseline, on this thread) run on CPUs no shard is pinned to.
    let cpus = placement::free_cpus(&admin::shard_cores(socket).unwrap_or_default());
    let pinned = placement::pin_current_thread(&cpus);
    let client_cpus = if pinned { cpus } else { Vec::new() };
    let mut clients = spawn(plan, a.clients, &progress, &client_cpus)?;
    clients.wait_at(|g| &g.main)?;

    // Every client is connected and idle at the start line: measure the yardstick now (and
    // again after the run).
    let before = Yardstick::measure(plan.value_size);
    let phases = if plan.lookup.is_some() { 2 } else { 1 };
    let show = !a.json && std::io::stderr().is_terminal() && a.duration * phases > PROGRESS_AFTER;
    let evictions_before = facts.and_then(|_| admin::facts(socket).ok());

    let main_start = Instant::now();
    clients.gates.main.open(Some(main_start + a.duration));
    progress::wait_until(main_start + a.duration, "main", &progress, show);

    let mut lookup_start = None;
    if clients.gates.lookup.is_some() {
        clients.wait_at(|g| g.lookup.as_ref().expect("checked just above"))?;
        let start = Instant::now();
        lookup_start = Some(start);
        if let Some(g) = &clients.gates.lookup {
            g.open(Some(start + a.duration));
        }
        progress::wait_until(start + a.duration, "lookup", &progress, show);
    }
    let total = clients.join()?;
    let after = Yardstick::measure(plan.value_size);
    let evictions_after = facts.and_then(|_| admin::facts(socket).ok());
    Ok(Phases {
        total,
        client_cpus,
        main_start,
        lookup_start,
        before,
        after,
        evictions_before,
        evictions_after,
    })
}

/// GB/s of `bytes` in `time` (0 for no time).
fn gbps(bytes: u64, time: Duration) -> f64 {
    let secs = time.as_secs_f64();
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// The lookup phase's summary, when it ran (from `lookup_start`); per shard when the server
/// said how many it has.
fn lookup_summary(
    a: &ServeArgs,
    plan: &Plan,
    total: &ClientStats,
    lookup_start: Option<Instant>,
    shards: Option<usize>,
) -> Option<LookupSummary> {
    plan.lookup.zip(lookup_start).map(|(lp, start)| {
        let l = &total.lookup;
        let wall = l.ended.map_or(a.duration, |e| e.saturating_duration_since(start)).as_secs_f64();
        let keys_per_s = l.keys as f64 / wall;
        LookupSummary {
            batch: lp.batch,
            set_keys: lp.set_len,
            latency: OpSummary::from(&l.batch),
            batches_per_s: l.batch.count() as f64 / wall,
            keys_per_s,
            keys_per_s_per_shard: shards.filter(|s| *s > 0).map(|s| keys_per_s / s as f64),
            lookup_short: l.short,
            setup_missing: l.setup_missing,
            wall_s: wall,
        }
    })
}

/// Says on stderr the first error of each kind, and that `--verify-only` verified nothing
/// when it found none of the `nkeys` keys.
fn print_notes(a: &ServeArgs, total: &ClientStats, nkeys: u64) {
    for (kind, message) in &total.errors.first {
        eprintln!(
            "orbitkv-perf: {} {kind} error(s), first: {message}",
            total.errors.counts.get(kind).copied().unwrap_or(0)
        );
    }
    if a.verify_only && total.main.hits == 0 {
        eprintln!(
            "orbitkv-perf: note: --verify-only found none of the {nkeys} keys of seed {}: \
             nothing was verified",
            a.seed
        );
    }
}

fn measure(
    a: &ServeArgs,
    plan: &Arc<Plan>,
    socket: &Path,
    facts: Option<ServerFacts>,
    nkeys: u64,
) -> Result<ServeReport, Error> {
    let ran = run_phases(a, plan, socket, facts)?;
    let (total, main_start) = (&ran.total, ran.main_start);
    let (memcpy_gbps_before, memcpy_gbps_after) = (ran.before.memcpy_gbps, ran.after.memcpy_gbps);
    // The better of the two: a machine that was slow for one of them cannot flatter the ratio.
    let memcpy_gbps = memcpy_gbps_before.max(memcpy_gbps_after);
    let copy_chunk_gbps = ran.before.copy_chunk_gbps.max(ran.after.copy_chunk_gbps);
    let evictions = match (ran.evictions_before, ran.evictions_after) {
        (Some(b), Some(a)) => Some(a.evictions.saturating_sub(b.evictions)),
        _ => None,
    };
    let shards = ran.evictions_after.or(facts).map(|f| f.shards);

    let m = &total.main;
    // Without the yardstick's windows inside the phase (each client's, spread over them).
    let windows = m.bracketed.time.as_secs_f64() / a.clients as f64;
    let main_wall =
        (m.ended.map_or(a.duration, |e| e.saturating_duration_since(main_start)).as_secs_f64()
            - windows)
            .max(f64::MIN_POSITIVE);
    let get_gbps = gbps(m.get_bytes, m.get_time);
    let lookup_batch = lookup_summary(a, plan, total, ran.lookup_start, shards);
    print_notes(a, total, nkeys);
    let lookups = m.hits + m.misses;
    Ok(ServeReport {
        socket: socket.display().to_string(),
        client_cpus: ran.client_cpus,
        embedded: a.embedded,
        verify_only: a.verify_only,
        clients: a.clients,
        duration_s: a.duration.as_secs_f64(),
        value_size: a.value_size,
        working_set: a.working_set,
        nkeys,
        seed: a.seed,
        keys: a.keys.as_str(),
        zipf_theta: (a.keys == KeyDist::Zipf).then_some(a.zipf_theta),
        shards,
        evictions,
        hits: m.hits,
        misses: m.misses,
        hit_ratio: if lookups == 0 { 0.0 } else { m.hits as f64 / lookups as f64 },
        errors: total.errors.total(),
        errors_by_kind: total.errors.counts.clone(),
        verify_failures: m.verify_failures,
        put_rejected: m.put_rejected,
        put_stored: m.put_stored,
        put_already_present: m.put_already_present,
        get_batch: a.get_batch,
        get: OpSummary::from(&m.get),
        put: OpSummary::from(&m.put),
        lookup_batch,
        memcpy_gbps,
        memcpy_gbps_before,
        memcpy_gbps_after,
        get_gbps,
        get_copy_gbps: gbps(m.get_bytes, m.copy_time),
        get_gbps_aggregate: m.get_bytes as f64 / main_wall / 1e9,
        ratio_get_vs_memcpy: if memcpy_gbps > 0.0 { get_gbps / memcpy_gbps } else { 0.0 },
        copy_chunk_gbps,
        ratio_get_vs_copy_chunk: if copy_chunk_gbps > 0.0 {
            get_gbps / copy_chunk_gbps
        } else {
            0.0
        },
        baseline_every_s: a.baseline_every.map(|d| d.as_secs_f64()),
        ratio_get_vs_memcpy_bracketed: crate::stats::median(&m.bracketed.ratios),
        bracketed_ratios: m.bracketed.ratios.clone(),
        baseline_windows_gbps: m.bracketed.windows.clone(),
        main_wall_s: main_wall,
    })
}
