//! GPU save/load: the engine registrations and the CUDA/DMA thread pairs, one pair per device.
//!
//! `gpu-d2h-D` runs the saves of device D (engine pages -> arena slots) and `gpu-h2d-D` its
//! loads. Each owns the device's copy engine for its direction (streams, staging buffers,
//! events), takes jobs from one bounded SPSC queue per shard, plans the pieces itself (off the shard cores), and hands each completion back on
//! its own SPSC queue to that shard, ringing its doorbell. A job's engine memory is held (an `Arc`
//! of the imported mapping) until its CUDA event completes; its arena slots are held by the
//! request that submitted it, which waits for the completion before committing, aborting or
//! releasing them, whatever happens to the client meanwhile.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_queue::ArrayQueue;
use cudarc::driver::CudaContext;
use orbitkv_gpu::dma::{
    ChunkHasher, CopyEngine, CopyJob, Direction, DmaError, EngineMemory, Progress, SaveSums,
    SpanTotals, Strategy, SubmitTimes, TensorExport, Transfer, BATCHED_FROM,
};
use orbitkv_gpu::{DeviceInfo, HostRegistration};
use orbitkv_proto::{ErrorCode, GpuTensor, KvLayoutSpec};
use orbitkv_shards::SessionId;

use crate::config::ChecksumPlace;
use crate::shard::doorbell::Doorbells;

mod registry;
mod worker;

use registry::Registry;
use worker::{nanos, Device, Lanes, Running, StartTimes};

/// The bounds of GPU save/load (from the server configuration).
#[derive(Clone, Copy, Debug)]
pub struct GpuLimits {
    /// Jobs a shard may have queued for each thread (`--gpu-queue-depth`).
    pub queue_depth: usize,
    /// Registrations at once (`--max-gpu-registrations`).
    pub max_registrations: usize,
    /// GPU staging per device and thread, all its parts (`--gpu-staging`).
    pub staging_bytes: usize,
    /// Parts of the staging, used in turn (`--gpu-staging-depth`).
    pub staging_depth: usize,
    /// Where saves' checksums are computed (`--gpu-checksums`).
    pub checksums: ChecksumPlace,
    /// How copies cross the bus (`--gpu-copy`).
    pub copy: Strategy,
    /// Time every staged batch (`--gpu-timeline`).
    pub timeline: bool,
}

/// Runs driver work that may take milliseconds (opening or closing CUDA IPC mappings) on a
/// short-lived thread, so that no shard stalls on it. If no thread can be started, `f` is
/// dropped here: what it owns is released inline (a mapping closes on this thread), and a
/// caller waiting for its answer sees the channel closed.
pub fn off_shard(f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new().name("gpu-ipc".into()).spawn(f) {
        tracing::warn!(error = %e, "no thread for CUDA IPC work; done on the shard");
    }
}

/// A copy job from a shard (`M`: what keeps the engine's memory alive; the DMA worker's tests
/// use a stand-in).
pub struct GpuJob<M = Arc<EngineMemory>> {
    /// Submitting shard (where the completion goes).
    pub shard: usize,
    /// Id unique on that shard.
    pub id: u64,
    /// Device index in [`GpuService::devices`].
    pub device: usize,
    /// The engine's tensors (kept alive until the copy completes).
    pub memory: M,
    /// Per chunk: arena offset (from the start of the memfd) and its block ids.
    pub chunks: Vec<(u64, Vec<u64>)>,
    /// Bytes per chunk.
    pub chunk_len: u64,
    /// When its shard queued it (for `{save,load}_pickup_s`).
    pub queued_at: Instant,
}

