//! Registration of the DRAM arena with CUDA (`cuMemHostRegister`), so that copy engines can
//! move bytes between engine GPU memory and arena slots directly.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};
use orbitkv_shards::Arena;

use crate::GpuError;

/// The arena, registered with one device's context; unregistered on drop, before the arena
/// (which it keeps alive) can be unmapped.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    arena: Arc<Arena>,
    /// How long registering took.
    pub elapsed: Duration,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("bytes", &self.arena.len()).finish_non_exhaustive()
    }
}

/// Registers the whole arena (portable: usable from every context) with device `ordinal`.
pub fn register_arena(ordinal: usize, arena: &Arc<Arena>) -> Result<HostRegistration, GpuError> {
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| GpuError::Cuda(format!("creating a context on device {ordinal}: {e}")))?;
    ctx.bind_to_thread().map_err(|e| GpuError::Cuda(format!("binding the context: {e}")))?;
    let started = Instant::now();
    // SAFETY: the range is exactly the arena's live mapping, kept alive by the Arc stored in
    // the registration until after the matching unregister in `drop`.
    let status = unsafe {
        sys::cuMemHostRegister_v2(
            arena.base_ptr().cast(),
            arena.len() as usize,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::Cuda(format!("cuMemHostRegister of the arena failed: {status:?}")));
    }
    Ok(HostRegistration { ctx, arena: Arc::clone(arena), elapsed: started.elapsed() })
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: unregisters the range registered in `register_arena`; the arena is still
        // mapped (this struct holds an Arc to it).
        let status = unsafe { sys::cuMemHostUnregister(self.arena.base_ptr().cast()) };
        if status != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?status, "cuMemHostUnregister of the arena failed");
        }
    }
}
