//! Several clients put, get and look up chunks across shards; every byte matches.

use orbitkv_client::{ChunkOutcome, ErrorCode, PutOutcome, Tier};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

#[test]
fn several_clients_share_chunks_byte_exact() {
    let server = TestServer::start(&["--shards", "2", "--dram", "64MiB"]);
    let ns = server.client("probe").register_namespace(&namespace(16)).unwrap();
    assert_eq!(ns.max_chunk_bytes, 16 * 4096);

    let writers: Vec<_> = (0..3u32)
        .map(|w| {
            let socket = server.socket.clone();
            std::thread::spawn(move || {
                let mut c = orbitkv_client::Client::connect(
                    orbitkv_client::ClientOptions::with_socket(socket),
                )
                .unwrap();
                let info = c.register_namespace(&namespace(16)).unwrap();
                let keys = chain(info.id, w, 24);
                let values: Vec<Vec<u8>> =
                    keys.iter().enumerate().map(|(i, k)| value_for(k, 1000 + i * 2000)).collect();
                let items: Vec<_> =
                    keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
                let out = c.put(&items).unwrap();
                assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
                // A second put of the same chunks stores nothing.
                assert!(c.put(&items).unwrap().iter().all(|o| *o == PutOutcome::AlreadyPresent));
                keys
            })
        })
        .collect();
    let chains: Vec<_> = writers.into_iter().map(|t| t.join().unwrap()).collect();

    // Each reader checks every writer's chain.
    let mut reader = server.client("reader");
    reader.register_namespace(&namespace(16)).unwrap();
    for keys in &chains {
        let hits = reader.lookup(keys).unwrap();
        assert_eq!(hits.len(), keys.len());
        assert!(hits.iter().all(|h| h.tier == Tier::Dram));
        let leases = reader.lookup_leased(keys).unwrap();
        for (i, lease) in leases.iter().enumerate() {
            let expected = value_for(&keys[i], 1000 + i * 2000);
            assert_eq!(reader.chunk(lease).unwrap(), &expected[..], "chunk {i}");
            assert_eq!(lease.hit.checksum, xxhash_rust::xxh3::xxh3_64(&expected));
        }
        assert!(reader.release(&leases).unwrap().iter().all(|o| *o == ChunkOutcome::Done));
        let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 64 << 10]; keys.len()];
        let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let lens = reader.get_into(keys, &mut refs).unwrap();
        for (i, len) in lens.iter().enumerate() {
            assert_eq!(&bufs[i][..*len], &value_for(&keys[i], 1000 + i * 2000)[..]);
        }
    }
    // Both shards hold chunks, so lookups really crossed shards.
    let stats = server.admin("stats");
    for s in stats["shards"].as_array().unwrap() {
        assert!(s["entries"].as_u64().unwrap() > 0, "{stats}");
    }
    reader.flush().unwrap();
    assert_eq!(reader.deferred_failures(), 0);
    assert_eq!(server.shard_sum("leases"), 0);
}

#[test]
fn lookup_returns_the_longest_prefix_across_shards() {
    let server = TestServer::start(&["--shards", "2", "--dram", "64MiB"]);
    let mut c = server.client("prefix");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 7, 40);
    // Store all but chunk 25.
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 4096)).collect();
    let items: Vec<_> = keys
        .iter()
        .zip(&values)
        .enumerate()
        .filter(|(i, _)| *i != 25)
        .map(|(_, (k, v))| (*k, v.as_slice()))
        .collect();
    c.put(&items).unwrap();
    assert_eq!(c.lookup(&keys).unwrap().len(), 25);
    // A leased lookup leases exactly the prefix: hits after the hole are given back.
    let leases = c.lookup_leased(&keys).unwrap();
    assert_eq!(leases.len(), 25);
    assert_eq!(server.shard_sum("leases"), 25);
    c.release(&leases).unwrap();
    assert_eq!(server.shard_sum("leases"), 0);
    // A key of a namespace this session did not register is refused, naming it.
    let e = c.lookup(&chain(ns ^ 1, 7, 3)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownNamespace), "{e}");
    assert!(e.to_string().contains("not registered by this session"), "{e}");
    // Explicit evict makes a chunk disappear and shortens the prefix.
    assert_eq!(c.evict(&keys[3..4]).unwrap(), vec![ChunkOutcome::Done]);
    assert_eq!(c.lookup(&keys).unwrap().len(), 3);
}

#[test]
fn deferred_releases_land_and_failures_are_counted() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("deferred");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 21, 12);
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 3000)).collect();
    let items: Vec<_> = keys.iter().zip(&vals).map(|(k, v)| (*k, v.as_slice())).collect();
    c.put(&items).unwrap();
    // More deferred releases than may be in flight at once: the oldest are awaited in turn.
    let mut all = Vec::new();
    for k in &keys {
        let lease = c.lookup_leased(std::slice::from_ref(k)).unwrap();
        c.release_deferred(&lease).unwrap();
        all.extend(lease);
    }
    c.flush().unwrap();
    assert_eq!(c.deferred_failures(), 0);
    assert_eq!(server.shard_sum("leases"), 0);
    // Releasing the same leases again fails on the server: counted, not lost.
    c.release_deferred(&all).unwrap();
    c.flush().unwrap();
    assert_eq!(c.deferred_failures(), 1, "one failed release request (12 chunks)");
    assert_eq!(server.shard_sum("leases"), 0);
}

