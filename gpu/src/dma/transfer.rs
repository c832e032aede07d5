//! Copy jobs as owned values: [`CopyEngine::start`] checks a job against the memory it names
//! and hands it to the GPU; the [`Transfer`] it returns owns everything the GPU may touch for
//! the job (the engine's memory, the host registration, a save's checksum slot and results)
//! until the job's work has finished. Dropping a transfer waits for that work; it never frees
//! memory the GPU may still use. The fused checksum protocol (begin the slot, sum in the
//! gather, fold once the gathers are seen done, or give the slot back) lives here once.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaEvent;

use super::hasher::{drv, SummedSave};
use super::plan::{BlockJob, Piece};
use super::{ChecksumTicket, ChunkHasher, CopyEngine, DeviceBuffer, Direction, DmaError};
use super::{EngineMemory, JobShape, Strategy};
use crate::HostRegistration;

/// One copy job: chunks of `chunk_len` bytes, each at an offset of the host registration and
/// made of blocks of the engine's memory (packed block after block, as the layout orders a
/// block's parts).
#[derive(Clone, Copy)]
pub struct CopyJob<'a> {
    /// Save (engine pages to host) or load.
    pub direction: Direction,
    /// The engine's tensors, on the engine's device.
    pub memory: &'a Arc<EngineMemory>,
    /// The registered host memory the chunks lie in (the arena).
    pub host: &'a Arc<HostRegistration>,
    /// Per chunk: its offset in `host` and its block ids.
    pub chunks: &'a [(u64, Vec<u64>)],
    /// Bytes per chunk.
    pub chunk_len: u64,
}

/// What a save computes on the GPU beside its copy (loads compute nothing).
pub enum SaveSums<'h> {
    /// No checksums (the caller hashes the chunks, or the job is a load).
    Off,
    /// The chunks' checksums by kernels of their own beside the copy.
    Kernels(&'h mut ChunkHasher),
    /// Summed by the save's own gather where the form applies (block form, parts a multiple
    /// of 1 KiB), folded once the gathers are seen done ([`Transfer::fold`]); elsewhere as
    /// `Kernels`.
    Fused(&'h mut ChunkHasher),
}

/// Where a transfer stands ([`Transfer::progress`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The copy is running.
    Copying,
    /// The copy has landed; the checksums are still being computed (or folded).
    Summing,
    /// Everything has finished: [`Transfer::finish`] returns at once.
    Done,
}

/// A save's checksums on the GPU.
enum Sums {
    /// None computed (a load, `SaveSums::Off`, a form that did not start: the caller hashes).
    Off,
    /// Being computed; the ticket yields them.
    Ticket(ChecksumTicket),
    /// Summed by the gather, the fold not queued yet: queued once `gathered` (recorded after
    /// the job's last gather) is seen complete.
    Unfolded { save: SummedSave, gathered: CudaEvent },
}

/// What a transfer keeps alive on the device side.
enum Device {
    /// An engine's tensors.
    Engine(Arc<EngineMemory>),
    /// A buffer of this process ([`CopyEngine::start_contiguous`]).
    Buffer(Arc<DeviceBuffer>),
}

/// A copy job on the GPU (see the module doc).
pub struct Transfer {
    copied: CudaEvent,
    shape: JobShape,
    sums: Sums,
    /// Dropped only after `copied` (and the checksums) have finished: see `Drop`.
    device: Device,
    host: Arc<HostRegistration>,
}

