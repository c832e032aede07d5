//! The loop of one DMA thread (`gpu-d2h-D` or `gpu-h2d-D`), apart from the GPU it drives:
//! it takes jobs from the shards' queues in turn, starts them on its [`Device`], answers them
//! in order as they finish, keeps the counters, sleeps when idle, and after a panic fails
//! every job it held or is given. Unit-tested with a fake device.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use orbitkv_gpu::dma::{Direction, Progress};

use super::{GpuCounters, GpuDone, GpuJob, GpuResult, JobError};
use crate::shard::doorbell::Doorbells;

/// What a DMA thread drives: the copy engines and checksum kernels of its direction on every
/// device (`super::CudaDevice`), or a fake in tests.
pub(crate) trait Device {
    /// What keeps a job's engine memory alive (cloned while a job is being started).
    type Memory: Clone;
    /// A job on the device, which owns what the device may still touch.
    type Job;

    /// Starts `job` (a save with its checksums as the server's `--gpu-checksums` says);
    /// `inflight` are the thread's jobs still running, oldest first (a save may need one of
    /// theirs to give back a checksum slot first).
    fn start(
        &mut self,
        job: &GpuJob<Self::Memory>,
        inflight: &mut VecDeque<Running<Self::Job>>,
    ) -> Result<Self::Job, JobError>;

    /// Where a started job stands; an error when it failed.
    fn progress(&mut self, job: &Self::Job) -> Result<Progress, JobError>;

    /// A finished job's outcome: a save's checksums when the device computed them.
    fn finish(&mut self, job: Self::Job) -> GpuResult;

    /// Host-side copies of a started job.
    fn host_runs(&self, job: &Self::Job) -> u64;

    /// Moves jobs on that wait for the thread rather than the device (a fused save's fold
    /// once its gathers are seen done); true when it did anything.
    fn advance(&mut self, inflight: &mut VecDeque<Running<Self::Job>>) -> bool;

    /// Where the thread's time starting jobs went since the last call.
    fn take_times(&mut self) -> StartTimes;

    /// A busy period ended (nothing in flight, nothing queued).
    fn idle(&mut self);
}

/// Where a DMA thread's time starting jobs went (see `super::SubmitCounters`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StartTimes {
    /// Blocked on earlier work (a staging part, a checksum slot).
    pub waited: Duration,
    /// Finding the jobs' pieces, or checking their block ids.
    pub pieces: Duration,
    /// Planning staged batches.
    pub staged: Duration,
    /// Writing checksum tables.
    pub tables: Duration,
}

/// A job on the device.
pub(crate) struct Running<J> {
    pub shard: usize,
    pub id: u64,
    /// Its device (whose checksum kernels a fused save's fold goes to).
    pub device: usize,
    pub bytes: u64,
    /// Host-side copies its bytes went in.
    pub host_runs: u64,
    /// When the copy was first seen landed while its checksums were still running.
    pub copied_at: Option<Instant>,
    pub job: J,
}

/// A job taken off its queue, not yet started: failed by the panic handler if a panic comes
/// before it is in flight (or failed).
struct Starting<M> {
    shard: usize,
    id: u64,
    /// Held until the handler runs, after the device dropped (and waited) as the panic unwound.
    _memory: M,
}

/// What a DMA thread holds across a panic of its loop: its jobs in flight (oldest first), the
/// answers its shards' rings had no room for, and the job being started.
struct Held<J, M> {
    inflight: VecDeque<Running<J>>,
    undelivered: VecDeque<(usize, GpuDone)>,
    starting: Option<Starting<M>>,
}

/// What a DMA thread shares with the shards and the service.
pub(crate) struct Lanes<'a, M> {
    /// Its job queue from each shard.
    pub queues: &'a [ArrayQueue<GpuJob<M>>],
    /// Its completion ring to each shard.
    pub done: &'a [ArrayQueue<GpuDone>],
    /// Set by a shard that has started a request which will bring a job.
    pub expected: &'a AtomicBool,
    /// Set when the server stops.
    pub stop: &'a AtomicBool,
    pub doorbells: &'a Doorbells,
    pub counters: &'a GpuCounters,
    pub direction: Direction,
}

