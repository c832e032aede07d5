//! Page-aligned heap memory for the crate's own tests: what the shards' arena slice is to
//! the server.

#![allow(unsafe_code)]

use std::any::Any;
use std::sync::Arc;

use crate::memory::SlotMemory;

/// Page-aligned heap memory for the crate's own tests.
pub(crate) struct HeapSlots(Arc<crate::ring::AlignedBlock>);

impl HeapSlots {
    pub(crate) fn new(bytes: u64) -> Self {
        Self(Arc::new(crate::ring::AlignedBlock::with_pages(
            bytes.div_ceil(orbitkv_proto::PAGE_SIZE),
        )))
    }

    /// Copies `data` in at `offset`; nothing else may touch the range meanwhile (the tests
    /// write before submitting and read after completing).
    pub(crate) fn write(&self, offset: u64, data: &[u8]) {
        let to = self.raw_range(offset, data.len() as u64);
        // SAFETY: `raw_range` checked the range lies in the block, which `self` keeps alive;
        // no operation in flight touches it (see above).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), to, data.len()) }
    }
}

// SAFETY: the block is one allocation kept alive by the `Arc` that `keep_alive` clones;
// `raw_range` checks the range.
unsafe impl SlotMemory for HeapSlots {
    fn raw_range(&self, offset: u64, len: u64) -> *mut u8 {
        let size = self.0.bytes().len() as u64;
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= size),
            "range {offset}+{len} inside {size} bytes"
        );
        self.0.as_mut_ptr().wrapping_add(offset as usize)
    }

    fn bytes(&self, offset: u64, len: u64) -> &[u8] {
        &self.0.bytes()[offset as usize..(offset + len) as usize]
    }

    fn keep_alive(&self) -> Arc<dyn Any + Send + Sync> {
        self.0.clone()
    }
}
