//! Mooncake Transfer Engine (TE) through its C API (`mooncake-sys`), from the shared library of
//! a TE build that the operator names (`--te-library`): the route for hosts with TE built from
//! source. Needs nothing of TE at build time, and no interpreter.
//!
//! Same shape as the wheel's route ([`crate::te`] with feature `te-python`): one engine per
//! process, `P2PHANDSHAKE` (peers name each other `host:rpc_port`, no metadata server), memory
//! registered by address and length, batches of at most 1024 transfers (the TCP transport's
//! queue per peer), each waited for. Local ranges of a transfer must lie in memory registered
//! here: that is checked before TE is asked, so a wrong address is an error, never a write
//! into memory TE was not given.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mooncake_sys as sys;

/// Transfers per batch: TE's TCP transport queues at most 1024 per peer.
const MAX_BATCH: usize = 1024;

/// How often a batch that has not ended is reported (it is waited for until TE ends every
/// transfer of it: given up earlier, its slots could be reused while a late transfer still
/// writes into them).
const SLOW_BATCH_WARNING: Duration = Duration::from_secs(30);
/// How long after a batch's start or its last transfer's end the peer thread polls its status
/// without sleeping (yielding between polls) when it shares its core with TE's threads: a
/// transfer that lands is seen at once, not a sleep later. Past it the peer thread polls on
/// its runtime's timer, every 1 ms.
pub const POLL_HOT: Duration = Duration::from_millis(1);
/// [`POLL_HOT`] for a thread that may keep its core: the peer thread when it polls after
/// activity, a blocking [`TransferEngine::read_many`] (which past it polls every 50 us). The
/// transfers of a batch move at once and what is watched is the first not ended, which need
/// not end first: on the H200 host reads of 16 x 1 MiB went more than 1 ms without it about
/// once each, and a sleep then delays seeing the end by up to a tick.
pub const READ_POLL_HOT: Duration = Duration::from_millis(20);

/// Why a TE call through the C API failed.
#[derive(Debug, thiserror::Error)]
pub enum TeCError {
    /// The library could not be loaded, or is not a TE build with the C API.
    #[error("Mooncake Transfer Engine library {}", load_message(library, source))]
    Load {
        /// The path given.
        library: PathBuf,
        /// What the loader said.
        source: sys::LoadError,
    },
    /// A call returned an error code (or, for `createTransferEngine`, no engine: TE logs why).
    #[error("Mooncake Transfer Engine: {what} returned {code}")]
    Failed {
        /// The call.
        what: &'static str,
        /// Its return code.
        code: i64,
    },
    /// A transfer of the batch ended other than completed.
    #[error("Mooncake Transfer Engine: transfer {index} of a batch to {peer} ended with status {status}")]
    Transfer {
        /// The peer segment.
        peer: String,
        /// The transfer's index in the batch.
        index: usize,
        /// TE's status code (`STATUS_*`).
        status: i32,
    },
    /// A local range lies outside the memory registered with this engine.
    #[error("Mooncake Transfer Engine: local range {addr:#x}+{len} is not in registered memory")]
    NotRegistered {
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A name passed to TE had a NUL byte.
    #[error("Mooncake Transfer Engine: {0:?} has a NUL byte")]
    Nul(String),
}

/// The loader's message names the path already; the lookup's does not.
fn load_message(library: &Path, e: &sys::LoadError) -> String {
    match e {
        sys::LoadError::Open(_) => e.to_string(),
        sys::LoadError::Symbol(..) => format!("{}: {e}", library.display()),
    }
}

/// Loads TE's C API from `library` (a path, or a file name the loader searches for).
pub fn load(library: &Path) -> Result<Arc<sys::Api>, TeCError> {
    // SAFETY: the operator names this library as a Mooncake Transfer Engine build
    // (`--te-library`); a library that lacks any of the functions is refused before use.
    unsafe { sys::Api::load(library) }
        .map(Arc::new)
        .map_err(|source| TeCError::Load { library: library.to_owned(), source })
}

fn cstring(s: &str) -> Result<CString, TeCError> {
    CString::new(s).map_err(|_| TeCError::Nul(s.to_owned()))
}

/// One Transfer Engine, driven through the C API.
pub struct TransferEngine {
    api: Arc<sys::Api>,
    engine: NonNull<c_void>,
    segment: String,
    /// `(addr, len)` of what is registered here.
    registered: Mutex<Vec<(u64, u64)>>,
    /// Peer segments opened, by name (`None`: a transfer to it failed; its description is
    /// fetched afresh when it is opened again).
    segments: Mutex<HashMap<String, Option<sys::segment_id_t>>>,
}

// SAFETY: TE's engine is made for use from many threads at once (its transports run their own
// threads, and submitting, polling and registering lock inside); the handle is a pointer only
// to it, and the bookkeeping here is behind mutexes.
unsafe impl Send for TransferEngine {}
// SAFETY: as for Send: every method takes `&self` and TE locks internally.
unsafe impl Sync for TransferEngine {}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine").field("segment", &self.segment).finish_non_exhaustive()
    }
}

