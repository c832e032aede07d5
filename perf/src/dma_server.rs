//! `orbitkv-perf dma --socket`: this process acts as an engine rank. It shares its KV tensors
//! with the server by CUDA IPC, has the server save every chunk and load it back through its
//! DMA threads, and checks every byte on both sides: the chunks through the mapped arena, the
//! tensors by reading them back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv_client::{
    ChunkKey, ChunkOutcome, Client, ClientOptions, Dtype, GpuTensor, KvLayoutKind, KvLayoutSpec,
    NamespaceDescriptor,
};
use orbitkv_gpu::dma::{Direction, EngineMemory};
use orbitkv_gpu::LayoutGeometry;
use serde::Serialize;

use crate::args::{DmaArgs, DtypeArg};
use crate::barrier::Barrier;
use crate::dma_interference::{EngineSide, InterferenceResult, MatmulLoop, Windows};
use crate::error::Error;

/// What the server run adds to the report.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ServedResult {
    /// Median GB/s of a save of every chunk (request to answer, commit included).
    pub save_gbps: f64,
    /// Median GB/s of a load of every chunk.
    pub load_gbps: f64,
    /// Chunks whose save outcome was not `Done` (over all iterations, and the saves beside
    /// `--interference`'s matmul loop).
    pub save_failures: u64,
    /// Chunks whose load outcome was not `Done` (likewise).
    pub load_failures: u64,
    /// Mismatched bytes in the chunks read back through the arena after the last save.
    pub save_mismatched_bytes: u64,
    /// Mismatched bytes in the tensors after the last timed load, and after the last load
    /// beside `--interference`'s matmul loop.
    pub load_mismatched_bytes: u64,
    /// This rank of its tensor-parallel group (`--tp-rank`, `--tp-world-size`).
    pub tp_rank: u32,
    /// Ranks in the group.
    pub tp_world_size: u32,
    /// Chunks saved per series.
    pub chunks: usize,
    /// With `--barrier` and more than one rank: the group prefix (chunks every rank has)
    /// once every rank finished its saves; a complete group has all `chunks`.
    pub group_prefix_chunks: Option<usize>,
    /// Its per-rank counts, in rank order.
    pub group_prefix_per_rank: Option<Vec<usize>>,
    /// With `--duplex`: saves and loads at the same time.
    pub duplex: Option<DuplexResult>,
    /// The timed saves' bytes over the time the server's save thread had copies on the GPU
    /// (`gpu_transfers.save_busy_s` in its stats), GB/s: against `save_gbps`, what the
    /// requests cost around the copies. None when the stats do not say (an older server).
    /// Meaningful when this process is the server's only GPU client (a group's ranks share
    /// the busy time).
    pub save_busy_gbps: Option<f64>,
    /// The same for the timed loads.
    pub load_busy_gbps: Option<f64>,
    /// Mean microseconds per timed save from its start on the server to its first job handed
    /// to the DMA thread (`gpu_transfers.save_lead_s` / `save_requests`); None when the stats
    /// do not say.
    pub save_lead_us: Option<f64>,
    /// Mean microseconds per timed save from its last copy completing to its answer.
    pub save_tail_us: Option<f64>,
    /// The same two for the timed loads.
    pub load_lead_us: Option<f64>,
    /// See `load_lead_us`.
    pub load_tail_us: Option<f64>,
    /// Mean microseconds per timed save that the server's DMA thread, idle, took to take up
    /// the save's first job once queued (`gpu_transfers.save_pickup_s` / `save_requests`):
    /// its wake-up. None when the stats do not say.
    pub save_pickup_us: Option<f64>,
    /// The same for the timed loads.
    pub load_pickup_us: Option<f64>,
    /// With a server run with `--gpu-timeline`: what the timed saves' staged batches did on
    /// the GPU (None otherwise).
    pub save_timeline: Option<GpuTimeline>,
    /// The same for the timed loads.
    pub load_timeline: Option<GpuTimeline>,
    /// Host-side copies per job of the timed saves (`gpu_transfers.save_host_runs` /
    /// `save_jobs`): about one per shard holding the job's chunks when each shard gave them
    /// adjacent arena slots, up to one per chunk when none did; None when the stats do not say.
    pub save_runs_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_runs_per_job: Option<f64>,
    /// Mean microseconds the server's save thread spent handing each job of the timed saves
    /// to the GPU (planning, enqueueing, starting its checksums: `save_submit_s` / jobs);
    /// None when the stats do not say.
    pub save_submit_us_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_submit_us_per_job: Option<f64>,
    /// Of `save_submit_us_per_job`, the save thread's own CPU time (`save_submit_cpu_s` /
    /// jobs): against the jobs' copy time, whether the host side keeps up; None when the
    /// stats do not say.
    pub save_submit_cpu_us_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_submit_cpu_us_per_job: Option<f64>,
    /// Of `save_submit_us_per_job`, the time the save thread waited for earlier jobs to free
    /// staging, tables or checksum slots (`save_submit_wait_s` / jobs; CUDA spins, so the CPU
    /// time includes it): the rest is planning and enqueueing. None when the stats do not say.
    pub save_submit_wait_us_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_submit_wait_us_per_job: Option<f64>,
    /// The rest of `save_submit_us_per_job`, step by step; None when the stats do not say.
    pub save_submit_parts: Option<SubmitParts>,
    /// The same for the timed loads (no checksum tables).
    pub load_submit_parts: Option<SubmitParts>,
    /// Mean microseconds a job of the timed saves waited, its copy landed, for its GPU
    /// checksums (`save_checksum_wait_s` / jobs); None when the stats do not say.
    pub save_checksum_wait_us_per_job: Option<f64>,
    /// With `--interference`: the same server counters over the saves and loads beside the
    /// matmul loop (where the GPU checksums compete with the engine's kernels for SMs).
    pub beside_matmul: Option<BesideMatmul>,
    /// Contiguous copies of the series' bytes (the ceiling's copy) in this process just before
    /// the first timed save and just after each, GB/s. Empty for a rank of a group
    /// (`--barrier`): its copies would share the links with the other ranks' saves.
    pub save_ceiling_windows_gbps: Vec<f64>,
    /// Each timed save's GB/s over the mean of the two windows around it.
    pub save_bracketed_ratios: Vec<f64>,
    /// Their median (None without windows): the save ratio free of the bus's drift between
    /// the run's ceiling measurements and the saves.
    pub save_ratio_bracketed: Option<f64>,
    /// The same three for the timed loads.
    pub load_ceiling_windows_gbps: Vec<f64>,
    /// See `save_bracketed_ratios`.
    pub load_bracketed_ratios: Vec<f64>,
    /// See `save_ratio_bracketed`.
    pub load_ratio_bracketed: Option<f64>,
}

/// One contiguous copy of the series' bytes in the engine's process, the way the ceiling is
/// measured; GB/s.
pub(crate) type CeilingCopy<'a> = &'a mut dyn FnMut(Direction) -> Result<f64, Error>;

/// The windows around a series' timed operations: the first before the first, then one after
/// each.
#[derive(Default)]
struct Brackets {
    windows: Vec<f64>,
    intervals: Vec<(u64, Duration)>,
}

impl Brackets {
    /// Measures a window with `copy`, if there is one (none in a group).
    fn window(&mut self, copy: &mut Option<CeilingCopy<'_>>, d: Direction) -> Result<(), Error> {
        if let Some(copy) = copy.as_mut() {
            self.windows.push(copy(d)?);
        }
        Ok(())
    }

    /// (windows, ratios, their median).
    fn finish(self) -> (Vec<f64>, Vec<f64>, Option<f64>) {
        let ratios = crate::baseline::ratios(&self.windows, &self.intervals);
        let m = crate::stats::median(&ratios);
        (self.windows, ratios, m)
    }
}

/// Where a DMA thread's time per job went besides waiting, microseconds (the server's
/// `{save,load}_submit_{pieces,stage,tables}_s` over the jobs).
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct SubmitParts {
    /// The chunks' pieces.
    pub pieces_us: f64,
    /// Staged batches and their descriptor tables.
    pub stage_us: f64,
    /// A save's checksum tables.
    pub tables_us: f64,
    /// The rest, not waiting: the CUDA calls that enqueue the job.
    pub cuda_us: f64,
}

/// The server's counters over the saves and loads run beside `--interference`'s matmul loop.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct BesideMatmul {
    /// The saves' bytes over the save thread's busy time, GB/s.
    pub save_busy_gbps: Option<f64>,
    /// Mean microseconds per save job handing it to the GPU.
    pub save_submit_us_per_job: Option<f64>,
    /// Mean microseconds per save job between its copy landing and its checksums being ready.
    pub save_checksum_wait_us_per_job: Option<f64>,
    /// The loads' bytes over the load thread's busy time, GB/s.
    pub load_busy_gbps: Option<f64>,
    /// Mean microseconds per load job handing it to the GPU.
    pub load_submit_us_per_job: Option<f64>,
    /// With the server's `--gpu-timeline`: the saves' batches beside the matmul (whether they
    /// lose their rate there by slower copies or by the copy stream waiting for gathers).
    pub save_timeline: Option<GpuTimeline>,
    /// The same for the loads (waiting for uploads, or scatters waiting for SMs).
    pub load_timeline: Option<GpuTimeline>,
    /// The streamed saves' bytes (`server-stream` rows: requests back to back, two in
    /// flight) over the save thread's busy time, GB/s.
    pub stream_save_busy_gbps: Option<f64>,
    /// The same for the streamed loads.
    pub stream_load_busy_gbps: Option<f64>,
}

