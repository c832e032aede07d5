//! Copies into and out of the arena: [`copy_chunk`], and [`SummingCopy`], which writes a chunk
//! into its slot and computes the chunk checksum (XXH3-64) in the same pass.

/// Copies `src` into `dst` (the same length; panics otherwise), as
/// `dst.copy_from_slice(src)` does, faster for chunks out of (or into) the arena: from 64 KiB
/// on, where the CPU has AVX2, a loop of 256-byte AVX2 loads and stores that prefetches 4 KiB
/// ahead, across the 4 KiB page boundaries where the hardware prefetchers stop. On the 2-vCPU
/// development VM (AMD EPYC) it moved 1 MiB blocks out of a 2 GiB shared mapping at 1.2x what
/// glibc's `memcpy` did (docs/performance.md). Elsewhere, and below 64 KiB, it is
/// `copy_from_slice`.
pub fn copy_chunk(dst: &mut [u8], src: &[u8]) {
    copy_as(dst, src, Stores::Cached);
}

/// How the copy loops store.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Stores {
    /// Through the caches.
    Cached,
    /// For copies whose destination this core will not read soon (pages of a large batch,
    /// bound for the GPU or for another process): from 64 KiB on, non-temporal stores, which
    /// write whole cache lines to memory without first reading them in (a plain store loop
    /// moves three bytes over the memory bus per byte copied, this two) and leave the core's
    /// caches to other work; ordered before any later store (`sfence`), so the bytes are
    /// visible to whoever a following message tells about them. In [`SummingCopy`], only where
    /// the slot is aligned for the vector width.
    Streamed,
}

/// [`copy_chunk`], or with `Stores::Streamed` its non-temporal form.
pub(crate) fn copy_as(dst: &mut [u8], src: &[u8], stores: Stores) {
    assert_eq!(dst.len(), src.len(), "copy_chunk: destination and source lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= PREFETCHED_FROM && avx2() {
        // The head up to the destination's next 64-byte boundary, so that streamed stores
        // find it aligned (a whole cache line each with AVX-512).
        let head = dst.as_ptr().align_offset(64).min(src.len());
        dst[..head].copy_from_slice(&src[..head]);
        let (dst, src) = (&mut dst[head..], &src[head..]);
        if stores == Stores::Streamed && avx512() {
            // SAFETY: AVX-512F is present (checked just above); `dst` and `src` are valid for
            // `src.len()` bytes (slices of equal length, checked) and cannot overlap (a `&mut`
            // and a `&` borrow); `dst` is 64-byte aligned (its head was copied above).
            unsafe { copy_streamed_avx512(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
        } else {
            // SAFETY: AVX2 is present (checked above); the buffers as just above; `dst` is
            // 64-byte (so 32-byte) aligned.
            unsafe { copy_prefetched(dst.as_mut_ptr(), src.as_ptr(), src.len(), stores) };
        }
        return;
    }
    dst.copy_from_slice(src);
}

/// Copies from this length on go through [`copy_prefetched`].
const PREFETCHED_FROM: usize = 64 << 10;

/// How far ahead of their loads the copy loops prefetch: across the 4 KiB page boundaries
/// where the hardware prefetchers stop.
const PREFETCH_AHEAD: usize = 4 << 10;

/// Prefetches the `step` bytes [`PREFETCH_AHEAD`] past `at` in `src` (of `n` bytes), where
/// they are inside it: what every copy loop asks before copying its next `step` bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(src: *const u8, at: usize, step: usize, n: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    if at + PREFETCH_AHEAD + step <= n {
        for k in (0..step).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults; the address is inside `src`
            // (checked just above) and formed without leaving it.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(at + PREFETCH_AHEAD + k).cast())
            };
        }
    }
}

/// The AVX2 loop of [`copy_as`].
///
/// # Safety
/// The CPU has AVX2; `src` is valid for reads and `dst` for writes of `n` bytes, and they do
/// not overlap; with `Stores::Streamed`, `dst` is 32-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_prefetched(dst: *mut u8, src: *const u8, n: usize, stores: Stores) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256, _mm_sfence,
    };
    let streamed = stores == Stores::Streamed;
    const STEP: usize = 256;
    let mut i = 0;
    while i + STEP <= n {
        prefetch_ahead(src, i, STEP, n);
        // SAFETY: bytes i .. i + STEP are inside both buffers (the loop's condition); the
        // unaligned forms take any address.
        unsafe {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let v = [
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
                _mm256_loadu_si256(s.add(4)),
                _mm256_loadu_si256(s.add(5)),
                _mm256_loadu_si256(s.add(6)),
                _mm256_loadu_si256(s.add(7)),
            ];
            for (k, x) in v.into_iter().enumerate() {
                if streamed {
                    // `dst` is 32-byte aligned (the caller's promise) and i a multiple of 256.
                    _mm256_stream_si256(d.add(k), x);
                } else {
                    _mm256_storeu_si256(d.add(k), x);
                }
            }
        }
        i += STEP;
    }
    // SAFETY: the rest, i .. n, is inside both buffers, which do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) };
    if streamed {
        // Non-temporal stores are weakly ordered: drain them before anything said afterwards.
        _mm_sfence();
    }
}

