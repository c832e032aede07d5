//! What the server reports about itself, taken once per question ([`Sample`]) and shown two
//! ways: the admin socket's `stats` and `health` (`orbitkv-ctl`), and the Prometheus
//! exposition of `--metrics-addr` ([`http`]). Both read the same sample, so they agree.
//!
//! The shards keep their counters and latency histograms on their own cores; a sample asks
//! each for a copy over its control queue (a few tens of microseconds of its loop), and
//! everything else (merging, quantiles, encoding) runs on the thread that asked.

pub(crate) mod http;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use orbitkv_gpu::dma::Direction;
use orbitkv_proto::admin::{ClusterState, ClusterStatus, HealthReply, ServerState};
use orbitkv_proto::ErrorCode;
use orbitkv_proto::LatencyHistogram;
use orbitkv_shards::OpKind;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use crate::control::shared::{ServeState, Shared};
use crate::control::startup::Startup;
use crate::gpu::GpuService;
use crate::shard::messages::ShardSnapshot;

/// How long a sample waits for a shard's answer before reporting it as not answering.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(2);

/// Upper bounds of the latency histograms' Prometheus buckets, in nanoseconds (1 us to 10 s).
const BUCKETS_NS: [u64; 22] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    100_000_000,
    200_000_000,
    500_000_000,
    1_000_000_000,
    2_000_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Refusals at a bound: the error codes that say "not now, too many" rather than "wrong".
const REFUSALS: [ErrorCode; 3] = [ErrorCode::Busy, ErrorCode::LeaseLimit, ErrorCode::NoSpace];

/// Everything the server reports, taken at one moment.
#[derive(Debug)]
pub(crate) struct Sample {
    /// Serving, draining or drained (no admitted write left, no reservation anywhere).
    pub state: ServerState,
    /// Writes admitted and not yet answered, counted just before the snapshots.
    pub writes_admitted: u64,
    /// Each shard's snapshot; None for a shard that did not answer in time.
    pub shards: Vec<Option<ShardSnapshot>>,
    /// Sessions open (or closing).
    pub sessions: usize,
    /// Sessions refused at the bootstrap.
    pub refused_sessions: u64,
    pub uptime_s: f64,
    pub gpu: Option<Arc<GpuService>>,
    /// Cluster membership, in cluster mode.
    pub cluster: Option<orbitkv_peer::Status>,
    /// The start: its steps' seconds and how each shard's arena slice was populated.
    pub start: StartRecord,
}

/// The start as the metrics show it.
#[derive(Debug, Clone)]
pub(crate) struct StartRecord {
    /// 1 while starting.
    pub starting: bool,
    /// Arena bytes populated, of the arena's.
    pub populated: (u64, u64),
    /// Each finished step and its seconds.
    pub steps: Vec<(&'static str, f64)>,
    /// Each shard's slice as it was populated (none while starting).
    pub slices: Vec<orbitkv_shards::Populated>,
}

impl StartRecord {
    fn of(startup: &Startup, slices: Vec<orbitkv_shards::Populated>) -> Self {
        Self {
            starting: startup.server().is_none(),
            populated: (startup.populated.load(Ordering::Relaxed), startup.arena_bytes()),
            steps: startup.steps(),
            slices,
        }
    }
}

impl Sample {
    /// Takes a sample (waits up to 2 s for each shard).
    pub fn take(shared: &Shared, startup: &Startup) -> Self {
        let writes_admitted = shared.writes_admitted();
        let shards = shared.snapshots(SNAPSHOT_TIMEOUT);
        let state = match shared.state() {
            ServeState::Serving => ServerState::Serving,
            ServeState::Draining if writes_admitted == 0 && shared.writes_settled(&shards) => {
                ServerState::Drained
            }
            ServeState::Draining => ServerState::Draining,
        };
        let sessions = shared.sessions.lock().expect("session table lock is never poisoned").len();
        Self {
            state,
            writes_admitted,
            shards,
            sessions,
            refused_sessions: shared.refused_sessions.load(Ordering::Relaxed),
            uptime_s: shared.started.elapsed().as_secs_f64(),
            gpu: shared.gpu_service.get().cloned(),
            cluster: shared.cluster.get().map(|c| c.status()),
            start: StartRecord::of(startup, shared.arena_parts.clone()),
        }
    }

