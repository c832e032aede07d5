//! The SSD tier of one shard: its file format ([`format`]), the region log that places and
//! recovers records ([`log`]), the io_uring ring that moves bytes between memory slots and the
//! file with O_DIRECT and injects faults on request ([`ring`]), and the store that ties them to
//! one shard's file ([`store`]).
//!
//! The memory the ring reads into and writes from is anything that implements
//! [`SlotMemory`]: the server's shards hand it their arena slice.

pub mod format;
#[cfg(test)]
mod heap;
pub mod log;
mod memory;
pub mod ring;
pub mod store;

#[cfg(test)]
pub(crate) use heap::HeapSlots;
pub use memory::SlotMemory;
