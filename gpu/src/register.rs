//! Registration of host memory (the DRAM arena, or a process's mapping of it) with CUDA
//! (`cuMemHostRegister`), so that copy engines can move bytes between engine GPU memory and
//! arena slots directly.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use orbitkv_proto::{HostMapping, PAGE_SIZE};

use crate::GpuError;

/// Host memory (the server's arena, or a mapping of it in another process), registered with
/// one device's context, whole or in parts (each a range registered on its own); unregistered
/// on drop, before the memory it keeps alive can be unmapped.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    base: usize,
    len: usize,
    /// The registered ranges (offset from `base`, bytes), in address order, covering
    /// `0..len` together.
    pieces: Vec<(usize, usize)>,
    _host: Arc<dyn HostMapping>,
    /// How long registering took (wall clock, all parts).
    pub elapsed: Duration,
    /// Each part's seconds, in the order of the parts asked for (one for a whole arena).
    pub part_seconds: Vec<f64>,
}

/// A part of the arena to register on its own: `bytes` at `offset`, by a thread pinned to
/// `core` where given (the core that populated it, on the same NUMA node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterPart {
    pub offset: u64,
    pub bytes: u64,
    pub core: Option<usize>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("bytes", &self.len).finish_non_exhaustive()
    }
}

/// Registers the whole of `host` (portable: usable from every context) with device
/// `ordinal`: each of its mappings (the arena's memfds) on its own.
pub fn register_host(
    ordinal: usize,
    host: Arc<dyn HostMapping>,
) -> Result<HostRegistration, GpuError> {
    let parts: Vec<RegisterPart> = host
        .parts()
        .into_iter()
        .map(|(offset, bytes)| RegisterPart { offset, bytes, core: None })
        .collect();
    register_host_parts(ordinal, host, &parts)
}

/// Registers `host` in `parts` (which must cover it, in address order, each at whole
/// 4 KiB pages; empty parts are skipped), each by a thread of its own at once, pinned to its
/// part's core where given: the kernel's pinning walk and the device's mapping of each part
/// then run beside the others, on the part's NUMA node. All or nothing: if a part fails, the
/// parts registered are unregistered again and the error names the part.
pub fn register_host_parts(
    ordinal: usize,
    host: Arc<dyn HostMapping>,
    parts: &[RegisterPart],
) -> Result<HostRegistration, GpuError> {
    check_parts(host.size(), parts)?;
    // Any cudarc call before this check panics where libcuda is missing.
    if !crate::dma::driver_library_present() {
        return Err(GpuError::Cuda("libcuda (the NVIDIA driver library) is not installed".into()));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| GpuError::Cuda(format!("creating a context on device {ordinal}: {e}")))?;
    ctx.bind_to_thread().map_err(|e| GpuError::Cuda(format!("binding the context: {e}")))?;
    let base = host.base() as usize;
    let started = Instant::now();
    let results: Vec<Result<f64, GpuError>> = std::thread::scope(|scope| {
        let threads: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(i, part)| {
                let ctx = &ctx;
                let run = move || register_part(ctx, base, part);
                let spawned = std::thread::Builder::new()
                    .name(format!("orbitkv-cuda-register-{i}"))
                    .spawn_scoped(scope, run);
                (part, spawned)
            })
            .collect();
        threads
            .into_iter()
            .map(|(part, spawned)| match spawned {
                Ok(t) => t.join().unwrap_or_else(|_| {
                    Err(GpuError::Cuda(format!("registering {part:?}: its thread panicked")))
                }),
                // No thread: this one registers the part.
                Err(_) => register_part(&ctx, base, &RegisterPart { core: None, ..*part }),
            })
            .collect()
    });
    let elapsed = started.elapsed();
    let pieces: Vec<(usize, usize)> = parts
        .iter()
        .filter(|p| p.bytes > 0)
        .map(|p| (p.offset as usize, p.bytes as usize))
        .collect();
    if let Some(failed) = results.iter().position(Result::is_err) {
        for (part, result) in parts.iter().zip(&results) {
            if result.is_ok() && part.bytes > 0 {
                // SAFETY: registered by this call just now, still mapped (`host` is held).
                let _ = unsafe { crate::dma::host_unregister(base + part.offset as usize) };
            }
        }
        let mut results = results;
        return Err(results.swap_remove(failed).unwrap_err());
    }
    Ok(HostRegistration {
        ctx,
        base,
        len: host.size() as usize,
        pieces,
        _host: host,
        elapsed,
        part_seconds: results.into_iter().map(|r| r.unwrap_or_default()).collect(),
    })
}