    /// The answering shards' snapshots with their ids.
    fn answering(&self) -> impl Iterator<Item = (usize, &ShardSnapshot)> {
        self.shards.iter().enumerate().filter_map(|(i, s)| Some((i, s.as_ref()?)))
    }

    /// Every shard's latencies of each kind merged: the server-wide view.
    pub fn merged_latency(&self) -> Vec<(OpKind, LatencyHistogram)> {
        let mut merged: Vec<(OpKind, LatencyHistogram)> = Vec::new();
        for (_, s) in self.answering() {
            for (op, h) in &s.stats.latency {
                match merged.iter_mut().find(|(o, _)| o == op) {
                    Some((_, m)) => m.merge(h),
                    None => merged.push((*op, h.clone())),
                }
            }
        }
        merged.sort_by_key(|(op, _)| OpKind::ALL.iter().position(|o| o == op));
        merged
    }

    /// Readiness and degradation: the admin socket's `health` reply (`orbitkv-ctl health
    /// --json`), also `/readyz`'s body.
    pub fn health(&self) -> HealthReply {
        let all_answer = self.shards.iter().all(Option::is_some);
        let ready = all_answer && self.state == ServerState::Serving;
        let reason = if !all_answer {
            "a shard is not answering"
        } else if !ready {
            "not admitting new work (draining)"
        } else {
            "serving"
        };
        // Serving but impaired: reported, not fatal (DRAM keeps serving).
        let mut degraded: Vec<String> = self
            .answering()
            .filter_map(|(i, s)| {
                let errors = s.stats.ssd.map_or(0, |x| x.io_errors);
                (errors > 0).then(|| format!("shard {i}: {errors} SSD I/O errors"))
            })
            .collect();
        if let Some(g) = &self.gpu {
            if g.checksums_distrusted() {
                degraded.push(
                    "GPU checksums failed a check: saves' checksums are computed on the shards \
                     until the server restarts"
                        .into(),
                );
            }
            if g.threads_lost() > 0 {
                degraded.push(format!(
                    "{} GPU DMA thread(s) stopped after a panic: their GPU saves or loads fail \
                     until the server restarts",
                    g.threads_lost()
                ));
            }
        }
        HealthReply {
            ok: true,
            ready,
            state: self.state,
            reason: reason.to_string(),
            degraded,
            cluster: self.cluster.as_ref().map(cluster_status),
            starting: None,
        }
    }
}

/// Cluster membership as `health` and `peers` show it: `available` (joined), the state and
/// why, this node's id and epoch, and the members.
pub(crate) fn cluster_status(s: &orbitkv_peer::Status) -> ClusterStatus {
    use orbitkv_peer::State;
    let (state, reason) = match &s.state {
        State::Joining => (ClusterState::Joining, String::new()),
        State::Joined => (ClusterState::Joined, String::new()),
        State::Unavailable(why) => (ClusterState::Unavailable, why.clone()),
        State::Conflict(why) => (ClusterState::Conflict, format!("node id held by {why}")),
    };
    ClusterStatus {
        available: s.state == State::Joined,
        state,
        reason,
        since_s: s.since.elapsed().as_secs_f64(),
        cluster: s.cluster.clone(),
        node_id: s.node_id.clone(),
        epoch: s.epoch,
        members: s.members.clone(),
    }
}

/// The Prometheus text exposition (OpenMetrics 1.0) of `sample`.
pub(crate) fn exposition(sample: Sample) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Exposition(sample)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    out
}

/// The exposition while the server starts (no shards to sample yet): not ready, starting, the
/// arena's bytes populated and the steps done.
pub(crate) fn starting_exposition(startup: &Startup) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Starting(StartRecord::of(startup, Vec::new()))));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    out
}

/// The start's families alone, as a collector.
#[derive(Debug)]
struct Starting(StartRecord);

impl prometheus_client::collector::Collector for Starting {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let mut out = Families(&mut encoder);
        out.gauge(READY, vec![(Labels::new(), 0.0)])?;
        start_families(&mut out, &self.0)
    }
}

/// `orbitkv_ready`'s name and help.
const READY: (&str, &str, Option<Unit>) =
    ("orbitkv_ready", "1 when accepting engine work (serving, every shard answering).", None);

