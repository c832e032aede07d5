//! The DRAM arena: one or more memfds mapped shared, one after another, as one range split
//! into disjoint per-shard slices.
//!
//! The server makes one memfd, or one per shard (each the file of that shard's slice: faults in
//! one do not contend with the others' on a shared file's locks), and maps them contiguously; clients
//! map the same files the same way, so an arena offset means the same byte everywhere. The
//! range starts with a [`HEADER_BYTES`] header holding one doorbell word per shard (see
//! `server`'s executor: a shard that sleeps deeply sets its word, and whoever queues work for
//! it rings its eventfd). Chunk data follows the header.
//!
//! This is the only module of the crate with `unsafe`: it owns the mapping and hands out
//! byte views of ranges that the shard ownership protocol says nobody else writes.

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{madvise, mmap, mmap_anonymous, munmap, MapFlags, MmapAdvise, ProtFlags};

use crate::alloc::PAGE_SIZE;
use crate::Error;

pub use orbitkv_proto::{ARENA_HEADER_BYTES as HEADER_BYTES, DOORBELL_STRIDE};

/// The arena's memfds and this process's shared mapping of them (one range).
///
/// The mapping lives until the `Arena` is dropped; every [`ArenaSlice`] holds an `Arc` to it,
/// so no slice can outlive the memory it names.
#[derive(Debug)]
pub struct Arena {
    files: Vec<ArenaFile>,
    base: NonNull<c_void>,
    len: usize,
    locked: bool,
    pages: PageSize,
}

/// One memfd of the arena: mapped at `offset` of the range, `bytes` long.
#[derive(Debug)]
struct ArenaFile {
    fd: OwnedFd,
    offset: u64,
    bytes: u64,
}

/// The pages backing the arena: the kernel's 4 KiB pages (with transparent huge pages where
/// the host's shmem setting allows them), or hugetlb pages reserved by the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageSize {
    /// 4 KiB pages (THP advice given).
    Small,
    /// 2 MiB hugetlb pages.
    Huge2M,
    /// 1 GiB hugetlb pages.
    Huge1G,
}

impl PageSize {
    /// Bytes per page.
    pub fn bytes(self) -> u64 {
        match self {
            PageSize::Small => PAGE_SIZE,
            PageSize::Huge2M => 2 << 20,
            PageSize::Huge1G => 1 << 30,
        }
    }

    /// The name (`4KiB`, `2MiB`, `1GiB`).
    pub fn as_str(self) -> &'static str {
        match self {
            PageSize::Small => "4KiB",
            PageSize::Huge2M => "2MiB",
            PageSize::Huge1G => "1GiB",
        }
    }

    /// Hugetlb pages of this size free on the host (`/sys/kernel/mm/hugepages`); 0 for
    /// small pages or where the host does not say.
    pub fn free_huge_pages(self) -> u64 {
        let dir = match self {
            PageSize::Small => return 0,
            PageSize::Huge2M => "hugepages-2048kB",
            PageSize::Huge1G => "hugepages-1048576kB",
        };
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/{dir}/free_hugepages"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Bytes of an arena of `data_bytes` of chunk data on these pages (header included,
    /// rounded up to whole pages).
    pub fn arena_bytes(self, data_bytes: u64) -> u64 {
        (data_bytes + HEADER_BYTES).div_ceil(self.bytes()) * self.bytes()
    }
}

// SAFETY: the mapping is plain shared memory; the raw pointer is only dereferenced through
// `ArenaSlice`, whose ranges are disjoint per shard, so moving or sharing the owner between
// threads cannot create aliasing writes by itself.
unsafe impl Send for Arena {}
// SAFETY: see `Send`; `&Arena` exposes no byte access at all.
unsafe impl Sync for Arena {}

impl Arena {
    /// Creates a memfd of [`HEADER_BYTES`] plus `bytes` of chunk data (a multiple of 4 KiB),
    /// maps it shared and read-write, populates it on this thread and tries to lock it in
    /// memory when `lock` is set. Locking is best effort: on failure it logs a warning and the
    /// arena stays pageable. (The server populates in parallel: [`Arena::create_unpopulated`]
    /// and [`Arena::populate`].)
    pub fn create(data_bytes: u64, lock: bool) -> Result<Arena, Error> {
        let mut arena = Arena::create_unpopulated(data_bytes, PageSize::Small, 1)?;
        arena.populate(1, None, lock, &|_| ());
        Ok(arena)
    }