pub use orbitkv_config::TeTransport;

impl TransferEngine {
    /// Starts an engine reachable at `host` (its RPC port chosen by TE) moving bytes with
    /// `transport`.
    pub fn new(api: Arc<sys::Api>, host: &str, transport: TeTransport) -> Result<Self, TeCError> {
        let (metadata, host_c) = (cstring("P2PHANDSHAKE")?, cstring(host)?);
        let discover = i32::from(transport == TeTransport::Auto);
        // SAFETY: the strings are NUL-terminated and outlive the call (TE copies them); port 0
        // lets TE pick its RPC port; with discovery TE installs its transports itself, without
        // it none (TCP is installed below).
        let raw = unsafe {
            (api.createTransferEngine)(
                metadata.as_ptr(),
                host_c.as_ptr(),
                host_c.as_ptr(),
                0,
                discover,
            )
        };
        let engine =
            NonNull::new(raw).ok_or(TeCError::Failed { what: "createTransferEngine", code: 0 })?;
        let mut this = TransferEngine {
            api,
            engine,
            segment: String::new(),
            registered: Mutex::new(Vec::new()),
            segments: Mutex::new(HashMap::new()),
        };
        if transport == TeTransport::Tcp {
            let tcp = cstring("tcp")?;
            // SAFETY: a live engine; `tcp` is NUL-terminated; a null argument list is what
            // TE's TCP transport takes (it has no arguments).
            let installed = unsafe {
                (this.api.installTransport)(this.raw(), tcp.as_ptr(), std::ptr::null_mut())
            };
            if installed.is_null() {
                return Err(TeCError::Failed { what: "installTransport", code: 0 });
            }
        }
        let mut buf = [0u8; 256];
        // SAFETY: a live engine; TE writes at most `buf.len()` bytes, NUL-terminated.
        let code =
            unsafe { (this.api.getLocalIpAndPort)(this.raw(), buf.as_mut_ptr().cast(), buf.len()) };
        if code != 0 {
            return Err(TeCError::Failed { what: "getLocalIpAndPort", code: code.into() });
        }
        this.segment = CStr::from_bytes_until_nul(&buf)
            .map_err(|_| TeCError::Failed { what: "getLocalIpAndPort", code: -1 })?
            .to_string_lossy()
            .into_owned();
        Ok(this)
    }

    fn raw(&self) -> sys::transfer_engine_t {
        self.engine.as_ptr()
    }

    /// The name peers use for this engine's memory (`host:rpc_port`).
    pub fn segment(&self) -> &str {
        &self.segment
    }

    /// Registers `len` bytes at `addr` (the arena) for peers to read and write, and as the
    /// local side of this engine's transfers. The memory must stay mapped while the engine
    /// lives (the arena is mapped for the server's whole life).
    pub fn register(&self, addr: u64, len: u64) -> Result<(), TeCError> {
        let location = cstring("cpu:0")?;
        // SAFETY: a live engine; TE records the range and touches it only in transfers (peers'
        // and ours, whose local ranges are checked against it); the caller keeps it mapped.
        let code = unsafe {
            (self.api.registerLocalMemory)(
                self.raw(),
                addr as *mut c_void,
                len as usize,
                location.as_ptr(),
                1,
            )
        };
        if code != 0 {
            return Err(TeCError::Failed { what: "registerLocalMemory", code: code.into() });
        }
        self.registered.lock().unwrap_or_else(|e| e.into_inner()).push((addr, len));
        Ok(())
    }

