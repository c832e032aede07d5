use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;

use orbitkv_proto::ChunkKey;
use xxhash_rust::xxh3::xxh3_64;

use super::*;
use crate::format::{Superblock, FORMAT_VERSION};
use crate::log::RegionLog;
use crate::HeapSlots;

fn open_direct(path: &std::path::Path, len: u64) -> File {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    f.set_len(len).unwrap();
    f
}

fn value(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|b| (b as u32).wrapping_mul(2654435761).wrapping_add(i) as u8).collect()
}

fn key(i: u32) -> ChunkKey {
    ChunkKey::new(5, [i as u8; 32])
}

fn complete(ring: &mut SsdRing, id: u64) -> Completion {
    loop {
        for c in ring.wait().unwrap() {
            if c.id == id {
                return c;
            }
        }
    }
}

/// Records go from arena slots to an O_DIRECT file and back into other slots byte for byte,
/// and recovery through the ring rebuilds the same index.
#[test]
fn arena_slots_to_file_and_back() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let sb = Superblock {
        format_version: FORMAT_VERSION,
        shard_id: 0,
        shard_count: 1,
        region_bytes: 256 << 10,
        region_count: 4,
    };
    let file = open_direct(&dir.path().join("shard-0.okv"), sb.file_bytes());
    let slice = HeapSlots::new(4 << 20);
    let mut ring = SsdRing::new(8).unwrap();
    let mut sblock = AlignedBlock::new();
    sblock.bytes_mut().copy_from_slice(&sb.encode());
    let id = ring.write_block(&file, 0, sblock).unwrap();
    assert_eq!(complete(&mut ring, id).result.unwrap(), 4096);

    let mut log = RegionLog::new(sb);
    let lens = [1usize, 4096, 12_000, 70_000, 100];
    for (i, &len) in lens.iter().enumerate() {
        let v = value(i as u32, len);
        let slot = i as u64 * (128 << 10);
        slice.write(slot, &v);
        let (p, _) = log.place(key(i as u32), len as u64, xxh3_64(&v)).unwrap();
        let mut header = AlignedBlock::new();
        p.header.encode_into(header.bytes_mut());
        let rounded = (len as u64).div_ceil(4096) * 4096;
        let id = ring.write_record(&file, p.offset, header, &slice, slot, rounded).unwrap();
        let c = complete(&mut ring, id);
        assert_eq!(c.result.unwrap(), 4096 + rounded);
        log.complete_write(&p);
    }
    // Read every payload into a fresh slot and check it.
    let target = 2 << 20;
    for (i, &len) in lens.iter().enumerate() {
        let e = log.get(&key(i as u32)).unwrap();
        let rounded = e.len.div_ceil(4096) * 4096;
        let id = ring.read_into_slot(&file, e.payload_offset(), &slice, target, rounded).unwrap();
        assert_eq!(complete(&mut ring, id).result.unwrap(), rounded);
        let got = slice.bytes(target, e.len);
        assert_eq!(xxh3_64(got), e.checksum);
        assert_eq!(got, &value(i as u32, len)[..]);
    }
    // Reopen: superblock and index come back.
    let mut block = vec![0u8; 4096];
    ring.read_block_sync(&file, 0, &mut block).unwrap();
    assert_eq!(Superblock::decode(&block).unwrap(), sb);
    let (back, report) =
        RegionLog::recover(sb, |at, buf| ring.read_block_sync(&file, at, buf)).unwrap();
    assert_eq!(report.kept, lens.len() as u64);
    for i in 0..lens.len() as u32 {
        assert_eq!(back.get(&key(i)), log.get(&key(i)));
    }
}

/// Dropping the ring with operations in flight waits for them.
#[test]
fn drop_waits_for_operations_in_flight() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = open_direct(&dir.path().join("f"), 8 << 20);
    let slice = HeapSlots::new(8 << 20);
    let mut ring = SsdRing::new(4).unwrap();
    for i in 0..4u64 {
        ring.write_record(
            &file,
            i * (2 << 20),
            AlignedBlock::new(),
            &slice,
            i * (1 << 20),
            1 << 20,
        )
        .unwrap();
    }
    assert!(!ring.has_room());
    assert!(ring.write_block(&file, 0, AlignedBlock::new()).is_err(), "a full ring refuses");
    drop(slice); // the operations in flight keep the memory alive
    drop(ring); // must not free buffers under the kernel
}

/// An injected delay holds the operation in the kernel; nothing blocks in the meantime and
/// the operation then completes normally.
#[test]
fn injected_delay_postpones_without_blocking() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = open_direct(&dir.path().join("f"), 1 << 20);
    let slice = HeapSlots::new(1 << 20);
    let mut ring = SsdRing::new(4).unwrap();
    ring.inject_delay(std::time::Duration::from_millis(300));
    let id = ring.write_from_slot(&file, 0, &slice, 0, 64 << 10).unwrap();
    // Polling returns at once, with nothing finished yet.
    assert!(ring.poll().is_empty());
    assert_eq!(ring.inflight(), 1);
    assert_eq!(complete(&mut ring, id).result.unwrap(), 64 << 10);
    assert_eq!(ring.inflight(), 0);
}

/// Injected faults fail in the kernel without touching the file and report the error asked
/// for: `EIO` for every n-th operation, `ENOSPC` for every n-th write (reads unaffected);
/// the bytes of the file stay as they were.
#[test]
fn injected_faults_report_eio_and_enospc_and_leave_the_file_alone() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = open_direct(&dir.path().join("f"), 1 << 20);
    let slice = HeapSlots::new(1 << 20);
    slice.write(0, &value(1, 64 << 10));
    let mut ring = SsdRing::new(4).unwrap();
    let id = ring.write_from_slot(&file, 0, &slice, 0, 64 << 10).unwrap();
    assert_eq!(complete(&mut ring, id).result.unwrap(), 64 << 10);
    let errno = |c: Completion| c.result.unwrap_err().raw_os_error();

    ring.inject_no_space_every(1);
    slice.write(0, &value(2, 64 << 10));
    let id = ring.write_from_slot(&file, 0, &slice, 0, 64 << 10).unwrap();
    assert_eq!(errno(complete(&mut ring, id)), Some(libc::ENOSPC));
    let id = ring.write_whole_record(&file, 64 << 10, AlignedBlock::new()).unwrap();
    assert_eq!(errno(complete(&mut ring, id)), Some(libc::ENOSPC));
    let id = ring.read_into_slot(&file, 0, &slice, 0, 64 << 10).unwrap();
    assert_eq!(complete(&mut ring, id).result.unwrap(), 64 << 10, "reads go on");
    assert_eq!(slice.bytes(0, 64 << 10), &value(1, 64 << 10)[..], "the failed write left it");

    ring.inject_no_space_every(0);
    ring.inject_errors_every(2);
    let first = ring.read_into_slot(&file, 0, &slice, 0, 64 << 10).unwrap();
    assert_eq!(complete(&mut ring, first).result.unwrap(), 64 << 10);
    let second = ring.read_into_slot(&file, 0, &slice, 0, 64 << 10).unwrap();
    assert_eq!(errno(complete(&mut ring, second)), Some(libc::EIO));
}
