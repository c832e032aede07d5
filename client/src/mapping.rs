//! The client's shared mapping of the server's arena memfds (one range, the files one after
//! another as the server maps them), and the copies in and out of it
//! ([`copy_chunk`], and [`SummingCopy`], which hashes what it copies). The only `unsafe` of
//! this crate (here and in `copy`).

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use std::sync::atomic::AtomicU32;

use nix::sys::mman::{madvise, mmap, mmap_anonymous, munmap, MapFlags, MmapAdvise, ProtFlags};
use orbitkv_proto::{HostMapping, ARENA_HEADER_BYTES, DOORBELL_STRIDE};

mod copy;
mod error;
pub use copy::copy_chunk;
pub(crate) use copy::{copy_as, Stores, SummingCopy};
pub(crate) use error::MappingError;

/// A read-write shared mapping of the whole arena, unmapped on drop.
#[derive(Debug)]
pub(crate) struct ArenaMap {
    base: NonNull<c_void>,
    len: usize,
    /// The memfds, in mapping order, and each one's length.
    files: Vec<(OwnedFd, u64)>,
}

// SAFETY: the mapping is process-wide shared memory; moving its owner to another thread does
// not change who may touch which bytes (that is governed by leases and reservations), and
// `&`/`&mut` views still borrow the owner.
unsafe impl Send for ArenaMap {}

impl ArenaMap {
    /// New descriptors of the arena's memfds, in mapping order (for a mapping of one's own).
    pub(crate) fn dup_fds(&self) -> std::io::Result<Vec<OwnedFd>> {
        self.files.iter().map(|(fd, _)| fd.try_clone()).collect()
    }

    /// Offset and length of each memfd in the mapping, in order.
    pub(crate) fn files(&self) -> Vec<(u64, u64)> {
        let mut at = 0;
        self.files
            .iter()
            .map(|&(_, bytes)| {
                at += bytes;
                (at - bytes, bytes)
            })
            .collect()
    }

    /// Maps the arena's `fds`, of the `files` lengths the server announced (in order, adding
    /// up to `len`), one after another as one range (populating the page tables when
    /// `prefault`); checks each memfd is at least as long as announced first.
    pub(crate) fn new(
        fds: Vec<OwnedFd>,
        files: &[u64],
        len: u64,
        prefault: bool,
    ) -> Result<Self, MappingError> {
        if fds.len() != files.len() || files.is_empty() {
            return Err(MappingError::Announced { announced: files.len(), sent: fds.len() });
        }
        if files.iter().try_fold(0u64, |sum, &b| sum.checked_add(b)) != Some(len) {
            return Err(MappingError::FilesDoNotAddUp { files: files.to_vec(), len });
        }
        let mut align = 4096u64;
        for (i, (fd, &bytes)) in fds.iter().zip(files).enumerate() {
            let stat = nix::sys::stat::fstat(fd.as_fd())
                .map_err(|source| MappingError::Fstat { index: i, source })?;
            if (stat.st_size as u64) < bytes || bytes == 0 || !bytes.is_multiple_of(4096) {
                return Err(MappingError::FileSize {
                    index: i,
                    size: stat.st_size,
                    announced: bytes,
                });
            }
            // A hugetlb file says its page size here; its mapping must start at a whole page.
            let page = stat.st_blksize as u64;
            if page.is_power_of_two() && page <= 1 << 30 && bytes.is_multiple_of(page) {
                align = align.max(page);
            }
        }
        let size = usize::try_from(len)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or(MappingError::NotMappable { len })?;
        let base = map_one_after_another(&fds, files, size, align as usize)?;
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
        let files = fds.into_iter().zip(files.iter().copied()).collect();
        Ok(Self { base, len: size.get(), files })
    }

