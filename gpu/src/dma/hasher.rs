//! Chunk checksums on the GPU of one device: the kernels of `gpu/kernels/chunk_checksum.cu` on
//! streams of their own, beside the copies of a save (they read the engine's pages in GPU memory,
//! not what crossed the bus). Each submission returns a [`ChecksumTicket`] that yields the
//! checksums once its event has completed.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::checksum::{
    block_tables, tables_capacity, write_block_ids, write_tables, COUNTERS_PER_CHUNK, MIN_LEN,
    ROW_BYTES, ROW_LEN,
};
use super::ffi::{
    self, BlockRowsLaunch, ChecksumKernels, ChecksumLaunch, CopyKernel, DeviceBuffer, ExpandLaunch,
    PinnedHost, SummedGather, Way,
};
use super::plan::{BlockJob, KernelDesc, Piece};
use super::DmaError;

/// Submissions in flight at once, each on its own stream; the next one waits for the oldest
/// (its tables and scratch). Beside an engine's kernels (MPS) each launch waits for SMs to
/// free up, so submissions waiting side by side is what keeps checksummed saves going there
/// (on one stream: 20-28 GB/s; on four, with four launches per submission: 32-39; with three:
/// 48-50; without checksums 52-53).
const SLOTS: usize = 4;
/// Fused-form saves that may be begun and not yet finished at once, with no other submission
/// in between, and still leave a slot free for any submission after them: each holds its slot
/// until its fold is queued, and a submission refuses a held slot (whichever slot is next,
/// [`ChunkHasher::next_slot`]).
pub const SUMMED_UNFINISHED: usize = SLOTS - 1;
/// Bytes of the tables one warp of the pull (see [`ChunkHasher::submit`]) moves.
const PULL_PIECE: usize = 4096;

/// Memory and stream of one submission: its tables (pinned and on the device), scratch rows
/// and the fold's counters. The results go to the ticket's own pinned buffer.
struct Slot {
    stream: Arc<CudaStream>,
    tables_host: PinnedHost,
    /// The pull's descriptors (mapped pinned memory, read in place by the copy kernel).
    pull_descs: PinnedHost,
    tables: DeviceBuffer,
    /// Shared with the fused-form save that writes it (its gather runs on a copy engine's
    /// stream, which this hasher does not synchronize), so that it outlives that gather.
    scratch: Arc<DeviceBuffer>,
    /// The fold kernel's counters: zero whenever no submission of the slot runs.
    counters: DeviceBuffer,
    /// The slot's last submission finished (tables, scratch and counters reusable).
    done: CudaEvent,
    /// A fused-form save begun on it is not finished yet (its fold not queued, so `done`
    /// does not follow it). Shared with that save, whose owner clears it once the save's
    /// gathers are seen finished without a fold.
    summing: Arc<AtomicBool>,
}

impl Slot {
    /// Writes the pull's descriptors into the slot's pinned `pull_descs` (grown as needed):
    /// `pull_count` pieces of `PULL_PIECE` bytes, from its pinned tables to its device tables,
    /// `table_len` bytes in all.
    fn write_pull_descs(
        &mut self,
        ctx: &Arc<CudaContext>,
        table_len: usize,
        pull_count: usize,
    ) -> Result<(), DmaError> {
        if self.pull_descs.len() < pull_count * KernelDesc::BYTES {
            self.pull_descs =
                PinnedHost::new(ctx, (pull_count * KernelDesc::BYTES).next_power_of_two())?;
        }
        let descs = self.pull_descs.bytes_mut();
        for (i, out) in descs.chunks_exact_mut(KernelDesc::BYTES).take(pull_count).enumerate() {
            let at = i * PULL_PIECE;
            KernelDesc {
                src: self.tables_host.addr() + at as u64,
                dst: self.tables.ptr() + at as u64,
                len: (table_len - at).min(PULL_PIECE) as u64,
            }
            .write_to(out);
        }
        Ok(())
    }
}

/// The tables of one submission: chunks, the bytes the host writes (the pull brings them
/// over, or for a block-form save the expansion reads them in place), the bytes the tables
/// take on the device, and for a block-form save the expansion that writes them there.
struct Shape {
    chunks: usize,
    host_len: usize,
    device_len: usize,
    expand: Option<ExpandLaunch>,
}

/// A submission's launches ([`ChunkHasher::enqueue_checksums`]): the checksum kernels', the
/// expansion of a block-form save's records, and the pull of `pull_count` pieces (0 for a
/// block-form save) of the `table_len` bytes of host tables.
struct TablesLaunch {
    checksum: ChecksumLaunch,
    expand: Option<ExpandLaunch>,
    pull_count: usize,
    table_len: usize,
}

