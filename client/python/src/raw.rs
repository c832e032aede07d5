//! Caller memory named by address and length: the buffers the `orbitkv` Python layer resolved
//! (bytes, memoryviews, numpy arrays, CPU torch tensors, an engine's KV cache). The only
//! `unsafe` of this crate.
//!
//! The Python layer obtains each address from the object itself (the buffer protocol, or a
//! tensor's `data_ptr()`), checks it is C-contiguous and writable where it is written, and
//! keeps the object referenced for the whole call; these types only carry the address across
//! the released GIL.

#![allow(unsafe_code)]

use pyo3::PyResult;

use crate::errors::invalid;

/// A caller's buffer: `len` bytes at `addr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf {
    addr: usize,
    len: usize,
}

impl RawBuf {
    /// Checks what can be checked of an address from Python: not null unless empty, and the
    /// range does not wrap around.
    pub(crate) fn new(addr: usize, len: usize) -> PyResult<Self> {
        if addr == 0 && len != 0 {
            return Err(invalid(format!("a buffer of {len} bytes at address 0")));
        }
        if addr.checked_add(len).is_none() {
            return Err(invalid(format!("buffer at {addr:#x} of {len} bytes wraps around")));
        }
        Ok(Self { addr, len })
    }

    /// The bytes, for reading.
    pub(crate) fn bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the Python layer made this from a live, contiguous buffer of `len` bytes
        // that it keeps referenced until the call returns, and the returned slice is used
        // only within that call (the native methods never store it).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The bytes, for writing.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as for `bytes`, and the Python layer checked the buffer is writable; the
        // buffers of one call are distinct objects or disjoint blocks of one (each call takes
        // one mutable view per buffer), so no two views alias.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}