    /// Creates and maps the arena as [`Arena::create`] does, without populating or locking
    /// it (no page exists yet), in `files` memfds: those of [`Arena::populate`]'s parts for
    /// `files` parts (a part shorter than a hugetlb page joins the next). With hugetlb `pages`
    /// the memfds are hugetlb ones (the arena's size rounded up to whole pages, the rest chunk
    /// data); the pages are reserved when they are mapped, so too few free ones fail here
    /// (`mmap`), never at a first write.
    pub fn create_unpopulated(
        data_bytes: u64,
        pages: PageSize,
        files: usize,
    ) -> Result<Arena, Error> {
        if data_bytes == 0 || !data_bytes.is_multiple_of(PAGE_SIZE) {
            return Err(Error::ArenaSize {
                bytes: data_bytes,
                reason: "must be a positive multiple of 4 KiB",
            });
        }
        assert!(files > 0, "an arena has at least one file");
        let bytes = data_bytes
            .checked_add(HEADER_BYTES + pages.bytes())
            .map(|_| pages.arena_bytes(data_bytes))
            .ok_or(Error::ArenaSize { bytes: data_bytes, reason: "too large" })?;
        usize::try_from(bytes)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or(Error::ArenaSize { bytes, reason: "does not fit the address space" })?;
        let flags = MFdFlags::MFD_CLOEXEC
            | MFdFlags::MFD_ALLOW_SEALING
            | match pages {
                PageSize::Small => MFdFlags::empty(),
                PageSize::Huge2M => MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_2MB,
                PageSize::Huge1G => MFdFlags::MFD_HUGETLB | MFdFlags::MFD_HUGE_1GB,
            };
        let files = part_ranges(bytes, files, pages.bytes())
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .enumerate()
            .map(|(i, (offset, len))| {
                let name = std::ffi::CString::new(format!("orbitkv-arena-{i}"))
                    .expect("no NUL in the name");
                let fd = memfd_create(name.as_c_str(), flags)
                    .map_err(|source| Error::Arena { op: "memfd_create", source })?;
                nix::unistd::ftruncate(&fd, len as i64)
                    .map_err(|source| Error::Arena { op: "ftruncate", source })?;
                // Clients get this fd: seal its size so that none can shrink it under the
                // server (which would turn the server's next access into SIGBUS).
                let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
                fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))
                    .map_err(|source| Error::Arena { op: "fcntl(F_ADD_SEALS)", source })?;
                Ok(ArenaFile { fd, offset, bytes: len })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let (base, len) = map_files(&files, pages.bytes())?;
        // Huge pages when the host allows them for shared memory
        // (/sys/kernel/mm/transparent_hugepage/shmem_enabled: advise or always): a 1 MiB chunk
        // then costs no TLB misses to copy. The advice must come before the pages exist.
        if pages == PageSize::Small {
            // SAFETY: advice on exactly our live mapping; it changes no contents.
            if let Err(e) = unsafe { madvise(base, len, MmapAdvise::MADV_HUGEPAGE) } {
                tracing::debug!(error = %e, "MADV_HUGEPAGE not applied to the arena");
            }
        }
        Ok(Arena { files, base, len, locked: false, pages })
    }

