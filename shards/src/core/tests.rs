use std::sync::Arc;

use orbitkv_proto::{Dtype, NamespaceDescriptor};
use proptest::prelude::*;

use super::*;
use crate::Arena;

fn descriptor(tokens_per_chunk: u32) -> NamespaceDescriptor {
    // 1 layer * 2 * 1 head * 512 * fp32 = 4 KiB per token.
    NamespaceDescriptor {
        model: "test-model".into(),
        dtype: Dtype::Fp32,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 512,
        kv_tensors: 2,
        tokens_per_chunk,
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    }
}

fn shard(pages: u64) -> (ShardCore, u64) {
    let arena = Arc::new(Arena::create(pages * crate::PAGE_SIZE, false).unwrap());
    let slice = arena.split(1).pop().unwrap();
    let mut core = ShardCore::new(
        ShardConfig { id: 0, max_chunk_bytes: 1 << 30, max_namespaces: 4, ..Default::default() },
        slice,
    );
    let ns = descriptor(4);
    let id = ns.id();
    assert!(matches!(core.register(ns), Ok(16384)));
    (core, id)
}

fn key(ns: u64, i: u32) -> ChunkKey {
    let mut d = [0u8; 32];
    d[..4].copy_from_slice(&i.to_le_bytes());
    ChunkKey::new(ns, d)
}

fn fill(i: u32, len: u64) -> Vec<u8> {
    (0..len).map(|b| (b as u32).wrapping_mul(31).wrapping_add(i) as u8).collect()
}

/// Reserve, write the key's pattern into the slot, commit.
fn put(
    core: &mut ShardCore,
    session: SessionId,
    k: ChunkKey,
    i: u32,
    len: u64,
) -> Result<(), ErrorCode> {
    match core.reserve(session, &[k], &[len])[0] {
        Reservation::Slot { offset, len, generation } => {
            core.slice.write(offset - core.slice.offset(), &fill(i, len));
            match core
                .apply(ShardOp::Commit { session, slots: vec![SlotRef { key: k, generation }] })
            {
                ShardReply::Outcomes(o) if o[0] == ChunkOutcome::Done => Ok(()),
                other => panic!("commit failed: {other:?}"),
            }
        }
        Reservation::Failed(code) => Err(code),
    }
}

#[test]
fn put_lookup_lease_release() {
    let (mut core, ns) = shard(64);
    put(&mut core, 1, key(ns, 1), 1, 10_000).unwrap();
    let hits = core.lookup(2, &[key(ns, 1), key(ns, 2)], true);
    let hit = hits[0].expect("committed key is visible");
    assert!(hits[1].is_none());
    assert_eq!(hit.len, 10_000);
    assert_eq!(hit.checksum, xxhash_rust::xxh3::xxh3_64(&fill(1, 10_000)));
    assert_eq!(core.leases(), 1);
    let slot = SlotRef { key: key(ns, 1), generation: hit.generation };
    // Another session cannot release this lease.
    assert_eq!(core.release(3, &slot), Err(ErrorCode::NotFound));
    assert_eq!(
        core.release(2, &SlotRef { generation: 99, ..slot }),
        Err(ErrorCode::StaleGeneration)
    );
    assert_eq!(core.release(2, &slot), Ok(()));
    assert_eq!(core.release(2, &slot), Err(ErrorCode::NotFound));
    assert_eq!(core.leases(), 0);
}

#[test]
fn commits_with_given_checksums() {
    let (mut core, ns) = shard(64);
    let right = |i: u32| xxhash_rust::xxh3::xxh3_64(&fill(i, 5000));
    // (key, checksum given, verify): right and trusted, right and checked, wrong and checked,
    // wrong and trusted.
    let cases = [(1, right(1), false), (2, right(2), true), (3, 42, true), (4, 42, false)];
    let mut slots = Vec::new();
    for &(i, sum, verify) in &cases {
        match core.reserve(7, &[key(ns, i)], &[5000])[0] {
            Reservation::Slot { offset, generation, .. } => {
                core.slice.write(offset - core.slice.offset(), &fill(i, 5000));
                slots.push((SlotRef { key: key(ns, i), generation }, sum, verify));
            }
            Reservation::Failed(code) => panic!("reserve: {code:?}"),
        }
    }
    match core.apply(ShardOp::CommitSummed { session: 7, slots }) {
        ShardReply::Outcomes(o) => assert_eq!(
            o,
            vec![
                ChunkOutcome::Done,
                ChunkOutcome::Done,
                ChunkOutcome::Failed(ErrorCode::ChecksumMismatch),
                ChunkOutcome::Done
            ]
        ),
        other => panic!("{other:?}"),
    }
    let hits = core.lookup(8, &[key(ns, 1), key(ns, 2), key(ns, 3), key(ns, 4)], false);
    // A checked wrong checksum drops the chunk (its reservation is gone too); an unchecked
    // one is stored as given (the SSD tier and peers verify against it later, and miss
    // rather than serve).
    assert_eq!(hits[0].unwrap().checksum, right(1));
    assert_eq!(hits[1].unwrap().checksum, right(2));
    assert!(hits[2].is_none());
    assert_eq!(hits[3].unwrap().checksum, 42);
    let st = core.stats();
    assert_eq!(
        (st.given_checksums, st.given_checksums_verified, st.given_checksum_mismatches),
        (3, 2, 1)
    );
    assert_eq!((st.commits, st.reservations), (3, 0));
}

