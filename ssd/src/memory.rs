//! The memory SSD operations move bytes to and from.

#![allow(unsafe_code)]

use std::any::Any;
use std::sync::Arc;

/// Memory addressed by offsets relative to its start (a shard's slice of the arena) that the
/// kernel reads and writes while an SSD operation is in flight.
///
/// # Safety
///
/// Implementors promise that [`raw_range`](Self::raw_range) returns the address of `len`
/// readable and writable bytes, or panics when the range lies outside the memory, and that
/// those bytes stay mapped as long as any clone of [`keep_alive`](Self::keep_alive)'s value
/// lives. The ring hands the address to the kernel and keeps that value with the operation.
pub unsafe trait SlotMemory {
    /// The address of `[offset, offset + len)`; panics when the range lies outside.
    fn raw_range(&self, offset: u64, len: u64) -> *mut u8;

    /// The bytes at `[offset, offset + len)` (to checksum what a read brought in).
    fn bytes(&self, offset: u64, len: u64) -> &[u8];

    /// What keeps the memory mapped while the kernel may still touch it.
    fn keep_alive(&self) -> Arc<dyn Any + Send + Sync>;
}