    /// Populates the arena (a cache arena is allocated up front: first-touch faults would
    /// otherwise land on the data path) and, with `lock`, locks it in memory: in `parts` parts,
    /// those of [`Arena::split`] with `parts` slices (the first with the header, the last with
    /// the remainder), each by a thread of its own at once, pinned to `cores[i]` where given
    /// so that its pages land on that core's NUMA node (the kernel places a page where it is
    /// first touched). Locking is all or nothing: if a part cannot be locked (RLIMIT_MEMLOCK),
    /// the parts that were are unlocked again, a warning says so, and the arena stays pageable.
    /// Call before the arena is shared (no slice exists yet).
    /// `progress` is called with the bytes of each step populated (256 MiB, or a 1 GiB page),
    /// on the part's thread, as it is done (for readiness reports).
    pub fn populate(
        &mut self,
        parts: usize,
        cores: Option<&[usize]>,
        lock: bool,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Vec<Populated> {
        assert!(parts > 0, "shard count is validated to be non-zero");
        let huge = self.pages.bytes();
        let ranges = part_ranges(self.len as u64, parts, huge);
        let base = self.base.as_ptr() as usize;
        let mut done: Vec<Populated> = std::thread::scope(|scope| {
            let threads: Vec<_> = ranges
                .iter()
                .enumerate()
                .map(|(i, &(offset, bytes))| {
                    let core = cores.and_then(|c| c.get(i).copied());
                    let spawned = std::thread::Builder::new()
                        .name(format!("orbitkv-populate-{i}"))
                        .spawn_scoped(scope, move || {
                            populate_part(base, (offset, bytes, huge), core, lock, progress)
                        });
                    (offset, bytes, core, spawned)
                })
                .collect();
            threads
                .into_iter()
                .map(|(offset, bytes, core, spawned)| match spawned {
                    Ok(t) => t.join().unwrap_or_else(|_| failed_part(offset, bytes, core)),
                    // No thread: this one does it (the part is still populated).
                    Err(_) => populate_part(base, (offset, bytes, huge), None, lock, progress),
                })
                .collect()
        });
        if lock {
            if let Some(refused) = done.iter().find_map(|p| p.lock_error) {
                tracing::warn!(
                    bytes = self.len as u64,
                    error = %refused,
                    "could not lock the arena in memory ({}); it stays pageable",
                    memlock_hint(self.len as u64)
                );
                for p in done.iter_mut().filter(|p| p.locked) {
                    // SAFETY: a range of our live mapping that this call locked; unlocking
                    // changes no contents.
                    let _ = unsafe {
                        nix::sys::mman::munlock(
                            self.base.byte_add(p.offset as usize),
                            p.bytes as usize,
                        )
                    };
                    p.locked = false;
                }
            } else {
                self.locked = true;
            }
        }
        done
    }

    /// Maps an arena's memfds received from a server, in the order given (a process of its
    /// own mapping the same memory, e.g. to register it with CUDA): shared, read-write, one
    /// after another, each whole. Nothing is written, populated or locked; the server owns
    /// the contents.
    pub fn open(fds: Vec<OwnedFd>) -> Result<Arena, Error> {
        let mut files = Vec::with_capacity(fds.len());
        let (mut offset, mut align) = (0u64, PAGE_SIZE);
        for fd in fds {
            let stat = nix::sys::stat::fstat(fd.as_fd())
                .map_err(|source| Error::Arena { op: "fstat", source })?;
            let bytes = stat.st_size as u64;
            if bytes == 0 || !bytes.is_multiple_of(PAGE_SIZE) {
                return Err(Error::ArenaSize { bytes, reason: "is not an arena file's size" });
            }
            // A hugetlb file says its page size here; its mapping must start at a whole page.
            let page = stat.st_blksize as u64;
            if page.is_power_of_two() && page <= 1 << 30 && bytes.is_multiple_of(page) {
                align = align.max(page);
            }
            files.push(ArenaFile { fd, offset, bytes });
            offset += bytes;
        }
        if offset <= HEADER_BYTES {
            return Err(Error::ArenaSize { bytes: offset, reason: "is not an arena's size" });
        }
        let (base, len) = map_files(&files, align)?;
        Ok(Arena { files, base, len, locked: false, pages: PageSize::Small })
    }

    /// The pages backing the arena (an arena opened from a server's fd says `Small`: its
    /// mapping is the same memory, whatever backs it).
    pub fn pages(&self) -> PageSize {
        self.pages
    }

    /// The memfds, in mapping order, to pass to clients.
    pub fn fds(&self) -> impl ExactSizeIterator<Item = BorrowedFd<'_>> {
        self.files.iter().map(|f| f.fd.as_fd())
    }

    /// Offset and length of each memfd in the mapping, in order (they cover it end to end).
    pub fn files(&self) -> Vec<(u64, u64)> {
        self.files.iter().map(|f| (f.offset, f.bytes)).collect()
    }

    /// Start of the mapping (for registering it with a DMA engine; the mapping lives as long as
    /// the arena).
    pub fn base_ptr(&self) -> *mut u8 {
        self.base.as_ptr() as *mut u8
    }

    /// Size of the whole arena in bytes (header and data, every file).
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Bytes of chunk data (without the header).
    pub fn data_len(&self) -> u64 {
        self.len as u64 - HEADER_BYTES
    }

    /// The doorbell word of `shard`: non-zero while that shard sleeps waiting for its eventfd.
    pub fn doorbell(&self, shard: usize) -> &AtomicU32 {
        assert!((shard as u64) < HEADER_BYTES / DOORBELL_STRIDE, "at most 256 shards");
        // SAFETY: the word lies in the header of the live mapping (checked above), is 64-byte
        // aligned (page-aligned mapping, 64-byte stride), and is only ever accessed atomically,
        // by this process and by clients mapping the same memfd.
        unsafe {
            &*((self.base.as_ptr() as *const u8).add(shard * DOORBELL_STRIDE as usize)
                as *const AtomicU32)
        }
    }