    /// Unregisters what [`TransferEngine::register`] registered at `addr`.
    pub fn unregister(&self, addr: u64) -> Result<(), TeCError> {
        // SAFETY: a live engine; unregistering an address TE does not know is an error code.
        let code = unsafe { (self.api.unregisterLocalMemory)(self.raw(), addr as *mut c_void) };
        if code != 0 {
            return Err(TeCError::Failed { what: "unregisterLocalMemory", code: code.into() });
        }
        self.registered.lock().unwrap_or_else(|e| e.into_inner()).retain(|r| r.0 != addr);
        Ok(())
    }

    /// Reads many ranges of `peer`'s memory, `(local, remote, len)` each, waiting for all.
    pub fn read_many(&self, peer: &str, ranges: &[(u64, u64, u64)]) -> Result<(), TeCError> {
        self.transfer(sys::OPCODE_READ, peer, ranges)
    }

    /// Writes many local ranges into `peer`'s memory, `(local, remote, len)` each, waiting for
    /// all.
    pub fn write_many(&self, peer: &str, ranges: &[(u64, u64, u64)]) -> Result<(), TeCError> {
        self.transfer(sys::OPCODE_WRITE, peer, ranges)
    }

    /// Waits for [`TransferEngine::start`]'s transfer, polling on this thread.
    fn transfer(
        &self,
        opcode: i32,
        peer: &str,
        ranges: &[(u64, u64, u64)],
    ) -> Result<(), TeCError> {
        let mut t = self.start(opcode, peer, ranges)?;
        let (mut ended, mut spins, mut progress) = (0, 0u32, Instant::now());
        loop {
            if let Some(result) = t.poll() {
                return result;
            }
            if t.ended() > ended {
                (ended, spins, progress) = (t.ended(), 0, Instant::now());
            }
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else if progress.elapsed() < READ_POLL_HOT {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Starts moving `ranges` (`(local, remote, len)` each) from (`OPCODE_READ`) or to
    /// (`OPCODE_WRITE`) `peer`'s memory; [`Transfer::poll`] follows it. Every local range must
    /// lie in memory registered here (checked first). Opens the peer's segment if it is not
    /// open (a handshake with the peer, which blocks: see [`TransferEngine::is_open`]).
    fn start(
        &self,
        opcode: i32,
        peer: &str,
        ranges: &[(u64, u64, u64)],
    ) -> Result<Transfer<'_>, TeCError> {
        {
            let registered = self.registered.lock().unwrap_or_else(|e| e.into_inner());
            let inside = |&(addr, len): &(u64, u64)| {
                registered.iter().any(|&(base, n)| {
                    addr >= base && addr.checked_add(len).is_some_and(|end| end <= base + n)
                })
            };
            if let Some(&(addr, _, len)) = ranges.iter().find(|r| !inside(&(r.0, r.2))) {
                return Err(TeCError::NotRegistered { addr, len });
            }
        }
        let target = self.open(peer)?;
        let mut t = Transfer {
            engine: self,
            opcode,
            peer: peer.to_owned(),
            target,
            ranges: ranges.to_vec(),
            batch: None,
            ended: 0,
            landed: 0,
            failure: None,
            started: Instant::now(),
            warn_at: SLOW_BATCH_WARNING,
        };
        if !t.ranges.is_empty() {
            if let Err(e) = t.submit_next() {
                self.forget(peer, target);
                return Err(e);
            }
        }
        Ok(t)
    }

    /// Starts reading `ranges` of `peer`'s memory, `(local, remote, len)` each, as
    /// [`TransferEngine::read_many`] does, without waiting: [`Transfer::poll`] follows it.
    pub fn start_read(
        &self,
        peer: &str,
        ranges: &[(u64, u64, u64)],
    ) -> Result<Transfer<'_>, TeCError> {
        self.start(sys::OPCODE_READ, peer, ranges)
    }

    /// Whether `peer`'s segment is open, so that [`TransferEngine::start_read`] does not
    /// block.
    pub fn is_open(&self, peer: &str) -> bool {
        matches!(self.segments.lock().unwrap_or_else(|e| e.into_inner()).get(peer), Some(Some(_)))
    }

    /// Opens `peer`'s segment unless it is open (a handshake with the peer: blocks).
    pub fn open_segment(&self, peer: &str) -> Result<(), TeCError> {
        self.open(peer).map(|_| ())
    }

    /// The id of `peer`'s segment, opened once (and again, its description fetched afresh,
    /// after a transfer to it failed: the peer may have restarted at the same address).
    fn open(&self, peer: &str) -> Result<sys::segment_id_t, TeCError> {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = match segments.get(peer) {
            Some(&Some(id)) => return Ok(id),
            Some(None) => true,
            None => false,
        };
        let name = cstring(peer)?;
        let (what, id) = if fresh {
            // SAFETY: a live engine; `name` is NUL-terminated and TE copies it.
            ("openSegmentNoCache", unsafe {
                (self.api.openSegmentNoCache)(self.raw(), name.as_ptr())
            })
        } else {
            // SAFETY: as above.
            ("openSegment", unsafe { (self.api.openSegment)(self.raw(), name.as_ptr()) })
        };
        if id < 0 {
            return Err(TeCError::Failed { what, code: id.into() });
        }
        segments.insert(peer.to_owned(), Some(id));
        Ok(id)
    }

    /// Makes the next transfer to `peer` fetch its segment's description afresh, as after a
    /// failed transfer: the peer left, and an engine that comes back at its address is
    /// another one (new ports and memory). Transfers under way keep what they have.
    pub fn forget_segment(&self, peer: &str) {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry @ Some(_)) = segments.get_mut(peer) {
            *entry = None;
        }
    }

