//! Best-fit extent allocator over one shard's arena slice, in 4 KiB pages.
//!
//! Free space is kept twice: by start (to coalesce neighbours on free) and by (length, start)
//! (to find the smallest fitting extent). Both are O(log n); nothing is allocated per chunk
//! beyond the tree nodes.

use std::collections::{BTreeMap, BTreeSet};

/// Allocation granularity and alignment: every slot starts and ends on a page boundary, as
/// O_DIRECT I/O to the SSD tier needs.
pub use orbitkv_proto::PAGE_SIZE;

/// A run of pages handed out by [`ExtentAllocator`]; offsets are relative to the slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// First page.
    pub start_page: u64,
    /// Number of pages.
    pub pages: u64,
}

impl Extent {
    /// Byte offset of the extent within its slice.
    pub fn offset(&self) -> u64 {
        self.start_page * PAGE_SIZE
    }

    /// Byte length of the extent.
    pub fn bytes(&self) -> u64 {
        self.pages * PAGE_SIZE
    }
}

/// Best-fit, coalescing allocator of page runs.
#[derive(Debug)]
pub struct ExtentAllocator {
    capacity_pages: u64,
    used_pages: u64,
    by_start: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
}

impl ExtentAllocator {
    /// An allocator over `capacity_pages` free pages.
    pub fn new(capacity_pages: u64) -> Self {
        let mut a = Self {
            capacity_pages,
            used_pages: 0,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
        };
        if capacity_pages > 0 {
            a.insert_free(0, capacity_pages);
        }
        a
    }

    /// Pages needed for `bytes` (at least one).
    pub fn pages_for(bytes: u64) -> u64 {
        bytes.div_ceil(PAGE_SIZE).max(1)
    }

    /// Total pages managed.
    pub fn capacity_pages(&self) -> u64 {
        self.capacity_pages
    }

    /// Pages currently handed out.
    pub fn used_pages(&self) -> u64 {
        self.used_pages
    }

    /// The largest free run, in pages.
    pub fn largest_free(&self) -> u64 {
        self.by_len.last().map_or(0, |&(len, _)| len)
    }

    /// Allocates the smallest free run of at least `pages` pages (lowest address on ties).
    pub fn alloc(&mut self, pages: u64) -> Option<Extent> {
        if pages == 0 {
            return None;
        }
        let &(len, start) = self.by_len.range((pages, 0)..).next()?;
        self.remove_free(start, len);
        if len > pages {
            self.insert_free(start + pages, len - pages);
        }
        self.used_pages += pages;
        Some(Extent { start_page: start, pages })
    }

    /// Returns an extent; it is merged with free neighbours.
    pub fn free(&mut self, extent: Extent) {
        let Extent { mut start_page, mut pages } = extent;
        debug_assert!(start_page + pages <= self.capacity_pages, "extent inside the slice");
        self.used_pages -= pages;
        if let Some((&prev_start, &prev_len)) = self.by_start.range(..start_page).next_back() {
            debug_assert!(prev_start + prev_len <= start_page, "double free of {extent:?}");
            if prev_start + prev_len == start_page {
                self.remove_free(prev_start, prev_len);
                start_page = prev_start;
                pages += prev_len;
            }
        }
        if let Some(&next_len) = self.by_start.get(&(start_page + pages)) {
            self.remove_free(start_page + pages, next_len);
            pages += next_len;
        }
        self.insert_free(start_page, pages);
    }

    fn insert_free(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
    }

    /// The free extents, in page order (an audit's full scan).
    pub(crate) fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.by_start.iter().map(|(&start_page, &pages)| Extent { start_page, pages })
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        let mut free = 0;
        let mut prev_end: Option<u64> = None;
        for (&s, &l) in &self.by_start {
            assert!(l > 0);
            assert!(self.by_len.contains(&(l, s)));
            if let Some(end) = prev_end {
                assert!(s > end, "free extents overlap or touch without coalescing");
            }
            prev_end = Some(s + l);
            free += l;
        }
        assert_eq!(self.by_len.len(), self.by_start.len());
        assert_eq!(free + self.used_pages, self.capacity_pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_coalesce() {
        let mut a = ExtentAllocator::new(10);
        let x = a.alloc(3).unwrap();
        let y = a.alloc(2).unwrap();
        let z = a.alloc(5).unwrap();
        assert!(a.alloc(1).is_none());
        a.free(y);
        a.free(x);
        assert_eq!(a.largest_free(), 5);
        a.free(z);
        assert_eq!(a.largest_free(), 10);
        a.check_invariants();
    }

    proptest! {
        /// Random alloc/free sequences: extents never overlap, accounting adds up, free space
        /// is always coalesced.
        #[test]
        fn never_overlaps(ops in prop::collection::vec((any::<bool>(), 1u64..20, any::<prop::sample::Index>()), 1..300)) {
            let mut a = ExtentAllocator::new(256);
            let mut live: Vec<Extent> = Vec::new();
            for (is_alloc, pages, pick) in ops {
                if is_alloc || live.is_empty() {
                    if let Some(e) = a.alloc(pages) {
                        for o in &live {
                            prop_assert!(e.start_page + e.pages <= o.start_page || o.start_page + o.pages <= e.start_page);
                        }
                        prop_assert!(e.start_page + e.pages <= 256);
                        live.push(e);
                    } else {
                        prop_assert!(a.largest_free() < pages);
                    }
                } else {
                    let e = live.swap_remove(pick.index(live.len()));
                    a.free(e);
                }
                a.check_invariants();
            }
            for e in live.drain(..) {
                a.free(e);
            }
            prop_assert_eq!(a.largest_free(), 256);
        }
    }
}