/// [`copy_as`]'s streamed loop where the CPU has AVX-512F: 64-byte loads and non-temporal
/// stores of whole cache lines, prefetching 4 KiB ahead. On the H200 host (Intel Xeon) it moved
/// 1 MiB blocks at 7.8-8.6 GB/s against 7.1-7.6 for the AVX2 loop (docs/performance.md).
///
/// # Safety
/// The CPU has AVX-512F; `src` is valid for reads and `dst` for writes of `n` bytes, and they
/// do not overlap; `dst` is 64-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_streamed_avx512(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512, _mm_sfence};
    const STEP: usize = 256;
    let mut i = 0;
    while i + STEP <= n {
        prefetch_ahead(src, i, STEP, n);
        // SAFETY: bytes i .. i + STEP are inside both buffers (the loop's condition); the
        // loads take any address, the stores' addresses are 64-byte aligned (`dst` is, and i
        // is a multiple of 256).
        unsafe {
            let s = src.add(i).cast::<__m512i>();
            let d = dst.add(i).cast::<__m512i>();
            let v = [
                _mm512_loadu_si512(s),
                _mm512_loadu_si512(s.add(1)),
                _mm512_loadu_si512(s.add(2)),
                _mm512_loadu_si512(s.add(3)),
            ];
            for (k, x) in v.into_iter().enumerate() {
                _mm512_stream_si512(d.add(k), x);
            }
        }
        i += STEP;
    }
    // SAFETY: the rest, i .. n, is inside both buffers, which do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) };
    // Non-temporal stores are weakly ordered: drain them before anything said afterwards.
    _mm_sfence();
}

/// XXH3's default secret (the specification's `kSecret`): the chunk checksum is XXH3-64 with
/// seed 0, which uses it as is.
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];
const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
/// XXH3 works on 64-byte stripes, 16 to a block (the secret advances 8 bytes a stripe); each
/// block ends with a scramble of the accumulators.
const STRIPE: usize = 64;
const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
/// Above this length XXH3-64 takes its striped ("long") form, the one [`SummingCopy`] computes.
const LONG_FROM: usize = 241;

/// Writes a chunk of known length into its slot, front to back in pieces of any size, and
/// computes the chunk checksum (XXH3-64, seed 0: [`orbitkv_proto::chunk_checksum`]) from the
/// bytes while they are in registers: each 64-byte stripe is loaded once, stored into the
/// slot and folded into the hash, so the checksum costs no second pass over the bytes (on a
/// memory-bound copy its arithmetic hides under the loads and stores). Where it cannot do that
/// (no AVX2, chunks of 240 bytes or less) it copies with [`copy_chunk`] and hashes what it
/// wrote, 64 KiB at a time, while that is still in the core's cache.
pub(crate) struct SummingCopy {
    len: usize,
    at: usize,
    how: Summing,
    stores: Stores,
}

#[allow(
    clippy::large_enum_variant,
    reason = "one per chunk being copied, on the stack: boxing would allocate per chunk"
)]
enum Summing {
    /// XXH3's accumulators and the stripes folded into them (stripe k = bytes 64k..64k+64).
    Fused { acc: [u64; 8], stripes: usize, simd: Simd },
    /// Hashed after each copied piece.
    After(orbitkv_proto::ChunkChecksum),
}

/// The vector width of the fused loop.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Simd {
    Avx2,
    Avx512,
}

/// Bytes copied and then hashed at a time on the [`Summing::After`] path.
const HASHED_STEP: usize = 64 << 10;

impl SummingCopy {
    /// A copy of a `len`-byte chunk, nothing written yet; `Stores::Streamed` as for
    /// [`copy_as`] (where the bytes are hashed after each piece, stores stay cached: the
    /// hash reads them back).
    pub(crate) fn new(len: usize, stores: Stores) -> Self {
        let simd = if avx512() { Simd::Avx512 } else { Simd::Avx2 };
        Self::with(len, stores, simd)
    }

    /// [`SummingCopy::new`] with the given vector width (where the CPU has it).
    fn with(len: usize, stores: Stores, simd: Simd) -> Self {
        let fused = len >= LONG_FROM && avx2() && (simd == Simd::Avx2 || avx512());
        let how = if fused {
            Summing::Fused {
                simd,
                acc: [
                    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5,
                    PRIME32_1,
                ],
                stripes: 0,
            }
        } else {
            Summing::After(orbitkv_proto::ChunkChecksum::new())
        };
        Self { len, at: 0, how, stores }
    }