#[test]
fn reserved_chunks_are_invisible_and_owned() {
    let (mut core, ns) = shard(64);
    let k = key(ns, 1);
    let Reservation::Slot { generation, .. } = core.reserve(1, &[k], &[4096])[0] else {
        panic!("reserve failed")
    };
    assert!(core.lookup(1, &[k], false)[0].is_none());
    assert_eq!(core.reserve(2, &[k], &[4096])[0], Reservation::Failed(ErrorCode::Busy));
    let slot = SlotRef { key: k, generation };
    assert_eq!(
        core.commit(2, &slot, None, ShardCore::hash_here),
        Err(ErrorCode::NotFound),
        "not the owner"
    );
    assert_eq!(
        core.commit(1, &SlotRef { generation: generation + 1, ..slot }, None, ShardCore::hash_here),
        Err(ErrorCode::StaleGeneration)
    );
    assert_eq!(core.commit(1, &slot, None, ShardCore::hash_here), Ok(()));
    assert_eq!(core.reserve(2, &[k], &[4096])[0], Reservation::Failed(ErrorCode::AlreadyPresent));
    assert_eq!(core.reservations(), 0);
}

#[test]
fn bad_reservations_name_the_reason() {
    let (mut core, ns) = shard(64);
    let r = core.reserve(1, &[key(ns + 1, 1), key(ns, 2), key(ns, 3)], &[10, 0, 1 << 20]);
    assert_eq!(
        r,
        vec![
            Reservation::Failed(ErrorCode::UnknownNamespace),
            Reservation::Failed(ErrorCode::InvalidArgument),
            Reservation::Failed(ErrorCode::TooLarge),
        ]
    );
    assert_eq!(core.stats().errors.len(), 3);
}

#[test]
fn eviction_spares_leased_and_reserved_chunks() {
    let (mut core, ns) = shard(16); // 16 pages, chunks of 4 pages
    for i in 0..4 {
        put(&mut core, 1, key(ns, i), i, 16384).unwrap();
    }
    let leased = core.lookup(2, &[key(ns, 0)], true)[0].unwrap();
    // A fifth chunk evicts something, never key 0.
    for i in 4..20 {
        put(&mut core, 1, key(ns, i), i, 16384).unwrap();
        assert!(core.lookup(9, &[key(ns, 0)], false)[0].is_some());
    }
    assert!(core.metrics.evictions >= 16);
    // Key 0's bytes are intact.
    let bytes = core.slice.bytes(leased.offset - core.slice.offset(), leased.len);
    assert_eq!(bytes, &fill(0, 16384)[..]);
    // Fill the rest with reservations, lease everything left: then no space.
    let r = core.reserve(3, &[key(ns, 100), key(ns, 101), key(ns, 102)], &[16384; 3]);
    assert!(r.iter().all(|r| matches!(r, Reservation::Slot { .. })), "{r:?}");
    assert_eq!(
        core.reserve(3, &[key(ns, 103)], &[16384])[0],
        Reservation::Failed(ErrorCode::NoSpace)
    );
    // Closing session 3 frees its reservations; closing 2 releases its lease.
    assert_eq!(core.close_session(3), (0, 3));
    assert_eq!(core.close_session(2), (1, 0));
    assert_eq!((core.leases(), core.reservations()), (0, 0));
    put(&mut core, 1, key(ns, 103), 103, 16384).unwrap();
}

