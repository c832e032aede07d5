//! A copy engine on one device: a kernel stream and a copy stream, a staging buffer in equal
//! parts (2-8, see [`CopyEngine::default_depth`]), and the pipelines that move pieces between
//! engine GPU memory and the registered arena.
//!
//! Staged (save): the kernel gathers a batch of pieces into a staging part, then the copy
//! stream moves that part to the arena in host-contiguous runs, while the kernel fills the
//! next parts. Load runs the same pipeline backwards. Batched: `cuMemcpyBatchAsync` straight
//! between engine pages and arena slots (copy engines only, no SM). Every submission ends in
//! an event; until it completes, the caller keeps the engine memory and the arena slots.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::ffi::{
    self, BlockKernel, BlockLaunch, CopyKernel, DeviceBuffer, PinnedHost, ScatterUniformKernel,
    SummedGather, Way,
};
use super::hasher::drv;
use super::hasher::SummedSave;
use super::plan::{
    compact_uniform, next_batch_into, next_blocks_into, BlockCursor, BlockJob, KernelDesc, Piece,
    StageCursor, StagedBatch, BLOCK_UNIT,
};
use super::{wait_for, DmaError, Strategy, SubmitTimes};

/// Threads per block of the segment copy kernel.
const THREADS: u32 = 256;
/// Most thread blocks per launch (the kernel strides over the descriptors).
const MAX_GRID: u32 = 4096;
/// Pieces whose mean length decides `Strategy::Auto`.
const AUTO_SAMPLE: usize = 1024;
/// Most copies per `cuMemcpyBatchAsync` call.
const BATCH_CALL: usize = 4096;

/// Direction of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// GPU pages -> arena (save).
    Save,
    /// Arena -> GPU pages (load).
    Load,
}

/// One part of the staging buffer, with the tables and events of the batch in it.
struct Part {
    staging: DeviceBuffer,
    descs_dev: DeviceBuffer,
    descs_host: PinnedHost,
    /// The staging part is filled (gather done / host data arrived).
    filled: CudaEvent,
    /// The staging part is no longer used (reusable).
    free: CudaEvent,
}

impl Part {
    /// A part of `part_bytes` of staging, with tables for `max_descs` descriptors.
    fn new(ctx: &Arc<CudaContext>, part_bytes: usize, max_descs: usize) -> Result<Self, DmaError> {
        Ok(Part {
            staging: DeviceBuffer::new(ctx, part_bytes)?,
            descs_dev: DeviceBuffer::new(ctx, max_descs * KernelDesc::BYTES)?,
            descs_host: PinnedHost::new(ctx, max_descs * KernelDesc::BYTES)?,
            filled: ctx.new_event(None).map_err(drv("cuEventCreate"))?,
            free: ctx.new_event(None).map_err(drv("cuEventCreate"))?,
        })
    }
}

/// The engine's kernels, each None (with a warning logged) when its PTX did not load.
struct Kernels {
    copy: Option<CopyKernel>,
    /// Why the segment copy kernel did not load.
    copy_error: Option<String>,
    scatter_uniform: Option<ScatterUniformKernel>,
    block: Option<BlockKernel>,
}

impl Kernels {
    /// Loads the segment copy, uniform scatter and block copy kernels, in that order.
    fn load(ctx: &Arc<CudaContext>) -> Self {
        let (copy, copy_error) = match CopyKernel::load(ctx) {
            Ok(k) => (Some(k), None),
            Err(e) => {
                tracing::warn!(error = %e, "segment copy kernel not loaded (driver older than the PTX?): \
                    copies go batched, slower for pages under 1 MiB");
                (None, Some(e.to_string()))
            }
        };
        let scatter_uniform = match ScatterUniformKernel::load(ctx) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(error = %e, "uniform scatter kernel not loaded: loads scatter \
                    with the segment kernel, whose descriptor tables are three times larger");
                None
            }
        };
        let block = match BlockKernel::load(ctx) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(error = %e, "block copy kernel not loaded: staged copies are \
                    planned a descriptor per page, which costs the DMA threads more per job");
                None
            }
        };
        Kernels { copy, copy_error, scatter_uniform, block }
    }
}

/// Where one staged batch spent its time on the GPU (from [`CopyEngine::take_timeline`]):
/// microseconds since the first recorded batch's first operation (its kernel for a save, its
/// copy for a load) was reached on its stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct BatchSpan {
    /// Bytes of the batch.
    pub bytes: u64,
    /// Host-contiguous runs it was copied in.
    pub runs: usize,
    /// The gather (save) or scatter (load) kernel started.
    pub kernel_start_us: f64,
    /// The kernel ended.
    pub kernel_end_us: f64,
    /// The host-side copy started (its stream passed the waits before it).
    pub copy_start_us: f64,
    /// The copy ended.
    pub copy_end_us: f64,
}

/// Timing events of one batch: kernel start/end, copy start/end.
struct BatchEvents {
    bytes: u64,
    runs: usize,
    events: [CudaEvent; 4],
}

/// What one submission did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobShape {
    /// Bytes moved.
    pub bytes: u64,
    /// Contiguous pieces.
    pub pieces: usize,
    /// Staging batches (0 when batched).
    pub batches: usize,
    /// Host-side copies: the staged batches' host-contiguous runs (adjacent arena slots merge
    /// into one), or one per piece when batched. Runs under a megabyte cost the
    /// device-to-host engine a few percent.
    pub host_runs: usize,
    /// The strategy used.
    pub staged: bool,
    /// Staged in block form ([`CopyEngine::submit_blocks`]) rather than a descriptor per piece.
    pub blocks: bool,
}