/// Parts that cover `0..len` in order, at whole 4 KiB pages; else an error naming the first
/// part that does not.
fn check_parts(len: u64, parts: &[RegisterPart]) -> Result<(), GpuError> {
    let page = PAGE_SIZE;
    let mut at = 0u64;
    for part in parts {
        if part.offset != at || part.offset % page != 0 || part.bytes % page != 0 {
            return Err(GpuError::Cuda(format!(
                "registering the arena in parts: {part:?} does not follow at byte {at} at a \
                 whole 4 KiB page"
            )));
        }
        at += part.bytes;
    }
    if at != len {
        return Err(GpuError::Cuda(format!(
            "registering the arena in parts: the parts cover {at} of its {len} bytes"
        )));
    }
    Ok(())
}

/// Registers one part on this thread (pinned to its core where given): its seconds.
fn register_part(
    ctx: &Arc<CudaContext>,
    base: usize,
    part: &RegisterPart,
) -> Result<f64, GpuError> {
    if part.bytes == 0 {
        return Ok(0.0);
    }
    if let Some(core) = part.core {
        let mut set = nix::sched::CpuSet::new();
        if let Err(e) = set
            .set(core)
            .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set))
        {
            tracing::warn!(core, error = %e, "could not pin the thread registering an arena part with CUDA");
        }
    }
    ctx.bind_to_thread().map_err(|e| GpuError::Cuda(format!("binding the context: {e}")))?;
    let started = Instant::now();
    let (at, len) = (base + part.offset as usize, part.bytes as usize);
    // SAFETY: a range of the host memory's live mapping (checked to lie inside it), registered by
    // nobody else; unregistered in `drop` (or on a failed sibling, by the caller) before the
    // memory the registration holds may be unmapped.
    unsafe { crate::dma::host_register(at, len) }.map_err(|e| {
        GpuError::Cuda(format!("registering {len} bytes at arena offset {}: {e}", part.offset))
    })?;
    Ok(started.elapsed().as_secs_f64())
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
        for &(offset, _) in &self.pieces {
            // SAFETY: unregisters a range registered in `register_host_parts`, still mapped:
            // the memory it belongs to is held by this struct until after this call.
            if let Err(e) = unsafe { crate::dma::host_unregister(self.base + offset) } {
                tracing::warn!(offset, error = %e, "unregistering a part of the arena failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(offset: u64, bytes: u64) -> RegisterPart {
        RegisterPart { offset, bytes, core: None }
    }

    #[test]
    fn parts_must_cover_the_arena_in_order_at_whole_pages() {
        let page = PAGE_SIZE;
        assert!(
            check_parts(4 * page, &[part(0, page), part(page, 0), part(page, 3 * page)]).is_ok()
        );
        let gap = check_parts(4 * page, &[part(0, page), part(2 * page, 2 * page)]).unwrap_err();
        assert!(gap.to_string().contains("does not follow at byte 4096"), "{gap}");
        let short = check_parts(4 * page, &[part(0, page)]).unwrap_err();
        assert!(short.to_string().contains("cover 4096 of its 16384 bytes"), "{short}");
        let torn = check_parts(4 * page, &[part(0, 100), part(100, 4 * page - 100)]).unwrap_err();
        assert!(torn.to_string().contains("whole 4 KiB page"), "{torn}");
    }
}