#[test]
fn namespace_conflicts_and_limits() {
    let (mut core, _) = shard(64);
    // Same descriptor again: fine.
    assert!(core.register(descriptor(4)).is_ok());
    // Chunk bigger than the slice.
    let big = core.register(descriptor(1000)).unwrap_err();
    assert_eq!(big.0, ErrorCode::TooLarge);
    assert!(big.1.contains("--dram"), "{}", big.1);
    for t in 1..=3 {
        let _ = core.register(descriptor(t));
    }
    assert_eq!(core.register(descriptor(5)).unwrap_err().0, ErrorCode::NoSpace);
}

#[test]
fn explicit_evict() {
    let (mut core, ns) = shard(64);
    put(&mut core, 1, key(ns, 1), 1, 100).unwrap();
    core.lookup(2, &[key(ns, 1)], true);
    assert_eq!(core.evict(&key(ns, 1)), Err(ErrorCode::Busy));
    core.close_session(2);
    assert_eq!(core.evict(&key(ns, 1)), Ok(()));
    assert_eq!(core.evict(&key(ns, 1)), Err(ErrorCode::NotFound));
    assert_eq!(core.stats().dram_used_bytes, 0);
}

#[test]
fn a_namespace_is_evicted_whole_except_what_is_busy() {
    let (mut core, a) = shard(64);
    let b = descriptor(2).id();
    core.register(descriptor(2)).unwrap();
    for i in 0..4 {
        put(&mut core, 1, key(a, i), i, 100).unwrap();
        put(&mut core, 1, key(b, i), i, 100).unwrap();
    }
    // One chunk of `a` is leased; another write of `a` is not committed yet.
    core.lookup(2, &[key(a, 0)], true);
    let pending = match core.reserve(3, &[key(a, 9)], &[100])[0] {
        Reservation::Slot { generation, .. } => SlotRef { key: key(a, 9), generation },
        Reservation::Failed(code) => panic!("reserve: {code:?}"),
    };
    let removals = core.stats().removals;
    assert_eq!(core.evict_namespace(Some(a)), EvictSummary { removed: 3, busy: 1, not_durable: 0 });
    assert_eq!(core.stats().removals, removals + 3);
    let present = |core: &mut ShardCore, ns: u64| {
        (0..4).filter(|&i| core.lookup(4, &[key(ns, i)], false)[0].is_some()).count()
    };
    assert_eq!(present(&mut core, a), 1, "the leased chunk stays");
    assert_eq!(present(&mut core, b), 4, "the other namespace is untouched");
    // The uncommitted write is left alone: it still commits, and is then visible.
    assert_eq!(core.stats().reservations, 1);
    match core.apply(ShardOp::Commit { session: 3, slots: vec![pending] }) {
        ShardReply::Outcomes(o) => assert_eq!(o, vec![ChunkOutcome::Done]),
        other => panic!("{other:?}"),
    }
    assert!(core.lookup(4, &[key(a, 9)], false)[0].is_some());
    // Once released, the last chunk goes; a namespace with nothing left removes nothing.
    core.close_session(2);
    assert_eq!(core.evict_namespace(Some(a)), EvictSummary { removed: 2, busy: 0, not_durable: 0 });
    assert_eq!(core.evict_namespace(Some(12345)), EvictSummary::default());
    // Every namespace.
    assert_eq!(core.evict_namespace(None), EvictSummary { removed: 4, busy: 0, not_durable: 0 });
    assert_eq!(present(&mut core, b), 0);
}

#[derive(Debug, Clone)]
enum Step {
    Put(u32, u64),
    /// Several keys (from the first, wrapping, the first again at the end when asked) of one
    /// length reserved in one request, written, committed; the first twice as long when asked.
    PutMany(u32, u32, u64, bool, bool),
    Get(u32, bool),
    ReleaseAll,
    Reserve(u32),
    Close,
    Evict(u32),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u32..40, 1u64..16384).prop_map(|(k, l)| Step::Put(k, l)),
        2 => (0u32..40, 2u32..6, 1u64..8192, any::<bool>(), any::<bool>())
            .prop_map(|(k, n, l, dup, longer)| Step::PutMany(k, n, l, dup, longer)),
        4 => (0u32..40, any::<bool>()).prop_map(|(k, l)| Step::Get(k, l)),
        1 => Just(Step::ReleaseAll),
        1 => (0u32..40).prop_map(Step::Reserve),
        1 => Just(Step::Close),
        1 => (0u32..40).prop_map(Step::Evict),
    ]
}