    /// Stripes the striped loop folds in: all that start before the last byte (XXH3 folds the
    /// chunk's last 64 bytes once more, at the end, with another part of the secret).
    fn loop_stripes(&self) -> usize {
        self.len.saturating_sub(1) / STRIPE
    }

    /// Copies `src` into `slot` right after what was written before, hashing it. `slot` is the
    /// whole chunk's slot (`len` bytes; panics otherwise, or past its end).
    pub(crate) fn write(&mut self, slot: &mut [u8], src: &[u8]) {
        self.check(slot, src);
        if let Summing::After(sum) = &mut self.how {
            for piece in src.chunks(HASHED_STEP) {
                let dst = &mut slot[self.at..self.at + piece.len()];
                copy_chunk(dst, piece);
                sum.update(dst);
                self.at += piece.len();
            }
            return;
        }
        let src = self.head(slot, src);
        let whole = src.len() / STRIPE * STRIPE;
        if whole > 0 {
            let n = self.folds(whole);
            let dst = &mut slot[self.at..self.at + whole];
            let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
            let Summing::Fused { acc, stripes, simd } = &mut self.how else {
                unreachable!("hashed after each piece: returned above")
            };
            let align = if *simd == Simd::Avx512 { 64 } else { 32 };
            let stream = self.stores == Stores::Streamed && d.align_offset(align) == 0;
            #[cfg(target_arch = "x86_64")]
            match simd {
                // SAFETY: this path is taken only where the CPU has AVX-512F (`with`); `dst`
                // and `src` are valid for `whole` bytes (slices of that length) and cannot
                // overlap (a `&mut` and a `&` borrow); the first `n` of the `whole / 64`
                // stripes are folded; `dst` is 64-byte aligned where `stream` is set (checked
                // just above).
                Simd::Avx512 => unsafe {
                    copy_fold_avx512([Stream { dst: d, src: s, acc }], whole, (*stripes, n), stream)
                },
                // SAFETY: as above, with AVX2 (`with`) and 32-byte alignment.
                Simd::Avx2 => unsafe { copy_fold_avx2(d, s, whole, acc, (*stripes, n), stream) },
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("the fused path is x86_64 only: {d:p} {s:p} {acc:?} {simd:?} {stream}");
            *stripes += n;
            self.at += whole;
        }
        self.tail(slot, &src[whole..]);
    }

    /// Two chunks' next pieces, each as [`SummingCopy::write`] would copy it: where both are
    /// at the same place of chunks of one length, hashed on AVX-512 and the pieces are of one
    /// length, their stripes are copied and folded side by side in one loop. Two independent
    /// streams keep more of the memory system busy than one: on the H200 host (Intel Xeon),
    /// SGLang's 2 MiB pages (two 1 MiB pieces) on one copy thread were stored at a median 0.91
    /// of a one-core memcpy this way, 0.85 one chunk at a time, in alternated runs
    /// (docs/performance.md, "SGLang backend"). Otherwise one after the other.
    pub(crate) fn write_pair(
        (a, slot_a, src_a): (&mut Self, &mut [u8], &[u8]),
        (b, slot_b, src_b): (&mut Self, &mut [u8], &[u8]),
    ) {
        let side_by_side = matches!(
            (&a.how, &b.how),
            (Summing::Fused { simd: Simd::Avx512, .. }, Summing::Fused { simd: Simd::Avx512, .. })
        ) && a.len == b.len
            && a.at == b.at
            && src_a.len() == src_b.len()
            && a.stores == b.stores;
        if !side_by_side {
            a.write(slot_a, src_a);
            b.write(slot_b, src_b);
            return;
        }
        a.check(slot_a, src_a);
        b.check(slot_b, src_b);
        // At the same place of chunks of one length: the heads and the bodies are alike.
        let (src_a, src_b) = (a.head(slot_a, src_a), b.head(slot_b, src_b));
        let whole = src_a.len() / STRIPE * STRIPE;
        if whole > 0 {
            let n = a.folds(whole);
            let (da, db) =
                (slot_a[a.at..a.at + whole].as_mut_ptr(), slot_b[b.at..b.at + whole].as_mut_ptr());
            let stream = a.stores == Stores::Streamed
                && da.align_offset(64) == 0
                && db.align_offset(64) == 0;
            let (
                Summing::Fused { acc: acc_a, stripes, .. },
                Summing::Fused { acc: acc_b, stripes: stripes_b, .. },
            ) = (&mut a.how, &mut b.how)
            else {
                unreachable!("both fused: checked above")
            };
            let lanes = [
                Stream { dst: da, src: src_a.as_ptr(), acc: acc_a },
                Stream { dst: db, src: src_b.as_ptr(), acc: acc_b },
            ];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: both copies fold on AVX-512 (checked above), which `with` chose only where
            // the CPU has it; each destination and source is valid for `whole` bytes (slices of
            // that length: both chunks are at the same place with pieces of one length) and
            // does not overlap its source (`&mut` and `&` borrows) or the other stream's
            // destination (two slots, two `&mut` borrows); `n` stripes are folded into each;
            // both destinations are 64-byte aligned where `stream` is set (checked above).
            unsafe {
                copy_fold_avx512(lanes, whole, (*stripes, n), stream)
            };
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("AVX-512 is x86_64 only: {}", lanes.len());
            *stripes += n;
            *stripes_b += n;
            a.at += whole;
            b.at += whole;
        }
        a.tail(slot_a, &src_a[whole..]);
        b.tail(slot_b, &src_b[whole..]);
    }

    /// Panics unless `slot` is this chunk's and `src` fits after what was written.
    fn check(&self, slot: &[u8], src: &[u8]) {
        assert_eq!(slot.len(), self.len, "SummingCopy: slot of another length");
        let end = self.at + src.len();
        assert!(end <= self.len, "SummingCopy: {end} bytes written into a {}-byte chunk", self.len);
    }

    /// Completes the stripe a previous piece left unfinished, folding it from the slot; the
    /// rest of `src`.
    fn head<'s>(&mut self, slot: &mut [u8], src: &'s [u8]) -> &'s [u8] {
        let partial = self.at % STRIPE;
        if partial == 0 {
            return src;
        }
        let last = self.loop_stripes();
        let head = (STRIPE - partial).min(src.len());
        slot[self.at..self.at + head].copy_from_slice(&src[..head]);
        self.at += head;
        if let Summing::Fused { acc, stripes, .. } = &mut self.how {
            if self.at.is_multiple_of(STRIPE) && *stripes < last {
                fold_stripe(acc, &slot[self.at - STRIPE..self.at], *stripes);
                *stripes += 1;
            }
        }
        &src[head..]
    }

    /// How many of the next `whole / 64` stripes the loop folds (none past the last).
    fn folds(&self, whole: usize) -> usize {
        let done = match &self.how {
            Summing::Fused { stripes, .. } => *stripes,
            Summing::After(_) => 0,
        };
        (whole / STRIPE).min(self.loop_stripes().saturating_sub(done))
    }

    /// Less than a stripe after the loop: copied, folded when its stripe is complete (by a
    /// later piece's head, or at the end by `finish`).
    fn tail(&mut self, slot: &mut [u8], src: &[u8]) {
        slot[self.at..self.at + src.len()].copy_from_slice(src);
        self.at += src.len();
    }

    /// The checksum of the chunk; `slot` is the chunk's slot, written to its end (a slot
    /// written only in part gets the checksum of the part, hashed anew).
    pub(crate) fn finish(self, slot: &[u8]) -> u64 {
        let written = &slot[..self.at.min(slot.len())];
        match self.how {
            Summing::After(sum) => sum.finish(),
            Summing::Fused { .. } if self.at != self.len || slot.len() != self.len => {
                orbitkv_proto::chunk_checksum(written)
            }
            Summing::Fused { mut acc, stripes, .. } => {
                debug_assert_eq!(stripes, (self.len - 1) / STRIPE);
                let len = self.len;
                fold_at(&mut acc, &slot[len - STRIPE..], SECRET.len() - STRIPE - 7);
                merge(&acc, len as u64)
            }
        }
    }
}

fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn read64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Folds stripe number `k` of the loop (`stripe`, 64 bytes) into `acc`, ending its block's
/// scramble when it is a block's last stripe.
fn fold_stripe(acc: &mut [u64; 8], stripe: &[u8], k: usize) {
    fold_at(acc, stripe, (k % STRIPES_PER_BLOCK) * 8);
    if k % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1 {
        for (i, a) in acc.iter_mut().enumerate() {
            let x = (*a ^ (*a >> 47)) ^ read64(&SECRET, SECRET.len() - STRIPE + 8 * i);
            *a = x.wrapping_mul(PRIME32_1);
        }
    }
}

/// XXH3's accumulate step: one 64-byte stripe with the secret from `secret_at`.
fn fold_at(acc: &mut [u64; 8], stripe: &[u8], secret_at: usize) {
    for i in 0..8 {
        let v = read64(stripe, 8 * i);
        let k = v ^ read64(&SECRET, secret_at + 8 * i);
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(v);
        acc[i] = acc[i].wrapping_add((k & 0xFFFF_FFFF).wrapping_mul(k >> 32));
    }
}

/// XXH3-64's final merge of the accumulators for a `len`-byte input.
fn merge(acc: &[u64; 8], len: u64) -> u64 {
    const MERGE_AT: usize = 11;
    let mut h = len.wrapping_mul(PRIME64_1);
    for i in 0..4 {
        let a = acc[2 * i] ^ read64(&SECRET, MERGE_AT + 16 * i);
        let b = acc[2 * i + 1] ^ read64(&SECRET, MERGE_AT + 16 * i + 8);
        let p = u128::from(a) * u128::from(b);
        h = h.wrapping_add((p as u64) ^ ((p >> 64) as u64));
    }
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

/// The fused loop of [`SummingCopy::write`]: copies `n_bytes` (whole stripes) from `src` to
/// `dst`, folding the first `fold` stripes into `acc` as stripes `first`, `first + 1`, ... of
/// the loop (with their blocks' scrambles); `(first, fold)` is `stripes`. Prefetches 4 KiB
/// ahead, as [`copy_prefetched`]; non-temporal stores (then an `sfence`) when `stream`.
/// One function: the loop keeps its accumulators and pointers in registers across stripes,
/// and the hot loop's body is the copy and the fold of one stripe side by side.
///
/// # Safety
/// The CPU has AVX2; `src` is valid for reads and `dst` for writes of `n_bytes` bytes, which
/// is a multiple of 64 and at least `64 * fold`; they do not overlap; `dst` is 32-byte aligned
/// when `stream`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_fold_avx2(
    dst: *mut u8,
    src: *const u8,
    n_bytes: usize,
    acc: &mut [u64; 8],
    (first, fold): (usize, usize),
    stream: bool,
) {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi64x,
        _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64, _mm256_storeu_si256,
        _mm256_stream_si256, _mm256_xor_si256, _mm_sfence,
    };
    let key = SECRET.as_ptr().cast::<__m256i>();
    // Secret offsets below stay within 8 * 15 + 64 (stripe keys) and 128 + 64 (the scramble
    // key), inside its 192 bytes; the unaligned loads and stores take any address.
    // SAFETY: `acc` is 64 bytes, two 32-byte vectors.
    let (mut a0, mut a1) = unsafe {
        let p = acc.as_ptr().cast::<__m256i>();
        (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1)))
    };
    let prime = _mm256_set1_epi64x(PRIME32_1 as i64);
    let stripes = n_bytes / STRIPE;
    for s in 0..stripes {
        let at = s * STRIPE;
        prefetch_ahead(src, at, STRIPE, n_bytes);
        // SAFETY: bytes at .. at + 64 are inside both buffers (s < n_bytes / 64).
        let (d0, d1) = unsafe {
            let sp = src.add(at).cast::<__m256i>();
            let dp = dst.add(at).cast::<__m256i>();
            let d0 = _mm256_loadu_si256(sp);
            let d1 = _mm256_loadu_si256(sp.add(1));
            if stream {
                // `dst` is 32-byte aligned (the caller's promise), `at` a multiple of 64.
                _mm256_stream_si256(dp, d0);
                _mm256_stream_si256(dp.add(1), d1);
            } else {
                _mm256_storeu_si256(dp, d0);
                _mm256_storeu_si256(dp.add(1), d1);
            }
            (d0, d1)
        };
        if s >= fold {
            continue;
        }
        let k = first + s;
        let lane = k % STRIPES_PER_BLOCK;
        // SAFETY: secret bytes 8 * lane .. 8 * lane + 64, inside it (lane <= 15).
        let (k0, k1) = unsafe {
            let kp = key.cast::<u8>().add(8 * lane).cast::<__m256i>();
            (_mm256_loadu_si256(kp), _mm256_loadu_si256(kp.add(1)))
        };
        // acc[i ^ 1] += v[i]; acc[i] += lo32(v[i] ^ k[i]) * hi32(v[i] ^ k[i]).
        let x0 = _mm256_xor_si256(d0, k0);
        let x1 = _mm256_xor_si256(d1, k1);
        let p0 = _mm256_mul_epu32(x0, _mm256_srli_epi64::<32>(x0));
        let p1 = _mm256_mul_epu32(x1, _mm256_srli_epi64::<32>(x1));
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32::<0x4E>(d0)));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32::<0x4E>(d1)));
        if lane == STRIPES_PER_BLOCK - 1 {
            // SAFETY: the scramble key, secret bytes 128 .. 192, inside it.
            let (s0, s1) = unsafe {
                let kp = key.cast::<u8>().add(SECRET.len() - STRIPE).cast::<__m256i>();
                (_mm256_loadu_si256(kp), _mm256_loadu_si256(kp.add(1)))
            };
            // acc = ((acc ^ (acc >> 47)) ^ key) * PRIME32_1, the 64-bit product from two
            // 32-bit ones: lo * p + (hi * p) << 32.
            let scramble = |a: __m256i, k: __m256i| {
                let x = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64::<47>(a)), k);
                let lo = _mm256_mul_epu32(x, prime);
                let hi = _mm256_mul_epu32(_mm256_shuffle_epi32::<0xB1>(x), prime);
                _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi))
            };
            a0 = scramble(a0, s0);
            a1 = scramble(a1, s1);
        }
    }
    // SAFETY: `acc` is 64 bytes, two 32-byte vectors.
    unsafe {
        let p = acc.as_mut_ptr().cast::<__m256i>();
        _mm256_storeu_si256(p, a0);
        _mm256_storeu_si256(p.add(1), a1);
    }
    if stream {
        // Non-temporal stores are weakly ordered: drain them before anything said afterwards.
        _mm_sfence();
    }
}

