//! The shard's own io_uring ring for its SSD file: O_DIRECT reads and writes that move bytes
//! between arena slots and the file with no bounce copy (the 4 KiB record header is the only
//! buffer of its own).
//!
//! Ownership: every operation in flight owns what the kernel may touch (its header block, its
//! iovec array, the [`SlotMemory`]'s keep-alive: an `Arc` of the arena mapping). The caller
//! keeps the arena slot reserved or pinned until the completion is returned. Dropping the ring
//! waits for every operation in flight: memory handed to the kernel is never freed early.

#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::any::Any;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

use crate::memory::SlotMemory;
use orbitkv_proto::PAGE_SIZE;

/// A 4 KiB-aligned block of whole 4 KiB pages owned by an operation (O_DIRECT needs aligned
/// memory): a record header, or a whole record being rewritten elsewhere.
#[derive(Debug)]
pub struct AlignedBlock {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
}

// SAFETY: an exclusively owned heap block; no aliasing exists to share across threads.
unsafe impl Send for AlignedBlock {}
// SAFETY: through `&self` the block is only read (`bytes`); the crate's test memory writes
// through `as_mut_ptr` only while nothing else reads the range. Only the tests share a block
// between threads (their memory's keep-alive), so only they have this.
#[cfg(test)]
unsafe impl Sync for AlignedBlock {}

impl AlignedBlock {
    /// A zeroed 4 KiB block.
    pub fn new() -> Self {
        Self::with_pages(1)
    }

    /// A zeroed block of `pages` 4 KiB pages (at least one).
    pub fn with_pages(pages: u64) -> Self {
        let bytes = (pages.max(1) * PAGE_SIZE) as usize;
        let layout = Layout::from_size_align(bytes, PAGE_SIZE as usize)
            .expect("whole pages at page alignment form a valid layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, layout }
    }

    /// The block's address, for the crate's test memory (`HeapSlots`).
    #[cfg(test)]
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The block's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `layout.size()` bytes, initialised (zeroed), owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The block's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the view exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Default for AlignedBlock {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AlignedBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `with_pages` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// What an operation in flight keeps alive (its header block is kept in `SsdRing::blocks`).
struct InFlight {
    _iov: Box<[libc::iovec; 2]>,
    _memory: Option<Arc<dyn Any + Send + Sync>>,
    /// The injected delay's timespec, read by the kernel when the linked timeout starts.
    _delay: Option<Box<types::Timespec>>,
}

/// `user_data` of injected-delay timeouts (their completions are not operations).
const DELAY_MARK: u64 = u64::MAX;

// SAFETY: the iovecs point at memory owned by the same operation (its block) or kept alive by
// the memory's keep-alive; nothing about them is tied to the creating thread.
unsafe impl Send for InFlight {}

/// A finished operation.
#[derive(Debug)]
pub struct Completion {
    /// The id [`SsdRing`] returned at submission.
    pub id: u64,
    /// Bytes transferred, or the OS error.
    pub result: std::io::Result<u64>,
    /// The header block of a write, or the block read by a header read.
    pub header: Option<AlignedBlock>,
}

/// One shard's io_uring ring over its SSD file.
pub struct SsdRing {
    ring: IoUring,
    inflight: HashMap<u64, InFlight>,
    blocks: HashMap<u64, AlignedBlock>,
    next_id: u64,
    depth: u32,
    /// Fault injection: every operation starts this long after its submission.
    delay: Option<std::time::Duration>,
    /// Fault injection: every n-th operation fails with `EIO` (submitted against an invalid
    /// descriptor, its error reported as `EIO`).
    fail_every: Option<u64>,
    submitted: u64,
    /// Fault injection: every n-th write fails with `ENOSPC` (the same way).
    no_space_every: Option<u64>,
    writes: u64,
    /// The error the operation being submitted was made to fail with.
    fault_due: Option<i32>,
    /// Operations in flight made to fail, with the error they report.
    faulted: HashMap<u64, i32>,
}

impl std::fmt::Debug for SsdRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdRing").field("inflight", &self.inflight.len()).finish_non_exhaustive()
    }
}

impl SsdRing {
    /// A ring of `depth` entries (at most `depth` operations in flight).
    pub fn new(depth: u32) -> std::io::Result<Self> {
        // Two entries per operation: an injected delay is a linked timeout before it.
        let ring = IoUring::new(depth.saturating_mul(2).max(2))?;
        // Its descriptor tells this ring from the executor's own rings in a thread's
        // /proc/<pid>/task/<tid>/syscall when a shard is found blocked in io_uring_enter.
        tracing::debug!(fd = std::os::fd::AsRawFd::as_raw_fd(&ring), depth, "SSD io_uring ring");
        Ok(Self {
            ring,
            inflight: HashMap::new(),
            blocks: HashMap::new(),
            next_id: 1,
            depth,
            delay: None,
            fail_every: None,
            submitted: 0,
            no_space_every: None,
            writes: 0,
            fault_due: None,
            faulted: HashMap::new(),
        })
    }

