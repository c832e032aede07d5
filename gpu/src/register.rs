//! Registration of the DRAM arena with CUDA (`cuMemHostRegister`), so that copy engines can
//! move bytes between engine GPU memory and arena slots directly.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use orbitkv_shards::Arena;

use crate::GpuError;

/// An arena (the server's, or a mapping of it in another process), registered with one
/// device's context; unregistered on drop, before the arena it keeps alive can be unmapped.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    base: usize,
    len: usize,
    _arena: Arc<Arena>,
    /// How long registering took.
    pub elapsed: Duration,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("bytes", &self.len).finish_non_exhaustive()
    }
}

/// Registers the whole arena (portable: usable from every context) with device `ordinal`.
pub fn register_arena(ordinal: usize, arena: &Arc<Arena>) -> Result<HostRegistration, GpuError> {
    register_whole(ordinal, arena)
}

fn register_whole(ordinal: usize, arena: &Arc<Arena>) -> Result<HostRegistration, GpuError> {
    let (base, len) = (arena.base_ptr() as usize, arena.len() as usize);
    // SAFETY: the range is exactly the arena's live mapping, kept alive by the Arc stored in
    // the registration until after the matching unregister in `drop`.
    unsafe { register(ordinal, base, len, Arc::clone(arena)) }
}

/// # Safety
/// `base..base + len` must be a live mapping of this process, page-aligned, registered by
/// nobody else in this process, and stay mapped until the returned registration is dropped.
unsafe fn register(
    ordinal: usize,
    base: usize,
    len: usize,
    arena: Arc<Arena>,
) -> Result<HostRegistration, GpuError> {
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| GpuError::Cuda(format!("creating a context on device {ordinal}: {e}")))?;
    ctx.bind_to_thread().map_err(|e| GpuError::Cuda(format!("binding the context: {e}")))?;
    let started = Instant::now();
    // SAFETY: a live mapping of `len` bytes at `base` (the caller's contract), unregistered
    // in `drop` before the arena the registration holds may be unmapped.
    unsafe { crate::dma::host_register(base, len) }
        .map_err(|e| GpuError::Cuda(format!("registering {len} bytes: {e}")))?;
    Ok(HostRegistration { ctx, base, len, _arena: arena, elapsed: started.elapsed() })
}

impl HostRegistration {
    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether nothing is registered (never: registrations are of whole mappings).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address of `len` bytes at `offset` in the registered range; an error naming
    /// the range when it does not lie inside.
    pub(crate) fn range(&self, offset: u64, len: u64) -> Result<u64, crate::dma::DmaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(self.base as u64 + offset),
            _ => Err(crate::dma::DmaError::Invalid(format!(
                "host range {offset}+{len} is outside the registered {} bytes",
                self.len
            ))),
        }
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: unregisters the range registered in `register`, still mapped: the arena it
        // belongs to is held by this struct until after this call.
        if let Err(e) = unsafe { crate::dma::host_unregister(self.base) } {
            tracing::warn!(error = %e, "unregistering the arena failed");
        }
    }
}