/// The server's `--gpu-timeline` sums over the timed runs of one direction, per request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct GpuTimeline {
    /// The batches' bytes over the time their host-side copies ran, GB/s: the copies' own
    /// rate, their stream's idle gaps left out.
    pub copy_gbps: f64,
    /// Microseconds per request from the first batch's start to the last copy or kernel.
    pub span_us: f64,
    /// Microseconds per request the copy stream stood idle between consecutive copies.
    pub copy_gaps_us: f64,
    /// Microseconds per request the gather or scatter kernels ran.
    pub kernel_us: f64,
    /// The DMA thread's busy periods per request (more than one: it ran out of jobs in the
    /// middle of a request for longer than its spin; None from a server that does not count
    /// them).
    pub periods_per_request: Option<f64>,
    /// Microseconds per request from the first batch's start to the first copy's (a save's
    /// first gather; None from a server that does not report it).
    pub lead_us: Option<f64>,
    /// Microseconds per request from the last copy's end to the last kernel's (a load's last
    /// scatter; None likewise).
    pub tail_us: Option<f64>,
}

/// The server's `gpu_transfers` counters of one direction (`save` or `load`): seconds its DMA
/// thread was busy, its requests' lead and tail seconds, its requests; each None when the
/// server does not report it.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    busy_s: Option<f64>,
    lead_s: Option<f64>,
    tail_s: Option<f64>,
    /// Seconds the idle DMA thread took to take up new jobs.
    pickup_s: Option<f64>,
    requests: Option<f64>,
    /// Completed jobs and their host-side copies.
    jobs: Option<f64>,
    host_runs: Option<f64>,
    /// Seconds handing jobs to the GPU, and (saves) waiting for checksums after the copy.
    submit_s: Option<f64>,
    checksum_wait_s: Option<f64>,
    /// Of `submit_s`, the DMA thread's own CPU time, and the time it waited for the GPU.
    submit_cpu_s: Option<f64>,
    submit_wait_s: Option<f64>,
    /// Of `submit_s`: pieces, staged batches, checksum tables (`submit_parts` in order).
    submit_parts: [Option<f64>; 3],
    /// `--gpu-timeline` sums: bytes, span, copy busy, copy gaps, kernel seconds, busy
    /// periods, lead and tail seconds.
    timeline: [Option<f64>; 8],
}

impl Counters {
    fn read(socket: &std::path::Path, direction: &str) -> Self {
        let Ok(stats) = crate::admin::request(socket, "stats") else { return Self::default() };
        let g = &stats["gpu_transfers"];
        let f = |name: &str| g[format!("{direction}_{name}")].as_f64();
        let t = |name: &str| g["timeline"][direction][name].as_f64();
        Self {
            busy_s: f("busy_s"),
            lead_s: f("lead_s"),
            tail_s: f("tail_s"),
            pickup_s: f("pickup_s"),
            requests: f("requests"),
            jobs: f("jobs"),
            host_runs: f("host_runs"),
            submit_s: f("submit_s"),
            checksum_wait_s: f("checksum_wait_s"),
            submit_cpu_s: f("submit_cpu_s"),
            submit_wait_s: f("submit_wait_s"),
            // A load has no checksum tables: zero rather than missing.
            submit_parts: [
                f("submit_pieces_s"),
                f("submit_stage_s"),
                f("submit_tables_s").or(f("submit_stage_s").map(|_| 0.0)),
            ],
            timeline: [
                "bytes",
                "span_s",
                "copy_busy_s",
                "copy_gaps_s",
                "kernel_busy_s",
                "periods",
                "lead_s",
                "tail_s",
            ]
            .map(t),
        }
    }