/// Why a GPU job failed: sent from its DMA thread to its shard, which answers the request's
/// chunks `DeviceError` with the message.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The device's copy engine could not be made (out of device memory for its staging).
    #[error("creating the copy engine: {0}")]
    Engine(#[source] DmaError),
    /// The job did not reach the GPU (a chunk of another length than reserved, a range
    /// outside the arena, a kernel that did not load, a failed launch).
    #[error(transparent)]
    Start(DmaError),
    /// The copy failed on the GPU.
    #[error("CUDA copy failed: {0}")]
    Copy(#[source] DmaError),
    /// The DMA thread stopped on a bug; every job it held or is given fails.
    #[error("the GPU DMA thread failed (see the server log)")]
    ThreadFailed,
    /// A fault injected by a failpoint (builds with the `failpoints` feature only).
    #[cfg(feature = "failpoints")]
    #[error("injected fault: failpoint {0}")]
    Injected(&'static str),
}

/// How a job ended: Ok (with a save's chunk checksums when the GPU computed them), or why not.
pub type GpuResult = Result<Option<Vec<u64>>, JobError>;

/// A finished job.
#[derive(Debug)]
pub struct GpuDone {
    /// The job's id.
    pub id: u64,
    /// How it ended.
    pub result: GpuResult,
}

/// Where a DMA thread's time handing jobs to the GPU went: nanoseconds summed over its jobs.
/// `total_ns` less the waits and the three planning steps is the CUDA calls that enqueue the
/// jobs; against the jobs' copy time, whether the host side keeps up.
#[derive(Default, Debug)]
pub struct SubmitCounters {
    /// Planning each job, enqueueing its copies and starting a save's checksums, waits
    /// included. Against the thread's busy time, the host side of the pipeline.
    pub total_ns: AtomicU64,
    /// Of `total_ns`, the thread's own CPU time (its thread CPU clock). CUDA spins while the
    /// thread waits, so this includes `wait_ns`.
    pub cpu_ns: AtomicU64,
    /// Waiting for earlier jobs to free a staging half, a descriptor table or a checksum slot:
    /// the thread running ahead of the GPU.
    pub wait_ns: AtomicU64,
    /// The chunks' pieces (`chunk_pieces`).
    pub pieces_ns: AtomicU64,
    /// Staged batches with their descriptor tables (`plan::next_batch_into`).
    pub stage_ns: AtomicU64,
    /// A save's checksum tables (`checksum::write_tables`).
    pub tables_ns: AtomicU64,
}

/// Pins the calling thread to `core`; a refusal is logged and the thread runs unpinned.
fn pin_to(core: usize) {
    let mut set = nix::sched::CpuSet::new();
    let pinned = set
        .set(core)
        .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
    match pinned {
        Ok(()) => tracing::debug!(core, "GPU DMA thread pinned"),
        Err(e) => tracing::warn!(core, error = %e, "GPU DMA thread not pinned; it runs unpinned"),
    }
}

/// Counters for `ctl stats`.
#[derive(Default, Debug)]
pub struct GpuCounters {
    /// Save jobs completed.
    pub saves: AtomicU64,
    /// Load jobs completed.
    pub loads: AtomicU64,
    /// Bytes saved.
    pub saved_bytes: AtomicU64,
    /// Bytes loaded.
    pub loaded_bytes: AtomicU64,
    /// Host-side copies of the completed save jobs: per job, how far its chunks' arena slots
    /// were from adjacent (each run under a megabyte costs the copy engine a little).
    pub save_host_runs: AtomicU64,
    /// The same for loads.
    pub load_host_runs: AtomicU64,
    /// Jobs that failed in CUDA.
    pub failed_jobs: AtomicU64,
    /// Save jobs on the device now (started, not yet answered), as the save thread last saw.
    pub save_in_flight: AtomicU64,
    /// The same for loads.
    pub load_in_flight: AtomicU64,
    /// DMA threads stopped by a panic (their copies fail until the server restarts).
    pub threads_lost: AtomicU64,
    /// Nanoseconds during which the save thread had at least one job on the GPU (from a
    /// job's submission until its completion, checksums included, is noticed: within about
    /// 10 us): a save's bytes over this, against its request-to-answer rate, shows what the
    /// shards and the protocol around the copies cost.
    pub save_busy_ns: AtomicU64,
    /// The same for the load thread.
    pub load_busy_ns: AtomicU64,
    /// Where the save thread's time handing jobs to the GPU went.
    pub save_submit: SubmitCounters,
    /// The same for the load thread (no checksums).
    pub load_submit: SubmitCounters,
    /// Nanoseconds, summed over save jobs, from their copy landing to their GPU checksums
    /// being ready (as the thread polls, within about 10 us): what the checksums add to a
    /// job's completion.
    pub save_checksum_wait_ns: AtomicU64,
    /// Save requests that queued at least one job (the requests the two below describe).
    pub save_requests: AtomicU64,
    /// Nanoseconds, summed over those requests, from the request's start on its shard to its
    /// first job being handed to the DMA thread (the first job's reservations).
    pub save_lead_ns: AtomicU64,
    /// Nanoseconds, summed, from the request's last copy completing to its answer (the last
    /// job's commit).
    pub save_tail_ns: AtomicU64,
    /// The same three for loads (lead: the first job's lookups; tail: the last releases).
    pub load_requests: AtomicU64,
    /// See `save_lead_ns`.
    pub load_lead_ns: AtomicU64,
    /// See `save_tail_ns`.
    pub load_tail_ns: AtomicU64,
    /// Jobs the save thread took with nothing of its own on the GPU (the first of each busy
    /// period), and nanoseconds summed over them from their queueing to their being taken:
    /// how long an idle DMA thread took to wake for new work.
    pub save_pickups: AtomicU64,
    /// See `save_pickups`.
    pub save_pickup_ns: AtomicU64,
    /// The same two for the load thread.
    pub load_pickups: AtomicU64,
    /// See `save_pickups`.
    pub load_pickup_ns: AtomicU64,
    /// With `--gpu-timeline`: the save thread's staged batches, timed on the GPU.
    pub save_timeline: TimelineCounters,
    /// The same for loads.
    pub load_timeline: TimelineCounters,
}

/// Most staged batches `--gpu-timeline` times per busy period of a DMA thread (8 GiB at 32 MiB
/// per batch): their events are kept until the period ends.
const TIMELINE_BATCHES: usize = 256;

/// Sums of [`SpanTotals`] over the busy periods of one DMA thread (`--gpu-timeline`), in
/// nanoseconds.
#[derive(Debug, Default)]
pub struct TimelineCounters {
    /// Busy periods timed: a DMA thread that waits longer than its idle spin (200 us) for its next
    /// job starts a new one, so more than one per request means the GPU ran out of work in
    /// the middle of it.
    pub periods: AtomicU64,
    /// Staged batches timed.
    pub batches: AtomicU64,
    /// Their bytes.
    pub bytes: AtomicU64,
    /// GPU time from each busy period's first batch to its last copy or kernel.
    pub span_ns: AtomicU64,
    /// Of that, before the first copy started (a save's first gather).
    pub lead_ns: AtomicU64,
    /// And after the last copy ended (a load's last scatter).
    pub tail_ns: AtomicU64,
    /// Host-side copies running.
    pub copy_busy_ns: AtomicU64,
    /// The copy stream idle between consecutive copies within a busy period.
    pub copy_gaps_ns: AtomicU64,
    /// Gather or scatter kernels running.
    pub kernel_busy_ns: AtomicU64,
}

impl TimelineCounters {
    /// Adds one busy period's totals.
    pub fn add(&self, t: &SpanTotals) {
        let ns = |us: f64| (us * 1e3).round().clamp(0.0, u64::MAX as f64) as u64;
        for (c, v) in [
            (&self.periods, 1),
            (&self.batches, t.batches),
            (&self.bytes, t.bytes),
            (&self.span_ns, ns(t.span_us)),
            (&self.lead_ns, ns(t.first_copy_start_us)),
            (&self.tail_ns, ns(t.after_last_copy_us)),
            (&self.copy_busy_ns, ns(t.copy_busy_us)),
            (&self.copy_gaps_ns, ns(t.copy_gaps_us)),
            (&self.kernel_busy_ns, ns(t.kernel_busy_us)),
        ] {
            c.fetch_add(v, Ordering::Relaxed);
        }
    }

    /// The sums as `stats` shows them (seconds, and the copies' own GB/s).
    pub fn json(&self) -> serde_json::Value {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = |a: &AtomicU64| n(a) as f64 / 1e9;
        let busy = s(&self.copy_busy_ns);
        serde_json::json!({
            "periods": n(&self.periods),
            "batches": n(&self.batches),
            "bytes": n(&self.bytes),
            "span_s": s(&self.span_ns),
            "lead_s": s(&self.lead_ns),
            "tail_s": s(&self.tail_ns),
            "copy_busy_s": busy,
            "copy_gaps_s": s(&self.copy_gaps_ns),
            "kernel_busy_s": s(&self.kernel_busy_ns),
            "copy_gbps": if busy > 0.0 { n(&self.bytes) as f64 / busy / 1e9 } else { 0.0 },
        })
    }
}

/// When a save or load request reached its milestones on its shard: its start, its first job
/// handed to the DMA thread, its last copy completed. Added to [`GpuCounters`] once it is
/// answered, so that `stats` shows what a request costs around its copies.
#[derive(Debug)]
pub(crate) struct RequestPhases {
    start: Instant,
    first_submit: std::cell::Cell<Option<Instant>>,
    last_done: std::cell::Cell<Option<Instant>>,
}

impl RequestPhases {
    /// A request starting at `start`.
    pub(crate) fn new(start: Instant) -> Self {
        Self { start, first_submit: Default::default(), last_done: Default::default() }
    }

    /// A job is handed to the DMA thread at `at`.
    pub(crate) fn submitted(&self, at: Instant) {
        let first = self.first_submit.get().map_or(at, |f| f.min(at));
        self.first_submit.set(Some(first));
    }

    /// A job's copy completed at `at`.
    pub(crate) fn copied(&self, at: Instant) {
        let last = self.last_done.get().map_or(at, |l| l.max(at));
        self.last_done.set(Some(last));
    }

    /// The request is answered at `end`: adds its lead and tail to `counters` (nothing when
    /// no job was queued).
    pub(crate) fn finish(&self, counters: &GpuCounters, direction: Direction, end: Instant) {
        let (Some(first), Some(last)) = (self.first_submit.get(), self.last_done.get()) else {
            return;
        };
        let (requests, lead, tail) = match direction {
            Direction::Save => {
                (&counters.save_requests, &counters.save_lead_ns, &counters.save_tail_ns)
            }
            Direction::Load => {
                (&counters.load_requests, &counters.load_lead_ns, &counters.load_tail_ns)
            }
        };
        requests.fetch_add(1, Ordering::Relaxed);
        lead.fetch_add(nanos(first.saturating_duration_since(self.start)), Ordering::Relaxed);
        tail.fetch_add(nanos(end.saturating_duration_since(last)), Ordering::Relaxed);
    }
}

/// One DMA thread (one direction of one device), with a ring to and from each shard: every
/// ring has one producer and one consumer.
struct Worker {
    /// Jobs from each shard.
    queues: Vec<ArrayQueue<GpuJob>>,
    /// Completions to each shard.
    done: Vec<ArrayQueue<GpuDone>>,
    thread: OnceLock<std::thread::Thread>,
    /// Set by [`GpuService::expect`]: a job is on its way.
    expected: AtomicBool,
}

/// Registrations and the DMA thread pairs.
pub struct GpuService {
    devices: Vec<DeviceInfo>,
    contexts: Vec<Arc<CudaContext>>,
    /// The arena's registration with CUDA: chunks' offsets are from its start.
    host: Arc<HostRegistration>,
    registry: Mutex<Registry<Arc<EngineMemory>>>,
    limits: GpuLimits,
    /// Device `d`'s save thread at `2 * d`, its load thread at `2 * d + 1` (see [`worker_of`]).
    workers: Vec<Worker>,
    stop: AtomicBool,
    /// A GPU checksum failed its check on a shard: saves' checksums stay on the shards until
    /// the server restarts.
    checksums_distrusted: AtomicBool,
    handles: Mutex<Vec<JoinHandle<()>>>,
    /// Counters.
    pub counters: GpuCounters,
}

impl std::fmt::Debug for GpuService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuService").field("devices", &self.devices).finish_non_exhaustive()
    }
}

