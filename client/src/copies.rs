//! Copies spread over threads: a batch of chunks is split into contiguous runs, one per
//! thread, the calling thread taking the first.

use crate::mapping::Stores;

/// Least bytes worth a thread of their own (starting a scoped thread costs tens of
/// microseconds; 4 MiB takes about 200 us at memcpy speed).
pub(crate) const MIN_BYTES_PER_THREAD: u64 = 4 << 20;

/// Batches of at least this many bytes are copied with non-temporal stores
/// (`Stores::Streamed`): they do not fit in a core's caches, and their
/// destination (arena slots, an engine's pages) is not read back by this core soon.
pub(crate) const STREAMED_FROM: u64 = 8 << 20;

/// How a batch of `bytes` stores its copies.
pub(crate) fn stores_for(bytes: u64) -> Stores {
    if bytes >= STREAMED_FROM {
        Stores::Streamed
    } else {
        Stores::Cached
    }
}

/// Writes a chunk into its slot piece by piece; hashed, it computes the chunk checksum as it
/// copies ([`crate::mapping::SummingCopy`]: no second pass over the bytes).
pub(crate) struct SlotWriter<'a> {
    slot: &'a mut [u8],
    at: usize,
    sum: Option<crate::mapping::SummingCopy>,
    stores: Stores,
}

impl<'a> SlotWriter<'a> {
    pub(crate) fn new(slot: &'a mut [u8], hashed: bool, stores: Stores) -> Self {
        let sum = hashed.then(|| crate::mapping::SummingCopy::new(slot.len(), stores));
        Self { slot, at: 0, sum, stores }
    }

    /// Appends `src` (panics past the slot's end: callers size chunks before reserving).
    pub(crate) fn write(&mut self, src: &[u8]) {
        match self.sum.as_mut() {
            Some(sum) => sum.write(self.slot, src),
            None => crate::mapping::copy_as(
                &mut self.slot[self.at..self.at + src.len()],
                src,
                self.stores,
            ),
        }
        self.at += src.len();
    }

    /// Appends `src_a` to `a` and `src_b` to `b`: where both are hashed, side by side
    /// ([`crate::mapping::SummingCopy::write_pair`]); otherwise one after the other.
    pub(crate) fn write_pair(a: &mut Self, src_a: &[u8], b: &mut Self, src_b: &[u8]) {
        match (a.sum.as_mut(), b.sum.as_mut()) {
            (Some(sa), Some(sb)) => crate::mapping::SummingCopy::write_pair(
                (sa, &mut *a.slot, src_a),
                (sb, &mut *b.slot, src_b),
            ),
            _ => {
                a.write(src_a);
                b.write(src_b);
                return;
            }
        }
        a.at += src_a.len();
        b.at += src_b.len();
    }

    /// Writes two chunks whose sources are `a` and `b` (pieces in order), piece by piece side
    /// by side where they have as many pieces.
    pub(crate) fn write_pieces_pair<'s>(
        a: &mut Self,
        pa: impl Iterator<Item = &'s [u8]> + Clone,
        b: &mut Self,
        pb: impl Iterator<Item = &'s [u8]> + Clone,
    ) {
        if pa.clone().count() == pb.clone().count() {
            for (x, y) in pa.zip(pb) {
                Self::write_pair(a, x, b, y);
            }
        } else {
            pa.for_each(|x| a.write(x));
            pb.for_each(|y| b.write(y));
        }
    }

    /// The checksum of what was written (0 when not hashed).
    pub(crate) fn finish(self) -> u64 {
        self.sum.map_or(0, |s| s.finish(self.slot))
    }
}

/// Runs `work` on every item, on `threads` threads (the caller's included), each taking a
/// contiguous run of the items in order.
pub(crate) fn for_each<T: Send>(threads: usize, items: Vec<T>, work: impl Fn(T) + Sync) {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        items.into_iter().for_each(work);
        return;
    }
    let per = items.len().div_ceil(threads);
    let mut runs: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut rest = items.into_iter().peekable();
    while rest.peek().is_some() {
        runs.push(rest.by_ref().take(per).collect());
    }
    let work = &work;
    std::thread::scope(|scope| {
        let mut runs = runs.into_iter();
        let first = runs.next();
        for run in runs {
            scope.spawn(move || run.into_iter().for_each(work));
        }
        if let Some(run) = first {
            run.into_iter().for_each(work);
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_slot_written_in_pieces_is_hashed_as_a_whole() {
        let src: Vec<u8> =
            (0..300_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for (hashed, stores) in [false, true]
            .into_iter()
            .flat_map(|h| [(h, super::Stores::Cached), (h, super::Stores::Streamed)])
        {
            let mut slot = vec![0u8; src.len()];
            let mut w = super::SlotWriter::new(&mut slot, hashed, stores);
            for piece in [&src[..1000], &src[1000..200_000], &src[200_000..]] {
                w.write(piece);
            }
            let sum = w.finish();
            assert_eq!(slot, src);
            assert_eq!(sum, if hashed { orbitkv_proto::chunk_checksum(&src) } else { 0 });
        }
    }

    /// Two slots written as pairs of pieces (as many pieces, or not), hashed or not.
    #[test]
    fn two_slots_written_side_by_side_are_each_whole() {
        let src: Vec<u8> =
            (0..600_000u32).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8).collect();
        let (a, b) = src.split_at(300_000);
        type Pieces<'a> = &'a [&'a [u8]];
        let cuts: [(Pieces, Pieces); 2] = [
            (&[&a[..1000], &a[1000..]], &[&b[..1000], &b[1000..]]),
            (&[&a[..1000], &a[1000..]], &[&b[..5], &b[5..70_000], &b[70_000..]]),
        ];
        for (hashed, (pa, pb)) in [false, true].into_iter().flat_map(|h| cuts.map(|c| (h, c))) {
            let (mut slot_a, mut slot_b) = (vec![0u8; a.len()], vec![0u8; b.len()]);
            let mut wa = super::SlotWriter::new(&mut slot_a, hashed, super::Stores::Streamed);
            let mut wb = super::SlotWriter::new(&mut slot_b, hashed, super::Stores::Streamed);
            super::SlotWriter::write_pieces_pair(
                &mut wa,
                pa.iter().copied(),
                &mut wb,
                pb.iter().copied(),
            );
            let (sa, sb) = (wa.finish(), wb.finish());
            assert!(
                slot_a == a && slot_b == b,
                "hashed {hashed}, {} / {} pieces",
                pa.len(),
                pb.len()
            );
            let want = |x: &[u8]| if hashed { orbitkv_proto::chunk_checksum(x) } else { 0 };
            assert_eq!((sa, sb), (want(a), want(b)), "hashed {hashed}");
        }
    }

    use std::sync::Mutex;

    #[test]
    fn every_item_once_on_the_threads_asked_for() {
        for (threads, n) in [(1, 5), (3, 10), (4, 3), (8, 1), (2, 0)] {
            let seen = Mutex::new(Vec::new());
            let ids = Mutex::new(std::collections::HashSet::new());
            let calls = AtomicUsize::new(0);
            super::for_each(threads, (0..n).collect(), |i: usize| {
                calls.fetch_add(1, Ordering::Relaxed);
                seen.lock().unwrap().push(i);
                ids.lock().unwrap().insert(std::thread::current().id());
            });
            let mut seen = seen.into_inner().unwrap();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
            assert_eq!(calls.load(Ordering::Relaxed), n);
            assert!(ids.into_inner().unwrap().len() <= threads.min(n).max(1));
        }
    }
}
