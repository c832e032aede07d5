//! Host memory mapped at a fixed address: the arena, as the server and its clients map it.

/// Host memory mapped at one address for as long as the value lives (the server's arena, or a
/// process's mapping of it), made of one or more mappings laid end to end (one per memfd).
/// What CUDA host registration takes: it registers each part on its own and keeps the value
/// alive until it has unregistered them.
///
/// # Safety
///
/// Implementors promise that `base()..base() + size()` stays mapped, readable and writable as
/// long as the value lives, and that `parts()` tiles `0..size()` in address order.
#[allow(unsafe_code)]
pub unsafe trait HostMapping: Send + Sync {
    /// The first byte.
    fn base(&self) -> *mut u8;
    /// Bytes mapped.
    fn size(&self) -> u64;
    /// The mappings it is made of, `(offset from base, bytes)`, in address order.
    fn parts(&self) -> Vec<(u64, u64)>;
}