/// A fused-form save's checksums in the making ([`ChunkHasher::begin_summed`]): the slot whose
/// scratch rows the job's gather writes, and the results buffer the fold will fill.
pub struct SummedSave {
    slot: usize,
    /// The [`ChunkHasher::id`] of the hasher whose slot it holds.
    hasher: u64,
    results: PinnedHost,
    nchunks: u32,
    chunk_len: u64,
    gather: SummedGather,
    /// The slot's scratch, which the gather writes (kept while the save exists).
    scratch: Arc<DeviceBuffer>,
    /// The slot's flag, cleared by [`SummedSave::release_after_gathers`].
    summing: Arc<AtomicBool>,
}

impl SummedSave {
    /// The checksum slot it holds until its fold is queued.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Gives the slot back without a fold, once the caller has seen every gather of the
    /// save's job finish (no fold was queued, so the slot's `done` still follows its previous
    /// use). Dropping the save otherwise keeps the slot held.
    pub(crate) fn release_after_gathers(self) {
        self.summing.store(false, Ordering::Release);
    }

    /// The hasher whose slot it holds.
    pub(crate) fn hasher(&self) -> u64 {
        self.hasher
    }

    /// What the copy engine's gather needs to sum the job's rows.
    pub(crate) fn gather(&self) -> SummedGather {
        self.gather
    }
}

/// Whether a block-form job's rows can be summed unit by unit, as the block gather walks it
/// (the fused gather, the block row sums): every part a whole number of 1 KiB rows (so every
/// chunk too), and every part 16-byte aligned.
fn rows_by_units(job: &BlockJob<'_>) -> bool {
    let aligned = job.stride.is_multiple_of(16) && job.bases.iter().all(|b| b.is_multiple_of(16));
    job.part_len != 0 && job.part_len.is_multiple_of(ROW_LEN) && aligned
}

/// Makes room in `slot`'s counters for the fold of `chunks` chunks (zeroed on its stream).
fn counters_for(ctx: &Arc<CudaContext>, slot: &mut Slot, chunks: usize) -> Result<(), DmaError> {
    let len = chunks * COUNTERS_PER_CHUNK * 4;
    if slot.counters.len() < len {
        slot.counters = DeviceBuffer::zeroed_on(ctx, len.next_power_of_two(), &slot.stream)?;
    }
    Ok(())
}

/// A job whose block row sums are enqueued on its slot's stream, waiting for its fold.
struct PendingRows {
    slot: usize,
    /// Chunk length, and chunks.
    len: u64,
    nchunks: usize,
    /// Where the fold writes the checksums (handed to the ticket).
    results: PinnedHost,
}

/// One job of the uniform fold (`orbitkv_xxh3_fold_uniform`'s arguments).
struct FoldJobRecord {
    len: u64,
    nchunks: u64,
    scratch: u64,
    counters: u64,
    out: u64,
}

impl FoldJobRecord {
    fn of(p: &PendingRows, slot: &Slot) -> Self {
        Self {
            len: p.len,
            nchunks: p.nchunks as u64,
            scratch: slot.scratch.ptr(),
            counters: slot.counters.ptr(),
            out: p.results.addr(),
        }
    }
}

/// Pinned result buffers handed to tickets and given back when they are dropped.
type Pool = Arc<Mutex<Vec<PinnedHost>>>;

/// The checksums of one submission, once its event completes.
pub struct ChecksumTicket {
    event: CudaEvent,
    results: Option<PinnedHost>,
    count: usize,
    pool: Pool,
    /// The memory the kernels read, when the ticket owns it ([`ChunkHasher::checksums`]);
    /// dropped after `Drop` has waited for the event.
    _memory: Option<Arc<super::EngineMemory>>,
}

impl ChecksumTicket {
    /// Whether the checksums are ready.
    pub fn is_complete(&self) -> Result<bool, DmaError> {
        self.event
            .try_is_complete()
            .map_err(|e| DmaError::Cuda { op: "cuEventQuery", detail: e.to_string() })
    }

    /// The checksums, in chunk order (waits for the event).
    pub fn take(mut self) -> Result<Vec<u64>, DmaError> {
        self.event
            .synchronize()
            .map_err(|e| DmaError::Cuda { op: "cuEventSynchronize", detail: e.to_string() })?;
        let r = self.results.as_mut().expect("held until drop");
        Ok(r.bytes_mut()[..self.count * 8]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect())
    }
}

impl Drop for ChecksumTicket {
    fn drop(&mut self) {
        // The GPU may still write the results: only a finished buffer goes back to the pool.
        if self.event.synchronize().is_ok() {
            if let Some(r) = self.results.take() {
                self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(r);
            }
        } else {
            // A failed context: keep the buffer rather than reuse memory of unknown state.
            std::mem::forget(self.results.take());
        }
    }
}

