//! Caller memory held for the length of one call: Python objects with the buffer protocol
//! (bytes, bytearray, memoryview, numpy arrays, mmap; the `orbitkv` package turns CPU torch
//! tensors into numpy views of their memory). The only `unsafe` of this crate.
//!
//! A [`Held`] keeps the object's buffer exported (`PyObject_GetBuffer`) until it is dropped:
//! the exporter may neither free nor move the memory meanwhile (a bytearray refuses to resize,
//! an mmap to close), so the slices it lends stay valid across the released-GIL call that
//! uses them. No address ever crosses from Python: whatever object a caller passes, the worst
//! it gets is an `InvalidArgument` naming the argument.

#![allow(unsafe_code)]

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

use crate::errors::invalid;

/// Whether the call reads the buffer or writes into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

/// One caller buffer, exported for as long as this lives: C-contiguous, and writable where
/// the call writes.
pub(crate) struct Held {
    buf: PyUntypedBuffer,
    access: Access,
}

impl Held {
    /// Exports `obj`'s buffer; `what` names the argument in errors (`buffers[2]`, `region 0`).
    pub(crate) fn get(obj: &Bound<'_, PyAny>, access: Access, what: &str) -> PyResult<Self> {
        let type_name = || obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        let buf = PyUntypedBuffer::get(obj).map_err(|_| {
            invalid(format!(
                "{what} of type {} has no buffer protocol (bytes, bytearray, memoryview, numpy \
                 array or CPU torch tensor)",
                type_name()
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(invalid(format!("{what} is not C-contiguous")));
        }
        if access == Access::Write && buf.readonly() {
            return Err(invalid(format!(
                "{what} is read-only ({}); pass a writable buffer",
                type_name()
            )));
        }
        Ok(Self { buf, access })
    }

    /// Exports each of `objs`, named `{what}[i]`-style by `name(i)`.
    pub(crate) fn get_all(
        objs: &[Bound<'_, PyAny>],
        access: Access,
        name: impl Fn(usize) -> String,
    ) -> PyResult<Vec<Self>> {
        objs.iter().enumerate().map(|(i, o)| Self::get(o, access, &name(i))).collect()
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.buf.len_bytes()
    }

    /// The bytes, for reading.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: `self.buf` holds the export of a C-contiguous buffer of `len_bytes` bytes
        // starting at `buf_ptr`, and the exporter keeps that memory allocated and in place
        // until the export is released, which happens when `self` drops; the slice borrows
        // `self`, so it cannot outlive the export.
        unsafe { std::slice::from_raw_parts(self.buf.buf_ptr().cast::<u8>(), self.len()) }
    }

    /// Mutable views of several writable buffers at once, refused (naming the two) when any
    /// two overlap: two views of one bytearray, or the same array passed twice.
    pub(crate) fn views_mut(
        held: &mut [Held],
        name: impl Fn(usize) -> String,
    ) -> PyResult<Vec<&mut [u8]>> {
        if let Some(i) = held.iter().position(|h| h.access != Access::Write) {
            return Err(invalid(format!("{} was taken for reading, not writing", name(i))));
        }
        let mut spans: Vec<(usize, usize, usize)> = held
            .iter()
            .enumerate()
            .filter(|(_, h)| h.len() > 0)
            .map(|(i, h)| (h.buf.buf_ptr() as usize, h.len(), i))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            let ((a, a_len, i), (b, _, j)) = (w[0], w[1]);
            if a + a_len > b {
                let (i, j) = (i.min(j), i.max(j));
                return Err(invalid(format!(
                    "{} and {} overlap: each buffer written by one call must be its own memory",
                    name(i),
                    name(j)
                )));
            }
        }
        Ok(held
            .iter_mut()
            .map(|h| {
                if h.len() == 0 {
                    return &mut [][..];
                }
                // SAFETY: as for `bytes`, and `get` checked the buffer is writable (every
                // `Held` here was exported for `Access::Write`, checked above). The views
                // are pairwise disjoint (checked above), and each borrows its `Held` mutably,
                // so no other view of the same memory exists while they live.
                unsafe { std::slice::from_raw_parts_mut(h.buf.buf_ptr().cast::<u8>(), h.len()) }
            })
            .collect())
    }

    /// A mutable view of one writable buffer.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        Self::views_mut(std::slice::from_mut(self), |_| String::new())
            .expect("one buffer cannot overlap another")
            .pop()
            .expect("one view per buffer")
    }
}
