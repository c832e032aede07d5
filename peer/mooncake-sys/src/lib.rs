//! Raw FFI to Mooncake Transfer Engine's C API (`transfer_engine_c.h`), and nothing else.
//!
//! The functions are looked up at run time in a TE build's shared library (for example
//! `libtransfer_engine.so` of a `mooncake-transfer-engine` CMake build), so that nothing of TE
//! is needed to build OrbitKV and a host without TE is told so when it asks for it, not when
//! the binary starts. Only the calls OrbitKV makes are bound; they have kept their signatures
//! since TE's C API gained `getLocalIpAndPort` (2025).
//!
//! Everything here is `unsafe` to call; `orbitkv-peer` wraps it in a safe engine type.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, OsStr};

/// An engine handle (`transfer_engine_t`).
pub type transfer_engine_t = *mut c_void;
/// A transport handle (`transport_t`).
pub type transport_t = *mut c_void;
/// A peer segment's id in this engine (`segment_id_t`); negative on error.
pub type segment_id_t = i32;
/// A batch of transfers (`batch_id_t`).
pub type batch_id_t = u64;

/// `INVALID_BATCH`: what `allocateBatchID` returns when it fails.
pub const INVALID_BATCH: batch_id_t = u64::MAX;
/// `OPCODE_READ`: read the peer's memory into `source`.
pub const OPCODE_READ: c_int = 0;
/// `OPCODE_WRITE`: write `source` into the peer's memory.
pub const OPCODE_WRITE: c_int = 1;

/// `STATUS_WAITING`.
pub const STATUS_WAITING: c_int = 0;
/// `STATUS_PENDING`.
pub const STATUS_PENDING: c_int = 1;
/// `STATUS_INVALID`.
pub const STATUS_INVALID: c_int = 2;
/// `STATUS_CANCELED`.
pub const STATUS_CANCELED: c_int = 3;
/// `STATUS_COMPLETED`.
pub const STATUS_COMPLETED: c_int = 4;
/// `STATUS_TIMEOUT`.
pub const STATUS_TIMEOUT: c_int = 5;
/// `STATUS_FAILED`.
pub const STATUS_FAILED: c_int = 6;

/// `struct transfer_request`: one transfer of a batch. `target_offset` is the address in the
/// peer's registered memory.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct transfer_request {
    pub opcode: c_int,
    pub source: *mut c_void,
    pub target_id: segment_id_t,
    pub target_offset: u64,
    pub length: u64,
}

/// `struct transfer_status`: where one transfer of a batch is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct transfer_status {
    pub status: c_int,
    pub transferred_bytes: u64,
}

/// Why the library could not be used.
#[derive(Debug)]
pub enum LoadError {
    /// `dlopen` failed (the loader's message names the path or a missing dependency).
    Open(libloading::Error),
    /// The library lacks a function of the C API.
    Symbol(&'static str, libloading::Error),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Open(e) => write!(f, "{e}"),
            LoadError::Symbol(name, e) => {
                write!(f, "not a Transfer Engine C API library: no `{name}` ({e})")
            }
        }
    }
}

impl std::error::Error for LoadError {}

macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The C API's functions, looked up in one loaded library (kept loaded while this
        /// lives).
        #[allow(non_snake_case)]
        pub struct Api {
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,
            )*
            _lib: libloading::Library,
        }

        impl Api {
            /// Loads the library at `path` (a file name alone is searched for as `dlopen`
            /// does) and looks up every function.
            ///
            /// # Safety
            /// Loading runs the library's initializers: `path` must be a build of Mooncake
            /// Transfer Engine whose C API has the signatures declared here.
            pub unsafe fn load(path: impl AsRef<OsStr>) -> Result<Api, LoadError> {
                // SAFETY: the caller vouches for what the library is (see above).
                let lib = unsafe { libloading::Library::new(path.as_ref()) }
                    .map_err(LoadError::Open)?;
                Ok(Api {
                    $(
                        // SAFETY: the symbol is TE's C function of this name, whose signature
                        // the field's type states (the caller's promise above); the pointer is
                        // used only while `_lib` keeps the library loaded.
                        $name: unsafe {
                            *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|e| LoadError::Symbol(stringify!($name), e))?
                        },
                    )*
                    _lib: lib,
                })
            }
        }
    };
}

api! {
    createTransferEngine: fn(*const c_char, *const c_char, *const c_char, u64, c_int)
        -> transfer_engine_t;
    getLocalIpAndPort: fn(transfer_engine_t, *mut c_char, usize) -> c_int;
    installTransport: fn(transfer_engine_t, *const c_char, *mut *mut c_void) -> transport_t;
    destroyTransferEngine: fn(transfer_engine_t);
    openSegment: fn(transfer_engine_t, *const c_char) -> segment_id_t;
    openSegmentNoCache: fn(transfer_engine_t, *const c_char) -> segment_id_t;
    closeSegment: fn(transfer_engine_t, segment_id_t) -> c_int;
    registerLocalMemory: fn(transfer_engine_t, *mut c_void, usize, *const c_char, c_int) -> c_int;
    unregisterLocalMemory: fn(transfer_engine_t, *mut c_void) -> c_int;
    allocateBatchID: fn(transfer_engine_t, usize) -> batch_id_t;
    submitTransfer: fn(transfer_engine_t, batch_id_t, *mut transfer_request, usize) -> c_int;
    getTransferStatus: fn(transfer_engine_t, batch_id_t, usize, *mut transfer_status) -> c_int;
    freeBatchID: fn(transfer_engine_t, batch_id_t) -> c_int;
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_structs_have_the_c_layout() {
        // x86_64 / aarch64 Linux: int (4) + pad (4) + pointer (8) + int32 (4) + pad (4) + 2 x u64.
        assert_eq!(std::mem::size_of::<transfer_request>(), 40);
        assert_eq!(std::mem::offset_of!(transfer_request, source), 8);
        assert_eq!(std::mem::offset_of!(transfer_request, target_id), 16);
        assert_eq!(std::mem::offset_of!(transfer_request, target_offset), 24);
        assert_eq!(std::mem::offset_of!(transfer_request, length), 32);
        assert_eq!(std::mem::size_of::<transfer_status>(), 16);
        assert_eq!(std::mem::offset_of!(transfer_status, transferred_bytes), 8);
    }

    #[test]
    fn a_missing_library_or_function_is_named() {
        // SAFETY: the path does not exist; nothing is loaded.
        let err = unsafe { Api::load("/nonexistent/libtransfer_engine.so") }.unwrap_err();
        assert!(matches!(err, LoadError::Open(_)), "{err}");
        assert!(err.to_string().contains("/nonexistent/libtransfer_engine.so"), "{err}");
        // libc is a real library without TE's functions: the first one looked up is named.
        // SAFETY: loading libc (already loaded in this process) runs no new initializers.
        let err = unsafe { Api::load("libc.so.6") }.unwrap_err();
        assert!(matches!(err, LoadError::Symbol("createTransferEngine", _)), "{err}");
        assert!(err.to_string().contains("createTransferEngine"), "{err}");
    }
}