/// The checksum kernels of one device, their streams and memory.
pub struct ChunkHasher {
    /// Unique in this process: a fused-form save is finished only by the hasher that began it.
    id: u64,
    ctx: Arc<CudaContext>,
    kernels: ChecksumKernels,
    /// Pulls the tables from mapped pinned memory onto the device; None when it did not load
    /// (then they are uploaded with a copy).
    pull: Option<CopyKernel>,
    slots: Vec<Slot>,
    next: usize,
    pool: Pool,
    /// Where `submit`'s time went since the last `take_times`.
    times: super::SubmitTimes,
}

pub(super) fn drv(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> DmaError {
    move |e| DmaError::Cuda { op, detail: e.to_string() }
}

/// `buf` with at least `len` bytes: kept when large enough, else replaced (its previous use
/// must have finished).
fn at_least(ctx: &Arc<CudaContext>, buf: &mut DeviceBuffer, len: usize) -> Result<(), DmaError> {
    if buf.len() < len {
        *buf = DeviceBuffer::new(ctx, len.next_power_of_two())?;
    }
    Ok(())
}

/// `scratch` with at least `len` bytes: kept when large enough, else replaced (its previous
/// use must have finished; a fused-form save still holding it keeps it alive).
fn scratch_at_least(
    ctx: &Arc<CudaContext>,
    scratch: &mut Arc<DeviceBuffer>,
    len: usize,
) -> Result<(), DmaError> {
    if scratch.len() < len {
        *scratch = Arc::new(DeviceBuffer::new(ctx, len.next_power_of_two())?);
    }
    Ok(())
}

impl ChunkHasher {
    /// Loads the kernels on `ctx`; an error when they do not load (then checksums stay on the
    /// CPU).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, DmaError> {
        // The kernels write results into mapped pinned memory at its host address.
        let unified = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            )
            .map_err(drv("cuDeviceGetAttribute"))?;
        if unified != 1 {
            return Err(DmaError::Invalid(
                "the device lacks unified addressing, which the checksum kernels need".into(),
            ));
        }
        let kernels = ChecksumKernels::load(ctx)?;
        let pull = CopyKernel::load(ctx)
            .map_err(|e| tracing::warn!(error = %e, "checksum tables go up by copy: segment copy kernel not loaded"))
            .ok();
        let mut slots = Vec::with_capacity(SLOTS);
        for _ in 0..SLOTS {
            // Default, i.e. lowest, priority: the copy engine's gather and scatter kernels take
            // SMs first.
            let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
            let counters = DeviceBuffer::zeroed_on(ctx, 64 << 10, &stream)?;
            // The zeros in place before anything here may be dropped (an error below frees
            // what was made so far).
            stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
            slots.push(Slot {
                tables_host: PinnedHost::new(ctx, 64 << 10)?,
                pull_descs: PinnedHost::new(ctx, 4 << 10)?,
                tables: DeviceBuffer::new(ctx, 64 << 10)?,
                scratch: Arc::new(DeviceBuffer::new(ctx, 1 << 20)?),
                counters,
                done: ctx.new_event(None).map_err(drv("cuEventCreate"))?,
                summing: Arc::new(AtomicBool::new(false)),
                stream,
            });
        }
        static IDS: AtomicU64 = AtomicU64::new(0);
        Ok(Self {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            ctx: Arc::clone(ctx),
            kernels,
            pull,
            slots,
            next: 0,
            pool: Arc::new(Mutex::new(Vec::new())),
            times: super::SubmitTimes::default(),
        })
    }

    /// Unique in this process (see [`SummedSave`]).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The context's device ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Where `submit`'s time went since the last call (waiting for a slot's earlier
    /// submission; writing the checksum tables), reset to zero.
    pub fn take_times(&mut self) -> super::SubmitTimes {
        std::mem::take(&mut self.times)
    }

    /// Starts computing the checksums of the chunks whose bytes `pieces` name in GPU memory
    /// (consecutive chunks of `chunk_len` bytes, as `chunk_pieces` appends them); `None` when
    /// the chunks are too short for the kernels (at most 240 bytes: checksum them on the
    /// CPU). May wait for the submission before last to finish.
    ///
    /// # Safety
    /// Every piece's device range must be memory of this context's device that stays valid
    /// and unchanged until the ticket's event completes (the engine's pages being saved).
    pub(crate) unsafe fn submit(
        &mut self,
        pieces: &[Piece],
        chunk_len: u64,
    ) -> Result<Option<ChecksumTicket>, DmaError> {
        if chunk_len < MIN_LEN {
            return Ok(None);
        }
        let (n, table_len) = tables_capacity(pieces, chunk_len)?;
        let shape = Shape { chunks: n, host_len: table_len, device_len: table_len, expand: None };
        // SAFETY: forwarded from the caller.
        unsafe {
            self.submit_tables(shape, |out| {
                let t = write_tables(pieces, chunk_len, out)?;
                Ok((t.segs_offset, t.row_segs_offset, t.rows))
            })
        }
    }

    /// [`ChunkHasher::submit_blocks`] by the table-driven row sums, where the block row sums
    /// do not apply: the host writes the block ids, the device every record from them
    /// (`orbitkv_xxh3_expand_blocks`), with no list of pieces and no tables crossing the bus.
    ///
    /// # Safety
    /// As [`ChunkHasher::submit_blocks`].
    unsafe fn submit_block_tables(
        &mut self,
        job: &BlockJob<'_>,
        chunk_len: u64,
    ) -> Result<Option<ChecksumTicket>, DmaError> {
        if chunk_len < MIN_LEN {
            return Ok(None);
        }
        let t = block_tables(job, chunk_len)?;
        let count = |what: &str, v: u64| {
            u32::try_from(v).map_err(|_| DmaError::Invalid(format!("{v} {what} in one submission")))
        };
        // Addresses filled in by `submit_tables`: the ids where it writes them, the records in
        // the slot's device tables.
        let expand = ExpandLaunch {
            ids: 0,
            bases: (job.parts, count("parts per block", job.part_count())?),
            stride: job.stride,
            part_len: job.part_len,
            per_chunk: count("blocks per chunk", t.per_chunk as u64)?,
            nchunks: count("chunks", t.chunks as u64)?,
            chunks: 0,
            segs: 0,
            row_segs: 0,
        };
        let shape = Shape {
            chunks: t.chunks,
            host_len: t.ids_len,
            device_len: t.len,
            expand: Some(expand),
        };
        // SAFETY: forwarded from the caller.
        unsafe {
            self.submit_tables(shape, |out| {
                write_block_ids(job, out);
                Ok((t.segs_offset, t.row_segs_offset, t.rows))
            })
        }
    }

    /// The fused form (`--gpu-checksums fused`, the server's default): reserves a slot whose scratch
    /// rows the save's gather fills as it copies ([`super::CopyEngine::submit_blocks`] with
    /// the returned value), then [`ChunkHasher::finish_summed`] folds them. None where the form
    /// does not apply: the kernels missing from the PTX, parts not a multiple of 1 KiB or
    /// addresses not 16-byte aligned (then [`ChunkHasher::submit_blocks`]). May wait for the
    /// submission before last to finish.
    pub fn begin_summed(
        &mut self,
        job: &BlockJob<'_>,
        chunk_len: u64,
    ) -> Result<Option<SummedSave>, DmaError> {
        if !self.summed_applies(job) {
            return Ok(None);
        }
        // The same checks as the tables' (chunk lengths, counts), none of their bytes.
        let t = block_tables(job, chunk_len)?;
        let nchunks = u32::try_from(t.chunks)
            .map_err(|_| DmaError::Invalid(format!("{} chunks in one submission", t.chunks)))?;
        let per_chunk = u32::try_from(t.per_chunk)
            .map_err(|_| DmaError::Invalid(format!("{} blocks per chunk", t.per_chunk)))?;
        if nchunks == 0 {
            return Ok(None);
        }
        let index = self.free_slot()?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let results = self.pinned_results(t.chunks * 8)?;
        let slot = &mut self.slots[index];
        // The slot's scratch and counters are free once its last use finished.
        super::wait_for(&slot.done, &mut self.times.waited)?;
        scratch_at_least(&self.ctx, &mut slot.scratch, (t.rows * ROW_BYTES) as usize)?;
        counters_for(&self.ctx, slot, t.chunks)?;
        let Some(gather) =
            self.kernels.summed_gather(slot.scratch.ptr(), chunk_len / 1024, per_chunk)
        else {
            return Ok(None);
        };
        slot.summing.store(true, Ordering::Release);
        self.next = (self.next + 1) % SLOTS;
        Ok(Some(SummedSave {
            slot: index,
            hasher: self.id,
            results,
            nchunks,
            chunk_len,
            gather,
            scratch: Arc::clone(&slot.scratch),
            summing: Arc::clone(&slot.summing),
        }))
    }

    /// Starts the checksums of `chunks` (block ids of `memory`, `chunk_len` bytes each, packed
    /// as the layout orders a block's parts) without copying them: what a save's checksums
    /// cost alone. None where the kernels do not apply (chunks too short). The ticket keeps
    /// the memory until its kernels have finished.
    pub fn checksums(
        &mut self,
        memory: &Arc<super::EngineMemory>,
        chunks: &[(u64, Vec<u64>)],
        chunk_len: u64,
    ) -> Result<Option<ChecksumTicket>, DmaError> {
        if memory.ordinal() != self.ordinal() {
            return Err(DmaError::Invalid(format!(
                "the engine's memory is on device {}, these kernels on device {}",
                memory.ordinal(),
                self.ordinal()
            )));
        }
        // Host offsets play no part in checksums.
        let job = memory.block_job(0, chunks)?;
        // SAFETY: the block ids were checked against the memory (on this device, checked
        // above), which the ticket holds until its event has completed (its `Drop` waits).
        let ticket = unsafe { self.submit_blocks(&job, chunk_len)? };
        Ok(ticket.map(|mut t| {
            t._memory = Some(Arc::clone(memory));
            t
        }))
    }

    /// Whether the fused form applies to `job`'s shape: its kernels in the PTX, parts a
    /// multiple of 1 KiB, addresses 16-byte aligned ([`ChunkHasher::begin_summed`] also
    /// declines a job without chunks).
    pub fn summed_applies(&self, job: &BlockJob<'_>) -> bool {
        self.kernels.summed_gather(0, 0, 0).is_some() && rows_by_units(job)
    }

    /// The slot the next submission takes (see [`SummedSave::slot`]: a fused-form save
    /// holding it must be finished first).
    pub fn next_slot(&self) -> usize {
        self.next
    }

    /// The next slot, unless a fused-form save begun on it is not finished (its gathers may
    /// be writing its scratch, and its `done` does not follow them): then an error, the
    /// submission refused.
    fn free_slot(&self) -> Result<usize, DmaError> {
        if self.slots[self.next].summing.load(Ordering::Acquire) {
            return Err(DmaError::Invalid(format!(
                "checksum slot {} is held by a fused-form save whose fold is not queued yet",
                self.next
            )));
        }
        Ok(self.next)
    }

    /// Gives back the slot of a fused-form save whose job's submission failed, once nothing
    /// of that job runs on the GPU any more (the copy engine synchronized its streams, as
    /// `submit_blocks` does on an error): no fold was queued, so the slot's `done` still
    /// follows its previous use.
    pub fn abandon_summed(&mut self, s: SummedSave) {
        self.slots[s.slot].summing.store(false, Ordering::Release);
        // Never handed to a kernel.
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(s.results);
    }

    /// Folds a fused-form save's rows on the slot's stream; the ticket yields the checksums.
    ///
    /// # Safety
    /// `s` must have gone to the copy engine's `submit_blocks` for its job, and every gather
    /// of that job have been seen finished.
    pub(crate) unsafe fn finish_summed(
        &mut self,
        s: SummedSave,
    ) -> Result<ChecksumTicket, DmaError> {
        if s.hasher != self.id {
            return Err(DmaError::Invalid(
                "a fused-form save finished by another hasher than the one that began it".into(),
            ));
        }
        self.slots[s.slot].summing.store(false, Ordering::Release);
        let slot = &self.slots[s.slot];
        let stream = &slot.stream;
        let ctx = &self.ctx;
        let kernels = &self.kernels;
        let enqueue = || -> Result<CudaEvent, DmaError> {
            let event = ctx.new_event(None).map_err(drv("cuEventCreate"))?;
            // SAFETY: the rows are written (the gathers seen finished: the caller's contract);
            // scratch and counters are the slot's, reserved by `begin_summed` (the scratch kept
            // by the slot until `done`, recorded below, has passed); the results are pinned,
            // owned by the ticket until its event completes.
            unsafe {
                kernels.launch_fold_uniform(
                    stream,
                    (s.chunk_len, s.nchunks),
                    s.scratch.ptr(),
                    slot.counters.ptr(),
                    s.results.addr(),
                )?
            };
            slot.done.record(stream).map_err(drv("cuEventRecord"))?;
            event.record(stream).map_err(drv("cuEventRecord"))?;
            Ok(event)
        };
        let event = match enqueue() {
            Ok(event) => event,
            Err(e) => {
                // The slot's `done` may not follow what was queued here: the slot is free for
                // its next user only once that has finished.
                if let Err(sync) = stream.synchronize() {
                    tracing::warn!(error = %sync, "checksum stream failed after a failed submission");
                    std::mem::forget(s.results);
                }
                return Err(e);
            }
        };
        Ok(ChecksumTicket {
            event,
            results: Some(s.results),
            count: s.nchunks as usize,
            pool: Arc::clone(&self.pool),
            _memory: None,
        })
    }

    /// [`ChunkHasher::submit`] for a job in block form (its chunks of `chunk_len` bytes): by
    /// the block row sums where they apply (a warp per unit of the block gather's walk, no
    /// tables), by the table-driven row sums otherwise.
    ///
    /// # Safety
    /// As [`ChunkHasher::submit`], for every part of every block of the job.
    pub(crate) unsafe fn submit_blocks(
        &mut self,
        job: &BlockJob<'_>,
        chunk_len: u64,
    ) -> Result<Option<ChecksumTicket>, DmaError> {
        // SAFETY: forwarded from the caller.
        if let Some(ticket) = unsafe { self.submit_block_rows(job, chunk_len)? } {
            return Ok(Some(ticket));
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.submit_block_tables(job, chunk_len) }
    }

    /// [`ChunkHasher::submit_blocks`] by the block row sums (`orbitkv_xxh3_block_rows`: the
    /// fused gather's walk over the job's units, reading the engine's pages without copying
    /// them) and the uniform fold: two launches, no segment or row tables, the host writing
    /// the block ids only. None where it does not apply (the kernels missing from the PTX,
    /// parts not a multiple of 1 KiB, addresses not 16-byte aligned, chunks too short for the
    /// kernels). May wait for the submission before last to finish.
    ///
    /// # Safety
    /// As [`ChunkHasher::submit_blocks`].
    unsafe fn submit_block_rows(
        &mut self,
        job: &BlockJob<'_>,
        chunk_len: u64,
    ) -> Result<Option<ChecksumTicket>, DmaError> {
        // SAFETY: forwarded from the caller.
        let Some(rows) = (unsafe { self.enqueue_block_rows(job, chunk_len)? }) else {
            return Ok(None);
        };
        let slot = rows.slot;
        let stream = Arc::clone(&self.slots[slot].stream);
        let job = FoldJobRecord::of(&rows, &self.slots[slot]);
        let fold = || {
            // SAFETY: the rows were summed on this stream before; scratch, counters and
            // results are the submission's (`enqueue_block_rows`).
            unsafe {
                self.kernels.launch_fold_uniform(
                    &stream,
                    (job.len, job.nchunks as u32),
                    job.scratch,
                    job.counters,
                    job.out,
                )
            }
        };
        self.finish_folds(vec![rows], &stream, fold).map(|mut t| t.pop())
    }

    /// Launches `fold` on `stream` for `jobs` (their rows summed), then releases their slots
    /// and makes their tickets; on a failure, lets what was queued finish first.
    fn finish_folds(
        &self,
        jobs: Vec<PendingRows>,
        stream: &Arc<CudaStream>,
        fold: impl FnOnce() -> Result<(), DmaError>,
    ) -> Result<Vec<ChecksumTicket>, DmaError> {
        // The events inside: the jobs' row sums are queued already, so any failure from here
        // on goes through the synchronization below before the slots can be reused.
        let enqueue = || -> Result<Vec<CudaEvent>, DmaError> {
            let events: Vec<CudaEvent> = jobs
                .iter()
                .map(|_| self.ctx.new_event(None).map_err(drv("cuEventCreate")))
                .collect::<Result<_, _>>()?;
            fold()?;
            for (p, e) in jobs.iter().zip(&events) {
                self.slots[p.slot].done.record(stream).map_err(drv("cuEventRecord"))?;
                e.record(stream).map_err(drv("cuEventRecord"))?;
            }
            Ok(events)
        };
        let events = match enqueue() {
            Ok(events) => events,
            Err(e) => {
                // Whatever was queued may still read the slots and write the results.
                let synced = jobs.iter().all(|p| self.slots[p.slot].stream.synchronize().is_ok())
                    && stream.synchronize().is_ok();
                if !synced {
                    tracing::warn!("checksum stream failed after a failed submission");
                    for p in jobs {
                        std::mem::forget(p.results);
                    }
                }
                return Err(e);
            }
        };
        Ok(jobs
            .into_iter()
            .zip(events)
            .map(|(p, event)| ChecksumTicket {
                event,
                count: p.nchunks,
                results: Some(p.results),
                pool: Arc::clone(&self.pool),
                _memory: None,
            })
            .collect())
    }

    /// Reserves a slot for a block-form job and enqueues its block row sums there; the fold
    /// is the caller's. None where they do not apply.
    ///
    /// # Safety
    /// As [`ChunkHasher::submit_blocks`].
    unsafe fn enqueue_block_rows(
        &mut self,
        job: &BlockJob<'_>,
        chunk_len: u64,
    ) -> Result<Option<PendingRows>, DmaError> {
        if chunk_len < MIN_LEN || !self.kernels.has_block_rows() || !rows_by_units(job) {
            return Ok(None);
        }
        // The same checks as the tables' (chunk lengths, counts), none of their bytes.
        let t = block_tables(job, chunk_len)?;
        if t.chunks == 0 {
            return Ok(None);
        }
        let count = |what: &str, v: usize| {
            u32::try_from(v).map_err(|_| DmaError::Invalid(format!("{v} {what} in one submission")))
        };
        let per_chunk = count("blocks per chunk", t.per_chunk)?;
        let nblocks = count("blocks", t.chunks * t.per_chunk)?;
        let part_count = count("parts per block", job.bases.len())?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let index = self.free_slot()?;
        let results = self.pinned_results(t.chunks * 8)?;
        let slot = &mut self.slots[index];
        self.next = (self.next + 1) % SLOTS;
        // The slot's ids, scratch and counters are free once its last use finished.
        super::wait_for(&slot.done, &mut self.times.waited)?;
        if slot.tables_host.len() < t.ids_len {
            slot.tables_host = PinnedHost::new(&self.ctx, t.ids_len.next_power_of_two())?;
        }
        let started = std::time::Instant::now();
        write_block_ids(job, &mut slot.tables_host.bytes_mut()[..t.ids_len]);
        self.times.planned += started.elapsed();
        scratch_at_least(&self.ctx, &mut slot.scratch, (t.rows * ROW_BYTES) as usize)?;
        counters_for(&self.ctx, slot, t.chunks)?;
        let launch = BlockRowsLaunch {
            parts: (job.parts, part_count),
            blocks: slot.tables_host.addr(),
            stride: job.stride,
            part_len: job.part_len,
            scratch: (slot.scratch.ptr(), chunk_len / ROW_LEN),
            nblocks,
            per_chunk,
        };
        // SAFETY: the ids (mapped pinned, read in place), scratch and counters are the slot's,
        // free (waited on `done` above) until the fold records `done`; the parts are the
        // job's memory (the caller's contract). A failed launch queued nothing.
        unsafe { self.kernels.launch_block_rows(&slot.stream, &launch) }?;
        Ok(Some(PendingRows { slot: index, len: chunk_len, nchunks: t.chunks, results }))
    }

    /// The submission behind both forms: the tables' `shape`, and `write`, which writes the
    /// host's part of them into the slot's pinned buffer and says where the segment and row
    /// records are and how many rows.
    ///
    /// # Safety
    /// As [`ChunkHasher::submit`], for the device memory the tables name.
    unsafe fn submit_tables(
        &mut self,
        shape: Shape,
        write: impl FnOnce(&mut [u8]) -> Result<(usize, usize, u64), DmaError>,
    ) -> Result<Option<ChecksumTicket>, DmaError> {
        let (n, table_len) = (shape.chunks, shape.host_len);
        if n == 0 {
            return Ok(None);
        }
        let nchunks = u32::try_from(n)
            .map_err(|_| DmaError::Invalid(format!("{n} chunks in one checksum submission")))?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let index = self.free_slot()?;
        let results = self.pinned_results(n * 8)?;
        self.next = (self.next + 1) % SLOTS;
        let (segs_offset, row_segs_offset, rows) = self.write_slot_tables(index, &shape, write)?;
        // A block-form save's records are written on the device (no tables to bring over).
        let pull_count = if shape.expand.is_some() { 0 } else { table_len.div_ceil(PULL_PIECE) };
        if self.pull.is_some() && pull_count > 0 {
            self.slots[index].write_pull_descs(&self.ctx, table_len, pull_count)?;
        }
        let event = self.ctx.new_event(None).map_err(drv("cuEventCreate"))?;
        let slot = &self.slots[index];
        let stream = &slot.stream;
        let chunks_at = slot.tables.ptr();
        let launch = ChecksumLaunch {
            chunks: (chunks_at, nchunks),
            segs: chunks_at + segs_offset as u64,
            row_segs: chunks_at + row_segs_offset as u64,
            scratch: (slot.scratch.ptr(), rows),
            counters: slot.counters.ptr(),
            out: results.addr(),
        };
        let expand = shape.expand.map(|e| ExpandLaunch {
            ids: slot.tables_host.addr(),
            chunks: chunks_at,
            segs: chunks_at + segs_offset as u64,
            row_segs: chunks_at + row_segs_offset as u64,
            ..e
        });
        let tables = TablesLaunch { checksum: launch, expand, pull_count, table_len };
        // SAFETY: the slot's tables were written and its buffers are free (waited on `done` in
        // `write_slot_tables`); `results` is pinned, owned by the ticket below (or forgotten);
        // the device memory the tables name is the caller's contract.
        let enqueued = unsafe { self.enqueue_checksums(slot, &tables, &event) };
        if let Err(e) = enqueued {
            // Whatever was queued may still read the slot and write `results`: let it finish
            // before they are reused or freed.
            if let Err(sync) = stream.synchronize() {
                tracing::warn!(error = %sync, "checksum stream failed after a failed submission");
                std::mem::forget(results);
            }
            return Err(e);
        }
        Ok(Some(ChecksumTicket {
            event,
            results: Some(results),
            count: n,
            pool: Arc::clone(&self.pool),
            _memory: None,
        }))
    }

    /// Waits for slot `index`'s last use, then builds a submission's tables of `shape` into
    /// its pinned buffer (`write`, see [`ChunkHasher::submit_tables`]) and makes room in its
    /// device tables, scratch rows and counters. Returns what `write` said.
    fn write_slot_tables(
        &mut self,
        index: usize,
        shape: &Shape,
        write: impl FnOnce(&mut [u8]) -> Result<(usize, usize, u64), DmaError>,
    ) -> Result<(usize, usize, u64), DmaError> {
        let table_len = shape.host_len;
        let slot = &mut self.slots[index];
        // The slot's tables and scratch are free once its last use finished.
        super::wait_for(&slot.done, &mut self.times.waited)?;
        if slot.tables_host.len() < table_len {
            slot.tables_host = PinnedHost::new(&self.ctx, table_len.next_power_of_two())?;
        }
        // Built straight into the slot's pinned tables, in one pass over the pieces.
        let t = std::time::Instant::now();
        let image = write(&mut slot.tables_host.bytes_mut()[..table_len]);
        self.times.planned += t.elapsed();
        let (segs_offset, row_segs_offset, rows) = image?;
        at_least(&self.ctx, &mut slot.tables, shape.device_len)?;
        scratch_at_least(&self.ctx, &mut slot.scratch, (rows * ROW_BYTES) as usize)?;
        counters_for(&self.ctx, slot, shape.chunks)?;
        Ok((segs_offset, row_segs_offset, rows))
    }

    /// Enqueues a submission on `slot`'s stream: its tables brought to the device (by the
    /// expansion, the pull or a copy), the checksum kernels, then `done` and `event`.
    ///
    /// # Safety
    /// As [`ChunkHasher::submit`], for the device memory the tables name; the slot's pinned
    /// tables (and pull descriptors) written, its buffers free until `done` is recorded here,
    /// and the results `tables.checksum` names pinned and kept until `event` completes.
    unsafe fn enqueue_checksums(
        &self,
        slot: &Slot,
        tables: &TablesLaunch,
        event: &CudaEvent,
    ) -> Result<(), DmaError> {
        let (kernels, pull, stream) = (&self.kernels, self.pull.as_ref(), &slot.stream);
        let (pull_count, table_len) = (tables.pull_count, tables.table_len);
        let chunks_at = slot.tables.ptr();
        match (&tables.expand, pull) {
            // The expansion reads the ids where they were written (mapped pinned memory,
            // 8 bytes per block) and writes every record on the device.
            // SAFETY: the pinned ids and the device tables belong to the slot, free
            // (waited on `done` before the call) until `done` is recorded below; the bases are
            // the job's memory (the caller's contract).
            (Some(e), _) => unsafe { kernels.launch_expand(stream, e)? },
            // The tables come over by the copy kernel, its warps reading the mapped pinned
            // tables (and their own descriptors) in place. A copy would be a host-to-device
            // copy, which beside a load queues behind the load's data on the copy engine,
            // and the save's checksums (so the save) would wait a whole load batch.
            // SAFETY: the pinned tables and descriptors and the device tables belong to
            // the slot, free (waited on `done` before the call) until `done` is recorded below.
            (None, Some(k)) => unsafe {
                // A warp per piece: the reads cross PCIe, and many in flight is what
                // brings the tables over quickly.
                let grid = CopyKernel::grid(pull_count as u32, 1, 256, u32::MAX);
                k.launch(stream, slot.pull_descs.addr(), pull_count as u32, 1, grid, 256)?;
            },
            // SAFETY: the same tables as the pull's (the slot's pinned descriptors, written,
            // and its device tables, free until `done`), uploaded by a copy instead.
            (None, None) => unsafe {
                ffi::copy_async(
                    Way::HostToDevice,
                    chunks_at,
                    slot.tables_host.addr(),
                    table_len,
                    stream,
                )?;
            },
        }
        // The fold kernel writes the checksums straight into the pinned results (host memory
        // is mapped at the same address under unified addressing): a copy back would queue
        // behind the saves' data on the device-to-host copy engine and hold the slot until
        // a whole staging batch had crossed.
        // SAFETY: tables uploaded earlier on this stream; scratch and counters are the
        // slot's (the counters zero: zeroed on this stream at allocation, and put back by
        // every fold, the slot's last one finished); the results (`tables.checksum.out`) are
        // pinned, owned by the ticket until its event completes; the pieces' memory is the
        // caller's contract.
        unsafe { kernels.launch(stream, &tables.checksum)? };
        slot.done.record(stream).map_err(drv("cuEventRecord"))?;
        event.record(stream).map_err(drv("cuEventRecord"))
    }

    /// A pinned buffer of at least `len` bytes from the pool, or a new one.
    fn pinned_results(&self, len: usize) -> Result<PinnedHost, DmaError> {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = pool.iter().position(|b| b.len() >= len) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        PinnedHost::new(&self.ctx, len.max(8 << 10))
    }
}

impl Drop for ChunkHasher {
    fn drop(&mut self) {
        // Kernels and buffers go only after the streams have finished with them.
        let _ = self.ctx.bind_to_thread();
        for slot in &self.slots {
            if let Err(e) = slot.stream.synchronize() {
                tracing::warn!(error = %e, "checksum stream failed while closing");
            }
        }
    }
}