/// Copy engine of one device and direction-agnostic pipelines (one per thread).
pub struct CopyEngine {
    ctx: Arc<CudaContext>,
    /// The staging kernel; None when its PTX did not load (then only batched copies run).
    kernel: Option<CopyKernel>,
    kernel_error: Option<String>,
    /// Scatters load batches whose segments share one length from a table a third the size
    /// (None when it did not load: the segment kernel does it).
    scatter_uniform: Option<ScatterUniformKernel>,
    /// Copies jobs given in block form (None when it did not load: they go as pieces).
    block_kernel: Option<BlockKernel>,
    kernel_stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    /// The staging parts, used in turn: a batch's kernel may run up to `parts.len() - 1`
    /// batches ahead of the copies (or, for a load, the copies ahead of the scatters).
    parts: Vec<Part>,
    next: usize,
    max_descs: usize,
    /// Pieces at least this long are copied batched when the strategy is `Auto`.
    batched_from: u64,
    batch: StagedBatch,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    /// With a timeline on: the job's start event, then the events of each batch.
    timeline: Option<(Option<CudaEvent>, Vec<BatchEvents>)>,
    /// Most batches the timeline keeps.
    timeline_cap: usize,
    /// Timing events of timelines already taken, recorded again by the next one (creating and
    /// destroying events between jobs cost a server's transfers several percent).
    spare_events: Vec<CudaEvent>,
    /// Where `submit`'s time went since the last `take_times`.
    times: SubmitTimes,
}

/// [`CopyEngine::blocks_for`]'s decision, with `kernels` saying whether the segment and the
/// block kernels loaded, `batched_from` the engine's threshold, `staging_part` the bytes of
/// one part of its staging and `summed_save` whether the job is a save whose gather would sum
/// its rows (the fused checksums).
fn block_form(
    strategy: Strategy,
    (segment_kernel, block_kernel): (bool, bool),
    batched_from: u64,
    staging_part: u64,
    job: &BlockJob<'_>,
    summed_save: bool,
) -> bool {
    // What `staged_for` would see as the job's typical piece: a part, or a whole block where
    // its parts lie one after another.
    let run = if job.blocks_contiguous() { job.block_bytes() } else { job.part_len };
    let staged = match strategy {
        Strategy::Staged => true,
        Strategy::Batched => false,
        // A save summing its rows uses SMs whatever copies it: batched, its rows would be
        // summed by a kernel of their own after the copy engines; staged, its gather sums
        // them in the one pass that reads the pages (docs/performance.md: cross-layer saves
        // beside a matmul).
        Strategy::Auto => segment_kernel && (run < batched_from || summed_save),
    };
    let units = (staging_part / job.part_len.max(1)) * job.part_len.div_ceil(BLOCK_UNIT);
    staged
        && block_kernel
        && job.part_len > 0
        && job.block_bytes() <= staging_part
        && units <= u32::MAX as u64
}

/// What a staged batch's kernel works from.
#[derive(Clone, Copy, Debug)]
enum Work {
    /// Descriptors (`next_batch_into`), with their one length when they share it.
    Segments { uniform: Option<u64> },
    /// Block ids (`next_blocks_into`) and the layout's arithmetic; the table and staging
    /// addresses are filled in at launch.
    Blocks(BlockLaunch),
    /// As `Blocks`, a save's gather summing its rows too (the fused form), the batch's first
    /// block being the job's block of that number.
    Summed(BlockLaunch, SummedGather, u32),
}

/// How one staged batch's kernel runs ([`CopyEngine::enqueue_batch`]).
#[derive(Clone, Copy, Debug)]
struct BatchKernel {
    work: Work,
    /// The staging part the batch was planned into, and that part's staging.
    part: usize,
    staging: u64,
    /// Entries of the batch's table.
    n: u32,
    /// The one length of a load's segments, when the uniform scatter takes them.
    uniform: Option<u64>,
    /// The segment kernel's descriptors per warp and grid; the uniform scatter's grid.
    group: u32,
    grid: u32,
    uniform_grid: u32,
}

/// Records event `i` of a timed batch (`timed`; None when untimed) on `stream`: 0 and 1 the
/// kernel's start and end, 2 and 3 the copy's.
fn mark_batch(
    timed: Option<&[CudaEvent; 4]>,
    i: usize,
    stream: &CudaStream,
) -> Result<(), DmaError> {
    match timed {
        Some(events) => events[i].record(stream).map_err(drv("cuEventRecord")),
        None => Ok(()),
    }
}

/// Launches the block kernel over `l` with the batch's block ids at `blocks` and the part's
/// staging at `staging`: `MAX_GRID` blocks at most, a warp per group of units.
///
/// # Safety
/// As [`BlockKernel::launch`].
unsafe fn launch_blocks(
    kernel: Option<&BlockKernel>,
    stream: &CudaStream,
    l: BlockLaunch,
    blocks: u64,
    staging: u64,
) -> Result<(), DmaError> {
    let k = kernel.ok_or_else(|| DmaError::Invalid("the block copy kernel did not load".into()))?;
    let l = BlockLaunch { blocks, staging, ..l };
    let grid = CopyKernel::grid(l.count, l.group, THREADS, MAX_GRID);
    // SAFETY: forwarded from the caller.
    unsafe { k.launch(stream, l, grid, THREADS) }
}