proptest! {
    /// Under any sequence of puts, leased gets, releases, reservations, session closes and
    /// evictions on a small shard: every hit returns exactly the bytes put for its key, a
    /// leased chunk stays present until released, and the accounting returns to zero.
    #[test]
    fn never_a_wrong_byte(steps in prop::collection::vec(step(), 1..200)) {
        let (mut core, ns) = shard(24);
        let mut held: Vec<(ChunkKey, Hit)> = Vec::new();
        for s in steps {
            match s {
                Step::Put(i, len) => { let _ = put(&mut core, 1, key(ns, i), i, len); }
                Step::PutMany(first, n, len, dup, longer) => {
                    let mut ids: Vec<u32> = (0..n).map(|j| (first + j) % 40).collect();
                    if dup { ids.push(first); }
                    let ks: Vec<ChunkKey> = ids.iter().map(|&i| key(ns, i)).collect();
                    let mut lens = vec![len; ks.len()];
                    if longer { lens[0] = 2 * len; }
                    let r = core.reserve(1, &ks, &lens);
                    let mut slots = Vec::new();
                    for (&i, r) in ids.iter().zip(&r) {
                        if let Reservation::Slot { offset, len, generation } = *r {
                            core.slice.write(offset - core.slice.offset(), &fill(i, len));
                            slots.push(SlotRef { key: key(ns, i), generation });
                        }
                    }
                    core.apply(ShardOp::Commit { session: 1, slots });
                }
                Step::Get(i, lease) => {
                    if let Some(hit) = core.lookup(2, &[key(ns, i)], lease)[0] {
                        let bytes = core.slice.bytes(hit.offset - core.slice.offset(), hit.len);
                        prop_assert_eq!(bytes, &fill(i, hit.len)[..]);
                        if lease { held.push((key(ns, i), hit)); }
                    }
                }
                Step::ReleaseAll => {
                    for (k, h) in held.drain(..) {
                        prop_assert_eq!(core.release(2, &SlotRef { key: k, generation: h.generation }), Ok(()));
                    }
                }
                Step::Reserve(i) => { let _ = core.reserve(3, &[key(ns, 1000 + i)], &[4096]); }
                Step::Close => { core.close_session(3); }
                Step::Evict(i) => { let _ = core.evict(&key(ns, i)); }
            }
            for (k, h) in &held {
                let now = core.lookup(9, &[*k], false)[0];
                prop_assert_eq!(now.map(|n| n.generation), Some(h.generation), "leased chunk lost");
            }
            // Every page in use belongs to exactly one entry.
            let mut extents: Vec<(u64, u64)> = core
                .entries
                .keys()
                .map(|k| core.entries.get(core.entries.find(k).expect("listed")))
                .map(|e| {
                    assert!(e.len <= e.extent.bytes(), "{} bytes in a slot of {}", e.len, e.extent.bytes());
                    (e.extent.start_page, e.extent.pages)
                })
                .collect();
            extents.sort();
            prop_assert!(extents.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "overlapping slots: {:?}", extents);
            prop_assert_eq!(extents.iter().map(|e| e.1).sum::<u64>(), core.alloc.used_pages());
            let audit = core.audit();
            prop_assert!(audit.problems.is_empty(), "{:?}", audit.problems);
            prop_assert_eq!(audit.leases, held.len() as u64);
        }
        core.close_session(2);
        core.close_session(3);
        prop_assert_eq!(core.leases(), 0);
        prop_assert_eq!(core.reservations(), 0);
        let s = core.stats();
        let ready_pages: u64 = s.entries; // at least one page each
        prop_assert!(s.dram_used_bytes >= ready_pages * crate::PAGE_SIZE);
    }
}

/// The slice offsets of a reservation's slots (panics on a failed one).
fn offsets(r: &[Reservation]) -> Vec<u64> {
    r.iter()
        .map(|r| match r {
            Reservation::Slot { offset, .. } => *offset,
            Reservation::Failed(code) => panic!("reserve: {code:?}"),
        })
        .collect()
}

fn keys(ns: u64, ids: std::ops::Range<u32>) -> Vec<ChunkKey> {
    ids.map(|i| key(ns, i)).collect()
}

/// A shard of `pages` pages holding keys 0-7, 8 KiB (two pages) each, in pages 0-15.
fn eight_chunks(pages: u64) -> (ShardCore, u64) {
    let (mut core, ns) = shard(pages);
    for i in 0..8 {
        put(&mut core, 1, key(ns, i), i, 8192).unwrap();
    }
    (core, ns)
}