    /// Fault injection for tests and drills: every later operation waits `delay` in the
    /// kernel (a linked io_uring timeout) before it starts. Nothing in the process blocks.
    pub fn inject_delay(&mut self, delay: std::time::Duration) {
        self.delay = (!delay.is_zero()).then_some(delay);
    }

    /// Fault injection for tests and drills: every `n`-th later operation fails in the
    /// kernel, reported as `EIO` (a disk error), exercising every error path for real.
    pub fn inject_errors_every(&mut self, n: u64) {
        self.fail_every = (n > 0).then_some(n);
    }

    /// Fault injection for tests and drills: every `n`-th later write fails as on a full
    /// disk (`ENOSPC`; it never reaches the file).
    pub fn inject_no_space_every(&mut self, n: u64) {
        self.no_space_every = (n > 0).then_some(n);
    }

    /// The descriptor the next write uses: [`SsdRing::target`]'s, or an invalid one that
    /// fails as `ENOSPC` when that fault is due.
    fn write_target(&mut self, file: &File) -> types::Fd {
        let fd = self.target(file);
        self.writes += 1;
        match self.no_space_every {
            Some(n) if self.writes.is_multiple_of(n) => {
                self.fault_due = Some(libc::ENOSPC);
                types::Fd(-1)
            }
            _ => fd,
        }
    }

    /// The descriptor the next operation uses: an invalid one (the operation fails in the
    /// kernel without touching the file) when a fault is due.
    fn target(&mut self, file: &File) -> types::Fd {
        self.submitted += 1;
        match self.fail_every {
            Some(n) if self.submitted.is_multiple_of(n) => {
                self.fault_due = Some(libc::EIO);
                types::Fd(-1)
            }
            _ => {
                self.fault_due = None;
                types::Fd(file.as_raw_fd())
            }
        }
    }

    /// Operations in flight.
    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// True when another operation can be submitted.
    pub fn has_room(&self) -> bool {
        (self.inflight.len() as u32) < self.depth
    }

    fn push(&mut self, entry: io_uring::squeue::Entry, mut op: InFlight) -> std::io::Result<u64> {
        if !self.has_room() {
            return Err(std::io::Error::new(std::io::ErrorKind::WouldBlock, "ring full"));
        }
        let id = self.next_id;
        self.next_id += 1;
        let entry = entry.user_data(id);
        let delay = self.delay.map(|d| {
            let ts = Box::new(types::Timespec::new().sec(d.as_secs()).nsec(d.subsec_nanos()));
            let timeout = opcode::Timeout::new(&*ts)
                .flags(types::TimeoutFlags::ETIME_SUCCESS)
                .build()
                .flags(io_uring::squeue::Flags::IO_LINK)
                .user_data(DELAY_MARK);
            (ts, timeout)
        });
        let needed = if delay.is_some() { 2 } else { 1 };
        {
            let sq = self.ring.submission();
            if sq.capacity() - sq.len() < needed {
                return Err(std::io::Error::other("submission queue full"));
            }
        }
        // From here on the request is the kernel's: it is recorded as in flight before it is
        // queued, and queueing cannot fail (room was checked above).
        let entries: Vec<io_uring::squeue::Entry> = match delay {
            Some((ts, timeout)) => {
                op._delay = Some(ts);
                vec![timeout, entry]
            }
            None => vec![entry],
        };
        self.inflight.insert(id, op);
        if let Some(errno) = self.fault_due.take() {
            self.faulted.insert(id, errno);
        }
        // SAFETY: every buffer the entries point at (iovecs, blocks, the timespec) is owned by
        // the operation now in `self.inflight`, where it stays until its completion is reaped
        // (or the ring is dropped, which waits).
        unsafe {
            let mut sq = self.ring.submission();
            for e in &entries {
                sq.push(e).expect("room for the entries was checked above");
            }
        }
        // A failed submit (EAGAIN, ENOMEM) leaves the entries queued: they go out with the next
        // submit (every poll submits), so the operation stays in flight and its id is valid.
        if let Err(e) = self.ring.submit() {
            tracing::warn!(error = %e, "io_uring submit failed; retried on the next poll");
        }
        Ok(id)
    }

