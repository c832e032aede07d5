use super::*;
use crate::HeapSlots;

fn cfg(dir: &Path, shard_count: u32) -> SsdConfig {
    SsdConfig {
        dir: dir.to_owned(),
        shard_id: 0,
        shard_count,
        capacity_bytes: 4 << 20,
        region_bytes: 512 << 10,
        ring_depth: 8,
        inject_delay: std::time::Duration::ZERO,
        inject_errors_every: 0,
        inject_no_space_every: 0,
    }
}

fn key(i: u32) -> ChunkKey {
    ChunkKey::new(3, [i as u8; 32])
}

fn value(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|b| (b as u32 ^ (i << 3)).wrapping_mul(31) as u8).collect()
}

fn events(store: &mut SsdStore, slice: &HeapSlots, want: usize) -> Vec<SsdEvent> {
    let mut all = Vec::new();
    while all.len() < want {
        all.extend(store.poll(slice));
        std::thread::yield_now();
    }
    all
}

fn demote_all(store: &mut SsdStore, slice: &HeapSlots, n: u32, len: usize) {
    for i in 0..n {
        let v = value(i, len);
        let slot = i as u64 * (64 << 10);
        slice.write(slot, &v);
        assert!(store.demote(key(i), len as u64, chunk_checksum(&v), slice, slot).is_ok());
        for e in events(store, slice, 1) {
            assert_eq!(e, SsdEvent::Demoted { key: key(i), stored: true });
        }
    }
}

#[test]
fn records_survive_reopening_and_come_back_exact() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let slice = HeapSlots::new(4 << 20);
    let (mut store, report) = SsdStore::open(&cfg(dir.path(), 1)).unwrap();
    assert!(report.rebuilt.is_none());
    demote_all(&mut store, &slice, 10, 40_000);
    assert_eq!(store.stats().writes, 10);
    assert!(std::fs::metadata(store.path()).unwrap().len() <= 4 << 20, "file within its cap");
    drop(store);

    let (mut store, report) = SsdStore::open(&cfg(dir.path(), 1)).unwrap();
    assert_eq!(report.recovery.kept, 10);
    assert!(report.rebuilt.is_none());
    for i in 0..10 {
        let target = 2 << 20;
        assert!(store.promote(key(i), &slice, target));
        assert_eq!(
            events(&mut store, &slice, 1),
            vec![SsdEvent::Promoted { key: key(i), verified: true }]
        );
        assert_eq!(slice.bytes(target, 40_000), &value(i, 40_000)[..]);
    }
    assert_eq!(store.stats().reads, 10);
}

#[test]
fn a_flipped_byte_is_a_checksum_failure_never_served() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let slice = HeapSlots::new(4 << 20);
    let (mut store, _) = SsdStore::open(&cfg(dir.path(), 1)).unwrap();
    demote_all(&mut store, &slice, 3, 10_000);
    let entry = store.get(&key(1)).unwrap();
    let path = store.path().to_owned();
    drop(store);
    // Flip one payload byte behind the store's back.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, entry.payload_offset() + 777).unwrap();
    b[0] ^= 0x40;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, entry.payload_offset() + 777).unwrap();
    drop(f);

    let (mut store, report) = SsdStore::open(&cfg(dir.path(), 1)).unwrap();
    assert_eq!(report.recovery.kept, 3, "headers are intact; the payload is checked on read");
    assert!(store.promote(key(1), &slice, 2 << 20));
    assert_eq!(
        events(&mut store, &slice, 1),
        vec![SsdEvent::Promoted { key: key(1), verified: false }]
    );
    assert_eq!(store.stats().checksum_failures, 1);
    assert!(store.get(&key(1)).is_none(), "dropped");
    assert!(store.promote(key(0), &slice, 2 << 20));
    assert_eq!(
        events(&mut store, &slice, 1),
        vec![SsdEvent::Promoted { key: key(0), verified: true }]
    );
}

#[test]
fn another_shard_count_starts_afresh() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let slice = HeapSlots::new(4 << 20);
    let (mut store, _) = SsdStore::open(&cfg(dir.path(), 1)).unwrap();
    demote_all(&mut store, &slice, 4, 8000);
    drop(store);
    let (store, report) = SsdStore::open(&cfg(dir.path(), 2)).unwrap();
    let why = report.rebuilt.expect("a different shard count is not read");
    assert!(why.contains("1 shards") && why.contains("now 2 shards"), "{why}");
    assert_eq!(store.stats().records, 0);
    assert!(store.get(&key(0)).is_none());
    // The same geometry in a file cut short: started afresh, saying so.
    let path = store.path().to_owned();
    drop(store);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(64 << 10).unwrap();
    drop(f);
    let (_, report) = SsdStore::open(&cfg(dir.path(), 2)).unwrap();
    let why = report.rebuilt.expect("a short file is not read");
    assert!(why.contains("the file is 65536 bytes"), "{why}");
}

#[test]
fn bad_configurations_name_the_problem() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let small = SsdConfig { capacity_bytes: 600 << 10, ..cfg(dir.path(), 1) };
    let e = SsdStore::open(&small).unwrap_err().to_string();
    assert!(e.contains("--ssd") && e.contains("--ssd-region-size"), "{e}");
    let missing = SsdConfig { dir: dir.path().join("nope/deeper"), ..cfg(dir.path(), 1) };
    let e = SsdStore::open(&missing).unwrap_err().to_string();
    assert!(e.contains("opening") && e.contains("nope/deeper"), "{e}");
}

/// Every I/O failing (`ssd-io-errors-every=return(1)`) fails demotion writes too: the record is not stored, the
/// failure is counted, and the chunk's slot is the caller's again.
#[test]
fn injected_errors_reach_demotion_writes() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut c = cfg(dir.path(), 1);
    c.inject_errors_every = 1;
    let (mut store, _) = SsdStore::open(&c).unwrap();
    let slice = HeapSlots::new(1 << 20);
    let v = value(1, 5000);
    slice.write(0, &v);
    assert!(store.demote(key(1), 5000, chunk_checksum(&v), &slice, 0).is_ok());
    let ev = events(&mut store, &slice, 1);
    assert_eq!(ev[0], SsdEvent::Demoted { key: key(1), stored: false });
    assert_eq!(store.stats().io_errors, 1);
    assert!(store.get(&key(1)).is_none());
}

/// A read that fails (an I/O error, not a checksum) leaves the record: its bytes on SSD are
/// intact, and the next promotion reads them.
#[test]
fn a_failed_read_keeps_the_record() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut c = cfg(dir.path(), 1);
    c.inject_errors_every = 2; // the demotion's write passes, the first read fails
    let (mut store, _) = SsdStore::open(&c).unwrap();
    let slice = HeapSlots::new(4 << 20);
    demote_all(&mut store, &slice, 1, 10_000);
    assert!(store.promote(key(0), &slice, 2 << 20));
    assert_eq!(
        events(&mut store, &slice, 1),
        vec![SsdEvent::Promoted { key: key(0), verified: false }]
    );
    assert_eq!((store.stats().io_errors, store.stats().checksum_failures), (1, 0));
    assert!(store.get(&key(0)).is_some(), "kept after a read error");
    assert!(store.promote(key(0), &slice, 2 << 20));
    assert_eq!(
        events(&mut store, &slice, 1),
        vec![SsdEvent::Promoted { key: key(0), verified: true }]
    );
    assert_eq!(slice.bytes(2 << 20, 10_000), &value(0, 10_000)[..]);
}