#[test]
fn chunks_of_one_size_reserved_together_get_adjacent_slots() {
    let (mut core, ns) = shard(64);
    // A single chunk first, so that the run does not start at the slice's beginning.
    put(&mut core, 1, key(ns, 100), 100, 5000).unwrap();
    let r = core.reserve(1, &keys(ns, 0..6), &[8192; 6]);
    let at = offsets(&r);
    assert!(at.windows(2).all(|w| w[1] == w[0] + 8192), "{at:?}");
    // Lengths that are not page multiples: slots still a whole number of pages apart.
    let r = core.reserve(1, &keys(ns, 10..13), &[5000; 3]);
    let at = offsets(&r);
    assert!(at.windows(2).all(|w| w[1] == w[0] + 8192), "{at:?}");
    assert_eq!(core.alloc.used_pages(), 2 + 6 * 2 + 3 * 2);
}

#[test]
fn a_run_skips_refused_chunks_and_gives_back_what_it_did_not_use() {
    let (mut core, ns) = shard(64);
    put(&mut core, 1, key(ns, 2), 2, 8192).unwrap();
    let before = core.alloc.used_pages();
    // Key 2 is present, key 4 is named twice: the others are still adjacent.
    let ks = [key(ns, 0), key(ns, 1), key(ns, 2), key(ns, 3), key(ns, 4), key(ns, 4)];
    let r = core.reserve(1, &ks, &[8192; 6]);
    assert_eq!(r[2], Reservation::Failed(ErrorCode::AlreadyPresent));
    assert_eq!(r[5], Reservation::Failed(ErrorCode::Busy));
    let at = offsets(&[r[0], r[1], r[3], r[4]]);
    assert!(at.windows(2).all(|w| w[1] == w[0] + 8192), "{at:?}");
    // The slot meant for the duplicate went back to the allocator.
    assert_eq!(core.alloc.used_pages(), before + 4 * 2);
    // Aborting them frees everything they took.
    assert_eq!(core.close_session(1), (0, 4));
    assert_eq!(core.alloc.used_pages(), before);
}

#[test]
fn a_refused_reservation_evicts_nothing() {
    let (mut core, ns) = shard(16);
    for i in 0..4 {
        put(&mut core, 1, key(ns, i), i, 16384).unwrap();
    }
    // The arena is full. Too large, unknown namespace, already present: nothing to place,
    // so nothing is evicted to make room.
    let r = core.reserve(2, &keys(ns, 10..14), &[1 << 20; 4]);
    assert!(r.iter().all(|r| *r == Reservation::Failed(ErrorCode::TooLarge)), "{r:?}");
    let r = core.reserve(2, &keys(ns ^ 1, 10..14), &[16384; 4]);
    assert!(r.iter().all(|r| *r == Reservation::Failed(ErrorCode::UnknownNamespace)), "{r:?}");
    let r = core.reserve(2, &keys(ns, 0..4), &[16384; 4]);
    assert!(r.iter().all(|r| *r == Reservation::Failed(ErrorCode::AlreadyPresent)), "{r:?}");
    assert_eq!(core.metrics.evictions, 0);
    assert_eq!(core.lookup(3, &keys(ns, 0..4), false).iter().flatten().count(), 4);
}

#[test]
fn a_run_evicts_only_what_the_chunks_need() {
    let (mut core, ns) = eight_chunks(16);
    // Full. Three chunks need three victims; the oldest go, next to each other, and their
    // space takes the run.
    let r = core.reserve(2, &keys(ns, 20..23), &[8192; 3]);
    let at = offsets(&r);
    assert!(at.windows(2).all(|w| w[1] == w[0] + 8192), "{at:?}");
    assert_eq!(core.metrics.evictions, 3);
    assert_eq!(core.lookup(3, &keys(ns, 3..8), false).iter().flatten().count(), 5);
}

#[test]
fn fragmented_room_is_used_without_evicting() {
    let (mut core, ns) = eight_chunks(16);
    // Free every other slot: 8 free pages, no two slots' worth side by side.
    for i in (0..8).step_by(2) {
        assert_eq!(core.evict(&key(ns, i)), Ok(()));
    }
    let evicted = core.metrics.evictions;
    let r = core.reserve(2, &keys(ns, 20..24), &[8192; 4]);
    assert_eq!(offsets(&r).len(), 4);
    assert_eq!(core.metrics.evictions, evicted, "the room was there, in pieces");
    assert_eq!(core.lookup(3, &keys(ns, 0..8), false).iter().flatten().count(), 4);
}

