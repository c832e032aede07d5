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