/// Index of device `device`'s thread for `direction` in `GpuService::workers`.
fn worker_of(device: usize, direction: Direction) -> usize {
    2 * device
        + match direction {
            Direction::Save => 0,
            Direction::Load => 1,
        }
}

impl GpuService {
    /// Opens a context on every device; threads start with [`GpuService::start`].
    pub fn new(
        devices: Vec<DeviceInfo>,
        host: Arc<HostRegistration>,
        shards: usize,
        limits: GpuLimits,
    ) -> Result<Arc<Self>, orbitkv_gpu::GpuError> {
        let contexts = devices
            .iter()
            .map(|d| {
                CudaContext::new(d.ordinal as usize).map_err(|e| {
                    orbitkv_gpu::GpuError::Cuda(format!("context on {} ({}): {e}", d.name, d.uuid))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A completion ring holds as many as the job ring; a worker keeps what does not fit.
        let worker = || Worker {
            queues: (0..shards).map(|_| ArrayQueue::new(limits.queue_depth)).collect(),
            done: (0..shards).map(|_| ArrayQueue::new(limits.queue_depth)).collect(),
            thread: OnceLock::new(),
            expected: AtomicBool::new(false),
        };
        let workers: Vec<Worker> = (0..2 * contexts.len()).map(|_| worker()).collect();
        Ok(Arc::new(Self {
            devices,
            contexts,
            host,
            registry: Mutex::new(Registry::new(limits.max_registrations)),
            limits,
            workers,
            stop: AtomicBool::new(false),
            checksums_distrusted: AtomicBool::new(false),
            handles: Mutex::new(Vec::new()),
            counters: GpuCounters::default(),
        }))
    }

    /// Starts `gpu-d2h-D` and `gpu-h2d-D` for every device D. Their copy engines are created on
    /// the threads. One pair per device: a thread submitting to two devices' engines waits for
    /// one device's staging buffer while the other has nothing queued (two ranks saving 2 KiB
    /// pages through one pair reached 0.53 of the two links together).
    ///
    /// `cores`: a core for each thread (device 0's save thread, its load thread, then device
    /// 1's, ...), which it pins itself to; a thread without one runs unpinned.
    pub fn start(
        self: &Arc<Self>,
        doorbells: Arc<Doorbells>,
        cores: &[usize],
    ) -> Result<(), crate::error::StartError> {
        for device in 0..self.devices.len() {
            for (name, direction) in [("gpu-d2h", Direction::Save), ("gpu-h2d", Direction::Load)] {
                let i = worker_of(device, direction);
                let name = format!("{name}-{device}");
                let svc = Arc::clone(self);
                let bells = Arc::clone(&doorbells);
                let core = cores.get(i).copied();
                let handle = std::thread::Builder::new()
                    .name(name.clone())
                    .spawn(move || {
                        if let Some(core) = core {
                            pin_to(core);
                        }
                        let w = &svc.workers[i];
                        let lanes = Lanes {
                            queues: &w.queues,
                            done: &w.done,
                            expected: &w.expected,
                            stop: &svc.stop,
                            doorbells: &bells,
                            counters: &svc.counters,
                            direction,
                        };
                        worker::run(&lanes, || CudaDevice::new(&svc, direction))
                    })
                    .map_err(crate::error::StartError::thread(name))?;
                let _ = self.workers[i].thread.set(handle.thread().clone());
                self.handles.lock().expect("never poisoned").push(handle);
            }
        }
        Ok(())
    }

    /// Stops every DMA thread after its jobs in flight have completed.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for w in &self.workers {
            if let Some(t) = w.thread.get() {
                t.unpark();
            }
        }
        for h in self.handles.lock().expect("never poisoned").drain(..) {
            let _ = h.join();
        }
    }

    /// How copies cross the bus (`--gpu-copy`).
    pub fn copy_strategy(&self) -> Strategy {
        self.limits.copy
    }

    /// The staging per DMA thread and device, and its parts (`--gpu-staging`, its depth).
    pub fn staging(&self) -> (usize, usize) {
        (self.limits.staging_bytes, self.limits.staging_depth)
    }

    /// Whether staged batches are timed (`--gpu-timeline`).
    pub fn timeline(&self) -> bool {
        self.limits.timeline
    }

    /// Where saves' checksums are computed (`Cpu` after a GPU checksum failed its check).
    pub fn checksum_place(&self) -> ChecksumPlace {
        if self.checksums_distrusted.load(Ordering::Relaxed) {
            ChecksumPlace::Cpu
        } else {
            self.limits.checksums
        }
    }

    /// Whether a GPU checksum failed its check (saves' checksums are then the shards').
    pub fn checksums_distrusted(&self) -> bool {
        self.checksums_distrusted.load(Ordering::Relaxed)
    }

    /// DMA threads stopped by a panic.
    pub fn threads_lost(&self) -> u64 {
        self.counters.threads_lost.load(Ordering::Relaxed)
    }

    /// A GPU checksum differed from the bytes that landed: from now on the shards compute
    /// every save's checksums (until restart). Logged once.
    pub fn distrust_checksums(&self) {
        if !self.checksums_distrusted.swap(true, Ordering::Relaxed) {
            tracing::error!(
                "a checksum computed on the GPU did not match the saved bytes: saves' checksums \
                 are computed on the shards from now on (see gpu_checksum_mismatches in stats)"
            );
        }
    }

    /// The devices.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// Registrations open now.
    pub fn registrations(&self) -> usize {
        self.registry.lock().expect("never poisoned").len()
    }

    /// Imports an engine rank's tensors. Errors name the field.
    pub fn register(
        &self,
        session: SessionId,
        device_uuid: &str,
        spec: &KvLayoutSpec,
        tensors: &[GpuTensor],
    ) -> Result<(u64, u64), (ErrorCode, String)> {
        let device = self.devices.iter().position(|d| d.uuid == device_uuid).ok_or_else(|| {
            let have: Vec<&str> = self.devices.iter().map(|d| d.uuid.as_str()).collect();
            (
                ErrorCode::Unavailable,
                format!(
                    "device_uuid: {device_uuid:?} is not a device of this server ({})",
                    have.join(", ")
                ),
            )
        })?;
        let exports: Vec<TensorExport> = tensors
            .iter()
            .map(|t| TensorExport { handle: t.handle, offset: t.offset, len: t.len })
            .collect();
        // Opening IPC handles takes the driver a moment; registration is rare (engine start).
        let memory = EngineMemory::import(&self.contexts[device], *spec, &exports)
            .map_err(|e| (ErrorCode::InvalidArgument, e.to_string()))?;
        self.registry.lock().expect("never poisoned").insert(session, device, Arc::new(memory))
    }

    /// The registration `(id, generation)` of `session`: its device and memory.
    pub fn lookup(
        &self,
        session: SessionId,
        id: u64,
        generation: u64,
    ) -> Result<(usize, Arc<EngineMemory>), (ErrorCode, String)> {
        self.registry.lock().expect("never poisoned").get(session, id, generation)
    }

    /// Removes a registration; returns its memory so that the caller can wait until no copy
    /// uses it any more (the mapping closes when the last holder drops it).
    pub fn unregister(
        &self,
        session: SessionId,
        id: u64,
        generation: u64,
    ) -> Result<Arc<EngineMemory>, (ErrorCode, String)> {
        self.registry.lock().expect("never poisoned").remove(session, id, generation)
    }

    /// Removes every registration of a closed session (copies in flight keep their memory
    /// until they complete).
    pub fn drop_session(&self, session: SessionId) -> usize {
        let gone = self.registry.lock().expect("never poisoned").remove_session(session);
        let n = gone.len();
        off_shard(move || drop(gone));
        n
    }

    /// Queues a job on the thread for its device and `direction`; gives it back when the queue
    /// is full.
    pub fn submit(&self, direction: Direction, job: GpuJob) -> Result<(), GpuJob> {
        // `job.device` comes from a registration, which exists only for the opened devices.
        let w = &self.workers[worker_of(job.device, direction)];
        let shard = job.shard;
        w.queues[shard].push(job)?;
        if let Some(t) = w.thread.get() {
            t.unpark();
        }
        Ok(())
    }

    /// Tells the DMA thread of `device` and `direction` that a job is coming (a request has
    /// started on a shard): an idle thread wakes now and spins for it, so that its wake-up
    /// (tens to hundreds of microseconds on a VM) overlaps the request's reservations or
    /// lookups instead of following them.
    pub fn expect(&self, direction: Direction, device: usize) {
        let Some(w) = self.workers.get(worker_of(device, direction)) else { return };
        w.expected.store(true, Ordering::Release);
        if let Some(t) = w.thread.get() {
            t.unpark();
        }
    }

    /// Jobs waiting in the shards' queues for the threads of `direction`.
    pub fn queued(&self, direction: Direction) -> usize {
        (0..self.devices.len())
            .map(|d| {
                self.workers[worker_of(d, direction)]
                    .queues
                    .iter()
                    .map(ArrayQueue::len)
                    .sum::<usize>()
            })
            .sum()
    }

    /// Takes one completion for `shard`, from the first DMA thread with one.
    pub fn completion(&self, shard: usize) -> Option<GpuDone> {
        self.workers.iter().find_map(|w| w.done[shard].pop())
    }

    /// Whether completions wait for `shard`.
    pub fn has_completions(&self, shard: usize) -> bool {
        self.workers.iter().any(|w| !w.done[shard].is_empty())
    }
}

/// The GPU side of one DMA thread: its direction's copy engine and (for saves) checksum
/// kernels on every device, each made at its device's first job. Dropped on the thread
/// before the jobs it started (`worker::run`): the engines wait for their streams, so the
/// jobs' memory may go after.
struct CudaDevice<'s> {
    svc: &'s GpuService,
    direction: Direction,
    /// Per device: not tried yet (None), or the checksum kernels (None inside when they did
    /// not load: checksums then stay on the shards). Declared before the engines so that they
    /// outlive them: the engines drop first, waiting for their streams, where a fused gather
    /// may still write a checksum slot's scratch rows.
    hashers: Vec<Option<Option<ChunkHasher>>>,
    engines: Vec<Option<CopyEngine>>,
    /// Pieces planned for a job, reused.
    pieces: Vec<orbitkv_gpu::dma::plan::Piece>,
}

impl<'s> CudaDevice<'s> {
    fn new(svc: &'s GpuService, direction: Direction) -> Self {
        let n = svc.devices.len();
        Self {
            svc,
            direction,
            hashers: (0..n).map(|_| None).collect(),
            engines: (0..n).map(|_| None).collect(),
            pieces: Vec::new(),
        }
    }