    /// Never true: an arena has at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the mapping is locked in memory.
    pub fn locked(&self) -> bool {
        self.locked
    }

    /// Splits the arena into `n` equal, page-aligned, disjoint slices (the remainder pages stay
    /// unused). Call once: handing out two sets of slices would alias them.
    pub fn split(self: &Arc<Self>, n: usize) -> Vec<ArenaSlice> {
        assert!(n > 0, "shard count is validated to be non-zero");
        let per = (self.data_len() / n as u64) / PAGE_SIZE * PAGE_SIZE;
        (0..n as u64)
            .map(|i| ArenaSlice {
                arena: Arc::clone(self),
                offset: HEADER_BYTES + i * per,
                len: per,
            })
            .collect()
    }
}

// SAFETY: the mapping lives until the arena drops (unmapped in its `Drop`), read and write,
// and the files are mapped end to end from offset 0 (`map_files`).
unsafe impl orbitkv_proto::HostMapping for Arena {
    fn base(&self) -> *mut u8 {
        self.base_ptr()
    }

    fn size(&self) -> u64 {
        self.len()
    }

    fn parts(&self) -> Vec<(u64, u64)> {
        self.files()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are the range mapped in `create_unpopulated` or `open` (every
        // file's mapping in it); every slice holds an Arc to this arena, so none is alive now.
        if let Err(e) = unsafe { munmap(self.base, self.len) } {
            tracing::error!(error = %e, "munmap of the arena failed");
        }
    }
}

/// Offset and length of each of `parts` parts of an arena of `len` bytes (header included):
/// part i > 0 starts where slice i of [`Arena::split`] does, the first holds the header, the
/// last the remainder. With hugetlb pages of `page` bytes, faulted in whole, parts are cut at
/// whole pages (a part may then be empty, or begin with the previous slice's last page).
fn part_ranges(len: u64, parts: usize, page: u64) -> Vec<(u64, u64)> {
    let per = ((len - HEADER_BYTES) / parts as u64) / PAGE_SIZE * PAGE_SIZE;
    let at_page = |x: u64| if page > PAGE_SIZE { x / page * page } else { x };
    (0..parts as u64)
        .map(|i| {
            let start = if i == 0 { 0 } else { at_page(HEADER_BYTES + i * per) };
            let end =
                if i + 1 == parts as u64 { len } else { at_page(HEADER_BYTES + (i + 1) * per) };
            (start, end - start)
        })
        .collect()
}

/// Maps `files` shared and read-write one after another as one range starting at a multiple
/// of `align` bytes (a power of two, at least a page: hugetlb files map at whole pages).
fn map_files(files: &[ArenaFile], align: u64) -> Result<(NonNull<c_void>, usize), Error> {
    let total: u64 = files.iter().map(|f| f.bytes).sum();
    let len = usize::try_from(total)
        .ok()
        .and_then(NonZeroUsize::new)
        .ok_or(Error::ArenaSize { bytes: total, reason: "does not fit the address space" })?;
    let mmap_err = |source| Error::Arena { op: "mmap", source };
    if let [one] = files {
        // SAFETY: a fresh shared mapping (addr None) of the whole file, whose size we set or
        // read (arenas are sealed against resizing); no existing memory is replaced.
        let base = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                one.fd.as_fd(),
                0,
            )
        }
        .map_err(mmap_err)?;
        return Ok((base, len.get()));
    }
    // Reserve the range (no memory: PROT_NONE, MAP_NORESERVE), aligned, then map each file
    // over its part of it.
    let slack = align.saturating_sub(PAGE_SIZE) as usize;
    let reserved = len
        .checked_add(slack)
        .ok_or(Error::ArenaSize { bytes: total, reason: "does not fit the address space" })?;
    // SAFETY: a fresh anonymous mapping (addr None); no existing memory is replaced.
    let raw = unsafe {
        mmap_anonymous(
            None,
            reserved,
            ProtFlags::PROT_NONE,
            MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
        )
    }
    .map_err(mmap_err)?;
    let raw_at = raw.as_ptr() as usize;
    let at = raw_at.next_multiple_of(align as usize);
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
    let base = NonNull::new(at as *mut c_void).expect("inside a mapping, not null");
    for f in files {
        let part = NonZeroUsize::new(f.bytes as usize).expect("files are not empty");
        let addr = NonZeroUsize::new(at + f.offset as usize).expect("inside a mapping, not 0");
        // SAFETY: MAP_FIXED over `[addr, addr + part)`, a part of the reservation made above
        // (offsets and lengths cover it end to end), which nothing else uses; the file is at
        // least `part` bytes long (its size was set or read, and sealed).
        let mapped = unsafe {
            mmap(
                Some(addr),
                part,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                f.fd.as_fd(),
                0,
            )
        };
        if let Err(source) = mapped {
            // SAFETY: the whole aligned range is ours (reservation and files mapped so far).
            let _ = unsafe { munmap(base, len.get()) };
            return Err(mmap_err(source));
        }
    }
    Ok((base, len.get()))
}