    fn forget(&self, peer: &str, id: sys::segment_id_t) {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        if segments.get(peer) == Some(&Some(id)) {
            segments.insert(peer.to_owned(), None);
            // SAFETY: a live engine and a segment id it gave.
            unsafe { (self.api.closeSegment)(self.raw(), id) };
        }
    }

    fn free(&self, batch: sys::batch_id_t) {
        // SAFETY: a live engine and a batch it gave whose transfers have all ended (or never
        // started).
        unsafe { (self.api.freeBatchID)(self.raw(), batch) };
    }
}

/// A transfer under way ([`TransferEngine::start`]): its ranges go in batches of at most
/// [`MAX_BATCH`], one after another; [`Transfer::poll`] checks them without blocking, and the
/// transfer is over when it returns `Some`. Each batch is waited for until TE has ended every
/// transfer of it (completed or failed), never given up (its memory could be written later).
pub struct Transfer<'e> {
    engine: &'e TransferEngine,
    opcode: i32,
    peer: String,
    target: sys::segment_id_t,
    ranges: Vec<(u64, u64, u64)>,
    /// The batch under way: its id and first range.
    batch: Option<(sys::batch_id_t, usize)>,
    /// Ranges known to have ended (completed or failed), from the first.
    ended: usize,
    /// Ranges known to have completed, from the first, before any failure.
    landed: usize,
    failure: Option<TeCError>,
    started: Instant,
    warn_at: Duration,
}

impl std::fmt::Debug for Transfer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("peer", &self.peer)
            .field("ranges", &self.ranges.len())
            .field("ended", &self.ended)
            .field("landed", &self.landed)
            .finish_non_exhaustive()
    }
}

