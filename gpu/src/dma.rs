//! Moving engine KV pages between GPU memory and the arena: copy plans ([`plan`]), the copy
//! engine of one device ([`CopyEngine`]) and the CUDA calls behind it.

pub mod checksum;
mod engine;
mod ffi;
mod hasher;
mod memory;
pub mod plan;
mod timeline;
mod transfer;

pub use engine::{BatchSpan, CopyEngine, Direction, JobShape};
pub use ffi::DeviceBuffer;
pub(crate) use ffi::{driver_library_present, host_register, host_unregister, pci_address};
pub use hasher::{ChecksumTicket, ChunkHasher, SummedSave, SUMMED_UNFINISHED};
pub use memory::{EngineMemory, TensorExport};
pub use timeline::SpanTotals;
pub use transfer::{CopyJob, Progress, SaveSums, Transfer};

/// Pieces at least this long go batched under [`Strategy::Auto`]: measured on the H200 host
/// (docs/performance.md), `cuMemcpyBatchAsync` matched the staging pipeline only for pieces of
/// a megabyte or more (cross-layer blocks), and it uses no SM; below, staging wins (at 32 KiB
/// 0.92-0.95 of the ceiling batched against 0.96-0.98 staged, at 2 KiB 0.07 against 0.88).
pub const BATCHED_FROM: u64 = 1 << 20;

pub use orbitkv_config::JOB_BYTES;

pub use orbitkv_config::Strategy;

/// Where a submitting thread's time went inside [`CopyEngine::submit`] or
/// [`ChunkHasher::submit`], summed since the last `take_times`: the rest of a submission's
/// time is the CUDA calls that enqueue it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubmitTimes {
    /// Blocked on earlier work (a staging half, a descriptor table or a checksum slot still in
    /// use). CUDA spins meanwhile, so a thread CPU clock counts it as work.
    pub waited: std::time::Duration,
    /// Planning into pinned host memory: staged batches and their descriptor tables (the
    /// engine), checksum tables (the hasher).
    pub planned: std::time::Duration,
    /// Finding a job's pieces, or checking its block ids ([`CopyEngine::start`]).
    pub pieces: std::time::Duration,
}

impl std::ops::Add for SubmitTimes {
    type Output = Self;

    fn add(self, o: Self) -> Self {
        Self {
            waited: self.waited + o.waited,
            planned: self.planned + o.planned,
            pieces: self.pieces + o.pieces,
        }
    }
}

/// Waits for `event` and adds the time to `waited`: what a submitting thread spent blocked on
/// the GPU's progress (a staging half, a descriptor table or a checksum slot still in use).
/// CUDA spins while it waits, so the thread's CPU clock counts this time as work; taking it
/// apart tells planning from waiting.
fn wait_for(
    event: &cudarc::driver::CudaEvent,
    waited: &mut std::time::Duration,
) -> Result<(), DmaError> {
    let t = std::time::Instant::now();
    let r = event.synchronize().map_err(hasher::drv("cuEventSynchronize"));
    *waited += t.elapsed();
    r
}

/// Failures of the DMA path.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {detail}")]
    Cuda {
        /// The call.
        op: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// A request that cannot be carried out as given.
    #[error("invalid DMA request: {0}")]
    Invalid(String),
}