/// Copies a staging part's host-side runs in one `cuMemcpyBatchAsync` call (each separate
/// `cuMemcpyAsync` costs a few microseconds of copy-engine setup; a batch pays it once).
///
/// # Safety
/// As [`ffi::copy_async`] for every range.
unsafe fn copy_runs(
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    stream: &CudaStream,
) -> Result<(), DmaError> {
    // SAFETY: forwarded from the caller.
    unsafe { ffi::copy_batch_async(dsts, srcs, sizes, stream) }
}

impl CopyEngine {
    /// Fewest and most parts of the staging buffer.
    pub const DEPTHS: std::ops::RangeInclusive<usize> = orbitkv_config::STAGING_DEPTHS;

    /// The parts a staging of `staging_bytes` is cut into when none is asked for: as many as
    /// it holds jobs of `job_bytes` (up to eight, at least two), so that a part holds a whole
    /// job rather than leaving half of itself unused behind one.
    pub fn default_depth(staging_bytes: u64, job_bytes: u64) -> usize {
        orbitkv_config::default_staging_depth(staging_bytes, job_bytes)
    }

    /// An engine on `ctx` with `staging_bytes` of GPU staging in `depth` equal parts (see
    /// [`CopyEngine::DEPTHS`]).
    pub fn new(
        ctx: &Arc<CudaContext>,
        staging_bytes: usize,
        depth: usize,
        batched_from: u64,
    ) -> Result<Self, DmaError> {
        if !Self::DEPTHS.contains(&depth) {
            return Err(DmaError::Invalid(format!(
                "staging depth {depth}: must be {} to {}",
                Self::DEPTHS.start(),
                Self::DEPTHS.end()
            )));
        }
        let part_bytes = (staging_bytes / depth).max(1 << 16) / 16 * 16;
        // One descriptor per 2 KiB of staging on average, at least 4096.
        let max_descs = (part_bytes / 2048).max(4096);
        let kernels = Kernels::load(ctx);
        let mut parts = Vec::with_capacity(depth);
        for _ in 0..depth {
            parts.push(Part::new(ctx, part_bytes, max_descs)?);
        }
        // The copy pipeline's streams get the context's highest priority: other work of this
        // process on the device (the chunk checksum kernels, on a default-priority stream)
        // then gets SMs only when the gather/scatter kernels leave them.
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(drv("cuCtxGetStreamPriorityRange"))?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            kernel: kernels.copy,
            kernel_error: kernels.copy_error,
            scatter_uniform: kernels.scatter_uniform,
            block_kernel: kernels.block,
            kernel_stream: ctx
                .new_stream_with_priority(highest)
                .map_err(drv("cuStreamCreateWithPriority"))?,
            copy_stream: ctx
                .new_stream_with_priority(highest)
                .map_err(drv("cuStreamCreateWithPriority"))?,
            parts,
            next: 0,
            max_descs,
            batched_from,
            batch: StagedBatch::default(),
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
            timeline: None,
            timeline_cap: usize::MAX,
            spare_events: Vec::new(),
            times: SubmitTimes::default(),
        })
    }

    /// Records timing events around every staged batch of the jobs submitted from now on,
    /// until [`CopyEngine::take_timeline`] (a diagnostic: timing events cost a little).
    pub fn record_timeline(&mut self) {
        self.record_timeline_batches(usize::MAX);
    }

    /// As [`CopyEngine::record_timeline`], for the first `max` batches only (the later ones
    /// run untimed until the timeline is taken): a bound on the events a long busy period
    /// would otherwise pile up.
    pub fn record_timeline_batches(&mut self, max: usize) {
        // A batch whose enqueueing failed is not kept, so every kept event was recorded.
        self.timeline = Some((None, Vec::new()));
        self.timeline_cap = max;
    }

    /// Whether a timeline is being recorded ([`CopyEngine::record_timeline`]).
    pub fn recording_timeline(&self) -> bool {
        self.timeline.is_some()
    }

    /// The spans of the staged batches since [`CopyEngine::record_timeline`], once their work
    /// has completed (waits for it); recording stops.
    pub fn take_timeline(&mut self) -> Result<Vec<BatchSpan>, DmaError> {
        let Some((Some(start), batches)) = self.timeline.take() else {
            return Ok(Vec::new());
        };
        // One wait on the start and on the last batch's four events, which cover both streams
        // (each stream passes its events in order), then plain reads: `elapsed_ms` would wait
        // on both events of every read, five driver calls each, about a millisecond for a full
        // timeline in the DMA thread that the next job may be waiting for.
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        start.synchronize().map_err(drv("cuEventSynchronize"))?;
        for e in batches.last().map_or(&[][..], |b| &b.events[..]) {
            e.synchronize().map_err(drv("cuEventSynchronize"))?;
        }
        let at = |e: &CudaEvent| -> Result<f64, DmaError> {
            // Both have passed: waited for above, directly or through a later one on their
            // stream.
            Ok(f64::from(ffi::elapsed_ms(&start, e)?) * 1e3)
        };
        let spans = batches
            .iter()
            .map(|b| {
                Ok(BatchSpan {
                    bytes: b.bytes,
                    runs: b.runs,
                    kernel_start_us: at(&b.events[0])?,
                    kernel_end_us: at(&b.events[1])?,
                    copy_start_us: at(&b.events[2])?,
                    copy_end_us: at(&b.events[3])?,
                })
            })
            .collect::<Result<Vec<_>, DmaError>>()?;
        // All read, so all passed: the next timeline records them again.
        self.spare_events.push(start);
        self.spare_events.extend(batches.into_iter().flat_map(|b| b.events));
        Ok(spans)
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Why the staging kernel did not load (then only batched copies run); None when it did.
    pub fn kernel_error(&self) -> Option<&str> {
        self.kernel_error.as_deref()
    }

    /// Bytes of one staging part (what one staged batch holds at most).
    pub fn staging_part(&self) -> usize {
        self.parts[0].staging.len()
    }

    /// Where `start`'s time went since the last call (finding pieces; blocked on earlier
    /// work; planning staged batches into their tables), reset to zero.
    pub fn take_times(&mut self) -> SubmitTimes {
        std::mem::take(&mut self.times)
    }

    pub(crate) fn add_times(&mut self, t: SubmitTimes) {
        self.times = self.times + t;
    }

    /// Which strategy `strategy` means for these pieces.
    pub fn staged_for(&self, strategy: Strategy, pieces: &[Piece]) -> bool {
        match strategy {
            Strategy::Staged => true,
            Strategy::Batched => false,
            Strategy::Auto if self.kernel.is_none() => false,
            Strategy::Auto => {
                // The typical piece decides: below the threshold the copy engines are slow
                // per descriptor, above it they reach the bus limit on their own. A job's
                // pieces come from one layout, so its first pieces tell (a job of a million
                // pieces is not read through before its first copy starts).
                let sample = &pieces[..pieces.len().min(AUTO_SAMPLE)];
                let bytes: u64 = sample.iter().map(|p| p.len).sum();
                !sample.is_empty() && bytes / (sample.len() as u64) < self.batched_from
            }
        }
    }

    /// Whether `job` goes in block form under `strategy` ([`CopyEngine::submit_blocks`]):
    /// staged (as [`CopyEngine::staged_for`] would decide for its pieces: a block that is one
    /// contiguous run counts as one piece), the block kernel loaded, a block fitting a staging
    /// part and a part's units counted in 32 bits. Otherwise its pieces go through
    /// [`CopyEngine::submit`]. `summed_save`: the job is a save whose gather would sum its
    /// rows ([`ChunkHasher::summed_applies`](crate::dma::ChunkHasher::summed_applies)); under
    /// [`Strategy::Auto`] it goes staged whatever its pieces' length.
    pub fn blocks_for(&self, strategy: Strategy, job: &BlockJob<'_>, summed_save: bool) -> bool {
        let kernels = (self.kernel.is_some(), self.block_kernel.is_some());
        let part = self.staging_part() as u64;
        block_form(strategy, kernels, self.batched_from, part, job, summed_save)
    }

    /// Enqueues the staged copy of a job in block form (see [`CopyEngine::blocks_for`], which
    /// must have said yes) and returns the event that completes when every byte has landed.
    /// May block briefly when both staging halves are busy with earlier work.
    ///
    /// # Safety
    /// As [`CopyEngine::submit`], for every part of every block of the job (device side) and
    /// every chunk's host range.
    pub(crate) unsafe fn submit_blocks(
        &mut self,
        direction: Direction,
        job: &BlockJob<'_>,
        summed: Option<&SummedSave>,
    ) -> Result<(CudaEvent, JobShape), DmaError> {
        // The fused form sums rows as a save gathers them.
        let summed = summed.filter(|_| direction == Direction::Save).map(SummedSave::gather);
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let done = self.ctx.new_event(None).map_err(drv("cuEventCreate"))?;
        let pieces =
            job.chunks.iter().map(|(_, b)| b.len()).sum::<usize>() * job.part_count() as usize;
        let mut shape =
            JobShape { bytes: 0, pieces, batches: 0, staged: true, host_runs: 0, blocks: true };
        let enqueued = self.enqueue_blocks(direction, job, summed, &mut shape, &done);
        self.settle(enqueued)?;
        Ok((done, shape))
    }

    /// `enqueued`, after letting whatever a failed submission had put on the GPU finish (the
    /// caller gives the memory back on an error).
    fn settle(&self, enqueued: Result<(), DmaError>) -> Result<(), DmaError> {
        if enqueued.is_err() {
            if let Err(sync) = self.synchronize() {
                tracing::warn!(error = %sync, "copy engine: synchronizing after a failed submission");
            }
        }
        enqueued
    }

    /// Enqueues every block of a job, batch by batch, and records `done` after its last copy.
    fn enqueue_blocks(
        &mut self,
        direction: Direction,
        job: &BlockJob<'_>,
        summed: Option<SummedGather>,
        shape: &mut JobShape,
        done: &CudaEvent,
    ) -> Result<(), DmaError> {
        if self.block_kernel.is_none() {
            return Err(DmaError::Invalid("the block copy kernel did not load".into()));
        }
        let part_bytes = self.staging_part() as u64;
        let mut at = BlockCursor::default();
        let mut batch = std::mem::take(&mut self.batch);
        // The job's blocks staged before this batch (the fused gather numbers rows in the job).
        let mut first_block = 0u32;
        let result = (|| {
            loop {
                // Nothing left: no part to wait for.
                if at.finished(job) {
                    break;
                }
                let h = &mut self.parts[self.next];
                // The part's table and staging are free once its last batch's copy (save) or
                // scatter (load) has finished.
                wait_for(&h.free, &mut self.times.waited)?;
                let t = Instant::now();
                let ids = next_blocks_into(
                    job,
                    &mut at,
                    part_bytes,
                    h.descs_host.bytes_mut(),
                    &mut batch,
                );
                self.times.planned += t.elapsed();
                if ids == 0 {
                    break;
                }
                self.planned_into_next(shape, &batch);
                let subs = job.part_len.div_ceil(BLOCK_UNIT).max(1);
                let units = ids as u64 * job.part_count() * subs;
                let launch = BlockLaunch {
                    parts: job.parts,
                    blocks: 0, // set per direction by enqueue_batch
                    stride: job.stride,
                    part_len: job.part_len,
                    staging: 0, // the part's, set by enqueue_batch
                    part_count: u32::try_from(job.part_count())
                        .map_err(|_| DmaError::Invalid("more than 2^32 parts per block".into()))?,
                    subs: subs as u32,
                    count: u32::try_from(units)
                        .map_err(|_| DmaError::Invalid(format!("{units} units in one batch")))?,
                    group: CopyKernel::group(batch.bytes, units as usize),
                    gather: direction == Direction::Save,
                };
                let work = match summed {
                    Some(g) => Work::Summed(launch, g, first_block),
                    None => Work::Blocks(launch),
                };
                self.enqueue_batch(direction, &batch, ids, work)?;
                first_block = u32::try_from(u64::from(first_block) + ids as u64)
                    .map_err(|_| DmaError::Invalid("more than 2^32 blocks in one job".into()))?;
            }
            Ok::<(), DmaError>(())
        })();
        self.batch = batch;
        result?;
        let last = match direction {
            Direction::Save => &self.copy_stream,
            Direction::Load => &self.kernel_stream,
        };
        done.record(last).map_err(drv("cuEventRecord"))
    }

    /// An event recorded on the kernel stream now: it completes once every gather or scatter
    /// enqueued so far has run (for a fused save, once its row sums are all written).
    pub fn kernels_done(&self) -> Result<CudaEvent, DmaError> {
        let e = self.ctx.new_event(None).map_err(drv("cuEventCreate"))?;
        e.record(&self.kernel_stream).map_err(drv("cuEventRecord"))?;
        Ok(e)
    }

    /// Enqueues the copy of `pieces` and returns the event that completes when every byte has
    /// landed. May block briefly when both staging halves are busy with earlier work.
    ///
    /// # Safety
    /// Every piece must name device memory of this engine's device and host memory
    /// registered with CUDA (the arena), both valid and not written by anyone else until the
    /// returned event completes.
    pub(crate) unsafe fn submit(
        &mut self,
        direction: Direction,
        pieces: &[Piece],
        strategy: Strategy,
    ) -> Result<(CudaEvent, JobShape), DmaError> {
        // Raw copies and launches below use the thread's current context: make it this one
        // (a thread may drive engines of several devices).
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let staged = self.staged_for(strategy, pieces);
        // `bytes` is counted as the job is enqueued.
        let mut shape = JobShape {
            bytes: 0,
            pieces: pieces.len(),
            batches: 0,
            staged,
            host_runs: 0,
            blocks: false,
        };
        if staged && self.kernel.is_none() {
            return Err(DmaError::Invalid(format!(
                "staged copies need the segment copy kernel, which did not load: {}",
                self.kernel_error.as_deref().unwrap_or("unknown")
            )));
        }
        let done = self.ctx.new_event(None).map_err(drv("cuEventCreate"))?;
        let enqueued = self.enqueue_job(direction, pieces, &mut shape, &done);
        // Part of the job may already be on the GPU: it finishes before an error returns.
        self.settle(enqueued)?;
        Ok((done, shape))
    }

    /// Enqueues every piece of a job and records `done` after its last copy.
    fn enqueue_job(
        &mut self,
        direction: Direction,
        pieces: &[Piece],
        shape: &mut JobShape,
        done: &CudaEvent,
    ) -> Result<(), DmaError> {
        if shape.staged {
            let part_bytes = self.staging_part() as u64;
            let mut at = StageCursor::default();
            let mut batch = std::mem::take(&mut self.batch);
            let result = (|| {
                loop {
                    // Nothing left: no part to wait for.
                    if at.finished(pieces) {
                        break;
                    }
                    // The batch is planned straight into the next part's host table, once the
                    // part's last batch has finished with the table and the staging.
                    let h = &mut self.parts[self.next];
                    wait_for(&h.free, &mut self.times.waited)?;
                    let gather = direction == Direction::Save;
                    let t = Instant::now();
                    let (n, uniform) = next_batch_into(
                        pieces,
                        &mut at,
                        (part_bytes, self.max_descs),
                        (h.staging.ptr(), gather),
                        h.descs_host.bytes_mut(),
                        &mut batch,
                    );
                    self.times.planned += t.elapsed();
                    if n == 0 {
                        break;
                    }
                    self.planned_into_next(shape, &batch);
                    self.enqueue_batch(direction, &batch, n, Work::Segments { uniform })?;
                }
                Ok::<(), DmaError>(())
            })();
            self.batch = batch;
            result?;
            // The job is done when the stream that touches its last batch last has passed it.
            let last = match direction {
                Direction::Save => &self.copy_stream,
                Direction::Load => &self.kernel_stream,
            };
            done.record(last).map_err(drv("cuEventRecord"))?;
        } else {
            for group in pieces.chunks(BATCH_CALL) {
                let (mut dsts, mut srcs): (Vec<u64>, Vec<u64>) = match direction {
                    Direction::Save => group.iter().map(|p| (p.host, p.device)).unzip(),
                    Direction::Load => group.iter().map(|p| (p.device, p.host)).unzip(),
                };
                let mut sizes: Vec<usize> = group.iter().map(|p| p.len as usize).collect();
                shape.bytes += group.iter().map(|p| p.len).sum::<u64>();
                shape.host_runs += group.len();
                // SAFETY: per the caller's contract on every piece.
                unsafe {
                    ffi::copy_batch_async(&mut dsts, &mut srcs, &mut sizes, &self.copy_stream)?
                };
            }
            done.record(&self.copy_stream).map_err(drv("cuEventRecord"))?;
        }
        Ok(())
    }

    /// `batch` was planned into the next staging part's table: the part after it is next, and
    /// the job's shape counts the batch.
    fn planned_into_next(&mut self, shape: &mut JobShape, batch: &StagedBatch) {
        self.next = (self.next + 1) % self.parts.len();
        shape.batches += 1;
        shape.bytes += batch.bytes;
        shape.host_runs += batch.runs.len();
    }

    /// Enqueues one staged batch on the staging part just used (`self.next` has moved past
    /// it), whose host table holds its `n` entries: descriptors as `next_batch_into` wrote
    /// them (`Work::Segments`, with their one length when they share it), or block ids as
    /// `next_blocks_into` wrote them (`Work::Blocks`).
    fn enqueue_batch(
        &mut self,
        direction: Direction,
        b: &StagedBatch,
        n: usize,
        work: Work,
    ) -> Result<(), DmaError> {
        let last = (self.next + self.parts.len() - 1) % self.parts.len();
        let h = &mut self.parts[last];
        let table = h.descs_host.bytes_mut();
        let staging = h.staging.ptr();
        // A load whose segments share one length goes with the uniform scatter kernel: its
        // table is only the destinations, and it crosses the bus the way the load's data does.
        let uniform = match (direction, &self.scatter_uniform, work) {
            (Direction::Load, Some(_), Work::Segments { uniform }) => uniform,
            _ => None,
        };
        let table_bytes = match work {
            // Block ids, 8 bytes each.
            Work::Blocks(_) | Work::Summed(..) => n * 8,
            Work::Segments { .. } if uniform.is_some() => {
                compact_uniform(table, n);
                n * 8
            }
            Work::Segments { .. } => n * KernelDesc::BYTES,
        };
        let segments = n;
        let n = n as u32;
        // The segment kernel: a warp per group of descriptors; the uniform scatter: a warp
        // per segment. Eight warps per block.
        let group = CopyKernel::group(b.bytes, segments);
        let grid = CopyKernel::grid(n, group, THREADS, MAX_GRID);
        let uniform_grid = n.div_ceil(THREADS / 32).clamp(1, MAX_GRID);
        let k = BatchKernel { work, part: last, staging, n, uniform, group, grid, uniform_grid };
        self.host_runs_of(direction, b, &k, table_bytes);
        let timed = self.batch_events(direction)?;
        match direction {
            Direction::Save => self.enqueue_gather_then_copy(&k, timed.as_ref())?,
            Direction::Load => self.enqueue_copy_then_scatter(&k, timed.as_ref())?,
        }
        if let (Some(events), Some((_, batches))) = (timed, &mut self.timeline) {
            batches.push(BatchEvents { bytes: b.bytes, runs: b.runs.len(), events });
        }
        Ok(())
    }

    /// Host side of the batch `b`, planned into part `k.part`: one batched call for its runs
    /// (into `dsts`, `srcs` and `sizes`), a load's table of `table_bytes` first.
    fn host_runs_of(
        &mut self,
        direction: Direction,
        b: &StagedBatch,
        k: &BatchKernel,
        table_bytes: usize,
    ) {
        let h = &self.parts[k.part];
        let staging = k.staging;
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        if direction == Direction::Load {
            // A load's descriptor table goes up in the same batched call as its data, ahead of
            // it: as a copy of its own it cost the host-to-device engine several microseconds
            // of setup per batch (the timeline showed the copy stream idle 6-12 us between load
            // batches, 1-2% of a load). On the kernel stream it would also queue behind the
            // next batch's data.
            self.dsts.push(h.descs_dev.ptr());
            self.srcs.push(h.descs_host.addr());
            self.sizes.push(table_bytes);
        }
        for r in &b.runs {
            let (dst, src) = match direction {
                Direction::Save => (r.host, staging + r.staging),
                Direction::Load => (staging + r.staging, r.host),
            };
            self.dsts.push(dst);
            self.srcs.push(src);
            self.sizes.push(r.len as usize);
        }
    }

    /// With a timeline on: this batch's four events (kept only once all are recorded), and
    /// the start event, on the stream of the job's first operation. None when no timeline is
    /// on or it holds its most batches.
    fn batch_events(&mut self, direction: Direction) -> Result<Option<[CudaEvent; 4]>, DmaError> {
        let timed = match &mut self.timeline {
            Some((start, batches)) if batches.len() < self.timeline_cap => {
                let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                let (ctx, spare) = (&self.ctx, &mut self.spare_events);
                let mut new = || match spare.pop() {
                    Some(e) => Ok(e),
                    None => ctx.new_event(timing).map_err(drv("cuEventCreate")),
                };
                if start.is_none() {
                    let s = new()?;
                    let first = match direction {
                        Direction::Save => &self.kernel_stream,
                        Direction::Load => &self.copy_stream,
                    };
                    s.record(first).map_err(drv("cuEventRecord"))?;
                    *start = Some(s);
                }
                Some([new()?, new()?, new()?, new()?])
            }
            _ => None,
        };
        Ok(timed)
    }

    /// The segment kernel, where a batch needs it: a block-form job can be staged with only
    /// the block kernel loaded (`--gpu-copy staged`), and never reaches for it.
    fn segment_kernel(&self) -> Result<&CopyKernel, DmaError> {
        self.kernel
            .as_ref()
            .ok_or_else(|| DmaError::Invalid("the segment copy kernel did not load".into()))
    }

    /// A save's batch, planned into part `k.part` with its host runs in `dsts`, `srcs` and
    /// `sizes`: the gather on the kernel stream, then the copy to the host on the copy stream.
    fn enqueue_gather_then_copy(
        &mut self,
        k: &BatchKernel,
        timed: Option<&[CudaEvent; 4]>,
    ) -> Result<(), DmaError> {
        let mark = |i: usize, stream: &CudaStream| mark_batch(timed, i, stream);
        let h = &self.parts[k.part];
        let (kernel_stream, copy_stream) = (&self.kernel_stream, &self.copy_stream);
        let block_kernel = self.block_kernel.as_ref();
        let (staging, n, group, grid) = (k.staging, k.n, k.group, k.grid);
        // The thread saw `free` complete before it planned the batch.
        mark(0, kernel_stream)?;
        // The gather reads its table straight from the mapped pinned host copy (at its
        // host address under unified addressing), never uploaded: an upload is a
        // host-to-device copy, and beside a load it queues behind the load's data on
        // the host-to-device copy engine, so a save beside a load advanced one batch
        // per load batch (both at half rate; measured with `perf dma --duplex`).
        // A block-form batch's ids are read in place the same way.
        match k.work {
            // SAFETY: the block ids and the part table name engine parts
            // (submit_blocks' contract); staging and the host table as below.
            Work::Blocks(l) => unsafe {
                launch_blocks(block_kernel, kernel_stream, l, h.descs_host.addr(), staging)?
            },
            // SAFETY: as the block gather; the row sums go to the job's scratch rows,
            // which its checksum submission holds (`SummedSave`) until its fold.
            Work::Summed(l, g, first) => unsafe {
                let l = BlockLaunch { blocks: h.descs_host.addr(), staging, ..l };
                let grid = CopyKernel::grid(l.count, l.group, THREADS, MAX_GRID);
                ffi::launch_summed(kernel_stream, l, &g, first, (grid, THREADS))?
            },
            // SAFETY: descriptors name engine pieces (submit's contract) and this
            // part's staging, free since `free` was seen passed; the host table stays
            // untouched until `free`, recorded after this batch's copy, has passed.
            Work::Segments { .. } => unsafe {
                self.segment_kernel()?.launch(
                    kernel_stream,
                    h.descs_host.addr(),
                    n,
                    group,
                    grid,
                    THREADS,
                )?
            },
        }
        mark(1, kernel_stream)?;
        h.filled.record(kernel_stream).map_err(drv("cuEventRecord"))?;
        copy_stream.wait(&h.filled).map_err(drv("cuStreamWaitEvent"))?;
        mark(2, copy_stream)?;
        // SAFETY: staging filled (waited on `filled`); host ranges are the caller's
        // registered arena slots.
        unsafe { copy_runs(&mut self.dsts, &mut self.srcs, &mut self.sizes, copy_stream)? };
        mark(3, copy_stream)?;
        h.free.record(copy_stream).map_err(drv("cuEventRecord"))?;
        Ok(())
    }

    /// A load's batch, planned into part `k.part` with its table and host runs in `dsts`,
    /// `srcs` and `sizes`: the copy from the host on the copy stream, then the scatter on the
    /// kernel stream.
    fn enqueue_copy_then_scatter(
        &mut self,
        k: &BatchKernel,
        timed: Option<&[CudaEvent; 4]>,
    ) -> Result<(), DmaError> {
        let mark = |i: usize, stream: &CudaStream| mark_batch(timed, i, stream);
        let h = &self.parts[k.part];
        let (kernel_stream, copy_stream) = (&self.kernel_stream, &self.copy_stream);
        let block_kernel = self.block_kernel.as_ref();
        let (staging, n, group, grid) = (k.staging, k.n, k.group, k.grid);
        // The part's staging and device table are free: the scatter that last read
        // them was seen done before the batch was planned.
        mark(2, copy_stream)?;
        // SAFETY: the part is free (waited); the first copy is the part's own pinned
        // table into its device table, the others host ranges per submit's contract.
        unsafe { copy_runs(&mut self.dsts, &mut self.srcs, &mut self.sizes, copy_stream)? };
        mark(3, copy_stream)?;
        h.filled.record(copy_stream).map_err(drv("cuEventRecord"))?;
        kernel_stream.wait(&h.filled).map_err(drv("cuStreamWaitEvent"))?;
        mark(0, kernel_stream)?;
        let table = h.descs_dev.ptr();
        match (k.work, k.uniform, &self.scatter_uniform) {
            // SAFETY: staging filled (waited); the device table holds the batch's
            // block ids, the part table names engine parts (submit_blocks' contract).
            // Loads are never summed (`submit_blocks` keeps the fused form to saves).
            (Work::Blocks(l) | Work::Summed(l, ..), _, _) => unsafe {
                launch_blocks(block_kernel, kernel_stream, l, table, staging)?
            },
            (_, Some(len), Some(u)) => {
                // SAFETY: staging filled (waited); the table holds the `n` segments'
                // engine addresses, each `len` bytes at staging + d * len (uniform).
                unsafe { u.launch(kernel_stream, table, n, staging, len, k.uniform_grid, THREADS)? }
            }
            _ => {
                // SAFETY: staging filled (waited); the table holds the `n` segment
                // descriptors, destinations engine pieces.
                unsafe {
                    self.segment_kernel()?.launch(kernel_stream, table, n, group, grid, THREADS)?
                }
            }
        }
        mark(1, kernel_stream)?;
        h.free.record(kernel_stream).map_err(drv("cuEventRecord"))?;
        Ok(())
    }

    /// One contiguous copy on the copy stream (the ceiling every ratio is measured against).
    ///
    /// # Safety
    /// As [`CopyEngine::submit`] for the one range.
    pub(crate) unsafe fn contiguous(
        &mut self,
        direction: Direction,
        device: u64,
        host: u64,
        len: usize,
    ) -> Result<CudaEvent, DmaError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let way = match direction {
            Direction::Save => Way::DeviceToHost,
            Direction::Load => Way::HostToDevice,
        };
        // The event first: a failure after the copy is queued would leave the caller no event
        // to wait on before reusing the memory.
        let done = self.ctx.new_event(None).map_err(drv("cuEventCreate"))?;
        // SAFETY: forwarded from the caller.
        let enqueued = unsafe { ffi::copy_async(way, device, host, len, &self.copy_stream) }
            .and_then(|()| done.record(&self.copy_stream).map_err(drv("cuEventRecord")));
        self.settle(enqueued).map(|()| done)
    }

    /// Waits for everything submitted so far.
    pub fn synchronize(&self) -> Result<(), DmaError> {
        self.kernel_stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
        self.copy_stream.synchronize().map_err(drv("cuStreamSynchronize"))
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Staging and descriptor tables are freed after this: nothing may still use them.
        if let Err(e) = self.synchronize() {
            tracing::warn!(error = %e, "copy engine: synchronizing before teardown failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_form_where_a_staged_copy_of_whole_blocks_fits() {
        const MIB: u64 = 1 << 20;
        let chunks = [(0u64, vec![0u64])];
        // 2 KiB parts in two tensors (sglang-like): staged under auto.
        let bases = [0u64, 1 << 40];
        let sglang = BlockJob {
            parts: 0,
            bases: &bases,
            part_len: 2048,
            stride: 2048,
            host_base: 0,
            chunks: &chunks,
        };
        let both = (true, true);
        assert!(block_form(Strategy::Auto, both, MIB, 32 * MIB, &sglang, false));
        assert!(block_form(Strategy::Staged, both, MIB, 32 * MIB, &sglang, false));
        assert!(!block_form(Strategy::Batched, both, MIB, 32 * MIB, &sglang, false));
        // Without the block kernel, pieces; without the segment kernel, auto copies batched.
        assert!(!block_form(Strategy::Auto, (true, false), MIB, 32 * MIB, &sglang, false));
        assert!(!block_form(Strategy::Auto, (false, true), MIB, 32 * MIB, &sglang, false));
        assert!(block_form(Strategy::Staged, (false, true), MIB, 32 * MIB, &sglang, false));
        // Cross-layer: 64 parts of 32 KiB one after another, a 2 MiB run per block, which the
        // copy engines move alone under auto; staged when asked.
        let cross: Vec<u64> = (0..64).map(|p| p * (32 << 10)).collect();
        let packed = BlockJob { bases: &cross, part_len: 32 << 10, stride: 2 * MIB, ..sglang };
        assert!(packed.blocks_contiguous());
        assert!(!block_form(Strategy::Auto, both, MIB, 32 * MIB, &packed, false));
        assert!(block_form(Strategy::Staged, both, MIB, 32 * MIB, &packed, false));
        // A save whose gather sums its rows: staged under auto too, but not without the
        // segment kernel, nor past a staging part, nor under batched.
        assert!(block_form(Strategy::Auto, both, MIB, 32 * MIB, &packed, true));
        assert!(!block_form(Strategy::Auto, (false, true), MIB, 32 * MIB, &packed, true));
        assert!(!block_form(Strategy::Auto, both, MIB, MIB, &packed, true));
        assert!(!block_form(Strategy::Batched, both, MIB, 32 * MIB, &packed, true));
        // A block larger than a staging part goes as pieces.
        assert!(!block_form(Strategy::Staged, both, MIB, MIB, &packed, false));
        // Parts of 1 MiB or more: batched under auto.
        let long = BlockJob { part_len: MIB, stride: MIB, ..sglang };
        assert!(!block_form(Strategy::Auto, both, MIB, 32 * MIB, &long, false));
    }
}
