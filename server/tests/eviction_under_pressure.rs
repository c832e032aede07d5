//! A working set four times the arena: evictions happen, no wrong byte is ever returned, and
//! leased chunks survive the pressure.

use orbitkv_client::{ChunkOutcome, PutOutcome};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

#[test]
fn working_set_four_times_the_arena() {
    // 2 shards x 4 MiB; chunks of 64 KiB; working set 32 MiB.
    let server = TestServer::start(&["--shards", "2", "--dram", "8MiB"]);
    let mut writer = server.client("writer");
    let mut holder = server.client("holder");
    let ns = writer.register_namespace(&namespace(16)).unwrap().id;
    holder.register_namespace(&namespace(16)).unwrap();
    let keys = chain(ns, 99, 512);
    let len = 64 << 10;

    // Store the first 8 chunks and lease them from another session.
    for k in &keys[..8] {
        assert_eq!(writer.put(&[(*k, &value_for(k, len))]).unwrap(), vec![PutOutcome::Stored]);
    }
    let leases = holder.lookup_leased(&keys[..8]).unwrap();
    assert_eq!(leases.len(), 8);

    // Three passes over the whole working set, reading back through the writer as we go.
    let mut verified = 0;
    for pass in 0..3 {
        for (i, k) in keys.iter().enumerate().skip(8) {
            let out = writer.put(&[(*k, &value_for(k, len))]).unwrap();
            assert!(matches!(out[0], PutOutcome::Stored | PutOutcome::AlreadyPresent), "{out:?}");
            if i % 7 == pass {
                let probe = &keys[(i * 31) % keys.len()..][..1];
                let mut buf = vec![0u8; len];
                let got = writer.get_into(probe, &mut [&mut buf[..]]).unwrap();
                if let Some(n) = got.first() {
                    assert_eq!(&buf[..*n], &value_for(&probe[0], len)[..], "wrong bytes for a hit");
                    verified += 1;
                }
            }
        }
    }
    assert!(verified > 10, "too few hits to prove anything: {verified}");
    let evictions = server.shard_sum("evictions");
    assert!(evictions > 400, "expected heavy eviction, got {evictions}");

    // The leased chunks are intact and still present.
    for (lease, k) in leases.iter().zip(&keys) {
        assert_eq!(holder.chunk(lease).unwrap(), &value_for(k, len)[..]);
    }
    assert_eq!(holder.lookup(&keys[..8]).unwrap().len(), 8);
    assert!(holder.release(&leases).unwrap().iter().all(|o| *o == ChunkOutcome::Done));
    writer.flush().unwrap();
    assert_eq!(writer.deferred_failures(), 0);
    assert_eq!(server.shard_sum("leases"), 0);
    assert!(server.shard_sum("dram_used_bytes") <= 8 << 20);
}