#[test]
fn commits_with_the_writers_checksums_check_the_first_of_each_request() {
    let server = TestServer::start(&["--shards", "2", "--dram", "64MiB"]);
    let mut c = server.client("writer");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let write = |c: &mut orbitkv_client::Client, keys: &[orbitkv_client::ChunkKey]| {
        let lens: Vec<u64> = keys.iter().map(|_| 3000).collect();
        let slots: Vec<_> =
            c.reserve(keys, &lens).unwrap().into_iter().map(|r| r.unwrap()).collect();
        for (k, s) in keys.iter().zip(&slots) {
            c.slot_mut(s).unwrap().copy_from_slice(&value_for(k, 3000));
        }
        slots
    };
    let sum = |k: &orbitkv_client::ChunkKey| orbitkv_proto::chunk_checksum(&value_for(k, 3000));
    let checksum_of = |c: &mut orbitkv_client::Client, k: &orbitkv_client::ChunkKey| {
        c.lookup(&[*k]).unwrap().first().map(|h| h.checksum)
    };

    // Right checksums: stored with them (over both shards).
    let keys = chain(ns, 1, 8);
    let slots = write(&mut c, &keys);
    let sums: Vec<u64> = keys.iter().map(sum).collect();
    let out = c.commit_checked(&slots, &sums).unwrap();
    assert!(out.iter().all(|o| *o == ChunkOutcome::Done), "{out:?}");
    for k in &keys {
        assert_eq!(checksum_of(&mut c, k), Some(sum(k)));
    }

    // The first one wrong: that chunk is not stored; the others are, with checksums the
    // shards computed (the given ones, wrong too, are not used).
    let keys = chain(ns, 2, 6);
    let slots = write(&mut c, &keys);
    let bad: Vec<u64> = keys.iter().map(|k| sum(k) ^ 1).collect();
    let out = c.commit_checked(&slots, &bad).unwrap();
    assert_eq!(out[0], ChunkOutcome::Failed(orbitkv_client::ErrorCode::ChecksumMismatch));
    assert!(out[1..].iter().all(|o| *o == ChunkOutcome::Done), "{out:?}");
    assert_eq!(checksum_of(&mut c, &keys[0]), None);
    for k in &keys[1..] {
        assert_eq!(checksum_of(&mut c, k), Some(sum(k)));
    }

    // One checksum per slot, or nothing happens.
    let keys = chain(ns, 3, 2);
    let slots = write(&mut c, &keys);
    let err = c.commit_checked(&slots, &[1]).unwrap_err().to_string();
    assert!(err.contains("2 slots but 1 checksums"), "{err}");
    let out = c.commit_checked(&slots, &keys.iter().map(sum).collect::<Vec<_>>()).unwrap();
    assert!(out.iter().all(|o| *o == ChunkOutcome::Done), "{out:?}");
    // No reservation is left behind, and the mismatch was counted.
    let stats = server.admin("stats");
    let total = |f: &str| -> u64 {
        stats["shards"].as_array().unwrap().iter().map(|s| s[f].as_u64().unwrap()).sum()
    };
    assert_eq!(total("reservations"), 0);
    assert_eq!(total("gpu_checksum_mismatches"), 1);
}

/// Chunks of megabytes: their shards hash them at commit a piece at a time, other shards' ops
/// running between the pieces. Stored with their bytes' checksums and read back exact over
/// both shards; a wrong checksum given with a commit is still caught; nothing stays reserved.
#[test]
fn long_chunks_hashed_in_pieces_are_stored_exact() {
    // One shard yields to its own tasks between the pieces; two also go through the reactor
    // for each other's ops.
    for shards in ["1", "2"] {
        long_chunks_round_trip(shards);
    }
}

fn long_chunks_round_trip(shards: &str) {
    let server = TestServer::start(&["--shards", shards, "--dram", "128MiB"]);
    let mut c = server.client("long");
    // 4 MiB chunks at most; these are three 1 MiB pieces and a part.
    let ns = c.register_namespace(&namespace(1024)).unwrap().id;
    let len = (3 << 20) + 1000;
    let keys = chain(ns, 40, 8);
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, len)).collect();
    let items: Vec<_> = keys.iter().zip(&vals).map(|(k, v)| (*k, v.as_slice())).collect();
    let out = c.put(&items).unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    let leases = c.lookup_leased(&keys).unwrap();
    assert_eq!(leases.len(), keys.len());
    for (lease, v) in leases.iter().zip(&vals) {
        assert_eq!(lease.hit.checksum, orbitkv_proto::chunk_checksum(v));
        assert!(c.chunk(lease).unwrap() == v.as_slice(), "bytes read back differ");
    }
    c.release(&leases).unwrap();

    // Given checksums, each checked: the wrong one is refused, the right ones stored.
    let keys = chain(ns, 41, 4);
    let lens: Vec<u64> = keys.iter().map(|_| len as u64).collect();
    let slots: Vec<_> = c.reserve(&keys, &lens).unwrap().into_iter().map(|r| r.unwrap()).collect();
    for (k, s) in keys.iter().zip(&slots) {
        c.slot_mut(s).unwrap().copy_from_slice(&value_for(k, len));
    }
    let mut sums: Vec<u64> =
        keys.iter().map(|k| orbitkv_proto::chunk_checksum(&value_for(k, len))).collect();
    sums[0] ^= 1;
    let out = c.commit_checked(&slots, &sums).unwrap();
    assert_eq!(out[0], ChunkOutcome::Failed(orbitkv_client::ErrorCode::ChecksumMismatch));
    assert!(out[1..].iter().all(|o| *o == ChunkOutcome::Done), "{out:?}");
    let hits = c.lookup(&keys[1..]).unwrap();
    assert_eq!(hits.iter().map(|h| h.checksum).collect::<Vec<_>>(), sums[1..]);
    assert_eq!(server.shard_sum("reservations"), 0);
    assert_eq!(server.shard_sum("leases"), 0);
    c.ping().unwrap();
}