/// `[offset, offset + len)` of the slice of `slice_len` bytes at `start` in `arena`.
fn range_bytes(arena: &Arena, start: u64, slice_len: u64, offset: u64, len: u64) -> &[u8] {
    assert!(
        offset.checked_add(len).is_some_and(|end| end <= slice_len),
        "range {offset}+{len} inside the {slice_len}-byte slice"
    );
    // SAFETY: the range is inside the slice (checked above), the slice is inside the live
    // mapping (built by `Arena::split`), and the mapping outlives `arena`'s borrow.
    unsafe {
        std::slice::from_raw_parts(
            (arena.base.as_ptr() as *const u8).add((start + offset) as usize),
            len as usize,
        )
    }
}

/// Read access to one shard's slice that does not borrow the shard ([`ArenaSlice::reader`]).
/// The bytes of a range whose reservation goes away while they are read (its session closed)
/// may change under the reader; what it computed from them is then dropped, as the commit it
/// was for fails on the reservation.
#[derive(Debug, Clone)]
pub struct SliceReader {
    arena: Arc<Arena>,
    offset: u64,
    len: u64,
}

impl SliceReader {
    /// The bytes at `[offset, offset + len)` of the slice (slice-relative offsets), as
    /// [`ArenaSlice::bytes`].
    pub fn bytes(&self, offset: u64, len: u64) -> &[u8] {
        range_bytes(&self.arena, self.offset, self.len, offset, len)
    }
}

/// One shard's disjoint range of the arena.
#[derive(Debug)]
pub struct ArenaSlice {
    arena: Arc<Arena>,
    offset: u64,
    len: u64,
}

impl ArenaSlice {
    /// Offset of the slice within the arena memfd.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size of the slice in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the slice has no pages (more shards than pages).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes at `[offset, offset + len)` of this slice (slice-relative offsets).
    ///
    /// Used to checksum a chunk at commit. Clients write the same shared memory from other
    /// processes; the protocol says none writes a committed or leased range, and a client
    /// that breaks it only changes bytes (the memfd's size is sealed, so the range stays
    /// mapped and readable).
    pub fn bytes(&self, offset: u64, len: u64) -> &[u8] {
        range_bytes(&self.arena, self.offset, self.len, offset, len)
    }

    /// A handle on this slice's bytes for reading them outside a borrow of its shard: a long
    /// chunk's checksum hashed a piece at a time, other work running between the pieces.
    pub fn reader(&self) -> SliceReader {
        SliceReader { arena: Arc::clone(&self.arena), offset: self.offset, len: self.len }
    }

    /// Overwrites `[offset, offset + data.len())` of this slice (tests and benchmarks).
    pub fn write(&self, offset: u64, data: &[u8]) {
        assert!(
            offset.checked_add(data.len() as u64).is_some_and(|end| end <= self.len),
            "range inside the slice"
        );
        // SAFETY: in range (checked above) of the live shared mapping; the caller owns the
        // range by the reservation protocol.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.arena.base.as_ptr() as *mut u8).add((self.offset + offset) as usize),
                data.len(),
            );
        }
    }
}

// SAFETY: `raw_range` checks that the range lies in the slice, which lies in the arena's
// mapping; the mapping lives until the last `Arc<Arena>` drops, and `keep_alive` is one.
unsafe impl orbitkv_ssd::SlotMemory for ArenaSlice {
    fn raw_range(&self, offset: u64, len: u64) -> *mut u8 {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} inside the {}-byte slice",
            self.len
        );
        // wrapping_add keeps this free of unsafe: the result is only dereferenced by the
        // kernel, and the range was checked to lie in the mapping.
        (self.arena.base.as_ptr() as *mut u8).wrapping_add((self.offset + offset) as usize)
    }

    fn bytes(&self, offset: u64, len: u64) -> &[u8] {
        ArenaSlice::bytes(self, offset, len)
    }

    fn keep_alive(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        Arc::clone(&self.arena) as Arc<dyn std::any::Any + Send + Sync>
    }
}

