//! The client's shared mapping of the server's arena memfd, and the copies in and out of it
//! ([`copy_chunk`], and [`SummingCopy`], which hashes what it copies). The only `unsafe` of
//! this crate (here and in `copy`).

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use std::sync::atomic::AtomicU32;

use nix::sys::mman::{madvise, mmap, munmap, MapFlags, MmapAdvise, ProtFlags};
use orbitkv_proto::{ARENA_HEADER_BYTES, DOORBELL_STRIDE};

mod copy;
pub use copy::copy_chunk;
pub(crate) use copy::{copy_as, Stores, SummingCopy};

/// A read-write shared mapping of the whole arena, unmapped on drop.
#[derive(Debug)]
pub(crate) struct ArenaMap {
    base: NonNull<c_void>,
    len: usize,
    _fd: OwnedFd,
}

// SAFETY: the mapping is process-wide shared memory; moving its owner to another thread does
// not change who may touch which bytes (that is governed by leases and reservations), and
// `&`/`&mut` views still borrow the owner.
unsafe impl Send for ArenaMap {}

impl ArenaMap {
    /// A new descriptor of the arena memfd (for a mapping of one's own).
    pub(crate) fn dup_fd(&self) -> std::io::Result<OwnedFd> {
        self._fd.try_clone()
    }

    /// Maps `len` bytes of `fd` (populating the page tables when `prefault`); checks the
    /// memfd is at least that large first.
    pub(crate) fn new(fd: OwnedFd, len: u64, prefault: bool) -> Result<Self, String> {
        let stat = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| format!("fstat arena: {e}"))?;
        if (stat.st_size as u64) < len {
            return Err(format!("arena memfd has {} bytes, server announced {len}", stat.st_size));
        }
        let size = usize::try_from(len)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or_else(|| format!("arena size {len} is not mappable"))?;
        // SAFETY: a new shared mapping (addr None) of a memfd at least `len` bytes long, checked
        // above; nothing existing is replaced.
        let base = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| format!("mmap arena: {e}"))?;
        // The server's huge pages (when the host allows them for shared memory) are mapped as
        // huge pages here only if this mapping asks too, before its page tables are filled.
        // SAFETY: advice on exactly this live mapping; it changes no contents.
        let _ = unsafe { madvise(base, size.get(), MmapAdvise::MADV_HUGEPAGE) };
        if prefault {
            // SAFETY: as above; populating (as for a write, without writing) changes nothing.
            if unsafe { madvise(base, size.get(), MmapAdvise::MADV_POPULATE_WRITE) }.is_err() {
                // Kernels before 5.14 lack it: read every page instead (never write: the
                // server's data is there).
                let p = base.as_ptr().cast::<u8>();
                for off in (0..size.get()).step_by(4096) {
                    // SAFETY: inside this live mapping; a read changes nothing.
                    unsafe { p.add(off).read_volatile() };
                }
            }
        }
        Ok(Self { base, len: size.get(), _fd: fd })
    }

    /// A chunk's range: inside the mapping and past its header (the shards' doorbell words,
    /// which no chunk may overlap).
    fn check(&self, offset: u64, len: u64) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 && offset >= ARENA_HEADER_BYTES => Ok(()),
            _ => Err(format!(
                "range {offset}+{len} outside the {}-byte arena's chunk area (from {ARENA_HEADER_BYTES})",
                self.len
            )),
        }
    }

    /// The doorbell word of `shard` in the arena header (see `orbitkv_proto::DOORBELL_STRIDE`).
    pub(crate) fn doorbell(&self, shard: u32) -> Result<&AtomicU32, String> {
        let offset = shard as u64 * DOORBELL_STRIDE;
        if offset + 4 > ARENA_HEADER_BYTES.min(self.len as u64) {
            return Err(format!("shard {shard} has no doorbell word in the arena header"));
        }
        // SAFETY: inside the header of the live mapping (checked), 64-byte aligned (page-aligned
        // mapping, 64-byte stride), and only ever accessed atomically by every process.
        Ok(unsafe {
            &*((self.base.as_ptr() as *const u8).add(offset as usize) as *const AtomicU32)
        })
    }

    /// Where the mapping starts and how long it is.
    pub(crate) fn range(&self) -> (*mut u8, usize) {
        (self.base.as_ptr() as *mut u8, self.len)
    }

    /// The bytes of a leased slot.
    ///
    /// The server guarantees a leased slot is neither reused nor written until released; the
    /// bytes are stable for as long as the caller keeps the lease.
    pub(crate) fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], String> {
        self.check(offset, len)?;
        // SAFETY: the range lies inside the live mapping (checked), which lives as long as
        // `&self`; by the lease protocol nobody writes it while leased.
        Ok(unsafe {
            std::slice::from_raw_parts(
                (self.base.as_ptr() as *const u8).add(offset as usize),
                len as usize,
            )
        })
    }

    /// The bytes of a reserved slot, for the owner of the reservation to write.
    pub(crate) fn bytes_mut(&mut self, offset: u64, len: u64) -> Result<&mut [u8], String> {
        self.check(offset, len)?;
        // SAFETY: inside the live mapping (checked); the server hands a reserved slot to
        // exactly one session and `&mut self` excludes other views through this mapping.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(
                (self.base.as_ptr() as *mut u8).add(offset as usize),
                len as usize,
            )
        })
    }

    /// The bytes of several reserved slots at once, for their owner to write (from several
    /// threads). Refused unless every range lies inside the mapping and no two overlap.
    pub(crate) fn bytes_mut_many(
        &mut self,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<&mut [u8]>, String> {
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_unstable_by_key(|&i| ranges[i].0);
        let mut end = 0u64;
        for &i in &order {
            let (offset, len) = ranges[i];
            self.check(offset, len)?;
            if offset < end {
                return Err(format!("slot at {offset} overlaps another slot (up to {end})"));
            }
            end = offset + len;
        }
        let base = self.base.as_ptr() as *mut u8;
        Ok(ranges
            .iter()
            .map(|&(offset, len)| {
                // SAFETY: every range lies inside the live mapping (checked) and no two overlap
                // (checked after sorting), so the slices are disjoint; `&mut self` excludes other
                // views through this mapping for as long as they live; the server hands a
                // reserved slot to exactly one session.
                unsafe { std::slice::from_raw_parts_mut(base.add(offset as usize), len as usize) }
            })
            .collect())
    }
}