    /// Writes a record: `header` (its 4 KiB block) then `slot_len` bytes of the arena slot at
    /// `slot_offset` of `slice` (a multiple of 4 KiB), at file offset `at`. The slot must stay
    /// reserved or pinned, unmodified, until the completion.
    pub fn write_record(
        &mut self,
        file: &File,
        at: u64,
        header: AlignedBlock,
        slice: &impl SlotMemory,
        slot_offset: u64,
        slot_len: u64,
    ) -> std::io::Result<u64> {
        debug_assert!(slot_len.is_multiple_of(PAGE_SIZE) && at.is_multiple_of(PAGE_SIZE));
        let iov = Box::new([
            libc::iovec { iov_base: header.ptr.as_ptr().cast(), iov_len: PAGE_SIZE as usize },
            libc::iovec {
                iov_base: slice.raw_range(slot_offset, slot_len).cast(),
                iov_len: slot_len as usize,
            },
        ]);
        // Through the injected faults, as every other operation.
        let fd = self.write_target(file);
        let entry = opcode::Writev::new(fd, iov.as_ptr(), 2).offset(at).build();
        let id = self
            .push(entry, InFlight { _iov: iov, _memory: Some(slice.keep_alive()), _delay: None })?;
        self.blocks.insert(id, header);
        Ok(id)
    }

    /// Reads `len` bytes (a multiple of 4 KiB) at file offset `at` into the arena slot at
    /// `slot_offset` of `slice`. The slot must stay reserved until the completion.
    pub fn read_into_slot(
        &mut self,
        file: &File,
        at: u64,
        slice: &impl SlotMemory,
        slot_offset: u64,
        len: u64,
    ) -> std::io::Result<u64> {
        self.slot_op(file, at, slice, slot_offset, len, false)
    }

    /// Writes `len` bytes (a multiple of 4 KiB) of the arena slot at `slot_offset` of `slice`
    /// at file offset `at`, with no record header. The slot must stay reserved or pinned,
    /// unmodified, until the completion.
    pub fn write_from_slot(
        &mut self,
        file: &File,
        at: u64,
        slice: &impl SlotMemory,
        slot_offset: u64,
        len: u64,
    ) -> std::io::Result<u64> {
        self.slot_op(file, at, slice, slot_offset, len, true)
    }

    fn slot_op(
        &mut self,
        file: &File,
        at: u64,
        slice: &impl SlotMemory,
        slot_offset: u64,
        len: u64,
        write: bool,
    ) -> std::io::Result<u64> {
        debug_assert!(len.is_multiple_of(PAGE_SIZE) && at.is_multiple_of(PAGE_SIZE));
        let iov = Box::new([
            libc::iovec {
                iov_base: slice.raw_range(slot_offset, len).cast(),
                iov_len: len as usize,
            },
            libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 },
        ]);
        let fd = if write { self.write_target(file) } else { self.target(file) };
        let entry = if write {
            opcode::Writev::new(fd, iov.as_ptr(), 1).offset(at).build()
        } else {
            opcode::Readv::new(fd, iov.as_ptr(), 1).offset(at).build()
        };
        self.push(entry, InFlight { _iov: iov, _memory: Some(slice.keep_alive()), _delay: None })
    }

    /// Writes one 4 KiB block (a superblock) at file offset `at`.
    pub fn write_block(
        &mut self,
        file: &File,
        at: u64,
        block: AlignedBlock,
    ) -> std::io::Result<u64> {
        self.block_op(file, at, block, true)
    }

    /// Writes a record held whole in `block` (a tombstone: its 4 KiB header alone; a record
    /// being rewritten: header and payload) at file offset `at`: as [`SsdRing::write_block`],
    /// but, as every record write, through the injected faults.
    pub fn write_whole_record(
        &mut self,
        file: &File,
        at: u64,
        block: AlignedBlock,
    ) -> std::io::Result<u64> {
        let fd = self.write_target(file);
        self.block_op_on(fd, at, block, true)
    }