    /// As [`Counters::read`], after a run that `before` was read ahead of: with the server's
    /// `--gpu-timeline`, once the run's busy period is summed too (the DMA thread sums it
    /// after idling a moment; read too soon, it would count towards the next run, or none),
    /// waiting at most 50 ms.
    fn read_after(socket: &std::path::Path, direction: &str, before: &Self) -> Self {
        let deadline = Instant::now() + Duration::from_millis(50);
        loop {
            let after = Self::read(socket, direction);
            let summed = match (before.timeline[5], after.timeline[5]) {
                (Some(b), Some(a)) => a > b,
                _ => true,
            };
            if summed || Instant::now() >= deadline {
                return after;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The timed runs' counters, summed between the readings around each run (NaN once a reading
/// was missing).
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    busy_s: f64,
    lead_s: f64,
    tail_s: f64,
    pickup_s: f64,
    requests: f64,
    jobs: f64,
    host_runs: f64,
    submit_s: f64,
    checksum_wait_s: f64,
    submit_cpu_s: f64,
    submit_wait_s: f64,
    submit_parts: [f64; 3],
    timeline: [f64; 8],
}

impl Sums {
    fn add(&mut self, before: Counters, after: Counters) {
        self.busy_s += busy_delta(before.busy_s, after.busy_s);
        self.lead_s += busy_delta(before.lead_s, after.lead_s);
        self.tail_s += busy_delta(before.tail_s, after.tail_s);
        self.pickup_s += busy_delta(before.pickup_s, after.pickup_s);
        self.requests += busy_delta(before.requests, after.requests);
        self.jobs += busy_delta(before.jobs, after.jobs);
        self.host_runs += busy_delta(before.host_runs, after.host_runs);
        self.submit_s += busy_delta(before.submit_s, after.submit_s);
        self.checksum_wait_s += busy_delta(before.checksum_wait_s, after.checksum_wait_s);
        self.submit_cpu_s += busy_delta(before.submit_cpu_s, after.submit_cpu_s);
        self.submit_wait_s += busy_delta(before.submit_wait_s, after.submit_wait_s);
        for (sum, (b, a)) in self
            .submit_parts
            .iter_mut()
            .zip(before.submit_parts.into_iter().zip(after.submit_parts))
        {
            *sum += busy_delta(b, a);
        }
        for (sum, (b, a)) in
            self.timeline.iter_mut().zip(before.timeline.into_iter().zip(after.timeline))
        {
            *sum += busy_delta(b, a);
        }
    }

    /// The `--gpu-timeline` sums per request (None when the server did not time its batches,
    /// a reading was missing, or no batch was timed).
    fn timeline(&self) -> Option<GpuTimeline> {
        let [bytes, span, busy, gaps, kernel, periods, lead, tail] = self.timeline;
        if !(bytes > 0.0 && busy > 0.0) {
            return None;
        }
        Some(GpuTimeline {
            copy_gbps: bytes / busy / 1e9,
            span_us: self.per_request_us(span)?,
            copy_gaps_us: self.per_request_us(gaps)?,
            kernel_us: self.per_request_us(kernel)?,
            periods_per_request: self.per_request_us(periods).map(|p| p / 1e6),
            lead_us: self.per_request_us(lead),
            tail_us: self.per_request_us(tail),
        })
    }

    /// Host-side copies per completed job (None without jobs or a reading).
    fn runs_per_job(&self) -> Option<f64> {
        self.per_job(self.host_runs)
    }

    /// `total` per completed job (None without jobs or a reading).
    fn per_job(&self, total: f64) -> Option<f64> {
        (total.is_finite() && self.jobs.is_finite() && self.jobs > 0.0).then(|| total / self.jobs)
    }

    /// The submit time's parts per job (None when a reading was missing or no job ran).
    fn submit_parts(&self) -> Option<SubmitParts> {
        let [pieces, stage, tables] = self.submit_parts.map(|s| self.per_job(s * 1e6));
        let rest = self.submit_s - self.submit_wait_s - self.submit_parts.iter().sum::<f64>();
        Some(SubmitParts {
            pieces_us: pieces?,
            stage_us: stage?,
            tables_us: tables?,
            cuda_us: self.per_job(rest * 1e6)?,
        })
    }

    /// Mean microseconds per request of `total_s` (None without requests or a reading).
    fn per_request_us(&self, total_s: f64) -> Option<f64> {
        (total_s.is_finite() && self.requests.is_finite() && self.requests > 0.0)
            .then(|| total_s / self.requests * 1e6)
    }
}

/// A counter's increase between two readings (NaN when either is missing).
fn busy_delta(before: Option<f64>, after: Option<f64>) -> f64 {
    match (before, after) {
        (Some(b), Some(a)) => a - b,
        _ => f64::NAN,
    }
}

/// All timed runs' bytes over all their busy seconds, GB/s (None without busy time or with
/// a missing reading).
fn busy_gbps(bytes: u64, busy_s: f64) -> Option<f64> {
    (busy_s.is_finite() && busy_s > 0.0).then(|| bytes as f64 / busy_s / 1e9)
}

/// A save of the first half of the chunks and a load of the second half, sent together.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DuplexResult {
    /// Bytes saved per run.
    pub save_bytes: u64,
    /// Bytes loaded per run.
    pub load_bytes: u64,
    /// Median GB/s of both together (saved + loaded bytes over the time until both answered).
    pub gbps: f64,
    /// A contiguous device-to-host copy of the saved bytes beside a host-to-device copy of the
    /// loaded bytes, GB/s (measured in this process, in the same run).
    pub ceiling_gbps: f64,
    /// gbps / ceiling_gbps.
    pub ratio: f64,
    /// Chunks whose save or load was not `Done` (over all runs).
    pub failures: u64,
    /// Mismatched bytes after the last run: the saved chunks through the arena, every tensor.
    pub mismatched_bytes: u64,
}

/// The stand-in engine the server copies from and to.
pub(crate) struct Engine<'a> {
    /// Its tensors.
    pub memory: &'a Arc<EngineMemory>,
    /// Their contents.
    pub originals: &'a [Vec<u8>],
    /// Block ids of each chunk.
    pub chunks: Vec<Vec<u64>>,
    /// Bytes per chunk.
    pub chunk_len: u64,
    /// The device.
    pub device_uuid: &'a str,
}

pub(crate) fn client_err(op: &'static str) -> impl Fn(orbitkv_client::Error) -> Error {
    move |e| Error::Gpu(format!("{op} through the server: {e}"))
}

fn expected_chunk(l: &KvLayoutSpec, originals: &[Vec<u8>], blocks: &[u64], out: &mut Vec<u8>) {
    out.clear();
    for &block in blocks {
        for s in l.block_segments(block) {
            let t = &originals[s.tensor as usize];
            out.extend_from_slice(&t[s.offset as usize..(s.offset + s.len) as usize]);
        }
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn not_done(o: &[ChunkOutcome]) -> u64 {
    o.iter().filter(|o| **o != ChunkOutcome::Done).count() as u64
}

/// The namespace of the stand-in engine's chunks.
pub(crate) fn descriptor(
    a: &DmaArgs,
    layout: &KvLayoutSpec,
    per_chunk: u32,
) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: format!("orbitkv-perf-dma/{:?}", layout.kind),
        dtype: match a.dtype {
            DtypeArg::Bf16 => Dtype::Bf16,
            DtypeArg::Fp16 => Dtype::Fp16,
            DtypeArg::Fp8 => Dtype::Fp8E4m3,
        },
        num_layers: layout.num_layers,
        num_kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        kv_tensors: layout.kv() as u32,
        tokens_per_chunk: layout.block_size * per_chunk,
        layout_version: 1,
        tp_rank: a.tp_rank,
        tp_world_size: a.tp_world_size,
    }
}

/// The keys of the run's `n` chunks in namespace `ns` (the same prompt for every rank).
pub(crate) fn chunk_keys(ns: u64, seed: u64, n: usize) -> Vec<ChunkKey> {
    (0..n as u64)
        .map(|i| {
            let mut h = blake3::Hasher::new();
            h.update(b"orbitkv-perf-dma");
            h.update(&seed.to_le_bytes());
            h.update(&i.to_le_bytes());
            ChunkKey::new(ns, *h.finalize().as_bytes())
        })
        .collect()
}

/// Runs the save/load series through the server; with `interference` (`--interference`: the
/// engine-side copies' shape), also the matmul loop's slowdown beside them.
pub(crate) fn run(
    a: &DmaArgs,
    e: &Engine<'_>,
    barrier: Option<&Barrier>,
    duplex_ceiling: Option<f64>,
    interference: Option<EngineSide>,
    mut ceiling: Option<CeilingCopy<'_>>,
) -> Result<(ServedResult, Option<InterferenceResult>), Error> {
    let meet = |phase: &str| barrier.map_or(Ok(()), |b| b.wait(phase));
    let socket = a.socket.as_ref().expect("server mode has a socket");
    let Session { mut client, descriptor, ns, reg } = Session::open(a, e, socket)?;
    // Every rank of a group stores the same prompt's chunks, under its own namespace.
    let keys = chunk_keys(ns, a.seed, e.chunks.len());
    let blocks: Vec<u64> = e.chunks.iter().flatten().copied().collect();
    let bytes = e.chunk_len * keys.len() as u64;
    let mut requests = Requests { client: &mut client, reg: &reg, keys: &keys, blocks: &blocks };

    meet("save")?;
    let mut save = requests.timed(a, socket, Direction::Save, bytes, &mut ceiling)?;
    meet("saved")?;
    // No rank evicts again before the "load" meeting: the group prefix is complete now.
    let group = if barrier.is_some() && a.tp_world_size > 1 {
        Some(group_prefix(a, e, requests.client, &descriptor)?)
    } else {
        None
    };
    // Every chunk, read through the mapped arena.
    save.mismatched_bytes = saved_mismatches(requests.client, e, &keys, &e.chunks)?;

    let junk = vec![0x5au8; e.originals[0].len()];
    for i in 0..e.originals.len() {
        e.memory.write_tensor(i, &junk).map_err(|x| Error::Gpu(x.to_string()))?;
    }
    meet("load")?;
    let mut load = requests.timed(a, socket, Direction::Load, bytes, &mut ceiling)?;
    load.mismatched_bytes = tensor_mismatches(e)?;

    let interference = match interference {
        Some(shape) => {
            // Each rank's matmul loop beside its own copies, all ranks at once.
            meet("interference")?;
            let (result, failed, counters) =
                served_interference(a, e, requests.client, &reg, (&keys, &blocks), shape)?;
            save.failures += failed.0;
            load.failures += failed.1;
            load.mismatched_bytes += tensor_mismatches(e)?;
            Some((result, counters))
        }
        None => None,
    };
    let (interference, beside_matmul) = match interference {
        Some((result, counters)) => (Some(result), Some(counters)),
        None => (None, None),
    };
    let duplex = match duplex_ceiling {
        Some(ceiling) => Some(duplex(a, e, requests.client, &reg, (&keys, &blocks), ceiling)?),
        None => None,
    };

    // The checks below evict and re-register: after every rank's timed loads.
    meet("loaded")?;
    client.unregister_gpu(&reg).map_err(client_err("unregister_gpu"))?;
    let extras = ServedExtras { group, duplex, beside_matmul };
    let served = served_result(a, (save, load), bytes, keys.len(), extras);
    Ok((served, interference))
}

/// What [`run`] holds with the server: its client, the namespace's descriptor and id, and
/// the registration of this process's tensors.
struct Session {
    client: Client,
    descriptor: NamespaceDescriptor,
    ns: u64,
    reg: orbitkv_client::GpuRegistration,
}

impl Session {
    /// Connects to the server on `socket`, registers the run's namespace (checking that it
    /// holds the layout's chunks) and shares the engine's tensors with the server.
    fn open(a: &DmaArgs, e: &Engine<'_>, socket: &std::path::Path) -> Result<Self, Error> {
        let layout = *e.memory.layout();
        let mut client = Client::connect(ClientOptions {
            name: "orbitkv-perf-dma".into(),
            request_timeout: Duration::from_secs(120),
            ..ClientOptions::with_socket(socket)
        })
        .map_err(client_err("connect"))?;
        let per_chunk = e.chunks[0].len() as u32;
        let descriptor = descriptor(a, &layout, per_chunk);
        let ns =
            client.register_namespace(&descriptor).map_err(client_err("register namespace"))?;
        if ns.max_chunk_bytes < e.chunk_len {
            return Err(Error::Gpu(format!(
                "namespace holds {} bytes per chunk, the layout needs {}",
                ns.max_chunk_bytes, e.chunk_len
            )));
        }
        let exports = e.memory.exports().map_err(|x| Error::Gpu(x.to_string()))?;
        let tensors: Vec<GpuTensor> = exports
            .iter()
            .map(|x| GpuTensor { handle: x.handle, offset: x.offset, len: x.len })
            .collect();
        let reg = client
            .register_gpu(e.device_uuid, layout, &tensors)
            .map_err(client_err("register_gpu"))?;
        Ok(Self { client, descriptor, ns: ns.id, reg })
    }
}

/// The requests of a series through the server: every chunk's key, saved from (or loaded
/// into) its blocks of the registered tensors.
struct Requests<'a> {
    client: &'a mut Client,
    reg: &'a orbitkv_client::GpuRegistration,
    keys: &'a [ChunkKey],
    blocks: &'a [u64],
}

/// One direction's series through the server: each timed request's GB/s, the chunks not
/// done, the server's counters over the timed requests, the ceiling's windows around them,
/// and the bytes found wrong after it.
#[derive(Default)]
struct ServedSeries {
    runs: Vec<f64>,
    failures: u64,
    sums: Sums,
    brackets: Brackets,
    mismatched_bytes: u64,
}

