//! A mapping of the session's arena of this process's own (`orbitkv_client::HostArena`), its
//! bytes lent to Python by the buffer protocol (`numpy.frombuffer`, `torch.frombuffer`), and
//! registered with a CUDA device by `orbitkv-gpu` (`cuMemHostRegister`, a range per memfd)
//! for an engine's own copies (`orbitkv.gpu.EngineCopies`). Unsafe only for the export.

#![allow(unsafe_code)]

use std::os::raw::c_int;
use std::sync::Arc;

use orbitkv_client::HostArena;
use orbitkv_gpu::HostRegistration;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::invalid;

/// The arena of one connection, mapped by this process (and registered with one CUDA device
/// where asked); unregistered and unmapped once neither Python nor an array or tensor made
/// from its buffer refers to it.
#[pyclass(module = "orbitkv._native", frozen)]
pub(crate) struct ArenaMapping {
    /// With the device: unregistered before `arena` (which it holds too) can be unmapped.
    registration: Option<(HostRegistration, usize)>,
    arena: Arc<HostArena>,
}

impl ArenaMapping {
    /// The mapping, registered with nothing.
    pub(crate) fn host(arena: HostArena) -> Self {
        Self { registration: None, arena: Arc::new(arena) }
    }

    /// The mapping registered with device `device` (the process's numbering, as torch's).
    pub(crate) fn cuda(py: Python<'_>, arena: HostArena, device: usize) -> PyResult<Self> {
        let arena = Arc::new(arena);
        let host: Arc<dyn orbitkv_client::HostMapping> = arena.clone();
        let registration = py.detach(|| orbitkv_gpu::register_host(device, host)).map_err(|e| {
            invalid(format!("registering the arena with CUDA device {device}: {e}"))
        })?;
        Ok(Self { registration: Some((registration, device)), arena })
    }
}

#[pymethods]
impl ArenaMapping {
    /// The connection (`NativeClient.connection`) whose arena this maps.
    #[getter]
    fn connection(&self) -> u64 {
        self.arena.connection()
    }

    /// The CUDA device it is registered with (None: registered with none).
    #[getter]
    fn device(&self) -> Option<usize> {
        self.registration.as_ref().map(|&(_, device)| device)
    }

    fn __len__(&self) -> usize {
        self.arena.len()
    }

    /// Lends the whole mapping, writable, as unsigned bytes; the view holds this object.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().arena.as_ptr(), slf.get().arena.len());
        let len = isize::try_from(len).map_err(|_| invalid("arena larger than isize::MAX"))?;
        // SAFETY: `view` is the caller's `Py_buffer` to fill (the buffer protocol's contract);
        // `ptr` is the start of `len` mapped, writable bytes, which stay mapped for as long as
        // this object lives, and `PyBuffer_FillInfo` stores a new reference to it in
        // `view.obj`, released only with the view.
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len, 0, flags) };
        if rc == 0 {
            Ok(())
        } else {
            Err(PyErr::fetch(slf.py()))
        }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