    /// Reads one 4 KiB block at file offset `at`; the completion carries it.
    pub fn read_block(&mut self, file: &File, at: u64) -> std::io::Result<u64> {
        self.block_op(file, at, AlignedBlock::new(), false)
    }

    /// Reads `block`'s length at file offset `at` into it (a record to rewrite elsewhere);
    /// the completion carries it. Through the injected faults.
    pub fn read_into(&mut self, file: &File, at: u64, block: AlignedBlock) -> std::io::Result<u64> {
        let fd = self.target(file);
        self.block_op_on(fd, at, block, false)
    }

    fn block_op(
        &mut self,
        file: &File,
        at: u64,
        block: AlignedBlock,
        write: bool,
    ) -> std::io::Result<u64> {
        self.fault_due = None;
        self.block_op_on(types::Fd(file.as_raw_fd()), at, block, write)
    }

    fn block_op_on(
        &mut self,
        fd: types::Fd,
        at: u64,
        block: AlignedBlock,
        write: bool,
    ) -> std::io::Result<u64> {
        let iov = Box::new([
            libc::iovec { iov_base: block.ptr.as_ptr().cast(), iov_len: block.layout.size() },
            libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 },
        ]);
        let entry = if write {
            opcode::Writev::new(fd, iov.as_ptr(), 1).offset(at).build()
        } else {
            opcode::Readv::new(fd, iov.as_ptr(), 1).offset(at).build()
        };
        let id = self.push(entry, InFlight { _iov: iov, _memory: None, _delay: None })?;
        self.blocks.insert(id, block);
        Ok(id)
    }

    /// Reads `out.len()` bytes at `at` into `out`, one 4 KiB block at a time, waiting for
    /// each (start-up, tools and tests only: a serving shard polls). Nothing else may be in
    /// flight: other completions would be consumed here.
    pub fn read_block_sync(&mut self, file: &File, at: u64, out: &mut [u8]) -> std::io::Result<()> {
        assert_eq!(self.inflight(), 0, "read_block_sync runs alone on the ring");
        for (i, chunk) in out.chunks_mut(PAGE_SIZE as usize).enumerate() {
            let at = at + i as u64 * PAGE_SIZE;
            let id = self.read_block(file, at)?;
            let block = loop {
                if let Some(c) = self.wait()?.into_iter().find(|c| c.id == id) {
                    let n = c.result?;
                    if n != PAGE_SIZE {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!("short read of {n} bytes at {at}"),
                        ));
                    }
                    break c.header.expect("a block read returns its block");
                }
            };
            chunk.copy_from_slice(&block.bytes()[..chunk.len()]);
        }
        Ok(())
    }

    /// Collects finished operations without blocking (and submits anything still queued).
    pub fn poll(&mut self) -> Vec<Completion> {
        if !self.ring.submission().is_empty() {
            let _ = self.ring.submit();
        }
        let mut done = Vec::new();
        for cqe in self.ring.completion() {
            let id = cqe.user_data();
            if id == DELAY_MARK {
                continue;
            }
            self.inflight.remove(&id);
            let fault = self.faulted.remove(&id);
            let result = if cqe.result() < 0 {
                let errno = fault.unwrap_or(-cqe.result());
                Err(std::io::Error::from_raw_os_error(errno))
            } else {
                Ok(cqe.result() as u64)
            };
            done.push(Completion { id, result, header: self.blocks.remove(&id) });
        }
        done
    }

    /// Blocks until at least one operation finishes (start-up, recovery and tests only: a
    /// serving shard polls).
    pub fn wait(&mut self) -> std::io::Result<Vec<Completion>> {
        loop {
            let done = self.poll();
            if !done.is_empty() || self.inflight.is_empty() {
                return Ok(done);
            }
            self.ring.submit_and_wait(1)?;
        }
    }
}

impl Drop for SsdRing {
    fn drop(&mut self) {
        // Buffers of operations in flight belong to the kernel until they complete.
        while !self.inflight.is_empty() {
            let _ = self.poll();
            if !self.inflight.is_empty() && self.ring.submit_and_wait(1).is_err() {
                // The ring is unusable; leak the buffers rather than free memory the kernel
                // might still write.
                std::mem::forget(std::mem::take(&mut self.inflight));
                std::mem::forget(std::mem::take(&mut self.blocks));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests;
