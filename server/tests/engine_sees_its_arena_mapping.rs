//! An engine that copies with its own GPU registers its mapping of the arena with CUDA: the
//! client says where that mapping is, and every slot and leased chunk lies inside it.

use orbitkv_testkit::{chain, namespace, put_values, value_for, TestServer};

#[test]
fn slots_and_chunks_lie_in_the_reported_mapping() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("engine");
    let (base, len) = c.arena_range().expect("connected");
    let (base, end) = (base as usize, base as usize + len);
    // The whole arena, and its header (doorbells) before it.
    assert!(len as u64 >= server.admin("stats")["arena_bytes"].as_u64().unwrap());
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 3, 4);
    let lens = vec![5000u64; keys.len()];
    let slots: Vec<_> = c.reserve(&keys, &lens).unwrap().into_iter().map(Result::unwrap).collect();
    for (s, k) in slots.iter().zip(&keys) {
        let bytes = c.slot_mut(s).unwrap();
        let at = bytes.as_ptr() as usize;
        assert!(base <= at && at + bytes.len() <= end, "slot outside the mapping");
        bytes.copy_from_slice(&value_for(k, 5000));
    }
    c.commit(&slots).unwrap();
    let leases = c.lookup_leased(&keys).unwrap();
    assert_eq!(leases.len(), keys.len());
    for (l, k) in leases.iter().zip(&keys) {
        let bytes = c.chunk(l).unwrap();
        let at = bytes.as_ptr() as usize;
        assert!(base <= at && at + bytes.len() <= end, "chunk outside the mapping");
        assert_eq!(bytes, &value_for(k, 5000)[..]);
    }
    c.release(&leases).unwrap();
}

/// A mapping of one's own (what the Python package registers with CUDA) sees what the
/// session's does, and stays mapped, with the bytes it had, after the session ends.
#[test]
fn a_mapping_of_ones_own_sees_the_chunks_and_outlives_the_session() {
    let mut server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("engine");
    let own = c.map_arena().unwrap();
    assert_eq!(Some(own.connection()), c.connection());
    assert_eq!(own.len(), c.arena_range().expect("connected").1);
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 5, 3);
    put_values(&mut c, &keys, 5000);
    let leases = c.lookup_leased(&keys).unwrap();
    let offsets: Vec<u64> = leases.iter().map(|l| l.hit.offset).collect();
    for (l, k) in leases.iter().zip(&keys) {
        assert_eq!(own.bytes(l.hit.offset, 5000).unwrap(), &value_for(k, 5000)[..]);
    }
    assert!(own.bytes(0, 64).is_err(), "the header (doorbells) is no chunk");
    assert!(own.bytes(own.len() as u64 - 10, 64).is_err(), "past the end");
    c.release(&leases).unwrap();
    // The server goes away: the session's mapping ends, this one still holds the bytes.
    server.stop();
    server.spawn(&["--shards", "2", "--dram", "16MiB"]);
    c.ping().unwrap();
    assert_ne!(Some(own.connection()), c.connection());
    for (at, k) in offsets.iter().zip(&keys) {
        assert_eq!(own.bytes(*at, 5000).unwrap(), &value_for(k, 5000)[..]);
    }
}
