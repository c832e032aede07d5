use super::*;
use crate::format::FORMAT_VERSION;
use proptest::prelude::*;

fn sb(regions: u64, region_bytes: u64) -> Superblock {
    Superblock {
        format_version: FORMAT_VERSION,
        shard_id: 0,
        shard_count: 1,
        region_bytes,
        region_count: regions,
    }
}

fn key(i: u32) -> ChunkKey {
    let mut d = [0u8; 32];
    d[..4].copy_from_slice(&i.to_le_bytes());
    ChunkKey::new(9, d)
}

/// An in-memory file: writes records where the log places them.
struct Disk {
    bytes: Vec<u8>,
}

impl Disk {
    fn new(sb: &Superblock) -> Self {
        Disk { bytes: vec![0u8; sb.file_bytes() as usize] }
    }

    fn write(&mut self, p: &Placement, payload: &[u8]) {
        let at = p.offset as usize;
        p.header.encode_into(&mut self.bytes[at..at + 4096]);
        self.bytes[at + 4096..at + 4096 + payload.len()].copy_from_slice(payload);
    }

    fn read(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        buf.copy_from_slice(&self.bytes[at as usize..at as usize + buf.len()]);
        Ok(())
    }

    fn payload(&self, e: &SsdEntry) -> &[u8] {
        let at = e.payload_offset() as usize;
        &self.bytes[at..at + e.len as usize]
    }
}

fn value(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|b| (b as u32 ^ i.wrapping_mul(7919)) as u8).collect()
}

fn put(
    log: &mut RegionLog,
    disk: &mut Disk,
    i: u32,
    len: usize,
) -> Result<Vec<ChunkKey>, PlaceError> {
    let v = value(i, len);
    let (p, dropped) = log.place(key(i), len as u64, xxhash_rust::xxh3::xxh3_64(&v))?;
    disk.write(&p, &v);
    log.complete_write(&p);
    Ok(dropped)
}

/// A log of `regions` regions of 64 KiB (four 12 KiB records each) with keys 0..8 written:
/// two regions full.
fn filled(regions: u64) -> (Superblock, RegionLog, Disk) {
    let sb = sb(regions, 64 << 10);
    let mut log = RegionLog::new(sb);
    let mut disk = Disk::new(&sb);
    for i in 0..8 {
        put(&mut log, &mut disk, i, 12 << 10).unwrap();
    }
    (sb, log, disk)
}

#[test]
fn fills_regions_then_reclaims_the_oldest_whole() {
    let sb = sb(3, 64 << 10); // 3 regions of 64 KiB: 4 records of 16 KiB (4 KiB header + 12 KiB)
    let mut log = RegionLog::new(sb);
    let mut disk = Disk::new(&sb);
    for i in 0..12 {
        assert!(put(&mut log, &mut disk, i, 12 << 10).unwrap().is_empty());
    }
    assert_eq!(log.len(), 12);
    assert_eq!(log.used_bytes(), 3 * (64 << 10));
    // The 13th record reclaims region 0 and drops its four keys.
    let dropped = put(&mut log, &mut disk, 12, 12 << 10).unwrap();
    assert_eq!(dropped, (0..4).map(key).collect::<Vec<_>>());
    assert!(log.get(&key(0)).is_none());
    assert!(log.used_bytes() <= 3 * (64 << 10));
    assert_eq!(log.place(key(99), 64 << 10, 0), Err(PlaceError::TooLarge));
}

#[test]
fn a_pinned_region_is_not_reclaimed() {
    let sb = sb(2, 32 << 10);
    let mut log = RegionLog::new(sb);
    let mut disk = Disk::new(&sb);
    for i in 0..4 {
        put(&mut log, &mut disk, i, 12 << 10).unwrap();
    }
    let e = log.get(&key(0)).unwrap();
    log.pin(e.region);
    assert_eq!(log.place(key(10), 12 << 10, 0).unwrap_err(), PlaceError::Busy);
    log.unpin(e.region);
    assert!(put(&mut log, &mut disk, 10, 12 << 10).is_ok());
}