impl CopyEngine {
    /// Checks `job` (its memory on this engine's device, block ids in range, every chunk
    /// inside the host registration and of `chunk_len` bytes) and hands it to the GPU: in
    /// block form where [`CopyEngine::blocks_for`] says so, else as pieces (planned into
    /// `pieces`, a buffer the caller reuses). A save's checksums start as `sums` asks; where
    /// they cannot (kernels missing, chunks too short, a failed launch: logged), the transfer
    /// has none and the caller hashes the chunks. May block briefly when the staging parts
    /// are busy with earlier work.
    pub fn start(
        &mut self,
        job: &CopyJob<'_>,
        strategy: Strategy,
        sums: SaveSums<'_>,
        pieces: &mut Vec<Piece>,
    ) -> Result<Transfer, DmaError> {
        let started = Instant::now();
        let ordinal = self.context().ordinal();
        if job.memory.ordinal() != ordinal {
            return Err(DmaError::Invalid(format!(
                "the engine's memory is on device {}, this copy engine on device {ordinal}",
                job.memory.ordinal()
            )));
        }
        let host_base = job.host.range(0, 0)?;
        for (offset, _) in job.chunks {
            job.host.range(*offset, job.chunk_len)?;
        }
        let save = job.direction == Direction::Save;
        let (hasher, fused) = match sums {
            SaveSums::Off => (None, false),
            SaveSums::Kernels(h) => (Some(h).filter(|_| save), false),
            SaveSums::Fused(h) => (Some(h).filter(|_| save), save),
        };
        if let Some(h) = hasher.as_ref().filter(|h| h.ordinal() != ordinal) {
            return Err(DmaError::Invalid(format!(
                "checksum kernels of device {}, a copy engine of device {ordinal}",
                h.ordinal()
            )));
        }
        let blocks = job.memory.block_job(host_base, job.chunks)?;
        let summed_save = fused && hasher.as_ref().is_some_and(|h| h.summed_applies(&blocks));
        let (copied, shape, sums) = if self.blocks_for(strategy, &blocks, summed_save) {
            let block_bytes = blocks.block_bytes();
            if let Some((_, ids)) =
                job.chunks.iter().find(|(_, ids)| ids.len() as u64 * block_bytes != job.chunk_len)
            {
                return Err(DmaError::Invalid(format!(
                    "chunk of {} bytes where {} were reserved",
                    ids.len() as u64 * block_bytes,
                    job.chunk_len
                )));
            }
            self.add_piece_time(started);
            self.start_blocks(job, &blocks, hasher, summed_save)?
        } else {
            pieces.clear();
            for (offset, ids) in job.chunks {
                let len = job.memory.chunk_pieces(ids, host_base + offset, pieces)?;
                if len != job.chunk_len {
                    return Err(DmaError::Invalid(format!(
                        "chunk of {len} bytes where {} were reserved",
                        job.chunk_len
                    )));
                }
            }
            self.add_piece_time(started);
            // SAFETY: every piece names the job's engine memory on this engine's device
            // (checked above; block ids checked by `chunk_pieces`) and a range inside the
            // registered host memory (checked above); the transfer returned holds both until
            // the copy's event has completed (its `Drop` waits).
            let (copied, shape) = unsafe { self.submit(job.direction, pieces, strategy)? };
            let sums = match hasher {
                // SAFETY: the pieces' device ranges are the job's engine memory, checked as for
                // the copy; the ticket's event completes before the transfer lets it go.
                Some(h) => ticket(unsafe { h.submit(pieces, job.chunk_len) }),
                None => Sums::Off,
            };
            (copied, shape, sums)
        };
        Ok(Transfer {
            copied,
            shape,
            sums,
            device: Device::Engine(Arc::clone(job.memory)),
            host: Arc::clone(job.host),
        })
    }