impl Requests<'_> {
    /// One untimed request of every chunk, then `--iterations` timed ones (a save each after
    /// an evict of every chunk), the ceiling's window before the first timed and after each;
    /// `bytes` the bytes of one request. The series' `mismatched_bytes` are the caller's.
    fn timed(
        &mut self,
        a: &DmaArgs,
        socket: &std::path::Path,
        direction: Direction,
        bytes: u64,
        ceiling: &mut Option<CeilingCopy<'_>>,
    ) -> Result<ServedSeries, Error> {
        let gbps = |t: Instant| bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        let way = match direction {
            Direction::Save => "save",
            Direction::Load => "load",
        };
        let mut s = ServedSeries::default();
        for i in 0..=a.iterations {
            if direction == Direction::Save {
                self.client.evict(self.keys).map_err(client_err("evict"))?;
            }
            if i == 1 {
                s.brackets.window(ceiling, direction)?;
            }
            let before = Counters::read(socket, way);
            let t = Instant::now();
            let o = match direction {
                Direction::Save => self.client.save(self.reg, self.keys, self.blocks),
                Direction::Load => self.client.load(self.reg, self.keys, self.blocks),
            }
            .map_err(client_err(way))?;
            if i > 0 {
                s.brackets.intervals.push((bytes, t.elapsed()));
                s.runs.push(gbps(t));
                s.sums.add(before, Counters::read_after(socket, way, &before));
                s.brackets.window(ceiling, direction)?;
            }
            s.failures += not_done(&o);
        }
        Ok(s)
    }
}

/// The group prefix once every rank has saved: each rank's chunks under its own namespace
/// (`descriptor` with the rank's `tp_rank`), looked up as a group.
fn group_prefix(
    a: &DmaArgs,
    e: &Engine<'_>,
    client: &mut Client,
    descriptor: &NamespaceDescriptor,
) -> Result<orbitkv_client::GroupPrefix, Error> {
    let mut ranks = Vec::with_capacity(a.tp_world_size as usize);
    for r in 0..a.tp_world_size {
        let d = NamespaceDescriptor { tp_rank: r, ..descriptor.clone() };
        let id = client.register_namespace(&d).map_err(client_err("register namespace"))?.id;
        ranks.push(chunk_keys(id, a.seed, e.chunks.len()));
    }
    let views: Vec<&[ChunkKey]> = ranks.iter().map(|k| &k[..]).collect();
    client.lookup_group(&views).map_err(client_err("lookup_group"))
}

/// What a server run may add besides its two series: the group prefix (`--barrier`), the
/// duplex (`--duplex`) and the server's counters beside the matmul loop (`--interference`).
struct ServedExtras {
    group: Option<orbitkv_client::GroupPrefix>,
    duplex: Option<DuplexResult>,
    beside_matmul: Option<BesideMatmul>,
}

/// The report of a server run from its `(save, load)` series (of `bytes` and `chunks` each)
/// and `extras`.
fn served_result(
    a: &DmaArgs,
    (save, load): (ServedSeries, ServedSeries),
    bytes: u64,
    chunks: usize,
    extras: ServedExtras,
) -> ServedResult {
    let ServedExtras { group, duplex, beside_matmul } = extras;
    let (save_sums, load_sums) = (&save.sums, &load.sums);
    let (save_ceiling_windows_gbps, save_bracketed_ratios, save_ratio_bracketed) =
        save.brackets.finish();
    let (load_ceiling_windows_gbps, load_bracketed_ratios, load_ratio_bracketed) =
        load.brackets.finish();
    ServedResult {
        save_gbps: median(save.runs),
        load_gbps: median(load.runs),
        save_failures: save.failures,
        load_failures: load.failures,
        save_mismatched_bytes: save.mismatched_bytes,
        load_mismatched_bytes: load.mismatched_bytes,
        tp_rank: a.tp_rank,
        tp_world_size: a.tp_world_size,
        chunks,
        group_prefix_chunks: group.as_ref().map(|g| g.chunks),
        group_prefix_per_rank: group.map(|g| g.per_rank),
        duplex,
        // All timed runs' bytes over all their busy time (None if a reading was missing).
        save_busy_gbps: busy_gbps(bytes * u64::from(a.iterations), save_sums.busy_s),
        load_busy_gbps: busy_gbps(bytes * u64::from(a.iterations), load_sums.busy_s),
        save_lead_us: save_sums.per_request_us(save_sums.lead_s),
        save_tail_us: save_sums.per_request_us(save_sums.tail_s),
        load_lead_us: load_sums.per_request_us(load_sums.lead_s),
        load_tail_us: load_sums.per_request_us(load_sums.tail_s),
        save_pickup_us: save_sums.per_request_us(save_sums.pickup_s),
        load_pickup_us: load_sums.per_request_us(load_sums.pickup_s),
        save_timeline: save_sums.timeline(),
        load_timeline: load_sums.timeline(),
        save_runs_per_job: save_sums.runs_per_job(),
        load_runs_per_job: load_sums.runs_per_job(),
        save_submit_us_per_job: save_sums.per_job(save_sums.submit_s * 1e6),
        load_submit_us_per_job: load_sums.per_job(load_sums.submit_s * 1e6),
        save_submit_cpu_us_per_job: save_sums.per_job(save_sums.submit_cpu_s * 1e6),
        load_submit_cpu_us_per_job: load_sums.per_job(load_sums.submit_cpu_s * 1e6),
        save_submit_wait_us_per_job: save_sums.per_job(save_sums.submit_wait_s * 1e6),
        load_submit_wait_us_per_job: load_sums.per_job(load_sums.submit_wait_s * 1e6),
        save_submit_parts: save_sums.submit_parts(),
        load_submit_parts: load_sums.submit_parts(),
        save_checksum_wait_us_per_job: save_sums.per_job(save_sums.checksum_wait_s * 1e6),
        beside_matmul,
        save_ceiling_windows_gbps,
        save_bracketed_ratios,
        save_ratio_bracketed,
        load_ceiling_windows_gbps,
        load_bracketed_ratios,
        load_ratio_bracketed,
    }
}

/// Mismatched bytes between the engine's tensors and what they held before any load.
pub(crate) fn tensor_mismatches(e: &Engine<'_>) -> Result<u64, Error> {
    let mut bad = 0;
    let mut got = vec![0u8; e.originals[0].len()];
    for (i, want) in e.originals.iter().enumerate() {
        e.memory.read_tensor(i, &mut got).map_err(|x| Error::Gpu(x.to_string()))?;
        bad += got.iter().zip(want).filter(|(x, y)| x != y).count() as u64;
    }
    Ok(bad)
}

/// `--interference` through the server: the matmul loop beside back-to-back saves and then
/// loads of every chunk through the server (its copies, its checksums), then beside the same
/// streamed (`server-stream`: see [`streamed`]), then beside the engine-side copies in the
/// loop's own process, then beside that process's gathers copied by the server
/// (`engine-gather`: see [`Gathered`]), each after a window of the loop alone (one more at the end),
/// `--interference-rounds` times. Each save follows an evict, and each save and load is framed
/// by two readings of the server's stats, inside the loop's window: a few milliseconds without
/// copies per save, so the `server` rows understate the slowdown slightly. Also returns the
/// chunks not done (saves, loads) and the server's counters over the saves and loads beside
/// the loop.
fn served_interference(
    a: &DmaArgs,
    e: &Engine<'_>,
    client: &mut Client,
    reg: &orbitkv_client::GpuRegistration,
    (keys, blocks): (&[ChunkKey], &[u64]),
    shape: EngineSide,
) -> Result<(InterferenceResult, (u64, u64), BesideMatmul), Error> {
    let socket = a.socket.as_ref().expect("server mode has a socket");
    let bytes = e.chunk_len * keys.len() as u64;
    let mut matmul = MatmulLoop::start(a.device, Some(shape))?;
    let mut gathered = Gathered::register(client, &matmul, shape, (e, keys), a.seed)
        .unwrap_or_else(|err| {
            eprintln!("--interference: no engine-gather rows: {err}");
            None
        });
    let mut windows = Windows::default();
    let mut beside = ServedBeside {
        requests: Requests { client, reg, keys, blocks },
        socket,
        chunk_len: e.chunk_len,
        bytes,
        failed: (0, 0),
        sums: [Sums::default(), Sums::default()],
        copied: [0u64, 0],
        stream_sums: [Sums::default(), Sums::default()],
        stream_copied: [0u64, 0],
    };
    for _ in 0..a.interference_rounds {
        beside.server_rows(&mut windows, &mut matmul)?;
        beside.streamed_rows(&mut windows, &mut matmul)?;
        matmul.engine_side_rows(&mut windows)?;
        beside.engine_gather_rows(&mut windows, &mut matmul, &mut gathered);
        windows.end_round();
    }
    if let Some(g) = gathered {
        let client = &mut *beside.requests.client;
        client.unregister_gpu(&g.reg).map_err(client_err("unregister_gpu (engine staging)"))?;
    }
    let result = windows.finish(&matmul);
    Ok((result, beside.failed, beside.counters()))
}

/// The server's rows beside the matmul loop ([`served_interference`]) and what they add up
/// over the rounds: the chunks not done (saves, loads), and per way (save, load) the server's
/// counters with the bytes they cover, for the requests of every chunk and for the streamed
/// runs.
struct ServedBeside<'a> {
    requests: Requests<'a>,
    socket: &'a std::path::Path,
    chunk_len: u64,
    /// Bytes of a request of every chunk.
    bytes: u64,
    failed: (u64, u64),
    sums: [Sums; 2],
    copied: [u64; 2],
    stream_sums: [Sums; 2],
    stream_copied: [u64; 2],
}