/// How long a DMA thread with nothing to do spins before it sleeps. For `--gpu-timeline`, a
/// busy period ends there: waits shorter than this for the next job count as copy-stream gaps.
const IDLE_SPIN_US: u64 = 200;

/// How long a DMA thread woken by an announced job spins for it (a request's reservations or
/// lookups on its shards come first: up to a few hundred microseconds). As the shards'
/// default `--spin-window`.
const EXPECT_SPIN: Duration = Duration::from_millis(2);

/// Until when an idle DMA thread spins before it parks: [`IDLE_SPIN_US`] after its last work,
/// or [`EXPECT_SPIN`] after a shard announced a job.
#[derive(Clone, Copy, Debug)]
pub(super) struct SpinUntil(Instant);

impl SpinUntil {
    pub(super) fn new(now: Instant) -> Self {
        Self(now + Duration::from_micros(IDLE_SPIN_US))
    }

    pub(super) fn worked(&mut self, now: Instant) {
        self.0 = self.0.max(now + Duration::from_micros(IDLE_SPIN_US));
    }

    pub(super) fn expected(&mut self, now: Instant) {
        self.0 = self.0.max(now + EXPECT_SPIN);
    }

    pub(super) fn spinning(&self, now: Instant) -> bool {
        now < self.0
    }
}

/// `d` in nanoseconds, saturating.
pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn add_time(counter: &AtomicU64, d: Duration) {
    counter.fetch_add(nanos(d), Ordering::Relaxed);
}