    /// A chunk's range: inside the mapping and past its header (the shards' doorbell words,
    /// which no chunk may overlap).
    fn check(&self, offset: u64, len: u64) -> Result<(), MappingError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 && offset >= ARENA_HEADER_BYTES => Ok(()),
            _ => Err(MappingError::OutsideChunkArea {
                offset,
                len,
                arena: self.len,
                header: ARENA_HEADER_BYTES,
            }),
        }
    }

    /// The doorbell word of `shard` in the arena header (see `orbitkv_proto::DOORBELL_STRIDE`).
    pub(crate) fn doorbell(&self, shard: u32) -> Result<&AtomicU32, MappingError> {
        let offset = shard as u64 * DOORBELL_STRIDE;
        if offset + 4 > ARENA_HEADER_BYTES.min(self.len as u64) {
            return Err(MappingError::NoDoorbell { shard });
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
    pub(crate) fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], MappingError> {
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
    pub(crate) fn bytes_mut(&mut self, offset: u64, len: u64) -> Result<&mut [u8], MappingError> {
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
    ) -> Result<Vec<&mut [u8]>, MappingError> {
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_unstable_by_key(|&i| ranges[i].0);
        let mut end = 0u64;
        for &i in &order {
            let (offset, len) = ranges[i];
            self.check(offset, len)?;
            if offset < end {
                return Err(MappingError::Overlap { offset, end });
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

/// A mapping of one session's arena of its own: the same memfds mapped again, without
/// populating its page tables (a CUDA registration does that), and unmapped only when this is
/// dropped, whatever becomes of the session. Memory registered with CUDA, or viewed by a
/// tensor, through it never goes away under them. Offsets in it are the session's
/// ([`crate::Reserved::offset`], a lease's `hit.offset`); once the session ends, the server
/// may hand its slots out again, so a copy through it must check the session first
/// ([`crate::Client::connection`] against [`HostArena::connection`]).
#[derive(Debug)]
pub struct HostArena {
    map: ArenaMap,
    connection: u64,
}

// SAFETY: the mapping is process-wide shared memory that `HostArena` never changes through
// `&self` (it hands out only its address; who may touch which bytes is governed by leases
// and reservations), so sharing references between threads is as sound as sending it.
unsafe impl Sync for HostArena {}

impl HostArena {
    /// Maps `session`'s arena again (new descriptors of its memfds).
    pub(crate) fn new(session: &ArenaMap, connection: u64) -> Result<Self, MappingError> {
        let fds = session.dup_fds().map_err(MappingError::Dup)?;
        let files: Vec<u64> = session.files().iter().map(|&(_, bytes)| bytes).collect();
        let map = ArenaMap::new(fds, &files, session.len as u64, false)?;
        Ok(Self { map, connection })
    }

    /// The first byte of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.range().0
    }

    /// Bytes mapped (the whole arena).
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Never: an arena has at least its header.
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// The connection (see [`crate::Client::connection`]) whose arena this maps.
    pub fn connection(&self) -> u64 {
        self.connection
    }

    /// The bytes of a chunk at `offset` (a lease's `hit.offset`), stable while the lease is
    /// held; an error when the range is not in the arena's chunk area.
    pub fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], crate::Error> {
        self.map.bytes(offset, len).map_err(|e| crate::Error::InvalidArgument(e.to_string()))
    }
}

// SAFETY: `base` and `size` are exactly this mapping, which stays mapped for as long as the
// `HostArena` lives; `parts` are its memfds' mappings, in address order, covering it.
unsafe impl HostMapping for HostArena {
    fn base(&self) -> *mut u8 {
        self.as_ptr()
    }

    fn size(&self) -> u64 {
        self.map.len as u64
    }

    fn parts(&self) -> Vec<(u64, u64)> {
        self.map.files()
    }
}

impl Drop for ArenaMap {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made in `new`; views borrow `self`, so
        // none outlives it.
        let _ = unsafe { munmap(self.base, self.len) };
    }
}

/// Maps `fds` (of the `files` lengths, checked against the files, adding up to `len`) shared
/// and read-write one after another as one range starting at a multiple of `align` bytes.
fn map_one_after_another(
    fds: &[OwnedFd],
    files: &[u64],
    len: NonZeroUsize,
    align: usize,
) -> Result<NonNull<c_void>, MappingError> {
    let map_err = MappingError::Mmap;
    if let [fd] = fds {
        // SAFETY: a new shared mapping (addr None) of a memfd at least `len` bytes long
        // (checked by the caller); nothing existing is replaced.
        return unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(map_err);
    }
    // Reserve the range (no memory: PROT_NONE, MAP_NORESERVE), aligned, then map each file
    // over its part of it.
    let reserved =
        len.checked_add(align - 4096).ok_or(MappingError::NotMappable { len: len.get() as u64 })?;
    // SAFETY: a fresh anonymous mapping (addr None); nothing existing is replaced.
    let raw = unsafe {
        mmap_anonymous(
            None,
            reserved,
            ProtFlags::PROT_NONE,
            MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
        )
    }
    .map_err(map_err)?;
    let raw_at = raw.as_ptr() as usize;
    let at = raw_at.next_multiple_of(align);
    let (head, tail) = (at - raw_at, raw_at + reserved.get() - (at + len.get()));
    // SAFETY: the slack before and after the aligned range, parts of the reservation just
    // made, which nothing uses.
    unsafe {
        if head > 0 {
            let _ = munmap(raw, head);
        }
        if tail > 0 {
            let _ = munmap(raw.byte_add(at - raw_at + len.get()), tail);
        }
    }
    let base = NonNull::new(at as *mut c_void).ok_or(MappingError::AtZero)?;
    let mut offset = 0usize;
    for (fd, &bytes) in fds.iter().zip(files) {
        let (part, addr) = (NonZeroUsize::new(bytes as usize), NonZeroUsize::new(at + offset));
        let (Some(part), Some(addr)) = (part, addr) else {
            unreachable!("files are not empty (checked) and the range is mapped, not at 0");
        };
        // SAFETY: MAP_FIXED over `[addr, addr + part)`, a part of the reservation made above
        // (the files' lengths add up to it), which nothing else uses; the memfd is at least
        // `part` bytes long (checked by the caller).
        let mapped = unsafe {
            mmap(
                Some(addr),
                part,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                fd.as_fd(),
                0,
            )
        };
        if let Err(e) = mapped {
            // SAFETY: the whole aligned range is ours (reservation and files mapped so far).
            let _ = unsafe { munmap(base, len.get()) };
            return Err(map_err(e));
        }
        offset += part.get();
    }
    Ok(base)
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
        let m = ArenaMap::new(vec![fd], &[1 << 20], 1 << 20, false).unwrap();
        assert!(m.check(ARENA_HEADER_BYTES, 4096).is_ok());
        assert!(m.check((1 << 20) - 4096, 4096).is_ok());
        let e = m.check(0, 4096).unwrap_err();
        assert!(matches!(e, MappingError::OutsideChunkArea { offset: 0, len: 4096, .. }), "{e}");
        assert!(e.to_string().contains("chunk area"), "{e}");
        assert!(m.check(ARENA_HEADER_BYTES - 64, 4096).is_err());
        assert!(m.check((1 << 20) - 4096, 8192).is_err());
        assert!(m.check(u64::MAX, 2).is_err());
    }

    fn memfd(bytes: i64) -> OwnedFd {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd = memfd_create(c"orbitkv-test", MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&fd, bytes).unwrap();
        fd
    }

    /// Several memfds map one after another: each file's bytes at its offset of the range.
    #[test]
    fn memfds_map_one_after_another() {
        let sizes = [ARENA_HEADER_BYTES + 8192, 4096, 16384];
        let fds: Vec<OwnedFd> = sizes.iter().map(|&b| memfd(b as i64)).collect();
        // Mark each file's first byte through a mapping of its own.
        for (i, fd) in fds.iter().enumerate() {
            nix::sys::uio::pwrite(fd, &[i as u8 + 1], 0).unwrap();
        }
        let len = sizes.iter().sum();
        let mut m = ArenaMap::new(fds, &sizes, len, true).unwrap();
        assert_eq!(
            m.files(),
            vec![(0, sizes[0]), (sizes[0], sizes[1]), (sizes[0] + sizes[1], sizes[2])]
        );
        let second = sizes[0];
        assert_eq!(m.bytes(second, 1).unwrap(), &[2]);
        assert_eq!(m.bytes(second + sizes[1], 1).unwrap(), &[3]);
        // A write through the range lands in its file.
        m.bytes_mut(second + 100, 3).unwrap().copy_from_slice(b"abc");
        let copy = m.dup_fds().unwrap();
        let mut seen = [0u8; 3];
        nix::sys::uio::pread(&copy[1], &mut seen, 100).unwrap();
        assert_eq!(&seen, b"abc");
        assert!(m.check(len - 4096, 4096).is_ok() && m.check(len - 4096, 4097).is_err());
    }

    /// What the server announced must match what it sent: else a clear error, nothing mapped.
    #[test]
    fn announced_memfds_must_match_the_ones_sent() {
        let arena = ARENA_HEADER_BYTES + 8192;
        let err = |fds: Vec<OwnedFd>, files: &[u64], len: u64| {
            ArenaMap::new(fds, files, len, false).unwrap_err()
        };
        let e = err(vec![memfd(arena as i64)], &[arena, 4096], arena + 4096);
        assert!(matches!(e, MappingError::Announced { announced: 2, sent: 1 }), "{e}");
        assert!(e.to_string().contains("announced 2 arena memfds and sent 1"), "{e}");
        let e = err(vec![memfd(arena as i64), memfd(4096)], &[arena, 4096], arena);
        assert!(e.to_string().contains("do not add up"), "{e}");
        let e = err(vec![memfd(arena as i64), memfd(4096)], &[arena, 8192], arena + 8192);
        assert!(
            matches!(e, MappingError::FileSize { index: 1, size: 4096, announced: 8192 }),
            "{e}"
        );
        assert!(
            e.to_string().contains("arena memfd 1 has 4096 bytes, server announced 8192"),
            "{e}"
        );
        let e = err(Vec::new(), &[], 0);
        assert!(e.to_string().contains("announced 0 arena memfds"), "{e}");
    }
}
