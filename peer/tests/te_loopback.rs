//! Real bytes through Mooncake Transfer Engine on loopback TCP (feature `te-python`; the
//! pinned wheel must be importable: scripts/test sets that up): two engines, each with memory
//! mapped as the arena is (shared), read and write each other's exactly; a range outside the
//! peer's registered memory and a peer that is gone are errors, not hangs.
#![cfg(feature = "te-python")]

mod common;

use common::{assert_scattered, pattern, scattered, Mapping, MIB};
use orbitkv_peer::te::{TeError, TransferEngine};

#[test]
fn two_engines_read_and_write_each_others_memory_exactly() {
    let (mut a_mem, mut b_mem) = (Mapping::new(64 * MIB), Mapping::new(64 * MIB));
    let want = pattern(64 * MIB, 7);
    a_mem.bytes().copy_from_slice(&want);
    let a = TransferEngine::new("127.0.0.1", "tcp").unwrap();
    let b = TransferEngine::new("127.0.0.1", "tcp").unwrap();
    assert_ne!(a.segment(), b.segment());
    a.register(a_mem.addr(), 64 * MIB as u64).unwrap();
    b.register(b_mem.addr(), 64 * MIB as u64).unwrap();

    // One read of 48 MiB from an offset.
    b.read(a.segment(), b_mem.addr(), a_mem.addr() + MIB as u64, 48 * MIB as u64).unwrap();
    assert!(b_mem.bytes()[..48 * MIB] == want[MIB..49 * MIB], "the read's bytes differ");

    // Many 32 KiB pieces, more than one batch's worth (1024), scattered.
    let ranges = scattered(&b_mem, &a_mem);
    b.read_many(a.segment(), &ranges).unwrap();
    assert_scattered(&mut b_mem, &a_mem, &want, &ranges);

    // A write the other way.
    let back = pattern(8 * MIB, 9);
    b_mem.bytes()[..8 * MIB].copy_from_slice(&back);
    b.write(a.segment(), b_mem.addr(), a_mem.addr() + 32 * MIB as u64, 8 * MIB as u64).unwrap();
    assert!(a_mem.bytes()[32 * MIB..40 * MIB] == back[..], "the write's bytes differ");

    // Outside the peer's registered memory: an error, nothing written.
    let outside = a_mem.addr() + 64 * MIB as u64;
    let err = b.read(a.segment(), b_mem.addr(), outside, 4096).unwrap_err();
    assert!(matches!(err, TeError::Failed { what: "transfer_sync_read", .. }), "{err}");

    // A peer that is gone: an error at once.
    let c = TransferEngine::new("127.0.0.1", "tcp").unwrap();
    let gone = c.segment().to_string();
    drop(c);
    let err = b.read(&gone, b_mem.addr(), 0, 4096).unwrap_err();
    assert!(matches!(err, TeError::Failed { .. } | TeError::Python(_)), "{err}");
}