    /// A job in block form, with its checksums as asked.
    fn start_blocks(
        &mut self,
        job: &CopyJob<'_>,
        blocks: &BlockJob<'_>,
        mut hasher: Option<&mut ChunkHasher>,
        summed_save: bool,
    ) -> Result<(CudaEvent, JobShape, Sums), DmaError> {
        let summed = match hasher.as_mut().filter(|_| summed_save) {
            Some(h) => h.begin_summed(blocks, job.chunk_len).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "fused GPU checksums not started; kernels of their own compute them");
                None
            }),
            None => None,
        };
        // SAFETY: as `CopyEngine::start`'s pieces, for every part of every block (ids checked
        // by `block_job`, chunk lengths and host ranges by the caller); a fused gather writes
        // the rows into the scratch `summed` keeps alive.
        let submitted = unsafe { self.submit_blocks(job.direction, blocks, summed.as_ref()) };
        let (copied, shape) = match submitted {
            Ok(r) => r,
            Err(e) => {
                // `submit_blocks` synchronized the streams on the error (or failed to).
                if let Some(s) = summed {
                    self.release_once_idle(s);
                }
                return Err(e);
            }
        };
        let sums = match (summed, hasher) {
            (Some(save), _) => match self.kernels_done() {
                Ok(gathered) => Sums::Unfolded { save, gathered },
                Err(e) => {
                    tracing::warn!(error = %e, "fused GPU checksums not finished; the chunks are hashed on the host");
                    self.release_once_idle(save);
                    Sums::Off
                }
            },
            // SAFETY: as the copy's blocks; the ticket's event completes before the transfer
            // lets the memory go.
            (None, Some(h)) => ticket(unsafe { h.submit_blocks(blocks, job.chunk_len) }),
            (None, None) => Sums::Off,
        };
        Ok((copied, shape, sums))
    }

    /// A contiguous copy of `len` bytes between `buffer` at `at` and `host` at `offset` (the
    /// ceiling benchmarks measure against); both ranges checked.
    pub fn start_contiguous(
        &mut self,
        direction: Direction,
        (buffer, at): (&Arc<DeviceBuffer>, u64),
        host: &Arc<HostRegistration>,
        offset: u64,
        len: u64,
    ) -> Result<Transfer, DmaError> {
        let ordinal = self.context().ordinal();
        let inside = at.checked_add(len).is_some_and(|end| end <= buffer.len() as u64);
        if buffer.ordinal() != ordinal || !inside {
            return Err(DmaError::Invalid(format!(
                "a {len}-byte copy at {at} of a {}-byte buffer of device {}, on device {ordinal}",
                buffer.len(),
                buffer.ordinal(),
            )));
        }
        let host_at = host.range(offset, len)?;
        // SAFETY: both ranges checked above; the transfer holds the buffer and the
        // registration until the copy's event has completed.
        let copied =
            unsafe { self.contiguous(direction, buffer.ptr() + at, host_at, len as usize)? };
        let shape = JobShape { bytes: len, pieces: 1, host_runs: 1, ..JobShape::default() };
        Ok(Transfer {
            copied,
            shape,
            sums: Sums::Off,
            device: Device::Buffer(Arc::clone(buffer)),
            host: Arc::clone(host),
        })
    }

    /// Gives back a fused save's slot once nothing of its job runs on the GPU (the engine's
    /// streams synchronized); if that cannot be seen (a failed context), the slot stays held.
    fn release_once_idle(&self, s: SummedSave) {
        match self.synchronize() {
            Ok(()) => s.release_after_gathers(),
            Err(e) => tracing::error!(slot = s.slot(), error = %e,
                "copy streams failed after a failed submission; a checksum slot stays held"),
        }
    }

    fn add_piece_time(&mut self, since: Instant) {
        self.add_times(super::SubmitTimes { pieces: since.elapsed(), ..Default::default() });
    }
}

/// A checksum submission's outcome as the transfer keeps it (a failure logged: the caller
/// hashes the chunks).
fn ticket(submitted: Result<Option<ChecksumTicket>, DmaError>) -> Sums {
    match submitted {
        Ok(Some(t)) => Sums::Ticket(t),
        Ok(None) => Sums::Off,
        Err(e) => {
            tracing::warn!(error = %e, "GPU checksums not started; the chunks are hashed on the host");
            Sums::Off
        }
    }
}

impl Transfer {
    /// What the job did (bytes, pieces, batches, host runs, form).
    pub fn shape(&self) -> JobShape {
        self.shape
    }

    /// Where the job stands; an error when its copy failed ([`Transfer::finish`] then
    /// returns it too).
    pub fn progress(&self) -> Result<Progress, DmaError> {
        if !self.copied.try_is_complete().map_err(drv("cuEventQuery"))? {
            return Ok(Progress::Copying);
        }
        Ok(match &self.sums {
            Sums::Off => Progress::Done,
            // A failed ticket counts as done: `finish` reports no checksums.
            Sums::Ticket(t) if t.is_complete().unwrap_or(true) => Progress::Done,
            Sums::Ticket(_) | Sums::Unfolded { .. } => Progress::Summing,
        })
    }