    /// `--gpu-checksums fused`: queues the fold of every in-flight save whose gathers this
    /// thread has seen finish; with `room_on`, also of the unfolded save holding the checksum
    /// slot that device's hasher hands out next, waiting for its gathers (a save begun there
    /// next takes that slot). True when it queued any.
    fn fold_seen(
        &mut self,
        inflight: &mut VecDeque<Running<Transfer>>,
        room_on: Option<usize>,
    ) -> bool {
        let mut queued = false;
        for job in inflight.iter_mut() {
            // A hasher exists where a save is unfolded; none is made here.
            let Some(Some(Some(hasher))) = self.hashers.get_mut(job.device).map(Option::as_mut)
            else {
                continue;
            };
            let Some(slot) = job.job.held_slot(hasher) else { continue };
            let wait = room_on == Some(job.device) && slot == hasher.next_slot();
            match job.job.fold(hasher, wait) {
                Ok(q) => queued |= q,
                Err(e) => tracing::error!(error = %e, "fused GPU checksums: fold refused"),
            }
        }
        queued
    }

    /// The checksum kernels of `device` in `hashers`, loaded at the first use (None when they
    /// did not load: logged once, and the shards compute saves' checksums).
    fn hasher<'h>(
        hashers: &'h mut [Option<Option<ChunkHasher>>],
        svc: &GpuService,
        device: usize,
    ) -> Option<&'h mut ChunkHasher> {
        hashers[device]
            .get_or_insert_with(|| match ChunkHasher::new(&svc.contexts[device]) {
                Ok(h) => Some(h),
                Err(e) => {
                    tracing::warn!(device = %svc.devices[device].uuid, error = %e,
                        "GPU checksum kernels not loaded: saves' checksums are computed on the shards");
                    None
                }
            })
            .as_mut()
    }

    /// The copy engine of `device`, made at its first job.
    fn copy_engine(&self, device: usize) -> Result<CopyEngine, JobError> {
        let limits = &self.svc.limits;
        let e = CopyEngine::new(
            &self.svc.contexts[device],
            limits.staging_bytes,
            limits.staging_depth,
            BATCHED_FROM,
        )
        .map_err(JobError::Engine)?;
        if let (Strategy::Staged, Some(why)) = (limits.copy, e.kernel_error()) {
            // The operator asked for the kernel explicitly: say so once, loudly; every job it
            // would copy then fails naming the reason (`auto` would copy batched instead).
            // Block-form jobs need only the block kernel.
            tracing::error!(
                device,
                error = why,
                "--gpu-copy {}, but the segment copy kernel did not load: GPU saves and loads \
                 that need it fail; use --gpu-copy auto or batched",
                limits.copy.as_str()
            );
        }
        Ok(e)
    }
}

