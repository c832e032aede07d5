//! Copies spread over threads: a batch of chunks is split into contiguous runs, one per
//! thread, the calling thread taking the first.

/// Least bytes worth a thread of their own (starting a scoped thread costs tens of
/// microseconds; 4 MiB takes about 200 us at memcpy speed).
pub(crate) const MIN_BYTES_PER_THREAD: u64 = 4 << 20;

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