/// How one part of the arena was populated (see [`Arena::populate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Populated {
    /// Byte offset of the part in the memfd.
    pub offset: u64,
    /// Its length in bytes.
    pub bytes: u64,
    /// The core its thread was pinned to (None: unpinned, or pinning refused).
    pub core: Option<usize>,
    /// Seconds its thread took to populate (and lock) it.
    pub seconds: f64,
    /// Of those, the seconds the `mlock` call took (0 when not locking; the pages are locked as
    /// they are faulted in, so their share is in the faults).
    pub lock_seconds: f64,
    /// The NUMA node holding its first page (None where the kernel does not say).
    pub node: Option<u32>,
    /// Whether it is locked in memory.
    pub locked: bool,
    /// Why it could not be locked, if locking was asked for and refused.
    pub lock_error: Option<nix::errno::Errno>,
}

/// What limits locking `bytes`: the memlock limit when it is below them (and how to raise
/// it), else the limit's name.
fn memlock_hint(bytes: u64) -> String {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft != RLIM_INFINITY && soft < bytes => format!(
            "RLIMIT_MEMLOCK is {} bytes, the arena {bytes}: raise it to the arena's size or \
             unlimited (ulimit -l, systemd's LimitMEMLOCK=, docker --ulimit memlock=-1), give \
             the server CAP_IPC_LOCK, or start it with --no-lock-arena",
            soft
        ),
        _ => "RLIMIT_MEMLOCK?".to_string(),
    }
}

/// A part whose thread died (it panicked): nothing known of it.
fn failed_part(offset: u64, bytes: u64, core: Option<usize>) -> Populated {
    untouched_part(offset, bytes, core, false)
}

/// A part no thread touched, `locked` as said.
fn untouched_part(offset: u64, bytes: u64, core: Option<usize>, locked: bool) -> Populated {
    Populated {
        offset,
        bytes,
        core,
        seconds: 0.0,
        lock_seconds: 0.0,
        node: None,
        locked,
        lock_error: None,
    }
}

/// Bytes populated per step between two progress reports (a multiple of any page size but
/// 1 GiB pages, whose step is one page).
const POPULATE_STEP: u64 = 256 << 20;

/// Populates (and locks) `bytes` at `offset` of the mapping at `base` (in pages of `page`
/// bytes), on `core` when given, telling `progress` each step's bytes as it is done.
fn populate_part(
    base: usize,
    (offset, bytes, page): (u64, u64, u64),
    core: Option<usize>,
    lock: bool,
    progress: &(dyn Fn(u64) + Sync),
) -> Populated {
    let started = std::time::Instant::now();
    let core = core.filter(|&c| {
        let mut set = nix::sched::CpuSet::new();
        let pinned = set
            .set(c)
            .and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
        if let Err(e) = &pinned {
            tracing::warn!(core = c, error = %e, "could not pin the arena's populating thread; its part may land on another NUMA node");
        }
        pinned.is_ok()
    });
    let at = NonNull::new((base + offset as usize) as *mut c_void).expect("inside the mapping");
    let len = bytes as usize;
    if len == 0 {
        // A part smaller than a huge page: its pages are the previous part's.
        return untouched_part(offset, bytes, core, lock);
    }
    // Locked as the pages are faulted in (mlock2 with MLOCK_ONFAULT, before populating): each
    // page goes to the unevictable list as it is made, instead of a second pass over every
    // page after (12-14% of a 4 GiB part's time on the 2-core development VM). Kernels
    // without mlock2 (before 4.4) lock after populating.
    let locking = std::time::Instant::now();
    let early = lock.then(|| lock_on_fault(at, len)).and_then(|r| match r {
        Err(Errno::ENOSYS | Errno::EINVAL) => None,
        decided => Some(decided),
    });
    let mut lock_seconds = if lock { locking.elapsed().as_secs_f64() } else { 0.0 };
    let step = POPULATE_STEP.max(page) as usize;
    let mut touch_pages = false;
    for from in (0..len).step_by(step) {
        let n = step.min(len - from);
        // SAFETY: `at + from .. + n` lies inside the live mapping (a part of it, at whole
        // pages), which no other process has yet; populating writes nothing visible (the memfd
        // reads as zeros).
        let step_at = unsafe { at.byte_add(from) };
        if !touch_pages {
            // SAFETY: as above.
            if let Err(e) = unsafe { madvise(step_at, n, MmapAdvise::MADV_POPULATE_WRITE) } {
                // Kernels before 5.14 lack it: touch every page instead (writing the zero it
                // holds).
                tracing::debug!(error = %e, "MADV_POPULATE_WRITE failed; populating the arena page by page");
                touch_pages = true;
            }
        }
        if touch_pages {
            let p = step_at.as_ptr().cast::<u8>();
            for off in (0..n).step_by(PAGE_SIZE as usize) {
                // SAFETY: inside this step of our live mapping.
                unsafe { p.add(off).write_volatile(0) };
            }
        }
        progress(n as u64);
    }
    let locked = match early {
        Some(decided) => decided,
        None if lock => {
            let locking = std::time::Instant::now();
            // SAFETY: the range is a part of our live mapping.
            let locked = unsafe { nix::sys::mman::mlock(at, len) };
            lock_seconds += locking.elapsed().as_secs_f64();
            locked
        }
        None => Ok(()),
    };
    let (locked, lock_error) = match locked {
        Ok(()) => (lock, None),
        Err(e) => (false, Some(e)),
    };
    Populated {
        offset,
        bytes,
        core,
        seconds: started.elapsed().as_secs_f64(),
        lock_seconds,
        node: numa_node(at.as_ptr()),
        locked,
        lock_error,
    }
}