/// The start's families: starting, arena bytes populated, each step's seconds and each
/// shard's slice (its core and NUMA node as labels, "none" where unknown).
fn start_families(out: &mut Families<'_, '_>, r: &StartRecord) -> std::fmt::Result {
    let one = |v: f64| vec![(Labels::new(), v)];
    out.gauge(
        ("orbitkv_starting", "1 while the server starts (populating its arena, ...).", None),
        one(flag(r.starting)),
    )?;
    out.gauge(
        ("orbitkv_arena_populated", "Arena bytes populated (faulted in).", Some(Unit::Bytes)),
        one(r.populated.0.min(r.populated.1) as f64),
    )?;
    out.gauge(
        ("orbitkv_arena", "The arena's size (its memfd, header included).", Some(Unit::Bytes)),
        one(r.populated.1 as f64),
    )?;
    out.gauge(
        (
            "orbitkv_start_step",
            "Time each start step took (populate_arena, register_cuda, start_shards).",
            Some(Unit::Seconds),
        ),
        r.steps.iter().map(|(step, secs)| (vec![("step", step.to_string())], *secs)),
    )?;
    let label = |v: Option<String>| v.unwrap_or_else(|| "none".into());
    out.gauge(
        (
            "orbitkv_arena_slice_populate",
            "Time each shard's arena slice took to populate, on its core and NUMA node.",
            Some(Unit::Seconds),
        ),
        r.slices.iter().enumerate().map(|(shard, p)| {
            let labels = with(
                with(shard_label(shard), "core", &label(p.core.map(|c| c.to_string()))),
                "numa_node",
                &label(p.node.map(|n| n.to_string())),
            );
            (labels, p.seconds)
        }),
    )
}

/// A sample as a collector: its metric families, encoded on each scrape (a registry and a
/// sample are made per scrape).
#[derive(Debug)]
struct Exposition(Sample);

type Labels = Vec<(&'static str, String)>;

impl prometheus_client::collector::Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let mut out = Families(&mut encoder);
        let s = &self.0;
        server_families(&mut out, s)?;
        shard_families(&mut out, s)?;
        latency_families(&mut out, s)?;
        if let Some(g) = &s.gpu {
            gpu_families(&mut out, g)?;
        }
        if let Some(c) = &s.cluster {
            cluster_families(&mut out, c)?;
        }
        Ok(())
    }
}

/// Writes metric families: a name, a help line, a type, then one value per label set.
struct Families<'e, 'a>(&'e mut DescriptorEncoder<'a>);

impl Families<'_, '_> {
    fn family(
        &mut self,
        (name, help, unit): (&str, &str, Option<Unit>),
        metric_type: MetricType,
        write: impl FnOnce(&mut MetricEncoder<'_>) -> std::fmt::Result,
    ) -> std::fmt::Result {
        let mut m = self.0.encode_descriptor(name, help, unit.as_ref(), metric_type)?;
        write(&mut m)
    }

    /// A counter (its name gets `_total`).
    fn counter(
        &mut self,
        what: (&str, &str, Option<Unit>),
        series: impl IntoIterator<Item = (Labels, u64)>,
    ) -> std::fmt::Result {
        self.family(what, MetricType::Counter, |m| {
            for (labels, v) in series {
                if labels.is_empty() {
                    m.encode_counter::<NoLabelSet, u64, u64>(&v, None)?;
                } else {
                    m.encode_family(&labels)?.encode_counter::<NoLabelSet, u64, u64>(&v, None)?;
                }
            }
            Ok(())
        })
    }

    /// A gauge.
    fn gauge(
        &mut self,
        what: (&str, &str, Option<Unit>),
        series: impl IntoIterator<Item = (Labels, f64)>,
    ) -> std::fmt::Result {
        self.family(what, MetricType::Gauge, |m| {
            for (labels, v) in series {
                if labels.is_empty() {
                    m.encode_gauge(&v)?;
                } else {
                    m.encode_family(&labels)?.encode_gauge(&v)?;
                }
            }
            Ok(())
        })
    }
}

fn shard_label(id: usize) -> Labels {
    vec![("shard", id.to_string())]
}

fn with(mut labels: Labels, key: &'static str, value: &str) -> Labels {
    labels.push((key, value.to_string()));
    labels
}

fn flag(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

fn server_families(out: &mut Families<'_, '_>, s: &Sample) -> std::fmt::Result {
    let health = s.health();
    let one = |v: f64| vec![(Labels::new(), v)];
    out.gauge(READY, one(flag(health.ready)))?;
    start_families(out, &s.start)?;
    out.gauge(
        (
            "orbitkv_draining",
            "1 while draining or drained (new sessions and writes refused).",
            None,
        ),
        one(flag(s.state != ServerState::Serving)),
    )?;
    out.gauge(
        (
            "orbitkv_degraded",
            "Problems that impair serving without stopping it (see ctl health).",
            None,
        ),
        one(health.degraded.len() as f64),
    )?;
    out.gauge(
        ("orbitkv_uptime", "Time since the server started.", Some(Unit::Seconds)),
        one(s.uptime_s),
    )?;
    out.gauge(
        ("orbitkv_sessions", "Engine sessions open (or closing).", None),
        one(s.sessions as f64),
    )?;
    out.counter(
        (
            "orbitkv_sessions_refused",
            "Sessions refused at the bootstrap (limits, uid, draining).",
            None,
        ),
        [(Labels::new(), s.refused_sessions)],
    )?;
    out.gauge(
        ("orbitkv_writes_admitted", "Writes admitted and not yet answered.", None),
        one(s.writes_admitted as f64),
    )?;
    out.gauge(
        ("orbitkv_shard_up", "1 when the shard answered the scrape within 2 s.", None),
        s.shards.iter().enumerate().map(|(i, x)| (shard_label(i), flag(x.is_some()))),
    )
}

/// Per shard (and tier) counters and gauges, of the shards that answered.
fn shard_families(out: &mut Families<'_, '_>, s: &Sample) -> std::fmt::Result {
    let sh = Shards(s.answering().collect());
    tier_families(out, &sh, s.cluster.is_some())?;
    flow_families(out, &sh)?;
    size_families(out, &sh)?;
    holding_families(out, &sh)?;
    ssd_families(out, &sh)?;
    error_families(out, &sh)?;
    if s.cluster.is_some() {
        peer_families(out, &sh)?;
    }
    Ok(())
}

/// The answering shards, with the label sets their series take.
struct Shards<'a>(Vec<(usize, &'a ShardSnapshot)>);