/// Runs a DMA thread until the server stops: the device is made by `device` on this thread
/// (and dropped, waiting for its work, before the jobs it held are failed after a panic).
pub(crate) fn run<D: Device>(lanes: &Lanes<'_, D::Memory>, device: impl FnOnce() -> D) {
    // Owned out here so that it outlives the device (made inside): a device waits for its
    // work when dropped, also when a panic unwinds, and only then may the jobs' memory go.
    let mut held: Held<D::Job, D::Memory> =
        Held { inflight: VecDeque::new(), undelivered: VecDeque::new(), starting: None };
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut device = device();
        work(lanes, &mut device, &mut held);
    }));
    let Held { mut inflight, mut undelivered, mut starting } = held;
    if run.is_ok() {
        return;
    }
    // A bug stopped this thread: fail what it held and everything queued from now on, so
    // that no request (and no closing session) waits forever.
    tracing::error!(direction = ?lanes.direction, "GPU DMA thread panicked; its copies fail from now on");
    let failed = || Err(JobError::ThreadFailed);
    let counters = lanes.counters;
    counters.threads_lost.fetch_add(1, Ordering::Relaxed);
    if let Some(job) = starting.take() {
        counters.failed_jobs.fetch_add(1, Ordering::Relaxed);
        undelivered.push_back((job.shard, GpuDone { id: job.id, result: failed() }));
    }
    for job in inflight.drain(..) {
        counters.failed_jobs.fetch_add(1, Ordering::Relaxed);
        undelivered.push_back((job.shard, GpuDone { id: job.id, result: failed() }));
    }
    loop {
        for q in lanes.queues {
            while let Some(job) = q.pop() {
                counters.failed_jobs.fetch_add(1, Ordering::Relaxed);
                undelivered.push_back((job.shard, GpuDone { id: job.id, result: failed() }));
            }
        }
        deliver(lanes, &mut undelivered);
        if lanes.stop.load(Ordering::SeqCst) && undelivered.is_empty() {
            return;
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

/// The thread's loop (see the module doc).
fn work<D: Device>(
    lanes: &Lanes<'_, D::Memory>,
    device: &mut D,
    held: &mut Held<D::Job, D::Memory>,
) {
    let mut next_queue = 0;
    let mut spin = SpinUntil::new(Instant::now());
    // Since when at least one job has been on the device (None while none is).
    let mut busy_since: Option<Instant> = None;
    let (busy_ns, in_flight) = match lanes.direction {
        Direction::Save => (&lanes.counters.save_busy_ns, &lanes.counters.save_in_flight),
        Direction::Load => (&lanes.counters.load_busy_ns, &lanes.counters.load_in_flight),
    };
    // Sleeps (between looks at the copies in flight) as asked, not 50 us longer: the default
    // timer slack would delay each request's last completion by that much.
    set_timer_slack_ns(1_000);
    loop {
        if lanes.expected.load(Ordering::Relaxed) && lanes.expected.swap(false, Ordering::Acquire) {
            spin.expected(Instant::now());
        }
        let mut progressed = deliver(lanes, &mut held.undelivered);
        let queues = lanes.queues;
        let first = next_queue;
        for k in 0..queues.len() {
            let q = (first + k) % queues.len();
            let Some(job) = queues[q].pop() else { continue };
            progressed = true;
            next_queue = q + 1;
            start(lanes, device, &job, held, &mut busy_since);
        }
        let Held { inflight, undelivered, .. } = held;
        progressed |= device.advance(inflight);
        progressed |= complete(lanes, device, inflight, undelivered);
        if progressed {
            in_flight.store(inflight.len() as u64, Ordering::Relaxed);
        }
        // Busy time is added as it passes (the counter moves under sustained load too); an
        // interval ends once no job is in flight.
        if let Some(t) = busy_since {
            let now = Instant::now();
            busy_ns.fetch_add(nanos(now.duration_since(t)), Ordering::Relaxed);
            busy_since = (!inflight.is_empty()).then_some(now);
        }
        progressed |= deliver(lanes, undelivered);
        if progressed {
            spin.worked(Instant::now());
            continue;
        }
        if lanes.stop.load(Ordering::SeqCst) && inflight.is_empty() && undelivered.is_empty() {
            break;
        }
        if !inflight.is_empty() || !undelivered.is_empty() {
            // A copy is running (or a shard's completion ring is full): look again soon
            // (completions are what requests wait for), without burning the core flat out.
            std::thread::sleep(Duration::from_micros(10));
        } else if spin.spinning(Instant::now()) {
            std::hint::spin_loop();
        } else {
            // A busy period ends here, while no job waits. A job arriving meanwhile (a
            // fraction of a millisecond, reading a timeline) waits for it.
            if queues.iter().all(|q| q.is_empty()) {
                device.idle();
            }
            // Shards unpark the thread when they queue a job.
            std::thread::park_timeout(Duration::from_millis(50));
        }
    }
}

/// Starts one job taken off a queue: in flight, or answered with its error.
fn start<D: Device>(
    lanes: &Lanes<'_, D::Memory>,
    device: &mut D,
    job: &GpuJob<D::Memory>,
    held: &mut Held<D::Job, D::Memory>,
    busy_since: &mut Option<Instant>,
) {
    let Held { inflight, undelivered, starting } = held;
    let c = lanes.counters;
    let (sc, pickups, pickup_ns) = match lanes.direction {
        Direction::Save => (&c.save_submit, &c.save_pickups, &c.save_pickup_ns),
        Direction::Load => (&c.load_submit, &c.load_pickups, &c.load_pickup_ns),
    };
    let (shard, id, bytes) = (job.shard, job.id, job.chunk_len * job.chunks.len() as u64);
    let submitted = Instant::now();
    if inflight.is_empty() {
        pickups.fetch_add(1, Ordering::Relaxed);
        add_time(pickup_ns, submitted.saturating_duration_since(job.queued_at));
    }
    let cpu_at_submit = thread_cpu_ns();
    *starting = Some(Starting { shard, id, _memory: job.memory.clone() });
    // Tests: the thread panics with this job taken (`panic`).
    fail::fail_point!("dma-thread-panic");
    let started = device.start(job, inflight);
    *starting = None;
    match started {
        Ok(started) => {
            let host_runs = device.host_runs(&started);
            let device_index = job.device;
            inflight.push_back(Running {
                shard,
                id,
                device: device_index,
                bytes,
                host_runs,
                copied_at: None,
                job: started,
            });
            busy_since.get_or_insert(submitted);
            add_time(&sc.total_ns, submitted.elapsed());
            sc.cpu_ns.fetch_add(thread_cpu_ns().saturating_sub(cpu_at_submit), Ordering::Relaxed);
            let t = device.take_times();
            add_time(&sc.wait_ns, t.waited);
            add_time(&sc.pieces_ns, t.pieces);
            add_time(&sc.stage_ns, t.staged);
            add_time(&sc.tables_ns, t.tables);
        }
        Err(e) => {
            c.failed_jobs.fetch_add(1, Ordering::Relaxed);
            undelivered.push_back((shard, GpuDone { id, result: Err(e) }));
            // A busy period begun for it (a timeline) must not run on into the next one.
            if inflight.is_empty() {
                device.idle();
            }
        }
    }
}

/// Answers the jobs at the front that have finished, in the order they started; true when
/// any was answered.
fn complete<D: Device>(
    lanes: &Lanes<'_, D::Memory>,
    device: &mut D,
    inflight: &mut VecDeque<Running<D::Job>>,
    undelivered: &mut VecDeque<(usize, GpuDone)>,
) -> bool {
    let c = lanes.counters;
    let mut any = false;
    while let Some(front) = inflight.front_mut() {
        let result = match device.progress(&front.job) {
            Ok(Progress::Copying) => break,
            // A save is answered once its checksums are in too.
            Ok(Progress::Summing) => {
                front.copied_at.get_or_insert_with(Instant::now);
                break;
            }
            Ok(Progress::Done) => Ok(()),
            Err(e) => Err(e),
        };
        // Tests: the answer of a finished job comes late (`sleep(MS)`: the thread waits with
        // the job, and its memory, held) or says the copy failed (`return`).
        fail::fail_point!("dma-late-completion");
        // (`fail::eval` reads a locked registry even without the feature: only with it.)
        #[cfg(feature = "failpoints")]
        let result = match fail::eval("dma-job-error", |_| ()) {
            Some(()) => result.and(Err(JobError::Injected("dma-job-error"))),
            None => result,
        };
        let job = inflight.pop_front().expect("the front job");
        // A failed job's device work holds its memory as long as the device may touch it.
        let result = result.and_then(|()| device.finish(job.job));
        match &result {
            Ok(_) => {
                if let Some(t) = job.copied_at {
                    c.save_checksum_wait_ns.fetch_add(nanos(t.elapsed()), Ordering::Relaxed);
                }
                let (n, b, r) = match lanes.direction {
                    Direction::Save => (&c.saves, &c.saved_bytes, &c.save_host_runs),
                    Direction::Load => (&c.loads, &c.loaded_bytes, &c.load_host_runs),
                };
                n.fetch_add(1, Ordering::Relaxed);
                b.fetch_add(job.bytes, Ordering::Relaxed);
                r.fetch_add(job.host_runs, Ordering::Relaxed);
            }
            Err(_) => {
                c.failed_jobs.fetch_add(1, Ordering::Relaxed);
            }
        }
        undelivered.push_back((job.shard, GpuDone { id: job.id, result }));
        any = true;
    }
    any
}

/// Hands completions to their shards' rings, oldest first, ringing each shard; keeps those
/// that do not fit, and every later one of the same shard (a ring that was full may have room
/// again a moment later: a later answer must not overtake the one kept). True when any was
/// delivered.
fn deliver<M>(lanes: &Lanes<'_, M>, undelivered: &mut VecDeque<(usize, GpuDone)>) -> bool {
    let mut any = false;
    let mut kept = VecDeque::new();
    let mut full = vec![false; lanes.done.len()];
    while let Some((shard, done)) = undelivered.pop_front() {
        if full[shard] {
            kept.push_back((shard, done));
            continue;
        }
        match lanes.done[shard].push(done) {
            Ok(()) => {
                any = true;
                lanes.doorbells.ring(shard);
            }
            Err(done) => {
                full[shard] = true;
                kept.push_back((shard, done));
            }
        }
    }
    *undelivered = kept;
    any
}

/// Sets the calling thread's timer slack (how much later than asked the kernel may end its
/// sleeps; 50 us by default); a refusal is logged and the default stays.
pub(super) fn set_timer_slack_ns(ns: u64) {
    if let Err(e) = nix::sys::prctl::set_timerslack(ns) {
        tracing::warn!(error = %e, "GPU DMA thread: timer slack not set; its sleeps may run 50 us long");
    }
}

/// CPU time of the calling thread, nanoseconds (0 if the clock cannot be read: the counters
/// built on it then stay at 0).
pub(super) fn thread_cpu_ns() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(0, |t| {
        (t.tv_sec() as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec() as u64)
    })
}

#[cfg(test)]
mod tests;
