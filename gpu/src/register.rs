//! Registration of the DRAM arena with CUDA (`cuMemHostRegister`), so that copy engines can
//! move bytes between engine GPU memory and arena slots directly.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use orbitkv_shards::Arena;

use crate::GpuError;

/// Host memory (the arena, or a client's mapping of it), registered with one device's
/// context; unregistered on drop, before the memory can be unmapped (an arena is kept alive
/// here; a raw range is the caller's to keep mapped).
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    base: usize,
    len: usize,
    _arena: Option<Arc<Arena>>,
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
    unsafe { register(ordinal, base, len, Some(Arc::clone(arena))) }
}

/// Registers `len` bytes of host memory at `base` (portable) with device `ordinal`: an
/// engine's own mapping of the arena, into which its copy engines then write directly. The
/// device's primary context becomes current on the calling thread (and again when the
/// registration is dropped). Registering pins the whole range in the calling process.
///
/// # Safety
/// `base..base + len` must be a live mapping of this process, page-aligned, registered by
/// nobody else in this process, and stay mapped until the returned registration is dropped.
pub unsafe fn register_host_range(
    ordinal: usize,
    base: *mut u8,
    len: usize,
) -> Result<HostRegistration, GpuError> {
    // SAFETY: forwarded from the caller.
    unsafe { register(ordinal, base as usize, len, None) }
}

/// # Safety
/// As [`register_host_range`].
unsafe fn register(
    ordinal: usize,
    base: usize,
    len: usize,
    arena: Option<Arc<Arena>>,
) -> Result<HostRegistration, GpuError> {
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| GpuError::Cuda(format!("creating a context on device {ordinal}: {e}")))?;
    ctx.bind_to_thread().map_err(|e| GpuError::Cuda(format!("binding the context: {e}")))?;
    let started = Instant::now();
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: a live mapping of `len` bytes at `base` (the caller's contract), unregistered
    // in `drop` before it may go away.
    let status = unsafe { sys::cuMemHostRegister_v2(base as *mut std::ffi::c_void, len, flags) };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::Cuda(format!("cuMemHostRegister of {len} bytes failed: {status:?}")));
    }
    Ok(HostRegistration { ctx, base, len, _arena: arena, elapsed: started.elapsed() })
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: unregisters the range registered in `register`, still mapped (an arena is
        // held by this struct; a raw range by the caller's contract).
        let status = unsafe { sys::cuMemHostUnregister(self.base as *mut std::ffi::c_void) };
        if status != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?status, "cuMemHostUnregister failed");
        }
    }
}