#[test]
fn a_run_takes_room_in_one_piece_over_scattered_holes() {
    let (mut core, ns) = eight_chunks(32);
    // Holes of one slot at pages 2, 6 and 10; pages 16-31 free in one piece.
    for i in [1, 3, 5] {
        assert_eq!(core.evict(&key(ns, i)), Ok(()));
    }
    // One by one, best fit would fill the three holes; together they go side by side.
    let at = offsets(&core.reserve(2, &keys(ns, 20..23), &[8192; 3]));
    let first = core.slice.offset() + 16 * crate::PAGE_SIZE;
    assert_eq!(at, [first, first + 8192, first + 16384]);
    // A single chunk still fills a hole.
    let one = offsets(&core.reserve(2, &[key(ns, 30)], &[8192]));
    assert_eq!(one, [core.slice.offset() + 2 * crate::PAGE_SIZE]);
}

#[test]
fn a_key_refused_before_the_run_evicted_it_does_not_take_a_run_slot() {
    let (mut core, ns) = eight_chunks(16);
    // Key 0 is present (refused up front), and the oldest: the run for keys 20 and 21 evicts
    // it. Key 0 may then be reserved, but with a slot of its own size, not one of the run's.
    let r = core.reserve(2, &[key(ns, 0), key(ns, 20), key(ns, 21)], &[16384, 8192, 8192]);
    let mut slots: Vec<(u64, u64)> = r
        .iter()
        .filter_map(|r| match r {
            Reservation::Slot { offset, len, .. } => Some((*offset, *len)),
            Reservation::Failed(_) => None,
        })
        .collect();
    assert!(slots.len() >= 2, "{r:?}");
    slots.sort();
    assert!(slots.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "overlapping slots: {slots:?}");
}

#[test]
fn a_key_named_twice_does_not_grow_the_run() {
    let (mut core, ns) = eight_chunks(16);
    let r = core.reserve(2, &[key(ns, 20); 4], &[8192; 4]);
    assert!(matches!(r[0], Reservation::Slot { .. }), "{r:?}");
    assert!(r[1..].iter().all(|r| *r == Reservation::Failed(ErrorCode::Busy)), "{r:?}");
    assert_eq!(core.metrics.evictions, 1, "one chunk needs one victim");
}

/// A commit's chunks hashed outside the shard (a piece at a time through its reader) and then
/// applied: the same checksums as the shard computes itself; a range whose reservation went
/// away meanwhile fails its commit and frees its pages; a hash for another generation of the
/// same key is not taken.
#[test]
fn commits_hashed_outside_the_shard() {
    let (mut core, ns) = shard(64);
    let len = 16_000u64;
    let mut slots = Vec::new();
    for i in 1..=3 {
        let Reservation::Slot { offset, generation, .. } =
            core.reserve(5, &[key(ns, i)], &[len])[0]
        else {
            panic!("reserve failed")
        };
        core.slice.write(offset - core.slice.offset(), &fill(i, len));
        slots.push(SlotRef { key: key(ns, i), generation });
    }
    let used = core.stats().dram_used_bytes;
    let op = ShardOp::Commit { session: 5, slots: slots.clone() };
    let ranges = core.hash_ranges(&op);
    assert_eq!(ranges.len(), 3);
    let reader = core.reader();
    let mut hashed: Vec<(HashRange, u64)> = ranges
        .iter()
        .map(|r| {
            let mut h = orbitkv_proto::ChunkChecksum::new();
            for at in (0..r.len).step_by(4096) {
                h.update(reader.bytes(r.offset + at, (r.len - at).min(4096)));
            }
            (*r, h.finish())
        })
        .collect();
    // Key 3's hash is for an older reservation of it: recomputed, not taken.
    hashed[2].0.generation += 1;
    hashed[2].1 = 42;
    // Key 2's session-held reservation is aborted while the hashes run.
    assert_eq!(core.abort(5, &slots[1]), Ok(()));
    match core.apply_hashed(op, &hashed) {
        ShardReply::Outcomes(o) => assert_eq!(
            o,
            vec![ChunkOutcome::Done, ChunkOutcome::Failed(ErrorCode::NotFound), ChunkOutcome::Done]
        ),
        other => panic!("{other:?}"),
    }
    let hits = core.lookup(6, &[key(ns, 1), key(ns, 2), key(ns, 3)], false);
    assert_eq!(hits[0].unwrap().checksum, xxhash_rust::xxh3::xxh3_64(&fill(1, len)));
    assert!(hits[1].is_none());
    assert_eq!(hits[2].unwrap().checksum, xxhash_rust::xxh3::xxh3_64(&fill(3, len)));
    let st = core.stats();
    assert_eq!((st.commits, st.reservations), (2, 0));
    assert!(st.dram_used_bytes < used, "the aborted slot's pages are free again");
}

