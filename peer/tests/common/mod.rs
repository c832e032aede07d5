//! What the Transfer Engine loopback tests share: memory mapped as the arena is, and data.
#![allow(dead_code)] // each test uses part

use std::num::NonZeroUsize;
use std::ptr::NonNull;

use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};

/// Shared anonymous memory (as the arena's memfd mapping), unmapped on drop.
pub struct Mapping {
    ptr: NonNull<std::ffi::c_void>,
    len: usize,
}

impl Mapping {
    pub fn new(len: usize) -> Self {
        // SAFETY: a new anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                NonZeroUsize::new(len).unwrap(),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
            )
        }
        .unwrap();
        Mapping { ptr, len }
    }

    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, alive while self is; TE
        // writes into it only during a call that has returned before this borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new`, unmapped once.
        unsafe { munmap(self.ptr, self.len) }.unwrap();
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub const MIB: usize = 1 << 20;

/// Bytes of each piece [`scattered`] gives.
pub const PIECE: usize = 32 * 1024;

/// 1,100 pieces of [`PIECE`] bytes (more than one TE batch of 1024) of `from`'s first 64 MiB,
/// scattered, to read in order into `into`: `(local, remote, len)` each.
pub fn scattered(into: &Mapping, from: &Mapping) -> Vec<(u64, u64, u64)> {
    (0..1100)
        .map(|i| {
            let at = (i * 7919 % 2048) * PIECE;
            (into.addr() + (i * PIECE) as u64, from.addr() + at as u64, PIECE as u64)
        })
        .collect()
}

/// Asserts that `into` holds, piece by piece, the bytes `ranges` read of `from` (whose memory
/// held `want`).
pub fn assert_scattered(
    into: &mut Mapping,
    from: &Mapping,
    want: &[u8],
    ranges: &[(u64, u64, u64)],
) {
    for (i, &(_, remote, _)) in ranges.iter().enumerate() {
        let at = (remote - from.addr()) as usize;
        assert!(
            into.bytes()[i * PIECE..(i + 1) * PIECE] == want[at..at + PIECE],
            "piece {i} differs"
        );
    }
}
