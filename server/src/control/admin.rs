//! The admin socket (`<socket>.admin`): one JSON request line, one JSON response line.
//!
//! The requests and replies are `orbitkv_proto::admin`'s (docs/operations.md says what they
//! mean); `stats` is assembled here from the metrics sample as one JSON object.
//! Unknown or malformed input gets `{"ok":false,"error":...}`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{json, Map, Value};

use orbitkv_proto::admin::{
    AdminRequest, AdminRequestLine, AuditReply, ErrorReply, EvictReply, EvictTarget, PeerLink,
    PeersReply, RefusalCode, ServerState, SessionInfo, SessionsReply, ShardAnswer, ShardAudit,
    ShardEvict, StateReply,
};
use orbitkv_proto::LatencyHistogram;
use orbitkv_shards::OpKind;

use crate::control::access::{Access, Denied};
use crate::control::shared::{ServeState, Shared};
use crate::control::startup::Startup;
use crate::deadline::DeadlineReader;
use crate::metrics::Sample;

const MAX_LINE: u64 = 4096;

/// Admin connections served at once; more wait in the listen backlog.
const MAX_ADMIN_CONNECTIONS: usize = 16;
/// Time a client has to send its request line.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// Serves admin connections, each on its own thread (at most [`MAX_ADMIN_CONNECTIONS`]),
/// until the listener fails. A slow client only holds its own thread, for at most
/// [`REQUEST_DEADLINE`].
pub fn serve(listener: UnixListener, startup: Arc<Startup>) {
    let live = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                while live.load(Ordering::Acquire) >= MAX_ADMIN_CONNECTIONS {
                    std::thread::sleep(Duration::from_millis(5));
                }
                live.fetch_add(1, Ordering::AcqRel);
                let startup = Arc::clone(&startup);
                let done = Arc::clone(&live);
                let spawned = std::thread::Builder::new().name("orbitkv-admin-conn".into()).spawn(
                    move || {
                        if let Err(e) = handle(stream, &startup) {
                            tracing::debug!(error = %e, "admin connection failed");
                        }
                        done.fetch_sub(1, Ordering::AcqRel);
                    },
                );
                if let Err(e) = spawned {
                    live.fetch_sub(1, Ordering::AcqRel);
                    tracing::error!(error = %e, "cannot start an admin thread");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn handle(stream: UnixStream, startup: &Startup) -> std::io::Result<()> {
    let creds = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(std::io::Error::from)?;
    let mut line = String::new();
    BufReader::new(DeadlineReader::new(&stream, REQUEST_DEADLINE).take(MAX_LINE))
        .read_line(&mut line)?;
    // Who may run the command, and whether it can run while starting, is decided on its name
    // before the rest of the request is read.
    let reply = match AdminRequestLine::parse(&line) {
        Ok(request) => match allowed(request.cmd(), (creds.uid(), creds.gid()), &startup.access) {
            Ok(()) => match (startup.server(), request.request()) {
                (None, request) => while_starting(request.ok(), startup),
                (Some((shared, _)), Ok(request)) => command(request, shared, startup),
                (Some(_), Err(why)) => reply(&ErrorReply::new(why.to_string())),
            },
            Err(why) => {
                let cmd = request.cmd();
                tracing::warn!(uid = creds.uid(), pid = creds.pid(), cmd, "admin command refused");
                reply(&ErrorReply::with_code(why.to_string(), RefusalCode::PermissionDenied))
            }
        },
        Err(why) => reply(&ErrorReply::new(why.to_string())),
    };
    // Through a JSON value, whose members are sorted: the answer's bytes do not depend on the
    // order of a type's fields.
    let mut out = serde_json::to_vec(&reply).expect("JSON values always serialize");
    out.push(b'\n');
    (&stream).write_all(&out)
}

/// A reply as the JSON value that goes on the wire.
fn reply(reply: &impl Serialize) -> Value {
    serde_json::to_value(reply).expect("admin replies serialize to JSON")
}

/// A command while the server starts: `health` says how far it got; the others wait for it.
fn while_starting(request: Option<AdminRequest>, startup: &Startup) -> Value {
    match request {
        Some(AdminRequest::Health) => reply(&startup.health()),
        _ => reply(&ErrorReply {
            starting: Some(startup.progress()),
            ..ErrorReply::with_code(
                format!(
                    "the server is starting ({}): try again once `orbitkv-ctl health` says ready",
                    startup.message()
                ),
                RefusalCode::Starting,
            )
        }),
    }
}

/// Whether the connection's `(uid, gid)` may run `cmd`: commands that change state need an
/// admin uid, the others a uid or group allowed sessions.
fn allowed(cmd: &str, (uid, gid): (u32, u32), access: &Access) -> Result<(), Denied> {
    match cmd {
        "drain" | "resume" | "evict" => access.may_change(uid, cmd),
        _ => access.may_connect(uid, gid),
    }
}

fn command(request: AdminRequest, shared: &Shared, startup: &Startup) -> Value {
    match request {
        AdminRequest::Evict(target) => reply(&evict(target, shared)),
        AdminRequest::Audit => reply(&audit(shared)),
        AdminRequest::Health => reply(&Sample::take(shared, startup).health()),
        AdminRequest::Stats => stats(shared, startup),
        AdminRequest::Peers => match shared.cluster.get() {
            Some(c) => reply(&PeersReply {
                ok: true,
                cluster: crate::metrics::cluster_status(&c.status()),
                peering: shared.peer_fetches.get().is_some(),
                peers: c.peers().into_iter().map(|(node, p)| (node, peer_link(&p))).collect(),
            }),
            None => {
                reply(&ErrorReply::new("standalone: this server is not in a cluster (no --etcd)"))
            }
        },
        AdminRequest::Drain => {
            shared.set_state(ServeState::Draining);
            tracing::info!("draining: new sessions and writes are refused");
            reply(&StateReply { ok: true, state: Sample::take(shared, startup).state })
        }
        AdminRequest::Resume => {
            shared.set_state(ServeState::Serving);
            tracing::info!("resumed serving");
            reply(&StateReply { ok: true, state: ServerState::Serving })
        }
        AdminRequest::Sessions => {
            let sessions = shared.sessions.lock().expect("session table lock is never poisoned");
            let sessions = sessions
                .values()
                .map(|s| SessionInfo {
                    id: s.id,
                    pid: s.pid,
                    uid: s.uid,
                    name: s.name.clone(),
                    home_shard: s.home_shard,
                    closing: s.closing,
                    opened_unix_s: s.opened.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
                })
                .collect();
            reply(&SessionsReply { ok: true, sessions })
        }
    }
}

/// What this node knows of one peer, for `peers`.
fn peer_link(p: &orbitkv_peer::PeerView) -> PeerLink {
    PeerLink {
        epoch: p.epoch,
        stream: p.stream.clone(),
        complete: p.complete,
        catalog_entries: p.catalog_entries,
        grants_held: p.grants_held,
        grants_given: p.grants_given,
        chunks_read: p.chunks_read,
        bytes_read: p.bytes_read,
        read_failures: p.read_failures,
        group_reads: p.groups,
        queue_us_mean: mean_us(p.queue_ns, p.groups),
        grant_us_mean: mean_us(p.grant_ns, p.groups),
        te_read_us_mean: mean_us(p.te_read_ns, p.groups),
        handoff_us_mean: mean_us(p.handoff_ns, p.groups),
    }
}

/// How long `audit` waits for every shard's full scan.
const AUDIT_TIMEOUT: Duration = Duration::from_secs(8);

/// `audit`: every shard's full scan of its bookkeeping (entries, arena pages, leases,
/// reservations, the SSD log) against its counters, and the server's session table; `ok` is
/// false when any shard found an inconsistency or did not answer. Read-only.
fn audit(shared: &Shared) -> AuditReply {
    let sessions = shared.sessions.lock().expect("session table lock is never poisoned").len();
    let mut problems = Vec::new();
    let shards: Vec<ShardAnswer<ShardAudit>> = shared
        .audits(AUDIT_TIMEOUT)
        .into_iter()
        .enumerate()
        .map(|(id, a)| match a {
            Some(a) => {
                problems.extend(a.problems.iter().map(|p| format!("shard {id}: {p}")));
                ShardAnswer { id, answer: Some(a) }
            }
            None => {
                problems.push(format!(
                    "shard {id} did not answer within {} s",
                    AUDIT_TIMEOUT.as_secs()
                ));
                ShardAnswer { id, answer: None }
            }
        })
        .collect();
    let error = problems
        .first()
        .map(|first| format!("audit: {} inconsistencies; the first: {first}", problems.len()));
    AuditReply { ok: problems.is_empty(), sessions, problems, shards, error }
}

/// How long `evict` waits for every shard's pass over its keys.
const EVICT_TIMEOUT: Duration = Duration::from_secs(8);

/// `evict`: removes a namespace's chunks (`"namespace": ID`) or every chunk (`"all": true`)
/// from every tier of every shard. Leased chunks, and chunks a tier is moving, stay (`busy`).
fn evict(target: EvictTarget, shared: &Shared) -> EvictReply {
    let namespace = target.namespace();
    let answers = shared.evict(namespace, EVICT_TIMEOUT);
    let (mut removed, mut busy, mut not_durable) = (0, 0, 0);
    let mut silent = Vec::new();
    let shards: Vec<ShardAnswer<ShardEvict>> = answers
        .iter()
        .enumerate()
        .map(|(id, a)| match a {
            Some(s) => {
                removed += s.removed;
                busy += s.busy;
                not_durable += s.not_durable;
                let answer =
                    ShardEvict { removed: s.removed, busy: s.busy, not_durable: s.not_durable };
                ShardAnswer { id, answer: Some(answer) }
            }
            None => {
                silent.push(id.to_string());
                ShardAnswer { id, answer: None }
            }
        })
        .collect();
    tracing::info!(namespace = ?namespace, removed, busy, not_durable, "evict from the admin socket");
    let error = (!silent.is_empty()).then(|| {
        format!(
            "evict: shard(s) {} did not answer within {} s (they may still evict); the others \
             removed {removed} chunks",
            silent.join(", "),
            EVICT_TIMEOUT.as_secs()
        )
    });
    EvictReply { ok: silent.is_empty(), namespace, removed, busy, not_durable, shards, error }
}

/// `orbitkv-ctl stats`: the server's state and every shard's counters as one JSON object. It
/// lists the fields of the reply in one place (the reply is the reference operators read), so
/// it runs past the usual length.
fn stats(shared: &Shared, startup: &Startup) -> Value {
    let sample = Sample::take(shared, startup);
    let shards: Vec<Value> = sample
        .shards
        .iter()
        .enumerate()
        .map(|(id, s)| match s {
            None => {
                // Where its loop was last: tells a shard stuck in a task from one that stopped
                // being scheduled.
                let (iteration, stage) = shared.doorbells.last_beat(id);
                json!({"id": id, "answering": false, "loop_iteration": iteration, "loop_stage": stage,
                       "executor_nudges": shared.doorbells.nudges(id)})
            }
            Some(s) => shard_json(id, s, shared),
        })
        .collect();
    json!({
        "ok": true,
        "state": sample.state,
        "writes_admitted": sample.writes_admitted,
        "pid": std::process::id(),
        "uptime_s": sample.uptime_s,
        "socket": shared.settings.socket.display().to_string(),
        "sessions": sample.sessions,
        "refused_sessions": sample.refused_sessions,
        "arena_bytes": shared.settings.dram_bytes,
        "arena_locked": shared.arena_locked,
        "arena_pages": shared.arena_pages.as_str(),
        "arena_memfds": shared.arena_memfds,
        "startup": startup.stats_json(),
        "arena_populate": {
            "seconds": shared.arena_populate_seconds,
            "slices": shared.arena_parts.iter().enumerate().map(|(shard, p)| json!({
                "shard": shard, "bytes": p.bytes, "core": p.core, "numa_node": p.node,
                "seconds": p.seconds, "lock_seconds": p.lock_seconds, "locked": p.locked,
                "register_cuda_seconds": shared.arena_register_seconds.get(shard),
            })).collect::<Vec<_>>(),
        },
        "gpu_mode": shared.settings.config.gpu.as_str(),
        "gpu": shared.gpu,
        "gpu_transfers": sample.gpu.as_ref().map(gpu_transfers),
        "latency": latency_json(&sample.merged_latency()),
        "shards": shards,
    })
}

/// One answering shard's part of `stats`.
fn shard_json(id: usize, s: &crate::shard::messages::ShardSnapshot, shared: &Shared) -> Value {
    let st = &s.stats;
    let errors: Map<String, Value> =
        st.errors.iter().map(|(c, n)| (c.as_str().to_string(), json!(n))).collect();
    let latency = latency_json(&st.latency);
    let mut v = json!({
        "id": id,
        "answering": true,
        "executor_nudges": shared.doorbells.nudges(id),
        "core": s.core,
        "sessions": s.sessions,
        "dram_capacity_bytes": st.dram_capacity_bytes,
        "dram_used_bytes": st.dram_used_bytes,
        "entries": st.entries,
        "reservations": st.reservations,
        "leases": st.leases,
        "namespaces": st.namespaces,
        "hits": st.hits,
        "misses": st.misses,
        "evictions": st.evictions,
        "removals": st.removals,
        "quota_refusals": st.quota_refusals,
        "ssd_quota_drops": st.ssd_quota_drops,
        "commits": st.commits,
        "bytes_committed": st.bytes_committed,
        "gpu_checksums": st.given_checksums,
        "gpu_checksums_verified": st.given_checksums_verified,
        "gpu_checksum_mismatches": st.given_checksum_mismatches,
        "rejected_requests": s.rejected_requests,
        "dropped_replies": s.dropped_replies,
        "orphaned_requests": s.orphaned_requests,
        "ssd_capacity_bytes": st.ssd.map_or(0, |x| x.capacity_bytes),
        "ssd_used_bytes": st.ssd.map_or(0, |x| x.used_bytes),
        "ssd_records": st.ssd.map_or(0, |x| x.records),
        "ssd_hits": st.ssd_hits,
        "ssd_reads": st.ssd.map_or(0, |x| x.reads),
        "ssd_writes": st.ssd.map_or(0, |x| x.writes),
        "ssd_io_errors": st.ssd.map_or(0, |x| x.io_errors),
        "ssd_in_flight": st.ssd.map_or(0, |x| x.in_flight),
        "ssd_reclaimed": st.ssd.map_or(0, |x| x.reclaimed),
        "ssd_tombstones": st.ssd.map_or(0, |x| x.tombstones),
        "ssd_relocated": st.ssd.map_or(0, |x| x.relocated),
        "ssd_relocations_abandoned": st.ssd.map_or(0, |x| x.relocations_abandoned),
        "demotions": st.demotions,
        "promotions": st.promotions,
        "checksum_failures": st.ssd.map_or(0, |x| x.checksum_failures),
        "admission_rejections": st.admission_rejections,
        "deep_sleeps": s.deep_sleeps,
        "doorbell_wakeups": s.doorbell_wakeups,
        "naps": s.naps,
        "errors": errors,
        "latency": latency,
    });
    let peer = json!({
        "peer_hits": st.peer_hits,
        "peer_reads": st.peer_fetches,
        "peer_read_bytes": st.peer_bytes,
        "peer_read_failures": st.peer_fetch_failures,
        "peer_checksum_failures": st.peer_checksum_mismatches,
        "peer_grants": st.peer_grants,
        "catalog_entries": st.catalog_entries,
    });
    if let (Some(v), Value::Object(peer)) = (v.as_object_mut(), peer) {
        v.extend(peer);
    }
    v
}

/// Latency quantiles by operation, in nanoseconds.
fn latency_json(latency: &[(OpKind, LatencyHistogram)]) -> Map<String, Value> {
    latency
        .iter()
        .map(|(op, h)| {
            let l = h.summary();
            (
                op.as_str().to_string(),
                json!({"count": l.count, "p50_ns": l.p50_ns, "p99_ns": l.p99_ns,
                       "p999_ns": l.p999_ns, "max_ns": l.max_ns}),
            )
        })
        .collect()
}

/// The GPU service's counters for `stats`: counts as they are, nanosecond counters in seconds.
fn gpu_transfers(g: &std::sync::Arc<crate::gpu::GpuService>) -> serde_json::Value {
    let c = &g.counters;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let (staging_bytes, staging_depth) = g.staging();
    let mut m = json!({
        "devices": g.devices().len(),
        "registrations": g.registrations(),
        "save_jobs": n(&c.saves),
        "load_jobs": n(&c.loads),
        "saved_bytes": n(&c.saved_bytes),
        "loaded_bytes": n(&c.loaded_bytes),
        "save_host_runs": n(&c.save_host_runs),
        "load_host_runs": n(&c.load_host_runs),
        "failed_jobs": n(&c.failed_jobs),
        "save_in_flight": n(&c.save_in_flight),
        "load_in_flight": n(&c.load_in_flight),
        "save_queued": g.queued(orbitkv_gpu::dma::Direction::Save),
        "load_queued": g.queued(orbitkv_gpu::dma::Direction::Load),
        "threads_lost": g.threads_lost(),
        "checksums_distrusted": g.checksums_distrusted(),
        "save_requests": n(&c.save_requests),
        "load_requests": n(&c.load_requests),
        "save_pickups": n(&c.save_pickups),
        "load_pickups": n(&c.load_pickups),
        "checksums": g.checksum_place().as_str(),
        "copy": g.copy_strategy().as_str(),
        "staging_bytes": staging_bytes,
        "staging_depth": staging_depth,
        "timeline": g.timeline().then(|| json!({
            "save": c.save_timeline.json(),
            "load": c.load_timeline.json(),
        })),
    });
    for (name, ns) in [
        ("save_busy_s", &c.save_busy_ns),
        ("load_busy_s", &c.load_busy_ns),
        ("save_submit_s", &c.save_submit.total_ns),
        ("load_submit_s", &c.load_submit.total_ns),
        ("save_submit_cpu_s", &c.save_submit.cpu_ns),
        ("load_submit_cpu_s", &c.load_submit.cpu_ns),
        ("save_submit_wait_s", &c.save_submit.wait_ns),
        ("load_submit_wait_s", &c.load_submit.wait_ns),
        ("save_submit_pieces_s", &c.save_submit.pieces_ns),
        ("load_submit_pieces_s", &c.load_submit.pieces_ns),
        ("save_submit_stage_s", &c.save_submit.stage_ns),
        ("load_submit_stage_s", &c.load_submit.stage_ns),
        ("save_submit_tables_s", &c.save_submit.tables_ns),
        ("save_checksum_wait_s", &c.save_checksum_wait_ns),
        ("save_lead_s", &c.save_lead_ns),
        ("save_tail_s", &c.save_tail_ns),
        ("load_lead_s", &c.load_lead_ns),
        ("load_tail_s", &c.load_tail_ns),
        ("save_pickup_s", &c.save_pickup_ns),
        ("load_pickup_s", &c.load_pickup_ns),
    ] {
        m[name] = json!(n(ns) as f64 / 1e9);
    }
    m
}

/// `total_ns` over `n`, in microseconds (0 when `n` is 0).
fn mean_us(total_ns: u64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        total_ns as f64 / n as f64 / 1e3
    }
}