impl Device for CudaDevice<'_> {
    type Memory = Arc<EngineMemory>;
    type Job = Transfer;

    /// Checks and hands a job to the GPU, with a save's checksums as `--gpu-checksums` says.
    fn start(
        &mut self,
        job: &GpuJob,
        inflight: &mut VecDeque<Running<Transfer>>,
    ) -> Result<Transfer, JobError> {
        let direction = self.direction;
        let place = self.svc.checksum_place();
        if direction == Direction::Save && place == ChecksumPlace::Fused {
            // A save begun next takes its device's next checksum slot: free it.
            self.fold_seen(inflight, Some(job.device));
        }
        if self.engines[job.device].is_none() {
            self.engines[job.device] = Some(self.copy_engine(job.device)?);
        }
        let hasher = match direction {
            Direction::Save if place != ChecksumPlace::Cpu => {
                Self::hasher(&mut self.hashers, self.svc, job.device)
            }
            _ => None,
        };
        let sums = match (place, hasher) {
            (_, None) => SaveSums::Off,
            (ChecksumPlace::Fused, Some(h)) => SaveSums::Fused(h),
            (_, Some(h)) => SaveSums::Kernels(h),
        };
        let engine = self.engines[job.device].as_mut().expect("made above");
        // Timed from the first job of a busy period (`idle` ends it), up to TIMELINE_BATCHES
        // batches of it.
        if self.svc.limits.timeline && !engine.recording_timeline() {
            engine.record_timeline_batches(TIMELINE_BATCHES);
        }
        let copy = CopyJob {
            direction,
            memory: &job.memory,
            host: &self.svc.host,
            chunks: &job.chunks,
            chunk_len: job.chunk_len,
        };
        engine.start(&copy, self.svc.limits.copy, sums, &mut self.pieces).map_err(JobError::Start)
    }

    fn progress(&mut self, job: &Transfer) -> Result<Progress, JobError> {
        job.progress().map_err(JobError::Copy)
    }

    /// Checksums that failed on the GPU come back as None: the shards compute them.
    fn finish(&mut self, job: Transfer) -> GpuResult {
        job.finish().map_err(JobError::Copy)
    }

    fn host_runs(&self, job: &Transfer) -> u64 {
        job.shape().host_runs as u64
    }

    fn advance(&mut self, inflight: &mut VecDeque<Running<Transfer>>) -> bool {
        self.fold_seen(inflight, None)
    }

    fn take_times(&mut self) -> StartTimes {
        let zero = SubmitTimes::default();
        let copies = self.engines.iter_mut().flatten().fold(zero, |t, e| t + e.take_times());
        let sums =
            self.hashers.iter_mut().flatten().flatten().fold(zero, |t, h| t + h.take_times());
        StartTimes {
            waited: copies.waited + sums.waited,
            pieces: copies.pieces,
            staged: copies.planned,
            tables: sums.planned,
        }
    }

    /// `--gpu-timeline`, at the end of a busy period (nothing in flight, so nothing to wait
    /// for): adds each engine's timed batches since the period began to the counters.
    fn idle(&mut self) {
        if !self.svc.limits.timeline {
            return;
        }
        let counters = match self.direction {
            Direction::Save => &self.svc.counters.save_timeline,
            Direction::Load => &self.svc.counters.load_timeline,
        };
        for engine in self.engines.iter_mut().flatten().filter(|e| e.recording_timeline()) {
            match engine.take_timeline() {
                Ok(spans) => counters.add(&SpanTotals::of(&spans)),
                Err(e) => {
                    tracing::warn!(error = %e, "--gpu-timeline: reading the timing events failed")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn checksum_places_parse_as_they_are_spelled() {
        let parse = |s: &str| <ChecksumPlace as clap::ValueEnum>::from_str(s, false).ok();
        for p in
            [ChecksumPlace::Gpu, ChecksumPlace::Verify, ChecksumPlace::Cpu, ChecksumPlace::Fused]
        {
            assert_eq!(parse(p.as_str()), Some(p));
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
        assert_eq!(parse("GPU"), None);
        assert_eq!(parse("tables"), None, "an experiment that lost");
        assert_eq!(parse("rows"), None, "the block row sums are `gpu` now");
        assert_eq!(parse(""), None);
    }

    #[test]
    fn timeline_counters_sum_busy_periods_and_show_seconds() {
        let c = TimelineCounters::default();
        let period = SpanTotals {
            batches: 2,
            bytes: 64 << 20,
            span_us: 1300.0,
            first_copy_start_us: 40.0,
            after_last_copy_us: 7.0,
            copy_busy_us: 1200.0,
            copy_gaps_us: 2.5,
            copy_gap_max_us: 2.0,
            kernel_busy_us: 60.0,
            kernel_max_us: 31.0,
        };
        c.add(&period);
        c.add(&period);
        let j = c.json();
        assert_eq!(j["periods"], 2);
        assert_eq!(j["batches"], 4);
        assert_eq!(j["bytes"], 128u64 << 20);
        let close = |k: &str, want: f64| {
            let got = j[k].as_f64().unwrap();
            assert!((got - want).abs() < 1e-12, "{k}: {got} != {want}");
        };
        close("span_s", 2.6e-3);
        close("lead_s", 8e-5);
        close("tail_s", 1.4e-5);
        close("copy_busy_s", 2.4e-3);
        close("copy_gaps_s", 5e-6);
        close("kernel_busy_s", 1.2e-4);
        close("copy_gbps", (128u64 << 20) as f64 / 2.4e-3 / 1e9);
        // Nothing timed yet: no rate rather than a division by zero.
        assert_eq!(TimelineCounters::default().json()["copy_gbps"], 0.0);
    }

    #[test]
    fn a_request_adds_its_lead_and_tail_once_answered() {
        let c = GpuCounters::default();
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        let p = RequestPhases::new(t0);
        // Jobs handed over at 30 and 10 us (tasks may run in any order), completed at 500,
        // 900 and 700 us; answered at 1000 us.
        p.submitted(at(30));
        p.submitted(at(10));
        p.copied(at(500));
        p.copied(at(900));
        p.copied(at(700));
        p.finish(&c, Direction::Save, at(1000));
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(n(&c.save_requests), 1);
        assert_eq!(n(&c.save_lead_ns), 10_000, "to the first hand-over");
        assert_eq!(n(&c.save_tail_ns), 100_000, "from the last completion");
        assert_eq!((n(&c.load_requests), n(&c.load_lead_ns), n(&c.load_tail_ns)), (0, 0, 0));

        // A load whose chunks were all missing queued nothing: not counted.
        RequestPhases::new(t0).finish(&c, Direction::Load, at(50));
        assert_eq!(n(&c.load_requests), 0);
        let p = RequestPhases::new(t0);
        p.submitted(at(5));
        p.copied(at(60));
        p.finish(&c, Direction::Load, at(80));
        assert_eq!(
            (n(&c.load_requests), n(&c.load_lead_ns), n(&c.load_tail_ns)),
            (1, 5_000, 20_000)
        );
    }
}