impl Drop for ArenaMap {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made in `new`; views borrow `self`, so
        // none outlives it.
        let _ = unsafe { munmap(self.base, self.len) };
    }
}

/// Takes ownership of a descriptor that `recvmsg` just installed from `SCM_RIGHTS`.
pub(crate) fn adopt_received_fd(raw: RawFd) -> OwnedFd {
    // SAFETY: the kernel installed `raw` into this process for this message only; nothing else
    // refers to it, so the new OwnedFd is its sole owner.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

#[cfg(test)]
mod check_tests {
    use super::*;

    /// A range the server names is used only inside the mapping and past its header: a
    /// faulty answer never reaches the doorbell words or beyond the arena.
    #[test]
    fn chunks_stay_inside_the_mapping_and_out_of_its_header() {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd = memfd_create(c"orbitkv-test", MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&fd, 1 << 20).unwrap();
        let m = ArenaMap::new(fd, 1 << 20, false).unwrap();
        assert!(m.check(ARENA_HEADER_BYTES, 4096).is_ok());
        assert!(m.check((1 << 20) - 4096, 4096).is_ok());
        assert!(m.check(0, 4096).unwrap_err().contains("chunk area"));
        assert!(m.check(ARENA_HEADER_BYTES - 64, 4096).is_err());
        assert!(m.check((1 << 20) - 4096, 8192).is_err());
        assert!(m.check(u64::MAX, 2).is_err());
    }
}