impl ServedBeside<'_> {
    /// The `server` rows: back-to-back saves (each after an evict), then loads, of every chunk.
    fn server_rows(&mut self, windows: &mut Windows, matmul: &mut MatmulLoop) -> Result<(), Error> {
        let (socket, bytes) = (self.socket, self.bytes);
        for (w, way) in ["save", "load"].into_iter().enumerate() {
            let r = &mut self.requests;
            let (client, reg, keys, blocks) = (&mut *r.client, r.reg, r.keys, r.blocks);
            let (sums, copied, failed) = (&mut self.sums, &mut self.copied, &mut self.failed);
            windows.measure(matmul, "server", way, |m| {
                let (rate, runs) = m.during(|| {
                    if way == "save" {
                        client.evict(keys).map_err(client_err("evict"))?;
                    }
                    let before = Counters::read(socket, way);
                    let t = Instant::now();
                    let outcomes = if way == "save" {
                        client.save(reg, keys, blocks)
                    } else {
                        client.load(reg, keys, blocks)
                    }
                    .map_err(client_err(way))?;
                    let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
                    sums[w].add(before, Counters::read_after(socket, way, &before));
                    copied[w] += bytes;
                    Ok((gbps, not_done(&outcomes)))
                })?;
                let not_done: u64 = runs.iter().map(|r| r.1).sum();
                if way == "save" {
                    failed.0 += not_done;
                } else {
                    failed.1 += not_done;
                }
                Ok((rate, median(runs.into_iter().map(|r| r.0).collect())))
            })?;
        }
        Ok(())
    }

    /// The `server-stream` rows: saves, then loads, streamed (see [`streamed`]).
    fn streamed_rows(
        &mut self,
        windows: &mut Windows,
        matmul: &mut MatmulLoop,
    ) -> Result<(), Error> {
        let (socket, chunk_len) = (self.socket, self.chunk_len);
        for (w, way) in ["save", "load"].into_iter().enumerate() {
            let r = &mut self.requests;
            let (client, reg, keys, blocks) = (&mut *r.client, r.reg, r.keys, r.blocks);
            let (stream_sums, stream_copied) = (&mut self.stream_sums, &mut self.stream_copied);
            let failed = &mut self.failed;
            windows.measure(matmul, "server-stream", way, |m| {
                let before = Counters::read(socket, way);
                let (rate, runs) =
                    m.during(|| streamed(client, reg, (keys, blocks, chunk_len), way))?;
                stream_sums[w].add(before, Counters::read_after(socket, way, &before));
                let (moved, not_done, took) =
                    runs.iter().fold((0, 0, 0.0), |t, r| (t.0 + r.0, t.1 + r.1, t.2 + r.2));
                stream_copied[w] += moved;
                if way == "save" {
                    failed.0 += not_done;
                } else {
                    failed.1 += not_done;
                }
                Ok((rate, moved as f64 / took / 1e9))
            })?;
        }
        Ok(())
    }

    /// The `engine-gather` rows, when `gathered` is registered: saves, then loads. A failure
    /// loses these rows only (the staging's registration is dropped, said on stderr), not the
    /// run's others.
    fn engine_gather_rows(
        &mut self,
        windows: &mut Windows,
        matmul: &mut MatmulLoop,
        gathered: &mut Option<Gathered>,
    ) {
        let mut gather_failed = false;
        if let Some(g) = gathered.as_mut() {
            for way in ["save", "load"] {
                let (client, failed) = (&mut *self.requests.client, &mut self.failed);
                let measured = windows.measure(matmul, "engine-gather", way, |m| {
                    let (rate, gbps, not_done) = engine_gather(m, client, g, way)?;
                    if way == "save" {
                        failed.0 += not_done;
                    } else {
                        failed.1 += not_done;
                    }
                    Ok((rate, gbps))
                });
                // A failure here loses these rows only, not the run's others.
                if let Err(e) = measured {
                    let _ = matmul.command("idle");
                    eprintln!("--interference: engine-gather {way}s: {e}; no more of them");
                    gather_failed = true;
                    break;
                }
            }
        }
        if gather_failed {
            if let Some(g) = gathered.take() {
                let _ = self.requests.client.unregister_gpu(&g.reg);
            }
        }
    }

    /// The server's counters over the saves and loads of every chunk, and over the streamed
    /// ones.
    fn counters(&self) -> BesideMatmul {
        let [save, load] = &self.sums;
        let (copied, stream_sums, stream_copied) =
            (&self.copied, &self.stream_sums, &self.stream_copied);
        BesideMatmul {
            save_busy_gbps: busy_gbps(copied[0], save.busy_s),
            save_submit_us_per_job: save.per_job(save.submit_s * 1e6),
            save_checksum_wait_us_per_job: save.per_job(save.checksum_wait_s * 1e6),
            load_busy_gbps: busy_gbps(copied[1], load.busy_s),
            load_submit_us_per_job: load.per_job(load.submit_s * 1e6),
            save_timeline: save.timeline(),
            load_timeline: load.timeline(),
            stream_save_busy_gbps: busy_gbps(stream_copied[0], stream_sums[0].busy_s),
            stream_load_busy_gbps: busy_gbps(stream_copied[1], stream_sums[1].busy_s),
        }
    }
}

/// The `engine-gather` rows: the matmul loop's process gathers its pages into its staging, as
/// an engine with the engine-side gather does (docs/operations.md), and the server copies the
/// staging's chunks to the arena with copy engines (a cross-layer registration of the staging,
/// one block per chunk); loads the reverse. This process passes the batches between the two.
struct Gathered {
    reg: orbitkv_client::GpuRegistration,
    ns: u64,
    seed: u64,
    chunk_len: u64,
    /// Chunks per staging slot, and the slots.
    per_slot: usize,
    depth: usize,
    /// The next batch a save names, and the batches saved last (most recent last; loads
    /// cycle over them, all still in the arena).
    next: u64,
    saved: VecDeque<u64>,
    loads: usize,
}

/// Batches of the `engine-gather` saves that its loads cycle over (batches of at most a
/// staging part, 32 MiB by default: up to 512 MiB, well inside what the arena keeps of the
/// latest saves).
const GATHERED_KEPT: usize = 16;