type Of<'f, T> = &'f dyn Fn(&ShardSnapshot) -> T;

impl Shards<'_> {
    /// One counter value per shard.
    fn per(&self, f: Of<'_, u64>) -> Vec<(Labels, u64)> {
        self.0.iter().map(|(i, x)| (shard_label(*i), f(x))).collect()
    }

    /// One gauge value per shard.
    fn gauges(&self, f: Of<'_, u64>) -> Vec<(Labels, f64)> {
        self.0.iter().map(|(i, x)| (shard_label(*i), f(x) as f64)).collect()
    }

    /// A gauge per shard and tier (the SSD's where the shard has one).
    fn tiers(&self, dram: Of<'_, u64>, ssd: Of<'_, Option<u64>>) -> Vec<(Labels, f64)> {
        let mut v = Vec::new();
        for (i, x) in &self.0 {
            v.push((with(shard_label(*i), "tier", "dram"), dram(x) as f64));
            if let Some(n) = ssd(x) {
                v.push((with(shard_label(*i), "tier", "ssd"), n as f64));
            }
        }
        v
    }

    /// A counter per shard and tier (the SSD's where the shard has one).
    fn tier_counts(&self, dram: Of<'_, u64>, ssd: Of<'_, u64>) -> Vec<(Labels, u64)> {
        let mut v = Vec::new();
        for (i, x) in &self.0 {
            v.push((with(shard_label(*i), "tier", "dram"), dram(x)));
            if x.stats.ssd.is_some() {
                v.push((with(shard_label(*i), "tier", "ssd"), ssd(x)));
            }
        }
        v
    }

    /// One value per shard with an SSD tier.
    fn ssd(&self, f: &dyn Fn(&orbitkv_ssd::store::SsdStats) -> u64) -> Vec<(Labels, u64)> {
        self.0.iter().filter_map(|(i, x)| Some((shard_label(*i), f(&x.stats.ssd?)))).collect()
    }

    /// Per shard, the count of each of `codes` (0 where none), labelled `key`.
    fn codes(&self, codes: &[ErrorCode], key: &'static str) -> Vec<(Labels, u64)> {
        let mut v = Vec::new();
        for (i, x) in &self.0 {
            for c in codes {
                let n = x.stats.errors.iter().find(|(e, _)| e == c).map_or(0, |(_, n)| *n);
                v.push((with(shard_label(*i), key, c.as_str()), n));
            }
        }
        v
    }

    /// Per shard, checksum failures by where they were found.
    fn checksum_failures(&self) -> Vec<(Labels, u64)> {
        let mut v = Vec::new();
        for (i, x) in &self.0 {
            v.push((with(shard_label(*i), "source", "gpu"), x.stats.given_checksum_mismatches));
            if let Some(d) = x.stats.ssd {
                v.push((with(shard_label(*i), "source", "ssd"), d.checksum_failures));
            }
            if x.stats.peer_checksum_mismatches > 0 {
                v.push((with(shard_label(*i), "source", "peer"), x.stats.peer_checksum_mismatches));
            }
        }
        v
    }
}