/// One stream of [`copy_fold_avx512`]: a chunk's destination and source at the same place,
/// and its XXH3 accumulators.
struct Stream<'a> {
    dst: *mut u8,
    src: *const u8,
    acc: &'a mut [u64; 8],
}

/// [`copy_fold_avx2`] with AVX-512F, for `K` streams side by side (chunks at the same place):
/// a stripe is one 64-byte vector, loaded once, stored as a whole cache line (non-temporal when
/// `stream`) and folded into its stream's eight accumulators at once; stripe s of every stream,
/// then stripe s + 1.
///
/// # Safety
/// The CPU has AVX-512F; for every stream, `src` is valid for reads and `dst` for writes of
/// `n_bytes` bytes, which is a multiple of 64 and at least `64 * fold`; no destination overlaps
/// a source or another destination; every `dst` is 64-byte aligned when `stream`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_fold_avx512<const K: usize>(
    streams: [Stream<'_>; K],
    n_bytes: usize,
    (first, fold): (usize, usize),
    stream: bool,
) {
    use std::arch::x86_64::{
        __m512i, _mm512_add_epi64, _mm512_loadu_si512, _mm512_mul_epu32, _mm512_set1_epi64,
        _mm512_shuffle_epi32, _mm512_slli_epi64, _mm512_srli_epi64, _mm512_storeu_si512,
        _mm512_stream_si512, _mm512_xor_si512, _mm_sfence,
    };
    let key = SECRET.as_ptr();
    // SAFETY: each `acc` is 64 bytes, one vector; the unaligned load takes any address.
    let mut a: [__m512i; K] =
        std::array::from_fn(|c| unsafe { _mm512_loadu_si512(streams[c].acc.as_ptr().cast()) });
    let prime = _mm512_set1_epi64(PRIME32_1 as i64);
    // SAFETY: the scramble key, secret bytes 128 .. 192, inside it.
    let scramble_key =
        unsafe { _mm512_loadu_si512(key.add(SECRET.len() - STRIPE).cast::<__m512i>()) };
    for s in 0..n_bytes / STRIPE {
        let at = s * STRIPE;
        let lane = (first + s) % STRIPES_PER_BLOCK;
        // SAFETY: secret bytes 8 * lane .. 8 * lane + 64, inside it (lane <= 15).
        let k = unsafe { _mm512_loadu_si512(key.add(8 * lane).cast::<__m512i>()) };
        for (c, st) in streams.iter().enumerate() {
            prefetch_ahead(st.src, at, STRIPE, n_bytes);
            // SAFETY: bytes at .. at + 64 are inside this stream's buffers (s < n_bytes / 64);
            // with `stream`, dst + at is 64-byte aligned (`dst` is, and at is a multiple of 64).
            let d = unsafe {
                let d = _mm512_loadu_si512(st.src.add(at).cast::<__m512i>());
                let dp = st.dst.add(at).cast::<__m512i>();
                if stream {
                    _mm512_stream_si512(dp, d);
                } else {
                    _mm512_storeu_si512(dp, d);
                }
                d
            };
            if s >= fold {
                continue;
            }
            // acc[i ^ 1] += v[i]; acc[i] += lo32(v[i] ^ k[i]) * hi32(v[i] ^ k[i]).
            let x = _mm512_xor_si512(d, k);
            let p = _mm512_mul_epu32(x, _mm512_srli_epi64::<32>(x));
            a[c] = _mm512_add_epi64(a[c], _mm512_add_epi64(p, _mm512_shuffle_epi32::<0x4E>(d)));
            if lane == STRIPES_PER_BLOCK - 1 {
                // acc = ((acc ^ (acc >> 47)) ^ key) * PRIME32_1, from two 32-bit products.
                let x = _mm512_xor_si512(
                    _mm512_xor_si512(a[c], _mm512_srli_epi64::<47>(a[c])),
                    scramble_key,
                );
                let lo = _mm512_mul_epu32(x, prime);
                let hi = _mm512_mul_epu32(_mm512_shuffle_epi32::<0xB1>(x), prime);
                a[c] = _mm512_add_epi64(lo, _mm512_slli_epi64::<32>(hi));
            }
        }
    }
    for (st, v) in streams.into_iter().zip(a) {
        // SAFETY: `acc` is 64 bytes, one vector.
        unsafe { _mm512_storeu_si512(st.acc.as_mut_ptr().cast::<__m512i>(), v) };
    }
    if stream {
        // Non-temporal stores are weakly ordered: drain them before anything said afterwards.
        _mm_sfence();
    }
}