/// Locks `len` bytes at `at` in memory as their pages are faulted in (`mlock2`,
/// `MLOCK_ONFAULT`): the memlock limit is checked for the whole range now.
fn lock_on_fault(at: NonNull<c_void>, len: usize) -> Result<(), Errno> {
    // SAFETY: mlock2 only changes how the kernel treats the pages of this range of our live
    // mapping (locked when present); it reads and writes no memory.
    let rc = unsafe { libc::mlock2(at.as_ptr(), len, libc::MLOCK_ONFAULT) };
    if rc == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

/// The NUMA node of the (populated) page at `addr`; None where the kernel does not say
/// (no NUMA support, or a seccomp policy refusing `get_mempolicy`).
fn numa_node(addr: *mut c_void) -> Option<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int to `node`; no node mask is asked for (null, 0).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (rc == 0 && node >= 0).then_some(node as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn parts_cover_the_mapping_as_the_slices_split_it() {
        let mut arena =
            Arena::create_unpopulated(10 * PAGE_SIZE + 3 * PAGE_SIZE, PageSize::Small, 1).unwrap();
        // A core this process may run on (its affinity may leave core 0 out).
        let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        let core = (0..nix::sched::CpuSet::count()).find(|&c| set.is_set(c).unwrap()).unwrap();
        let progress = AtomicU64::new(0);
        let parts = arena.populate(3, Some(&[core, core, core]), false, &|n| {
            progress.fetch_add(n, Ordering::Relaxed);
        });
        assert_eq!(parts.len(), 3);
        // Every byte counted once.
        assert_eq!(progress.load(Ordering::Relaxed), arena.len());
        // Contiguous from the header to the end of the mapping.
        assert_eq!(parts[0].offset, 0);
        for w in parts.windows(2) {
            assert_eq!(w[0].offset + w[0].bytes, w[1].offset);
        }
        let last = parts.last().unwrap();
        assert_eq!(last.offset + last.bytes, arena.len());
        assert!(parts.iter().all(|p| !p.locked && p.lock_error.is_none()));
        assert!(parts.iter().all(|p| p.lock_seconds == 0.0), "nothing locked: {parts:?}");
        assert!(!arena.locked());
        // Part i (i > 0) starts where slice i does.
        let arena = Arc::new(arena);
        let slices = arena.split(3);
        for (p, s) in parts.iter().zip(&slices).skip(1) {
            assert_eq!(p.offset, s.offset());
        }
        // Pinned where asked.
        assert!(parts.iter().all(|p| p.core == Some(core)));
        assert!(parts.iter().all(|p| p.node.is_none_or(|n| n < 1024)));
    }

    #[test]
    fn a_memfd_per_part_maps_as_one_range_in_every_process() {
        // Three files for three parts (a server's memfd per shard); the mapping is one range.
        let mut arena = Arena::create_unpopulated(12 * PAGE_SIZE, PageSize::Small, 3).unwrap();
        let files = arena.files();
        assert_eq!(files.len(), 3);
        assert_eq!(arena.fds().len(), 3);
        assert_eq!(files[0].0, 0);
        for w in files.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0, "files cover the range end to end: {files:?}");
        }
        assert_eq!(files[2].0 + files[2].1, arena.len());
        // The files are the populate parts: each part is one file.
        let parts = arena.populate(3, None, false, &|_| ());
        let part_ranges: Vec<(u64, u64)> = parts.iter().map(|p| (p.offset, p.bytes)).collect();
        assert_eq!(part_ranges, files);
        // Bytes written through the slices are those another mapping of the same files reads,
        // across the files' boundaries.
        let arena = Arc::new(arena);
        let slices = arena.split(3);
        for (i, s) in slices.iter().enumerate() {
            s.write(0, &[i as u8 + 1; 100]);
            s.write(s.len() - 3, b"end");
        }
        let fds = arena.fds().map(|fd| fd.try_clone_to_owned().unwrap()).collect();
        let other = Arena::open(fds).unwrap();
        assert_eq!(other.len(), arena.len());
        assert_eq!(other.files(), arena.files());
        for (i, s) in slices.iter().enumerate() {
            let at = s.offset() as usize;
            // SAFETY: inside `other`'s live mapping, which is `len` bytes long.
            let seen = unsafe { std::slice::from_raw_parts(other.base_ptr().add(at), 100) };
            assert_eq!(seen, &[i as u8 + 1; 100][..]);
            let end = at + s.len() as usize - 3;
            // SAFETY: the slice's last 3 bytes, inside `other`'s live mapping.
            let seen = unsafe { std::slice::from_raw_parts(other.base_ptr().add(end), 3) };
            assert_eq!(seen, b"end");
        }
        // The doorbell words (in the first file) are shared too.
        arena.doorbell(2).store(7, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(other.doorbell(2).load(std::sync::atomic::Ordering::Relaxed), 7);
    }

    #[test]
    fn files_that_are_no_arena_are_refused_on_open() {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let odd = memfd_create(c"odd", MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&odd, 100).unwrap();
        assert!(matches!(Arena::open(vec![odd]), Err(Error::ArenaSize { bytes: 100, .. })));
        let empty = memfd_create(c"empty", MFdFlags::MFD_CLOEXEC).unwrap();
        assert!(matches!(Arena::open(vec![empty]), Err(Error::ArenaSize { bytes: 0, .. })));
        assert!(matches!(Arena::open(Vec::new()), Err(Error::ArenaSize { bytes: 0, .. })));
    }

    #[test]
    fn a_lock_is_all_or_nothing() {
        // Locking as this process may (root: no memlock limit binds; otherwise the limit may
        // refuse it): either every part is locked and so is the arena, or none is.
        let mut arena = Arena::create_unpopulated(64 * PAGE_SIZE, PageSize::Small, 1).unwrap();
        let parts = arena.populate(4, None, true, &|_| ());
        if arena.locked() {
            assert!(parts.iter().all(|p| p.locked));
        } else {
            assert!(
                parts.iter().all(|p| !p.locked) && parts.iter().any(|p| p.lock_error.is_some())
            );
        }
    }

    #[test]
    fn hugetlb_pages_are_whole_and_too_few_fail_at_creation() {
        assert_eq!(PageSize::Huge2M.arena_bytes(1), 2 << 20);
        assert_eq!(PageSize::Huge2M.arena_bytes((2 << 20) - HEADER_BYTES), 2 << 20);
        assert_eq!(PageSize::Huge1G.arena_bytes(1 << 30), 2 << 30);
        assert_eq!(PageSize::Small.arena_bytes(PAGE_SIZE), PAGE_SIZE + HEADER_BYTES);
        // More 2 MiB pages than the host has free: refused when the memfd is made or mapped
        // (the pages are reserved then), never at a first write.
        let free = PageSize::Huge2M.free_huge_pages();
        match Arena::create_unpopulated((free + 1) * (2 << 20), PageSize::Huge2M, 1) {
            Err(Error::Arena { op, .. }) => {
                assert!(["memfd_create", "ftruncate", "mmap"].contains(&op))
            }
            other => panic!("{} free 2MiB pages: {other:?}", free),
        }
    }
}