/// Lookups and evictions, by tier (hits from peers in cluster mode).
fn tier_families(out: &mut Families<'_, '_>, sh: &Shards<'_>, cluster: bool) -> std::fmt::Result {
    let mut hits = sh.tier_counts(&|x| x.stats.hits, &|x| x.stats.ssd_hits);
    if cluster {
        hits.extend(
            sh.0.iter().map(|(i, x)| (with(shard_label(*i), "tier", "peer"), x.stats.peer_hits)),
        );
    }
    out.counter(("orbitkv_hits", "Lookup keys found, by the tier that held them.", None), hits)?;
    out.counter(
        ("orbitkv_misses", "Lookup keys found in no tier.", None),
        sh.per(&|x| x.stats.misses),
    )?;
    out.counter(
        (
            "orbitkv_evictions",
            "Chunks dropped to make room: from DRAM (demoted or gone), from SSD (region reclaim).",
            None,
        ),
        sh.tier_counts(&|x| x.stats.evictions, &|x| x.stats.ssd.map_or(0, |d| d.reclaimed)),
    )?;
    Ok(())
}

/// Chunks removed and moved between tiers.
fn flow_families(out: &mut Families<'_, '_>, sh: &Shards<'_>) -> std::fmt::Result {
    out.counter(
        ("orbitkv_removals", "Chunks removed by explicit evict requests.", None),
        sh.per(&|x| x.stats.removals),
    )?;
    out.counter(
        ("orbitkv_demotions", "Chunks written to SSD and dropped from DRAM.", None),
        sh.per(&|x| x.stats.demotions),
    )?;
    out.counter(
        ("orbitkv_promotions", "Chunks read back from SSD into DRAM.", None),
        sh.per(&|x| x.stats.promotions),
    )?;
    out.counter(
        (
            "orbitkv_ssd_admission_rejections",
            "DRAM victims the SSD admission filter turned away.",
            None,
        ),
        sh.per(&|x| x.stats.admission_rejections),
    )?;
    out.counter(
        (
            "orbitkv_ssd_quota_drops",
            "DRAM victims dropped instead of demoted: their namespace at its SSD limit.",
            None,
        ),
        sh.per(&|x| x.stats.ssd_quota_drops),
    )?;
    out.counter(
        (
            "orbitkv_ssd_relocations",
            "SSD records rewritten before their region's reclaim to keep an SSD guarantee.",
            None,
        ),
        sh.per(&|x| x.stats.ssd.map_or(0, |d| d.relocated)),
    )?;
    out.counter(
        (
            "orbitkv_ssd_relocations_abandoned",
            "SSD regions reclaimed with records a guarantee kept (no room to rewrite them).",
            None,
        ),
        sh.per(&|x| x.stats.ssd.map_or(0, |d| d.relocations_abandoned)),
    )?;
    Ok(())
}

/// Bytes and chunks held, by tier.
fn size_families(out: &mut Families<'_, '_>, sh: &Shards<'_>) -> std::fmt::Result {
    out.gauge(
        (
            "orbitkv_used",
            "Bytes in use by tier (DRAM: allocated pages; SSD: regions holding records).",
            Some(Unit::Bytes),
        ),
        sh.tiers(&|x| x.stats.dram_used_bytes, &|x| x.stats.ssd.map(|d| d.used_bytes)),
    )?;
    out.gauge(
        ("orbitkv_capacity", "Capacity by tier.", Some(Unit::Bytes)),
        sh.tiers(&|x| x.stats.dram_capacity_bytes, &|x| x.stats.ssd.map(|d| d.capacity_bytes)),
    )?;
    out.gauge(
        ("orbitkv_entries", "Chunks held by tier (DRAM: visible chunks; SSD: records).", None),
        sh.tiers(&|x| x.stats.entries, &|x| x.stats.ssd.map(|d| d.records)),
    )?;
    Ok(())
}