/// Given checksums: only those to verify are hashed, and a wrong given one is caught by the
/// hash made outside the shard.
#[test]
fn verified_commits_hashed_outside_the_shard() {
    let (mut core, ns) = shard(64);
    let mut slots = Vec::new();
    for (i, sum, verify) in [(1, 7, false), (2, 9, true)] {
        let Reservation::Slot { offset, generation, .. } =
            core.reserve(5, &[key(ns, i)], &[5000])[0]
        else {
            panic!("reserve failed")
        };
        core.slice.write(offset - core.slice.offset(), &fill(i, 5000));
        slots.push((SlotRef { key: key(ns, i), generation }, sum, verify));
    }
    let op = ShardOp::CommitSummed { session: 5, slots };
    let ranges = core.hash_ranges(&op);
    assert_eq!(ranges.len(), 1);
    assert_eq!(ranges[0].key, key(ns, 2));
    let sum = orbitkv_proto::chunk_checksum(core.reader().bytes(ranges[0].offset, ranges[0].len));
    match core.apply_hashed(op, &[(ranges[0], sum)]) {
        ShardReply::Outcomes(o) => assert_eq!(
            o,
            vec![ChunkOutcome::Done, ChunkOutcome::Failed(ErrorCode::ChecksumMismatch)]
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(core.stats().given_checksum_mismatches, 1);
    // Nothing to hash in ops that are not commits, or for slots not reserved by the session.
    assert!(core.hash_ranges(&ShardOp::Evict { keys: vec![key(ns, 1)] }).is_empty());
    let gone = SlotRef { key: key(ns, 2), generation: 1 };
    assert!(core.hash_ranges(&ShardOp::Commit { session: 5, slots: vec![gone] }).is_empty());
}

/// The audit's full scan finds a counter that disagrees with the entries, and a page that is
/// neither free nor held.
#[test]
fn the_audit_finds_what_does_not_add_up() {
    let (mut core, ns) = shard(8);
    put(&mut core, 1, key(ns, 1), 1, 5000).unwrap();
    let hit = core.lookup(2, &[key(ns, 1)], true)[0].unwrap();
    let audit = core.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    assert_eq!((audit.entries, audit.leases, audit.pins), (1, 1, 0));
    core.leases += 1;
    assert_eq!(core.audit().problems.len(), 1, "{:?}", core.audit().problems);
    core.leases -= 1;
    core.release(2, &SlotRef { key: key(ns, 1), generation: hit.generation }).unwrap();
    let idx = core.entries.find(&key(ns, 1)).unwrap();
    core.entries.get_mut(idx).extent.pages -= 1; // a page leaks
    let problems = core.audit().problems;
    assert!(problems.iter().any(|p| p.contains("neither free nor held")), "{problems:?}");
}

/// A shard of `pages` pages with two namespaces (a noisy and a quiet one) under `cfg`'s
/// limit and guarantee.
fn two_tenants(pages: u64, limit: u64, guarantee: u64) -> (ShardCore, u64, u64) {
    let arena = Arc::new(Arena::create(pages * crate::PAGE_SIZE, false).unwrap());
    let slice = arena.split(1).pop().unwrap();
    let cfg = ShardConfig {
        max_chunk_bytes: 1 << 30,
        max_namespaces: 4,
        quota: NamespaceQuota {
            dram_limit_pages: limit,
            dram_guarantee_pages: guarantee,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut core = ShardCore::new(cfg, slice);
    let noisy = descriptor(4);
    let quiet = NamespaceDescriptor { model: "quiet-model".into(), ..descriptor(4) };
    let (n, q) = (noisy.id(), quiet.id());
    core.register(noisy).unwrap();
    core.register(quiet).unwrap();
    (core, n, q)
}

/// A noisy namespace writing far more than the shard holds cannot evict a quiet one below
/// its guarantee; without a guarantee it does.
#[test]
fn a_noisy_namespace_cannot_evict_a_quiet_one_below_its_guarantee() {
    for guarantee in [0, 6] {
        let (mut core, noisy, quiet) = two_tenants(24, 0, guarantee);
        for i in 0..8 {
            put(&mut core, 1, key(quiet, i), i, 4096).unwrap();
        }
        for i in 0..200 {
            put(&mut core, 2, key(noisy, i), i, 4096).unwrap();
        }
        let left = (0..8).filter(|&i| core.lookup(3, &[key(quiet, i)], false)[0].is_some()).count();
        if guarantee == 0 {
            assert_eq!(left, 0, "without a guarantee SIEVE takes them all");
        } else {
            assert_eq!(left, 6, "the guarantee's 6 pages stay");
        }
        assert!(core.audit().problems.is_empty(), "{:?}", core.audit().problems);
    }
}

/// A namespace at its limit evicts its own chunks for its next writes, never another's; when
/// none of its own can go (leased), the write is refused with `QuotaExceeded` and counted.
#[test]
fn a_namespace_at_its_limit_evicts_its_own_then_is_refused() {
    let (mut core, noisy, quiet) = two_tenants(64, 10, 0);
    for i in 0..4 {
        put(&mut core, 1, key(quiet, i), i, 4096).unwrap();
    }
    for i in 0..30 {
        put(&mut core, 2, key(noisy, i), i, 4096).unwrap();
    }
    assert_eq!(core.entries.namespace_pages(noisy), 10);
    assert_eq!(core.entries.namespace_pages(quiet), 4, "another's chunks are not its room");
    // Lease all ten: nothing of its own can make room.
    let leased: Vec<ChunkKey> = (20..30).map(|i| key(noisy, i)).collect();
    let hits = core.lookup(2, &leased, true);
    assert!(hits.iter().all(Option::is_some), "{hits:?}");
    assert!(matches!(
        core.reserve(2, &[key(noisy, 99)], &[4096])[0],
        Reservation::Failed(ErrorCode::QuotaExceeded)
    ));
    assert_eq!(core.stats().quota_refusals, 1);
    // The quiet namespace still writes.
    put(&mut core, 1, key(quiet, 50), 50, 4096).unwrap();
    assert!(core.audit().problems.is_empty(), "{:?}", core.audit().problems);
}

/// Quotas differ per model: the quiet model's own guarantee protects it where the default
/// (none) does not, and the noisy model's own limit bounds it where the default does not.
#[test]
fn each_model_has_its_own_quota() {
    let arena = Arc::new(Arena::create(14 * crate::PAGE_SIZE, false).unwrap());
    let slice = arena.split(1).pop().unwrap();
    let quota = |limit, guarantee| NamespaceQuota {
        dram_limit_pages: limit,
        dram_guarantee_pages: guarantee,
        ..Default::default()
    };
    let cfg = ShardConfig {
        max_chunk_bytes: 1 << 30,
        max_namespaces: 4,
        quota: quota(0, 0),
        model_quotas: vec![("quiet-model".into(), quota(0, 6)), ("test-model".into(), quota(5, 0))],
        ..Default::default()
    };
    let mut core = ShardCore::new(cfg, slice);
    let noisy = descriptor(4);
    let quiet = NamespaceDescriptor { model: "quiet-model".into(), ..descriptor(4) };
    let other = NamespaceDescriptor { model: "other-model".into(), ..descriptor(4) };
    let (n, q, o) = (noisy.id(), quiet.id(), other.id());
    for d in [noisy, quiet, other] {
        core.register(d).unwrap();
    }
    assert_eq!(core.quotas.of(q), quota(0, 6));
    assert_eq!(core.quotas.of(n), quota(5, 0));
    assert_eq!(core.quotas.of(o), quota(0, 0), "a model without its own: the default");
    for i in 0..8 {
        put(&mut core, 1, key(q, i), i, 4096).unwrap();
    }
    for i in 0..8 {
        put(&mut core, 1, key(o, i), i, 4096).unwrap();
    }
    for i in 0..100 {
        put(&mut core, 2, key(n, i), i, 4096).unwrap();
    }
    assert_eq!(core.entries.namespace_pages(n), 5, "the noisy model's own limit");
    assert_eq!(core.entries.namespace_pages(q), 6, "the quiet model's own guarantee");
    assert_eq!(core.entries.namespace_pages(o), 3, "no guarantee: the rest of the shard");
    assert!(core.audit().problems.is_empty(), "{:?}", core.audit().problems);
}