#[test]
fn recovery_keeps_every_complete_record_and_newest_versions() {
    let sb = sb(4, 64 << 10);
    let mut log = RegionLog::new(sb);
    let mut disk = Disk::new(&sb);
    for i in 0..30 {
        put(&mut log, &mut disk, i % 11, 5000 + (i as usize % 3) * 4096).unwrap();
    }
    let (back, report) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert_eq!(back.len(), log.len());
    assert_eq!(report.kept, log.len() as u64);
    assert_eq!(report.dropped, 0);
    assert_eq!(back.used_bytes(), log.used_bytes());
    for i in 0..11 {
        assert_eq!(back.get(&key(i)), log.get(&key(i)), "key {i}");
        if let Some(e) = back.get(&key(i)) {
            assert_eq!(xxhash_rust::xxh3::xxh3_64(disk.payload(&e)), e.checksum);
        }
    }
    // Appends continue after recovery without clobbering live records.
    let mut back = back;
    put(&mut back, &mut disk, 50, 5000).unwrap();
    let (again, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert!(again.get(&key(50)).is_some());
    for i in 0..11 {
        assert_eq!(again.get(&key(i)), back.get(&key(i)));
    }
}

#[test]
fn a_torn_record_is_dropped_and_later_records_survive() {
    let sb = sb(2, 128 << 10);
    let mut log = RegionLog::new(sb);
    let mut disk = Disk::new(&sb);
    for i in 0..5 {
        put(&mut log, &mut disk, i, 8000).unwrap();
    }
    // Tear the header of record 2 (a crash with writes in flight out of order).
    let torn = log.get(&key(2)).unwrap();
    disk.bytes[torn.offset as usize + 100] ^= 0xff;
    let (back, report) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert!(back.get(&key(2)).is_none());
    assert!(report.dropped >= 1);
    for i in [0, 1, 3, 4] {
        assert_eq!(back.get(&key(i)), log.get(&key(i)), "key {i}");
    }
}

#[test]
fn leftovers_of_an_earlier_region_use_are_not_resurrected() {
    let (sb, mut log, mut disk) = filled(2); // fills both regions
                                             // Reuse region 0 for one record: keys 1..3 of its old generation stay on disk after it.
    let dropped = put(&mut log, &mut disk, 100, 12 << 10).unwrap();
    assert_eq!(dropped.len(), 4);
    let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    for i in 0..4 {
        assert!(back.get(&key(i)).is_none(), "stale key {i} came back");
    }
    assert!(back.get(&key(100)).is_some());
    assert_eq!(back.len(), 5);
}

proptest! {
    /// Any sequence of writes (with reclaims): the cap holds, and recovery rebuilds exactly
    /// the live index, every payload matching its checksum.
    #[test]
    fn recovery_equals_the_live_index(writes in prop::collection::vec((0u32..40, 1usize..40_000), 1..120)) {
        let sb = sb(5, 96 << 10);
        let mut log = RegionLog::new(sb);
        let mut disk = Disk::new(&sb);
        for (k, len) in writes {
            put(&mut log, &mut disk, k, len).unwrap();
            prop_assert!(log.used_bytes() <= sb.region_count * sb.region_bytes);
        }
        let (back, report) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
        prop_assert_eq!(report.dropped, 0);
        prop_assert_eq!(back.len(), log.len());
        for k in 0..40 {
            prop_assert_eq!(back.get(&key(k)), log.get(&key(k)));
            if let Some(e) = back.get(&key(k)) {
                prop_assert_eq!(xxhash_rust::xxh3::xxh3_64(disk.payload(&e)), e.checksum);
            }
        }
    }
}

/// A crash leaves a completed record C behind a record B that never reached the disk. After
/// recovery, new writes go to a fresh region with a new generation and sequences above every
/// header on disk, so after a second crash C cannot pass for a newer version of its key.
#[test]
fn a_leftover_never_beats_a_newer_record_after_a_second_crash() {
    let (sb, mut log, mut disk) = filled(3);
    put(&mut log, &mut disk, 100, 12 << 10).unwrap();
    let vb = value(101, 12 << 10);
    log.place(key(101), vb.len() as u64, xxhash_rust::xxh3::xxh3_64(&vb)).unwrap(); // lost
    let vc = value(102, 12 << 10);
    let (pc, _) = log.place(key(102), vc.len() as u64, xxhash_rust::xxh3::xxh3_64(&vc)).unwrap();
    disk.write(&pc, &vc);
    // Crash 1.
    let (mut back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    // Key 102 is stored again with new content.
    let vnew = value(999, 12 << 10);
    let (pn, _) =
        back.place(key(102), vnew.len() as u64, xxhash_rust::xxh3::xxh3_64(&vnew)).unwrap();
    assert!(pn.header.sequence > pc.header.sequence, "no sequence is reused");
    assert_ne!(pn.region, pc.region, "new writes start a fresh region");
    disk.write(&pn, &vnew);
    back.complete_write(&pn);
    // Crash 2.
    let (again, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    let e = again.get(&key(102)).unwrap();
    assert_eq!(e.checksum, xxhash_rust::xxh3::xxh3_64(&vnew), "a stale leftover won");
}

/// While a reused region's first record is in flight nothing else goes into it, so a crash
/// can never leave a completed record behind a first block of an earlier generation.
#[test]
fn nothing_lands_behind_an_unwritten_first_record() {
    let (sb, mut log, mut disk) = filled(2);
    let v = value(100, 12 << 10);
    let (first, dropped) =
        log.place(key(100), v.len() as u64, xxhash_rust::xxh3::xxh3_64(&v)).unwrap();
    assert_eq!(dropped.len(), 4);
    assert_eq!(log.place(key(101), 100, 0).unwrap_err(), PlaceError::Busy, "region still opening");
    disk.write(&first, &v);
    log.complete_write(&first);
    put(&mut log, &mut disk, 101, 12 << 10).unwrap();
    let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert!(back.get(&key(100)).is_some() && back.get(&key(101)).is_some());
    assert!((0..4).all(|i| back.get(&key(i)).is_none()), "reclaimed keys stay gone");
}

/// A failed first write closes the region: later records go to another region.
#[test]
fn a_failed_first_write_closes_its_region() {
    let sb = sb(3, 64 << 10);
    let mut log = RegionLog::new(sb);
    let (first, _) = log.place(key(1), 100, 0).unwrap();
    log.abort_write(&first);
    let (next, _) = log.place(key(2), 100, 0).unwrap();
    assert_ne!(next.region, first.region);
    assert!(log.used_bytes() <= sb.region_count * sb.region_bytes);
}

/// A write that failed in the middle of a region leaves an earlier use's header at its offset;
/// records written after it (live in the index) are found again at restart.
#[test]
fn records_after_a_failed_write_mid_region_survive_a_restart() {
    let (sb, mut log, mut disk) = filled(2);
    put(&mut log, &mut disk, 100, 12 << 10).unwrap(); // region 0 again, a new generation
    let (failed, _) = log.place(key(101), 12 << 10, 0).unwrap();
    log.abort_write(&failed); // the write failed (EIO); the server keeps running
    put(&mut log, &mut disk, 102, 12 << 10).unwrap();
    assert!(log.get(&key(102)).is_some());
    let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert!(back.get(&key(100)).is_some());
    assert!(back.get(&key(101)).is_none());
    assert!(back.get(&key(102)).is_some(), "live before the restart, lost after");
}

/// Writes a tombstone of `kind` for `key` (its header block alone).
fn tombstone(log: &mut RegionLog, disk: &mut Disk, kind: RecordKind, key: ChunkKey) {
    let (p, _) = log.place_tombstone(kind, key).unwrap();
    assert_eq!(p.header.disk_bytes(), RECORD_HEADER_BYTES);
    disk.write(&p, &[]);
    log.remove(&key);
    log.complete_write(&p);
}

fn other_namespace(i: u32) -> ChunkKey {
    ChunkKey::new(10, key(i).digest)
}

/// A tombstone deletes its key's earlier records at recovery, not a later one; a namespace
/// tombstone every earlier record of its namespace; an everything tombstone all earlier.
#[test]
fn tombstones_delete_what_came_before_them() {
    let sb = sb(4, 64 << 10);
    let mut log = RegionLog::new(sb);
    let mut disk = Disk::new(&sb);
    for i in 0..4 {
        put(&mut log, &mut disk, i, 12 << 10).unwrap();
    }
    put(&mut log, &mut disk, 1, 12 << 10).unwrap(); // a second record of key 1
    tombstone(&mut log, &mut disk, RecordKind::Tombstone, key(1));
    tombstone(&mut log, &mut disk, RecordKind::Tombstone, key(2));
    put(&mut log, &mut disk, 2, 12 << 10).unwrap(); // written again after its tombstone
    let v = value(5, 8192);
    let (p, _) = log.place(other_namespace(5), 8192, xxhash_rust::xxh3::xxh3_64(&v)).unwrap();
    disk.write(&p, &v);
    log.complete_write(&p);
    let (back, report) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert!(back.get(&key(1)).is_none(), "both records of key 1 are deleted");
    assert_eq!(back.get(&key(2)), log.get(&key(2)), "the record after the tombstone stays");
    for i in [0, 3] {
        assert_eq!(back.get(&key(i)), log.get(&key(i)), "key {i}");
    }
    assert_eq!((back.len(), report.deleted), (4, 2), "{report:?}");

    // Namespace 9 goes; namespace 10's record stays. Then everything.
    tombstone(&mut log, &mut disk, RecordKind::NamespaceTombstone, key(0));
    let (back, report) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert_eq!(back.len(), 1, "{report:?}");
    assert!(back.get(&other_namespace(5)).is_some());
    tombstone(&mut log, &mut disk, RecordKind::EverythingTombstone, key(0));
    put(&mut log, &mut disk, 7, 4096).unwrap();
    let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back.get(&key(7)), log.get(&key(7)));
}

/// A tombstone outlives what it deletes: regions go oldest first, so the record's region is
/// reclaimed before (or with) the tombstone's; until then recovery still deletes it.
#[test]
fn a_tombstone_outlives_the_records_it_deletes() {
    let (sb, mut log, mut disk) = filled(3); // keys 0..8 in regions 0 and 1
    tombstone(&mut log, &mut disk, RecordKind::Tombstone, key(0)); // region 2
    let mut i = 100;
    // Write until region 0 (key 0's) is reclaimed and reused; then until the tombstone's
    // region would be next.
    while log.get(&key(4)).is_some() {
        put(&mut log, &mut disk, i, 12 << 10).unwrap();
        let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
        assert!(back.get(&key(0)).is_none(), "key 0 came back after {} writes", i - 100);
        i += 1;
    }
}

/// A reclaimed region whose first write after the reclaim failed still shows its old
/// generation on disk: later records' mark keeps recovery from bringing it back, and with it
/// a record whose tombstone was reclaimed since.
#[test]
fn a_reclaimed_region_whose_first_write_failed_stays_reclaimed() {
    let (sb, mut log, mut disk) = filled(3); // keys 0..8 fill regions 0 and 1
    tombstone(&mut log, &mut disk, RecordKind::Tombstone, key(1)); // region 2
    for i in 100..103 {
        put(&mut log, &mut disk, i, 12 << 10).unwrap(); // region 2 full
    }
    // Region 0 is reclaimed for the next record, whose write fails (nothing reaches disk).
    let (failed, dropped) = log.place(key(200), 12 << 10, 0).unwrap();
    assert_eq!((failed.region, dropped.len()), (0, 3), "{dropped:?}");
    log.abort_write(&failed);
    // Records go on into region 1 (reclaimed), then region 2 (the tombstone's) is reclaimed.
    let mut i = 300;
    while log.superblock().region_count > 0 && log.get(&key(100)).is_some() {
        put(&mut log, &mut disk, i, 12 << 10).unwrap();
        i += 1;
    }
    let (back, report) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    for k in 0..4 {
        assert!(back.get(&key(k)).is_none(), "key {k} of the reclaimed region came back");
    }
    assert!(report.reclaimed >= 1, "{report:?}");
    for (k, e) in log.iter() {
        assert_eq!(back.get(k), Some(*e), "a live record lost");
    }
}

/// Near reclaim (two regions free or fewer), the oldest region's records of a namespace whose
/// records elsewhere, with those already moving, hold less than its guarantee are picked, in
/// write order; none when the guarantees present would not fit the log less two regions.
#[test]
fn relocation_picks_what_a_guarantee_needs_from_the_oldest_region() {
    let record = 16 << 10; // 4 KiB header + 12 KiB
    let pick = |log: &mut RegionLog, g: u64, moving: &HashMap<ChunkKey, SsdEntry>| {
        log.set_guarantees(SsdGuarantees { default: 0, by_namespace: HashMap::from([(9, g)]) });
        log.relocation_candidate(moving).map(|(k, _)| k)
    };
    let (_, mut log, _) = filled(5); // keys 0..8 fill regions 0 and 1; three free
    assert_eq!(pick(&mut log, 6 * record, &HashMap::new()), None, "reclaim is not near");
    let (_, mut log, _) = filled(4); // two free
    let mut moving = HashMap::new();
    assert_eq!(pick(&mut log, 4 * record, &moving), None, "four records elsewhere: enough");
    for i in 0..2 {
        let k = pick(&mut log, 6 * record, &moving).unwrap();
        assert_eq!(k, key(i), "in write order");
        moving.insert(k, log.get(&k).unwrap());
    }
    assert_eq!(pick(&mut log, 6 * record, &moving), None, "six kept with the two moving");
    assert_eq!(pick(&mut log, 0, &HashMap::new()), None, "no guarantee");
    let (_, mut log, _) = filled(3); // the guarantee (eight records) exceeds one region of room
    assert_eq!(pick(&mut log, 8 * record, &HashMap::new()), None, "overcommitted: none kept");
}

/// A record rewritten at the head replaces its old place (also for recovery); a rewrite whose
/// record was deleted meanwhile is not made live, and its tombstone, newer, deletes it at
/// recovery too.
#[test]
fn a_rewrite_replaces_its_record_unless_it_was_deleted_meanwhile() {
    let (sb, mut log, mut disk) = filled(4);
    let rewrite = |log: &mut RegionLog, disk: &mut Disk, i: u32| {
        let from = log.get(&key(i)).unwrap();
        let (p, _) = log.place(key(i), from.len, from.checksum).unwrap();
        let v = disk.payload(&from).to_vec();
        disk.write(&p, &v);
        (p, from)
    };
    let (p, from) = rewrite(&mut log, &mut disk, 0);
    log.complete_write_over(&p, Some(from));
    let now = log.get(&key(0)).unwrap();
    assert_ne!(now.region, from.region);
    assert_eq!(disk.payload(&now), &value(0, 12 << 10)[..]);
    assert!(log.audit().is_empty(), "{:?}", log.audit());
    let (p, from) = rewrite(&mut log, &mut disk, 1);
    tombstone(&mut log, &mut disk, RecordKind::Tombstone, key(1));
    log.complete_write_over(&p, Some(from));
    assert!(log.get(&key(1)).is_none(), "deleted while being rewritten: stays deleted");
    assert!(log.audit().is_empty(), "{:?}", log.audit());
    let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
    assert_eq!(back.get(&key(0)), log.get(&key(0)), "the rewrite is what recovery finds");
    assert!(back.get(&key(1)).is_none());
}

/// Rewrites what the guarantees ask for, as the store does (one at a time, each landing at
/// once); returns how many.
fn rewrite_all(log: &mut RegionLog, disk: &mut Disk) -> usize {
    let mut n = 0;
    while let Some((k, from)) = log.relocation_candidate(&HashMap::new()) {
        log.pin(from.region);
        let v = disk.payload(&from).to_vec();
        let Ok((p, _)) = log.place_rewrite(k, from.len, from.checksum) else {
            assert!(log.rewrite_needs_held(from.len), "a rewrite refused with room left");
            log.abandon_hold();
            log.unpin(from.region);
            return n;
        };
        disk.write(&p, &v);
        log.complete_write_over(&p, Some(from));
        log.unpin(from.region);
        n += 1;
    }
    n
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A quiet namespace (10) with a guarantee and a noisy one (9) writing records of any
    /// size through the log many times over: the noisy writes never stall for good (each is
    /// placed once the rewrites are done), the quiet namespace keeps its guarantee (or all it
    /// had, if less), no hold is ever given up, and recovery finds what the log holds.
    #[test]
    fn a_guarantee_holds_and_writes_go_on(
        quiet in prop::collection::vec(1usize..30_000, 1..20),
        noisy in prop::collection::vec(1usize..30_000, 100..300),
        guarantee_kib in 16u64..120,
    ) {
        let sb = sb(8, 64 << 10);
        let mut log = RegionLog::new(sb);
        let guarantee = guarantee_kib << 10;
        log.set_guarantees(SsdGuarantees { default: 0, by_namespace: HashMap::from([(10, guarantee)]) });
        let mut disk = Disk::new(&sb);
        for (i, len) in quiet.iter().enumerate() {
            let v = value(i as u32, *len);
            let (p, _) = log.place(other_namespace(i as u32), *len as u64, xxhash_rust::xxh3::xxh3_64(&v)).unwrap();
            disk.write(&p, &v);
            log.complete_write(&p);
        }
        let had = log.namespace_bytes(10);
        for (i, len) in noisy.iter().enumerate() {
            let placed = loop {
                match put(&mut log, &mut disk, 1000 + i as u32, *len) {
                    Ok(_) => break true,
                    Err(_) => {
                        if rewrite_all(&mut log, &mut disk) == 0 {
                            break false;
                        }
                    }
                }
            };
            prop_assert!(placed, "write {} of {} bytes stalled", i, len);
            rewrite_all(&mut log, &mut disk);
            prop_assert!(log.namespace_bytes(10) >= guarantee.min(had), "{} < {}", log.namespace_bytes(10), guarantee.min(had));
            prop_assert!(log.audit().is_empty(), "{:?}", log.audit());
        }
        prop_assert!(log.abandoned.is_none());
        let (back, _) = RegionLog::recover(sb, |at, buf| disk.read(at, buf)).unwrap();
        prop_assert_eq!(back.len(), log.len());
        for (k, e) in log.iter() {
            prop_assert_eq!(back.get(k), Some(*e));
        }
    }
}