    /// The checksum slot of `hasher` this transfer holds while its fold is not queued.
    pub fn held_slot(&self, hasher: &ChunkHasher) -> Option<usize> {
        match &self.sums {
            Sums::Unfolded { save, .. } if save.hasher() == hasher.id() => Some(save.slot()),
            _ => None,
        }
    }

    /// Queues the fold of a fused save once its gathers are seen done, or with `wait` after
    /// waiting for them (`hasher` must be the one its checksums began on: another is refused
    /// with an error, nothing changed). True when a fold was queued or given up (logged: its
    /// chunks are then hashed by the caller); false when there was none to queue or its
    /// gathers still run.
    pub fn fold(&mut self, hasher: &mut ChunkHasher, wait: bool) -> Result<bool, DmaError> {
        let Sums::Unfolded { save, gathered } = &self.sums else { return Ok(false) };
        if save.hasher() != hasher.id() {
            return Err(DmaError::Invalid(
                "a fused save folded by another hasher than its own".into(),
            ));
        }
        // An event that failed counts as done: the wait below reports it.
        if !wait && gathered.try_is_complete() == Ok(false) {
            return Ok(false);
        }
        let waited = gathered.synchronize();
        let Sums::Unfolded { save, .. } = std::mem::replace(&mut self.sums, Sums::Off) else {
            unreachable!("matched above")
        };
        if let Err(e) = waited {
            tracing::warn!(error = %e, "fused GPU checksums: the gathers failed; the chunks are hashed on the host");
            // The slot stays held (its gathers cannot be seen finished), and so does the
            // scratch they write.
            std::mem::forget(save);
            return Ok(true);
        }
        // SAFETY: `save` went with this transfer's job to `submit_blocks`, and that job's
        // gathers have finished (waited just above).
        match unsafe { hasher.finish_summed(save) } {
            Ok(t) => self.sums = Sums::Ticket(t),
            Err(e) => tracing::warn!(error = %e,
                "fused GPU checksums not finished; the chunks are hashed on the host"),
        }
        Ok(true)
    }

    /// Waits for the job and returns a save's checksums (None where the GPU computed none or
    /// they failed: logged; the caller hashes the chunks), or the copy's failure. A fused
    /// save's fold must have been queued ([`Transfer::fold`]) for its checksums to come back.
    pub fn finish(mut self) -> Result<Option<Vec<u64>>, DmaError> {
        self.copied.synchronize().map_err(drv("cuEventSynchronize"))?;
        match std::mem::replace(&mut self.sums, Sums::Off) {
            Sums::Ticket(t) => Ok(t
                .take()
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "GPU checksums failed; the chunks are hashed on the host")
                })
                .ok()),
            unfolded @ Sums::Unfolded { .. } => {
                // Its gathers came before the copy: give the slot back in `Drop`.
                self.sums = unfolded;
                Ok(None)
            }
            Sums::Off => Ok(None),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // Until the copy has completed the GPU may use the device memory and the host range.
        if let Err(e) = self.copied.synchronize() {
            // A failed context: what the GPU may touch is never freed.
            tracing::error!(error = %e, "a copy's event failed; its memory stays held");
            match &self.device {
                Device::Engine(m) => std::mem::forget(Arc::clone(m)),
                Device::Buffer(b) => std::mem::forget(Arc::clone(b)),
            }
            std::mem::forget(Arc::clone(&self.host));
            if let Sums::Unfolded { save, .. } = std::mem::replace(&mut self.sums, Sums::Off) {
                std::mem::forget(save);
            }
            return;
        }
        match std::mem::replace(&mut self.sums, Sums::Off) {
            // Gathers come before the copy on the GPU: done by now; no fold was queued.
            Sums::Unfolded { save, gathered } => match gathered.synchronize() {
                Ok(()) => save.release_after_gathers(),
                Err(_) => std::mem::forget(save),
            },
            // A ticket's drop waits for its kernels, which read the engine's memory.
            Sums::Ticket(t) => drop(t),
            Sums::Off => {}
        }
    }
}