/// Commits, and what engines hold.
fn holding_families(out: &mut Families<'_, '_>, sh: &Shards<'_>) -> std::fmt::Result {
    out.counter(("orbitkv_commits", "Chunks committed.", None), sh.per(&|x| x.stats.commits))?;
    out.counter(
        ("orbitkv_committed", "Bytes committed.", Some(Unit::Bytes)),
        sh.per(&|x| x.stats.bytes_committed),
    )?;
    out.gauge(("orbitkv_leases", "Leases held by engines.", None), sh.gauges(&|x| x.stats.leases))?;
    out.gauge(
        ("orbitkv_reservations", "Reservations not yet committed or aborted.", None),
        sh.gauges(&|x| x.stats.reservations),
    )?;
    out.gauge(
        ("orbitkv_namespaces", "Namespaces registered.", None),
        sh.gauges(&|x| x.stats.namespaces),
    )?;
    out.gauge(
        ("orbitkv_shard_sessions", "Sessions homed on the shard.", None),
        sh.gauges(&|x| x.sessions),
    )?;
    Ok(())
}

/// The SSD tier's operations.
fn ssd_families(out: &mut Families<'_, '_>, sh: &Shards<'_>) -> std::fmt::Result {
    out.gauge(
        ("orbitkv_ssd_in_flight", "SSD reads and writes submitted and not yet completed.", None),
        sh.ssd(&|d| d.in_flight).into_iter().map(|(l, v)| (l, v as f64)),
    )?;
    out.counter(("orbitkv_ssd_reads", "SSD payload reads completed.", None), sh.ssd(&|d| d.reads))?;
    out.counter(
        ("orbitkv_ssd_writes", "SSD record writes completed.", None),
        sh.ssd(&|d| d.writes),
    )?;
    out.counter(
        ("orbitkv_ssd_io_errors", "SSD reads or writes that failed with an I/O error.", None),
        sh.ssd(&|d| d.io_errors),
    )?;
    Ok(())
}

/// Refusals, errors and checksum failures.
fn error_families(out: &mut Families<'_, '_>, sh: &Shards<'_>) -> std::fmt::Result {
    out.counter(
        (
            "orbitkv_refusals",
            "Requests or chunks refused at a bound: busy, lease_limit, no_space.",
            None,
        ),
        sh.codes(&REFUSALS, "reason"),
    )?;
    out.counter(
        ("orbitkv_errors", "Error replies and per-chunk failures, by code.", None),
        sh.codes(&ErrorCode::ALL, "code"),
    )?;
    out.counter(
        (
            "orbitkv_rejected_requests",
            "Requests rejected before execution (malformed, too large, draining, limits).",
            None,
        ),
        sh.per(&|x| x.rejected_requests),
    )?;
    out.counter(
        ("orbitkv_dropped_replies", "Replies dropped because their client had gone.", None),
        sh.per(&|x| x.dropped_replies),
    )?;
    out.counter(
        (
            "orbitkv_checksum_failures",
            "Chunks whose bytes failed their checksum (dropped, never served).",
            None,
        ),
        sh.checksum_failures(),
    )
}

/// The operations' latency histograms, per shard.
fn latency_families(out: &mut Families<'_, '_>, s: &Sample) -> std::fmt::Result {
    let help = "Latency of requests by their home shard (lookup, reserve, commit, release, save, \
                load, other) and of the shard's SSD reads and writes.";
    out.family(("orbitkv_op_latency", help, Some(Unit::Seconds)), MetricType::Histogram, |m| {
        for (i, x) in s.answering() {
            for (op, h) in &x.stats.latency {
                let counts = h.bucket_counts(&BUCKETS_NS);
                let buckets: Vec<(f64, u64)> = BUCKETS_NS
                    .iter()
                    .map(|&b| b as f64 / 1e9)
                    .chain([f64::MAX])
                    .zip(counts)
                    .collect();
                let labels = with(shard_label(i), "op", op.as_str());
                m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                    h.sum_ns() as f64 / 1e9,
                    h.count(),
                    &buckets,
                    None,
                )?;
            }
        }
        Ok(())
    })
}