impl Gathered {
    /// Registers the matmul loop's staging with the server, if it shared it and its slots
    /// hold whole chunks (else None, said on stderr).
    fn register(
        client: &mut Client,
        matmul: &MatmulLoop,
        shape: EngineSide,
        (e, keys): (&Engine<'_>, &[ChunkKey]),
        seed: u64,
    ) -> Result<Option<Self>, Error> {
        let st = match matmul.staging() {
            Ok(st) => st,
            Err(why) => {
                eprintln!("--interference: no engine-gather rows: the matmul loop shared no staging ({why})");
                return Ok(None);
            }
        };
        let Some((per_slot, depth)) = staging_slots(shape, e.chunk_len) else {
            eprintln!(
                "--interference: staging batches of {} bytes do not hold whole chunks of {}; \
                 no engine-gather rows",
                shape.batch_bytes, e.chunk_len
            );
            return Ok(None);
        };
        let blocks = (per_slot * depth) as u64;
        if st.len < blocks * e.chunk_len {
            return Err(Error::Gpu(format!(
                "--interference: the shared staging has {} bytes, not {}",
                st.len,
                blocks * e.chunk_len
            )));
        }
        // One cross-layer block per chunk: 1 layer, 1 token, 1 head of chunk_len / 2 bytes,
        // K and V.
        let layout = KvLayoutSpec {
            kind: KvLayoutKind::CrossLayer,
            num_layers: 1,
            num_blocks: blocks,
            block_size: 1,
            kv_heads: 1,
            head_dim: u32::try_from(e.chunk_len / 2)
                .map_err(|_| Error::Gpu("--interference: chunks too large to stage".into()))?,
            elem_bytes: 1,
        };
        let tensor = GpuTensor { handle: st.handle, offset: st.offset, len: blocks * e.chunk_len };
        let reg = client
            .register_gpu(e.device_uuid, layout, &[tensor])
            .map_err(client_err("register_gpu (engine staging)"))?;
        let ns = keys.first().map_or(0, |k| k.namespace);
        Ok(Some(Self {
            reg,
            ns,
            seed,
            chunk_len: e.chunk_len,
            per_slot,
            depth,
            next: 0,
            saved: VecDeque::new(),
            loads: 0,
        }))
    }

    /// The keys of batch `b` (fresh for every saved batch).
    fn keys(&self, b: u64) -> Vec<ChunkKey> {
        (0..self.per_slot as u64)
            .map(|i| {
                let mut h = blake3::Hasher::new();
                h.update(b"orbitkv-perf-gather");
                h.update(&self.seed.to_le_bytes());
                h.update(&b.to_le_bytes());
                h.update(&i.to_le_bytes());
                ChunkKey::new(self.ns, *h.finalize().as_bytes())
            })
            .collect()
    }

    /// The staging blocks of slot `j`.
    fn blocks(&self, j: usize) -> Vec<u64> {
        let first = (j * self.per_slot) as u64;
        (first..first + self.per_slot as u64).collect()
    }

    /// The next batch to load: the saved ones in turn.
    fn next_load(&mut self) -> Option<u64> {
        let b = *self.saved.get(self.loads % self.saved.len().max(1))?;
        self.loads += 1;
        Some(b)
    }

    /// Starts the transfer of a batch through staging slot `j`: a save (`way`) of a fresh
    /// batch, or a load of the next saved one. Returns (slot, batch, transfer).
    fn start(
        &mut self,
        client: &mut Client,
        j: usize,
        way: &'static str,
    ) -> Result<(usize, u64, orbitkv_client::Transfer), Error> {
        let save = way == "save";
        let (b, t) = if save {
            let b = self.next;
            self.next += 1;
            (b, client.start_save(&self.reg, &self.keys(b), &self.blocks(j)))
        } else {
            let b = self.next_load().expect("saved batches");
            (b, client.start_load(&self.reg, &self.keys(b), &self.blocks(j)))
        };
        t.map(|t| (j, b, t)).map_err(client_err(way))
    }

    /// Batch `b`'s transfer through slot `j` answered `o`: the slot goes back to the matmul
    /// loop (after a save, the batch is kept for the loads if stored whole). Returns (chunks
    /// done, chunks not done).
    fn finish(
        &mut self,
        m: &mut MatmulLoop,
        j: usize,
        b: u64,
        o: &[ChunkOutcome],
        save: bool,
    ) -> Result<(u64, u64), Error> {
        if save {
            // Only a batch stored whole is loaded later.
            if not_done(o) == 0 {
                self.saved.push_back(b);
            }
            if self.saved.len() > GATHERED_KEPT {
                self.saved.pop_front();
            }
            m.command(&format!("free {j}"))
        } else {
            m.command(&format!("loaded {j} {b}"))
        }
        .map(|()| (o.len() as u64 - not_done(o), not_done(o)))
    }
}

/// (chunks per staging slot, slots) of the engine-side copies' staging, when a slot holds
/// whole chunks (the slot's pages as the matmul loop works them out).
fn staging_slots(shape: EngineSide, chunk_len: u64) -> Option<(usize, usize)> {
    let page = shape.page_bytes.max(1);
    let per = (shape.batch_bytes / page).min(shape.pool_bytes / page).max(1);
    let slot = per * page;
    (chunk_len > 0 && slot.is_multiple_of(chunk_len) && shape.depth > 0)
        .then(|| ((slot / chunk_len) as usize, shape.depth as usize))
}

/// One `engine-gather` measurement (`way` save or load): the batches the matmul loop hands
/// over are saved from (or loaded into) its staging through the server for a window, timed
/// from the first completed; returns (products per second meanwhile, GB/s the server moved,
/// chunks not done). Every transfer started is waited for before the loop is told to stop.
fn engine_gather(
    m: &mut MatmulLoop,
    client: &mut Client,
    g: &mut Gathered,
    way: &'static str,
) -> Result<(f64, f64, u64), Error> {
    let save = way == "save";
    if !save && g.saved.is_empty() {
        return Err(Error::Gpu("--interference: engine-gather loads before any save".into()));
    }
    m.forget_handoffs();
    m.command(if save { "save-server" } else { "load-server" })?;
    // (slot, batch, transfer) in start order.
    let mut inflight: VecDeque<(usize, u64, orbitkv_client::Transfer)> = VecDeque::new();
    if !save {
        for j in 0..g.depth {
            inflight.push_back(g.start(client, j, way)?);
        }
    }
    let (window, moved, mut not_done_) = gather_window(m, client, g, way, &mut inflight)?;
    let (t0, m0) = window;
    let (took, m1) = (t0.elapsed().as_secs_f64(), m.mark());
    while let Some((j, b, t)) = inflight.pop_front() {
        let o = client.wait_transfer(&t).map_err(client_err(way))?;
        not_done_ += g.finish(m, j, b, &o, save)?.1;
    }
    m.command("idle")?;
    Ok((m.rate(m0, m1), moved as f64 / took / 1e9, not_done_))
}

/// The body of [`engine_gather`]: starts a transfer for every slot the matmul loop hands over
/// and finishes those that complete, until a window has passed since the first completed.
/// Returns when that window began (and the loop's mark then), the bytes moved since, and the
/// chunks not done; the transfers still in flight stay in `inflight`.
fn gather_window(
    m: &mut MatmulLoop,
    client: &mut Client,
    g: &mut Gathered,
    way: &'static str,
    inflight: &mut VecDeque<(usize, u64, orbitkv_client::Transfer)>,
) -> Result<((Instant, usize), u64, u64), Error> {
    use crate::dma_interference::{Handoff, WINDOW};
    let save = way == "save";
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut window: Option<(Instant, usize)> = None;
    let (mut moved, mut not_done_) = (0u64, 0u64);
    loop {
        let mut busy = false;
        while let Some(h) = m.handoff(Duration::ZERO) {
            busy = true;
            let j = match h {
                Handoff::Staged(j) if save => j,
                Handoff::Scattered(j) if !save => j,
                _ => continue,
            };
            if j >= g.depth {
                return Err(Error::Gpu(format!("--interference: the matmul loop named slot {j}")));
            }
            inflight.push_back(g.start(client, j, way)?);
        }
        let mut k = 0;
        while k < inflight.len() {
            match client.poll_transfer(&inflight[k].2).map_err(client_err(way))? {
                Some(o) => {
                    let (j, b, _) = inflight.remove(k).expect("in range");
                    let (done, missed) = g.finish(m, j, b, &o, save)?;
                    not_done_ += missed;
                    match window {
                        Some(_) => moved += done * g.chunk_len,
                        None => window = Some((Instant::now(), m.mark())),
                    }
                    busy = true;
                }
                None => k += 1,
            }
        }
        if let Some((t0, _)) = window {
            if t0.elapsed() >= WINDOW {
                break;
            }
        } else if Instant::now() >= deadline || m.ended() {
            let _ = m.command("idle");
            return Err(Error::Gpu(format!(
                "--interference: the engine-gather {way}s completed nothing within 30 s"
            )));
        }
        if !busy {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    let window = window.expect("the loop ends inside a window");
    Ok((window, moved, not_done_))
}

/// Groups a streamed run splits the chunks into: two in flight, and a group saved again only
/// after its previous save has answered (and been evicted).
const STREAM_GROUPS: usize = 4;

/// Saves (`way` "save", each group evicted just before) or loads of `keys` for a matmul
/// window, in [`STREAM_GROUPS`] requests of a quarter of the chunks each, started back to back
/// with two in flight: the next request is queued before the one running ends, so the DMA
/// thread never runs dry between them, as for an engine saving (or loading) as it computes.
/// Returns the bytes moved (of `chunk_len` each), the chunks not done and the seconds taken.
fn streamed(
    client: &mut Client,
    reg: &orbitkv_client::GpuRegistration,
    (keys, blocks, chunk_len): (&[ChunkKey], &[u64], u64),
    way: &'static str,
) -> Result<(u64, u64, f64), Error> {
    let per_chunk = blocks.len() / keys.len().max(1);
    let size = keys.len().div_ceil(STREAM_GROUPS).max(1);
    let groups: Vec<(&[ChunkKey], &[u64])> =
        keys.chunks(size).zip(blocks.chunks(size * per_chunk)).collect();
    let start = Instant::now();
    let (mut moved, mut not_done_) = (0, 0);
    round_robin(
        client,
        groups.len(),
        || start.elapsed() < crate::dma_interference::WINDOW,
        |client, g| {
            let (k, b) = groups[g];
            if way == "save" {
                client.evict(k).map_err(client_err("evict"))?;
                client.start_save(reg, k, b)
            } else {
                client.start_load(reg, k, b)
            }
            .map_err(client_err(way))
        },
        |client, g, t| {
            let outcomes = client.wait_transfer(&t).map_err(client_err(way))?;
            moved += groups[g].0.len() as u64 * chunk_len;
            not_done_ += not_done(&outcomes);
            Ok(())
        },
    )?;
    Ok((moved, not_done_, start.elapsed().as_secs_f64()))
}

/// Starts group 0, 1, ... of `groups` (round robin) while `more()` says so, two in flight at
/// most (one with fewer than three groups), and waits for each in the order started (also
/// those in flight once `more()` stops): a group is started again only after its previous
/// start was waited for.
fn round_robin<C, T>(
    ctx: &mut C,
    groups: usize,
    mut more: impl FnMut() -> bool,
    mut start: impl FnMut(&mut C, usize) -> Result<T, Error>,
    mut wait: impl FnMut(&mut C, usize, T) -> Result<(), Error>,
) -> Result<(), Error> {
    let most = if groups >= 3 { 2 } else { 1 };
    let mut inflight = std::collections::VecDeque::new();
    let mut next = 0;
    loop {
        while inflight.len() < most && more() {
            let g = next % groups;
            next += 1;
            inflight.push_back((g, start(ctx, g)?));
        }
        let Some((g, t)) = inflight.pop_front() else { return Ok(()) };
        wait(ctx, g, t)?;
    }
}

/// Counts the bytes of chunks `keys` (blocks `chunks`) that differ from what the engine saved,
/// read through the mapped arena; a missing chunk counts whole.
pub(crate) fn saved_mismatches(
    client: &mut Client,
    e: &Engine<'_>,
    keys: &[ChunkKey],
    chunks: &[Vec<u64>],
) -> Result<u64, Error> {
    let layout = *e.memory.layout();
    let mut bad = 0;
    let mut want = Vec::new();
    for (kb, cb) in keys.chunks(256).zip(chunks.chunks(256)) {
        let leases = client.lookup_leased(kb).map_err(client_err("lookup"))?;
        for (lease, blocks) in leases.iter().zip(cb) {
            expected_chunk(&layout, e.originals, blocks, &mut want);
            let got = client.chunk(lease).map_err(client_err("chunk"))?;
            bad += got.iter().zip(&want).filter(|(x, y)| x != y).count() as u64;
        }
        bad += (kb.len() - leases.len()) as u64 * e.chunk_len;
        client.release(&leases).map_err(client_err("release"))?;
    }
    Ok(bad)
}

/// Saves the first half of the chunks while loading the second half (all of them present
/// when it starts): before each run the first half is evicted and the second half's blocks
/// are scribbled over on the GPU; after the last, every byte is checked on both sides.
fn duplex(
    a: &DmaArgs,
    e: &Engine<'_>,
    client: &mut Client,
    reg: &orbitkv_client::GpuRegistration,
    (keys, blocks): (&[ChunkKey], &[u64]),
    ceiling_gbps: f64,
) -> Result<DuplexResult, Error> {
    let layout = *e.memory.layout();
    let per_chunk = e.chunks[0].len();
    let half = keys.len() / 2;
    if half == 0 {
        return Err(Error::InvalidArgument {
            flag: "--duplex",
            reason: "needs at least two chunks".into(),
        });
    }
    let (save_keys, load_keys) = keys.split_at(half);
    let (save_blocks, load_blocks) = blocks.split_at(half * per_chunk);
    // The tensors with the loaded half's blocks scribbled over (the saved half's blocks keep
    // their bytes: they are what the save reads).
    let mut scribbled: Vec<Vec<u8>> = e.originals.to_vec();
    for &block in load_blocks {
        for s in layout.block_segments(block) {
            scribbled[s.tensor as usize][s.offset as usize..(s.offset + s.len) as usize].fill(0xa7);
        }
    }
    let (save_bytes, load_bytes) =
        (e.chunk_len * save_keys.len() as u64, e.chunk_len * load_keys.len() as u64);
    let mut runs = Vec::new();
    let mut failures = 0;
    for i in 0..=a.iterations {
        client.evict(save_keys).map_err(client_err("evict"))?;
        for (t, bytes) in scribbled.iter().enumerate() {
            e.memory.write_tensor(t, bytes).map_err(|x| Error::Gpu(x.to_string()))?;
        }
        let t = Instant::now();
        let saving =
            client.start_save(reg, save_keys, save_blocks).map_err(client_err("start_save"))?;
        let loading = match client.start_load(reg, load_keys, load_blocks) {
            Ok(l) => l,
            Err(e) => {
                // The save is under way: let it finish before the tensors are touched again.
                let _ = client.wait_transfer(&saving);
                return Err(client_err("start_load")(e));
            }
        };
        // Both are waited for before either error counts: neither may still be running.
        let saved = client.wait_transfer(&saving);
        let loaded = client.wait_transfer(&loading);
        let saved = saved.map_err(client_err("save"))?;
        let loaded = loaded.map_err(client_err("load"))?;
        if i > 0 {
            runs.push((save_bytes + load_bytes) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        failures += not_done(&saved) + not_done(&loaded);
    }
    let mismatched_bytes =
        saved_mismatches(client, e, save_keys, &e.chunks[..half])? + tensor_mismatches(e)?;
    let gbps = median(runs);
    Ok(DuplexResult {
        save_bytes,
        load_bytes,
        gbps,
        ceiling_gbps,
        ratio: if ceiling_gbps > 0.0 { gbps / ceiling_gbps } else { 0.0 },
        failures,
        mismatched_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::{
        busy_delta, busy_gbps, round_robin, staging_slots, Brackets, CeilingCopy, Counters,
        Direction, EngineSide, Error, Sums,
    };
    use std::time::Duration;

    #[test]
    fn each_timed_operation_against_the_ceiling_copies_around_it() {
        // Windows of 50, 60 and 40 GB/s around two 1 GB operations of 25 and 20 ms (40 and 50
        // GB/s): 40 / 55 and 50 / 50.
        let mut readings = vec![40.0, 60.0, 50.0];
        let mut asked = Vec::new();
        let mut copy = |d: Direction| {
            asked.push(d);
            Ok(readings.pop().expect("three windows"))
        };
        let mut b = Brackets::default();
        let mut ceiling: Option<CeilingCopy<'_>> = Some(&mut copy);
        b.window(&mut ceiling, Direction::Load).unwrap();
        for ms in [25, 20] {
            b.intervals.push((1_000_000_000, Duration::from_millis(ms)));
            b.window(&mut ceiling, Direction::Load).unwrap();
        }
        let (windows, ratios, median) = b.finish();
        assert_eq!(windows, [50.0, 60.0, 40.0]);
        assert_eq!(asked, [Direction::Load; 3]);
        assert!((ratios[0] - 40.0 / 55.0).abs() < 1e-9 && (ratios[1] - 1.0).abs() < 1e-9);
        assert!((median.unwrap() - (40.0 / 55.0 + 1.0) / 2.0).abs() < 1e-9, "{median:?}");
        // Without a copy (a rank of a group): no windows, no ratios.
        let mut b = Brackets::default();
        b.window(&mut None, Direction::Save).unwrap();
        b.intervals.push((1, Duration::from_millis(1)));
        assert_eq!(b.finish(), (vec![], vec![], None));
        // A copy that fails fails the series, naming why.
        let mut failing = |_: Direction| Err(crate::error::Error::Gpu("copy refused".into()));
        let e = Brackets::default().window(&mut Some(&mut failing), Direction::Save).unwrap_err();
        assert!(e.to_string().contains("copy refused"), "{e}");
    }

    #[test]
    fn busy_rate_needs_both_readings_and_time() {
        let runs = busy_delta(Some(1.0), Some(1.5)) + busy_delta(Some(4.0), Some(4.5));
        assert_eq!(busy_gbps(2_000_000_000, runs), Some(2.0));
        // A missing reading in any run: no rate.
        assert_eq!(busy_gbps(1, runs + busy_delta(None, Some(2.0))), None);
        assert_eq!(busy_gbps(1, busy_delta(Some(1.0), None)), None);
        // No busy time between the readings (the counter did not move): no rate.
        assert_eq!(busy_gbps(1, busy_delta(Some(3.0), Some(3.0))), None);
    }

    #[test]
    fn engine_gather_slots_hold_whole_chunks_or_there_are_none() {
        let shape = |page: u64, batch: u64, pool: u64, depth: u32| EngineSide {
            page_bytes: page,
            batch_bytes: batch,
            pool_bytes: pool,
            depth,
        };
        // 32 MiB batches of 2 KiB pages: sixteen 2 MiB chunks per slot, four slots.
        assert_eq!(staging_slots(shape(2048, 32 << 20, 2 << 30, 4), 2 << 20), Some((16, 4)));
        // mla's 18 KiB pages in batches cut to whole 576 KiB chunks (56 of them).
        let mla = 576 << 10;
        assert_eq!(staging_slots(shape(18 << 10, 56 * mla, 2 << 30, 4), mla), Some((56, 4)));
        // A batch that is not whole chunks, a pool smaller than a chunk, no chunk: none.
        assert_eq!(staging_slots(shape(18 << 10, 32 << 20, 2 << 30, 4), mla), None);
        assert_eq!(staging_slots(shape(2048, 32 << 20, 1 << 20, 4), 2 << 20), None);
        assert_eq!(staging_slots(shape(2048, 32 << 20, 2 << 30, 4), 0), None);
    }

    #[test]
    fn lead_and_tail_are_means_per_request_over_the_timed_runs() {
        let at = |lead: f64, tail: f64, requests: f64| Counters {
            busy_s: Some(1.0),
            lead_s: Some(lead),
            tail_s: Some(tail),
            // The DMA thread's wake-up: a fifth of the lead here.
            pickup_s: Some(lead / 5.0),
            requests: Some(requests),
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(at(0.5, 0.1, 10.0), at(0.5003, 0.1001, 11.0));
        sums.add(at(0.5003, 0.1001, 11.0), at(0.5008, 0.1004, 12.0));
        let (lead, tail) = (sums.per_request_us(sums.lead_s), sums.per_request_us(sums.tail_s));
        assert!((lead.unwrap() - 400.0).abs() < 1e-6, "{lead:?}");
        assert!((tail.unwrap() - 200.0).abs() < 1e-6, "{tail:?}");
        let pickup = sums.per_request_us(sums.pickup_s);
        assert!((pickup.unwrap() - 80.0).abs() < 1e-6, "{pickup:?}");
        // A server that does not report them, or no request between the readings: nothing.
        let mut old = Sums::default();
        old.add(Counters::default(), Counters::default());
        assert_eq!(old.per_request_us(old.lead_s), None);
        let mut idle = Sums::default();
        idle.add(at(1.0, 1.0, 3.0), at(1.0, 1.0, 3.0));
        assert_eq!(idle.per_request_us(idle.lead_s), None);
    }

    #[test]
    fn the_server_timeline_is_summed_over_runs_and_given_per_request() {
        // (requests, bytes, span, copy busy, copy gaps, kernel seconds, busy periods, lead,
        // tail) so far.
        let at = |r: f64, t: [f64; 8]| Counters {
            requests: Some(r),
            timeline: t.map(Some),
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(
            at(4.0, [1e9, 1.0, 1.0, 0.1, 0.2, 7.0, 0.5, 0.25]),
            at(5.0, [3e9, 1.05, 1.04, 0.1001, 0.2002, 8.0, 0.5001, 0.25]),
        );
        sums.add(
            at(5.0, [3e9, 1.05, 1.04, 0.1001, 0.2002, 8.0, 0.5001, 0.25]),
            at(6.0, [5e9, 1.1, 1.08, 0.1003, 0.2004, 11.0, 0.5004, 0.2501]),
        );
        let t = sums.timeline().expect("timed");
        assert!((t.copy_gbps - 4e9 / 0.08 / 1e9).abs() < 1e-6, "{t:?}");
        assert!((t.span_us - 50_000.0).abs() < 1e-3, "{t:?}");
        assert!((t.copy_gaps_us - 150.0).abs() < 1e-3, "{t:?}");
        assert!((t.kernel_us - 200.0).abs() < 1e-3, "{t:?}");
        assert_eq!(t.periods_per_request, Some(2.0), "one, then three busy periods");
        assert!((t.lead_us.unwrap() - 200.0).abs() < 1e-3, "{t:?}");
        assert!((t.tail_us.unwrap() - 50.0).abs() < 1e-3, "{t:?}");
        // A server without --gpu-timeline (no such counters), or nothing timed: none.
        let mut plain = Sums::default();
        plain.add(at(1.0, [0.0; 8]), Counters { requests: Some(2.0), ..Counters::default() });
        assert_eq!(plain.timeline(), None);
        let mut none = Sums::default();
        let idle = [7.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        none.add(at(1.0, idle), at(2.0, idle));
        assert_eq!(none.timeline(), None);
        // A server from before the lead and tail: the rest, without them.
        let old = |r: f64, t: [f64; 6]| {
            let mut c = at(r, [0.0; 8]);
            c.timeline = [t.map(Some).as_slice(), &[None, None]].concat().try_into().unwrap();
            c
        };
        let mut older = Sums::default();
        older.add(
            old(1.0, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            old(2.0, [1e9, 0.1, 0.1, 0.0, 0.0, 1.0]),
        );
        let t = older.timeline().expect("timed");
        assert_eq!((t.lead_us, t.tail_us), (None, None));
        assert!((t.copy_gbps - 10.0).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn streamed_groups_go_round_robin_two_in_flight_never_one_twice() {
        // The events as (started?, group), and what is in flight, checked at every start.
        let mut log: (Vec<(bool, usize)>, Vec<usize>) = (Vec::new(), Vec::new());
        let mut starts = 0;
        round_robin(
            &mut log,
            4,
            || {
                starts += 1;
                starts <= 10
            },
            |(events, inflight), g| {
                assert!(!inflight.contains(&g), "group {g} started while in flight");
                assert!(inflight.len() < 2, "three in flight: {inflight:?}");
                inflight.push(g);
                events.push((true, g));
                Ok(g * 10)
            },
            |(events, inflight), g, t| {
                assert_eq!(t, g * 10, "each wait gets its own start's transfer");
                assert_eq!(inflight.remove(0), g, "waited in the order started");
                events.push((false, g));
                Ok(())
            },
        )
        .unwrap();
        let started: Vec<usize> = log.0.iter().filter(|e| e.0).map(|e| e.1).collect();
        assert_eq!(started, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
        assert!(log.1.is_empty(), "every start waited for");
        assert_eq!(log.0.len(), 20);
        // The second start comes before the first wait: the next request is queued early.
        assert_eq!(&log.0[..3], &[(true, 0), (true, 1), (false, 0)]);
        // A failed start ends it, after nothing else is started.
        let mut n = 0;
        let e = round_robin(
            &mut n,
            3,
            || true,
            |n, g| {
                *n += 1;
                if g == 2 {
                    Err(Error::InvalidArgument { flag: "--test", reason: "start failed".into() })
                } else {
                    Ok(())
                }
            },
            |_, _, ()| Ok(()),
        );
        assert!(e.is_err());
        assert_eq!(n, 3);
        // Two groups (a run of fewer than four chunks): one at a time.
        let mut log: (Vec<usize>, Option<usize>) = (Vec::new(), None);
        let mut left = 5;
        round_robin(
            &mut log,
            2,
            || {
                left -= 1;
                left >= 0
            },
            |(started, inflight), g| {
                assert_eq!(*inflight, None, "one at a time");
                *inflight = Some(g);
                started.push(g);
                Ok(())
            },
            |(_, inflight), g, ()| {
                assert_eq!(inflight.take(), Some(g));
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(log.0, [0, 1, 0, 1, 0]);
    }

    #[test]
    fn host_runs_are_given_per_job_over_the_timed_runs() {
        let at = |jobs: f64, runs: f64| Counters {
            jobs: Some(jobs),
            host_runs: Some(runs),
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(at(10.0, 40.0), at(26.0, 72.0));
        sums.add(at(26.0, 72.0), at(42.0, 104.0));
        assert_eq!(sums.runs_per_job(), Some(2.0));
        let mut old = Sums::default();
        old.add(Counters::default(), Counters::default());
        assert_eq!(old.runs_per_job(), None, "a server without the counters");
        let mut idle = Sums::default();
        idle.add(at(3.0, 9.0), at(3.0, 9.0));
        assert_eq!(idle.runs_per_job(), None, "no job");
    }

    #[test]
    fn submit_and_checksum_wait_are_given_per_job() {
        let at = |jobs: f64, submit: f64, wait: Option<f64>| Counters {
            jobs: Some(jobs),
            submit_s: Some(submit),
            checksum_wait_s: wait,
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(at(10.0, 1.0, Some(0.5)), at(30.0, 1.002, Some(0.5006)));
        sums.add(at(30.0, 1.002, Some(0.5006)), at(50.0, 1.004, Some(0.5008)));
        assert!((sums.per_job(sums.submit_s * 1e6).unwrap() - 100.0).abs() < 1e-6);
        assert!((sums.per_job(sums.checksum_wait_s * 1e6).unwrap() - 20.0).abs() < 1e-6);
        // The DMA thread's own CPU time, per job, from the same readings; an older server
        // without the counter gives none.
        let cpu = |jobs: f64, cpu: f64| Counters {
            submit_cpu_s: Some(cpu),
            submit_wait_s: Some(cpu / 2.0),
            ..at(jobs, 0.0, None)
        };
        let mut sums = Sums::default();
        sums.add(cpu(10.0, 2.0), cpu(20.0, 2.003));
        assert!((sums.per_job(sums.submit_cpu_s * 1e6).unwrap() - 300.0).abs() < 1e-6);
        assert!((sums.per_job(sums.submit_wait_s * 1e6).unwrap() - 150.0).abs() < 1e-6);
        // The submit time's parts; the rest, past the wait and the planning, is CUDA calls.
        let parts = |jobs: f64, submit: f64| Counters {
            submit_wait_s: Some(submit / 2.0),
            submit_parts: [Some(submit / 8.0), Some(submit / 8.0), Some(submit / 16.0)],
            ..at(jobs, submit, None)
        };
        let mut sums = Sums::default();
        sums.add(parts(10.0, 1.6), parts(20.0, 1.616));
        let p = sums.submit_parts().unwrap();
        let near = |x: f64, y: f64| (x - y).abs() < 1e-6;
        assert!(near(p.pieces_us, 200.0) && near(p.stage_us, 200.0), "{p:?}");
        assert!(near(p.tables_us, 100.0) && near(p.cuda_us, 300.0), "{p:?}");
        assert!(Sums::default().submit_parts().is_none());
        let mut old = Sums::default();
        old.add(at(1.0, 0.0, None), at(2.0, 0.001, None));
        assert_eq!(old.per_job(old.submit_cpu_s * 1e6), None);
        assert_eq!(old.per_job(old.submit_wait_s * 1e6), None);
        assert!(old.submit_parts().is_none());
        // Loads have no checksum wait: the server does not report one.
        let mut loads = Sums::default();
        loads.add(at(1.0, 0.0, None), at(2.0, 0.001, None));
        assert_eq!(loads.per_job(loads.checksum_wait_s), None);
    }
}