impl Transfer<'_> {
    /// The first this many ranges have landed (it only grows; after a failure it stops).
    pub fn landed(&self) -> usize {
        self.landed
    }

    /// The first this many ranges have ended, completed or failed.
    pub fn ended(&self) -> usize {
        self.ended
    }

    /// Checks the transfers without blocking (submitting the next batch when one is over):
    /// `None` while some still move, else the outcome (an error names the first failure),
    /// answered once: poll no more after it.
    pub fn poll(&mut self) -> Option<Result<(), TeCError>> {
        loop {
            // No batch under way: no ranges to move (or the outcome was answered already).
            let Some((batch, first)) = self.batch else { return Some(Ok(())) };
            let len = self.ranges.len().min(first + MAX_BATCH) - first;
            while self.ended < first + len {
                let mut status = sys::transfer_status::default();
                // SAFETY: a live engine, a batch it gave and an index inside it; `status` is
                // written by TE before it returns.
                let code = unsafe {
                    (self.engine.api.getTransferStatus)(
                        self.engine.raw(),
                        batch,
                        self.ended - first,
                        &mut status,
                    )
                };
                if code != 0 {
                    // The batch is unknown to TE now: nothing of it can still run.
                    self.batch = None;
                    return Some(self.over(Err(TeCError::Failed {
                        what: "getTransferStatus",
                        code: code.into(),
                    })));
                }
                match status.status {
                    sys::STATUS_COMPLETED => {
                        if self.failure.is_none() {
                            self.landed = self.ended + 1;
                        }
                    }
                    sys::STATUS_WAITING | sys::STATUS_PENDING => {
                        if self.started.elapsed() > self.warn_at {
                            self.warn_at += SLOW_BATCH_WARNING;
                            tracing::warn!(
                                peer = %self.peer,
                                bytes = self.ranges[first..first + len].iter().map(|r| r.2).sum::<u64>(),
                                waited_s = self.started.elapsed().as_secs(),
                                "a Transfer Engine batch has not ended (its peer paused?); its \
                                 local slots stay reserved until it does"
                            );
                        }
                        return None;
                    }
                    status => {
                        self.failure.get_or_insert(TeCError::Transfer {
                            peer: self.peer.clone(),
                            index: self.ended,
                            status,
                        });
                    }
                }
                self.ended += 1;
            }
            // Every transfer of the batch has ended.
            self.engine.free(batch);
            self.batch = None;
            if self.failure.is_some() || self.ended == self.ranges.len() {
                let result = self.failure.take().map_or(Ok(()), Err);
                return Some(self.over(result));
            }
            if let Err(e) = self.submit_next() {
                return Some(self.over(Err(e)));
            }
        }
    }

    /// The transfer is over with `result`: after a failure the peer's segment is looked up
    /// afresh next time (the peer may be gone or restarted).
    fn over(&self, result: Result<(), TeCError>) -> Result<(), TeCError> {
        if result.is_err() {
            self.engine.forget(&self.peer, self.target);
        }
        result
    }

    /// Submits the batch of ranges from `self.ended` on.
    fn submit_next(&mut self) -> Result<(), TeCError> {
        let first = self.ended;
        let ranges = &self.ranges[first..self.ranges.len().min(first + MAX_BATCH)];
        let mut requests: Vec<sys::transfer_request> = ranges
            .iter()
            .map(|&(local, remote, len)| sys::transfer_request {
                opcode: self.opcode,
                source: local as *mut c_void,
                target_id: self.target,
                target_offset: remote,
                length: len,
            })
            .collect();
        let (api, raw) = (&self.engine.api, self.engine.raw());
        // SAFETY: a live engine.
        let batch = unsafe { (api.allocateBatchID)(raw, requests.len()) };
        if batch == sys::INVALID_BATCH {
            return Err(TeCError::Failed { what: "allocateBatchID", code: -1 });
        }
        // SAFETY: a live engine and batch of this size; `requests` is valid for the call (TE
        // copies it); every local range lies in registered memory (checked by `start`).
        let code =
            unsafe { (api.submitTransfer)(raw, batch, requests.as_mut_ptr(), requests.len()) };
        if code != 0 {
            self.engine.free(batch);
            return Err(TeCError::Failed { what: "submitTransfer", code: code.into() });
        }
        self.batch = Some((batch, first));
        Ok(())
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if let Some((batch, _)) = self.batch {
            // Dropped while transfers may still move (its task ended with the process): the
            // batch is left to TE rather than freed under them.
            tracing::warn!(peer = %self.peer, batch, "a Transfer Engine transfer dropped before it ended; its batch is not freed");
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        // SAFETY: the engine is live and dropped once; `self.api` (a field, dropped after this)
        // keeps the library loaded for the call.
        unsafe { (self.api.destroyTransferEngine)(self.raw()) };
    }
}