fn gpu_families(out: &mut Families<'_, '_>, g: &GpuService) -> std::fmt::Result {
    let c = &g.counters;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let one = |v: f64| vec![(Labels::new(), v)];
    let dir = |save: u64, load: u64| {
        vec![
            (vec![("direction", "save".to_string())], save),
            (vec![("direction", "load".to_string())], load),
        ]
    };
    out.gauge(("orbitkv_gpu_devices", "GPUs in use.", None), one(g.devices().len() as f64))?;
    out.gauge(
        ("orbitkv_gpu_registrations", "Engine GPU registrations.", None),
        one(g.registrations() as f64),
    )?;
    out.counter(
        ("orbitkv_gpu_jobs", "GPU copy jobs completed.", None),
        dir(n(&c.saves), n(&c.loads)),
    )?;
    out.counter(
        ("orbitkv_gpu", "Bytes copied between GPUs and the arena.", Some(Unit::Bytes)),
        dir(n(&c.saved_bytes), n(&c.loaded_bytes)),
    )?;
    out.counter(
        ("orbitkv_gpu_requests", "Save and load requests that queued at least one job.", None),
        dir(n(&c.save_requests), n(&c.load_requests)),
    )?;
    out.counter(
        ("orbitkv_gpu_failed_jobs", "GPU jobs that failed.", None),
        [(Labels::new(), n(&c.failed_jobs))],
    )?;
    let fdir = |save: u64, load: u64| dir(save, load).into_iter().map(|(l, v)| (l, v as f64));
    out.gauge(
        ("orbitkv_gpu_jobs_in_flight", "GPU jobs on the device now.", None),
        fdir(n(&c.save_in_flight), n(&c.load_in_flight)),
    )?;
    out.gauge(
        ("orbitkv_gpu_jobs_queued", "GPU jobs waiting for their DMA thread.", None),
        fdir(g.queued(Direction::Save) as u64, g.queued(Direction::Load) as u64),
    )?;
    out.family(
        ("orbitkv_gpu_busy", "Time with at least one job on the device.", Some(Unit::Seconds)),
        MetricType::Counter,
        |m| {
            for (way, ns) in [("save", n(&c.save_busy_ns)), ("load", n(&c.load_busy_ns))] {
                let labels = vec![("direction", way.to_string())];
                m.encode_family(&labels)?
                    .encode_counter::<NoLabelSet, f64, f64>(&(ns as f64 / 1e9), None)?;
            }
            Ok(())
        },
    )?;
    out.gauge(
        ("orbitkv_gpu_threads_lost", "DMA threads stopped by a panic (their copies fail).", None),
        one(g.threads_lost() as f64),
    )
}

/// Peer reads and grants, per shard (cluster mode).
fn peer_families(out: &mut Families<'_, '_>, sh: &Shards<'_>) -> std::fmt::Result {
    out.counter(
        ("orbitkv_peer_reads", "Chunks read from peers and stored here.", None),
        sh.per(&|x| x.stats.peer_fetches),
    )?;
    out.counter(
        ("orbitkv_peer_read", "Bytes read from peers.", Some(Unit::Bytes)),
        sh.per(&|x| x.stats.peer_bytes),
    )?;
    out.counter(
        (
            "orbitkv_peer_read_failures",
            "Peer reads that failed (the lookup answered a miss): refused, gone, or a bad checksum.",
            None,
        ),
        sh.per(&|x| x.stats.peer_fetch_failures),
    )?;
    out.counter(
        ("orbitkv_peer_grants", "Chunks leased here for peers' reads.", None),
        sh.per(&|x| x.stats.peer_grants),
    )?;
    out.gauge(
        ("orbitkv_catalog_entries", "Peers' chunks this shard's catalog slice lists.", None),
        sh.gauges(&|x| x.stats.catalog_entries),
    )
}

fn cluster_families(out: &mut Families<'_, '_>, c: &orbitkv_peer::Status) -> std::fmt::Result {
    let one = |v: f64| vec![(Labels::new(), v)];
    out.gauge(
        ("orbitkv_cluster_available", "1 while this node holds its membership in etcd.", None),
        one(flag(c.state == orbitkv_peer::State::Joined)),
    )?;
    out.gauge(
        (
            "orbitkv_cluster_members",
            "Members of the cluster as last read (this one included).",
            None,
        ),
        one(c.members.len() as f64),
    )?;
    out.gauge(
        ("orbitkv_cluster_epoch", "This node's epoch (incremented at every start).", None),
        one(c.epoch.unwrap_or(0) as f64),
    )
}