#[cfg(test)]
mod copy_tests {
    use super::{copy_as, copy_chunk, Stores};

    #[test]
    fn copies_every_byte_at_every_length_and_offset() {
        let src: Vec<u8> = (0..(1usize << 20) + 777).map(|i| (i * 131 + 7) as u8).collect();
        for len in [0, 1, 255, 256, 257, 4095, 64 << 10, (64 << 10) + 33, 1 << 20] {
            for off in [0, 1, 31] {
                let s = &src[off..off + len];
                for streamed in [false, true] {
                    let mut dst = vec![0u8; len + 2];
                    if streamed {
                        copy_as(&mut dst[1..=len], s, Stores::Streamed);
                    } else {
                        copy_chunk(&mut dst[1..=len], s);
                    }
                    assert_eq!(&dst[1..=len], s, "len {len} offset {off} streamed {streamed}");
                    assert_eq!((dst[0], dst[len + 1]), (0, 0), "nothing outside, len {len}");
                }
            }
        }
    }

    /// Both streamed loops (AVX2 and AVX-512; `copy_as` takes the widest the CPU has),
    /// on a 64-byte aligned destination, at lengths around their steps.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn both_streamed_loops_copy_every_byte() {
        let src: Vec<u8> = (0..(1usize << 20) + 333).map(|i| (i * 97 + 5) as u8).collect();
        for len in [0, 64, 255, 256, 4096 + 300, (64 << 10) + 7, 1 << 20] {
            let mut buf = vec![0u8; len + 128];
            let at = buf.as_ptr().align_offset(64);
            for wide in [false, true] {
                if wide && !super::avx512() || !super::avx2() {
                    continue;
                }
                buf.fill(0);
                let (d, s) = (buf[at..].as_mut_ptr(), src[3..].as_ptr());
                // SAFETY: the CPU has the instructions (checked just above); `d` is 64-byte
                // aligned with `len` bytes (and more) after it in `buf`, `s` has `len` bytes
                // in `src`; the two do not overlap.
                unsafe {
                    if wide {
                        super::copy_streamed_avx512(d, s, len);
                    } else {
                        super::copy_prefetched(d, s, len, super::Stores::Streamed);
                    }
                }
                assert_eq!(&buf[at..at + len], &src[3..3 + len], "len {len}, avx512 {wide}");
                assert!(buf[at + len..].iter().all(|&b| b == 0), "nothing past, len {len}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match() {
        copy_chunk(&mut [0u8; 3], &[1u8; 4]);
    }
}

#[cfg(test)]
mod summing_tests {
    use super::{Simd, Stores, SummingCopy};
    use orbitkv_proto::chunk_checksum;

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        (0..n as u32).map(|i| (i.wrapping_add(seed).wrapping_mul(2654435761) >> 13) as u8).collect()
    }

    /// The fused copy gives the bytes and the standard XXH3-64 at every length class (short,
    /// one block, block and stripe boundaries, many blocks) and however the chunk is cut into
    /// pieces (inside stripes, at stripe and block edges, one byte at a time at the start).
    #[test]
    fn copies_and_sums_as_the_reference_at_every_length_and_cut() {
        let lens = [
            0, 1, 64, 240, 241, 255, 256, 1023, 1024, 1025, 1088, 2047, 2048, 4096, 65_536, 65_537,
            300_001,
        ];
        let cuts: [&[usize]; 6] =
            [&[], &[1], &[63, 1, 64], &[100, 7, 1024], &[1024, 1024], &[4093, 65_536]];
        for &len in &lens {
            let src = bytes(len, len as u32);
            let kinds = [Stores::Cached, Stores::Streamed]
                .into_iter()
                .flat_map(|st| [(st, Simd::Avx2), (st, Simd::Avx512)]);
            for (cut, (stores, simd)) in
                cuts.iter().flat_map(|c| kinds.clone().map(move |k| (c, k)))
            {
                let mut slot = vec![0u8; len];
                let mut c = SummingCopy::with(len, stores, simd);
                let mut at = 0;
                for &n in cut.iter().chain(std::iter::repeat(&len)) {
                    if at == len {
                        break;
                    }
                    let n = n.min(len - at);
                    c.write(&mut slot, &src[at..at + n]);
                    at += n;
                }
                let what = format!("length {len}, cut {cut:?}, {stores:?}, {simd:?}");
                assert_eq!(c.finish(&slot), chunk_checksum(&src), "{what}");
                assert_eq!(slot, src, "{what}");
            }
        }
    }

    /// Two chunks written side by side (`write_pair`) give each its bytes and its checksum:
    /// alike (the paired loop, where the CPU has AVX-512), of other lengths, cut otherwise
    /// (pairs of pieces of other lengths, after which the chunks are at different places),
    /// hashed with other vector widths or stored otherwise (each alone).
    #[test]
    fn two_chunks_side_by_side_copy_and_sum_as_the_reference() {
        let cases: [(usize, usize, &[usize], &[usize]); 6] = [
            (300_001, 300_001, &[], &[]),
            (1 << 20, 1 << 20, &[1 << 19, 1 << 19], &[1 << 19, 1 << 19]),
            (65_600, 65_600, &[63, 1, 64, 1000], &[63, 1, 64, 1000]),
            (65_600, 65_600, &[100, 7, 1024], &[64, 43, 1024]),
            (4096, 65_536, &[1024], &[1024]),
            (241, 241, &[17], &[17]),
        ];
        let kinds = [(Stores::Streamed, Simd::Avx512), (Stores::Cached, Simd::Avx512)];
        for (la, lb, cut_a, cut_b) in cases {
            for (ka, kb) in [(kinds[0], kinds[0]), (kinds[1], kinds[1]), (kinds[0], kinds[1])]
                .into_iter()
                .chain([((Stores::Streamed, Simd::Avx2), kinds[0])])
            {
                let (src_a, src_b) = (bytes(la, 1), bytes(lb, 2));
                let (mut slot_a, mut slot_b) = (vec![0u8; la], vec![0u8; lb]);
                let mut a = SummingCopy::with(la, ka.0, ka.1);
                let mut b = SummingCopy::with(lb, kb.0, kb.1);
                let pieces = |len: usize, cut: &[usize]| {
                    let mut out = Vec::new();
                    let mut at = 0;
                    for &n in cut.iter().chain(std::iter::repeat(&len)) {
                        if at == len {
                            break;
                        }
                        out.push(at..at + n.min(len - at));
                        at += n.min(len - at);
                    }
                    out
                };
                let (pa, pb) = (pieces(la, cut_a), pieces(lb, cut_b));
                for (x, y) in pa.iter().zip(&pb) {
                    SummingCopy::write_pair(
                        (&mut a, &mut slot_a, &src_a[x.clone()]),
                        (&mut b, &mut slot_b, &src_b[y.clone()]),
                    );
                }
                for x in pa.iter().skip(pb.len()) {
                    a.write(&mut slot_a, &src_a[x.clone()]);
                }
                for y in pb.iter().skip(pa.len()) {
                    b.write(&mut slot_b, &src_b[y.clone()]);
                }
                let what = format!("{la}/{lb} bytes, cuts {cut_a:?}/{cut_b:?}, {ka:?}/{kb:?}");
                assert_eq!(a.finish(&slot_a), chunk_checksum(&src_a), "a: {what}");
                assert_eq!(b.finish(&slot_b), chunk_checksum(&src_b), "b: {what}");
                assert!(slot_a == src_a && slot_b == src_b, "{what}");
            }
        }
    }

    /// A slot written only in part gets the checksum of what was written.
    #[test]
    fn a_slot_written_in_part_gets_the_checksum_of_the_part() {
        let mut empty = SummingCopy::new(0, Stores::Cached);
        empty.write(&mut [], &[]);
        assert_eq!(empty.finish(&[]), chunk_checksum(&[]));
        let src = bytes(10_000, 3);
        let mut slot = vec![0u8; 10_000];
        let mut c = SummingCopy::new(10_000, Stores::Streamed);
        c.write(&mut slot, &src[..6_000]);
        assert_eq!(c.finish(&slot), chunk_checksum(&src[..6_000]));
    }

    #[test]
    #[should_panic(expected = "written into")]
    fn writing_past_the_chunk_panics() {
        let mut slot = vec![0u8; 300];
        let mut c = SummingCopy::new(300, Stores::Cached);
        c.write(&mut slot, &[1u8; 301][..]);
    }
}
