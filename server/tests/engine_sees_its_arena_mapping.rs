//! An engine that copies with its own GPU registers its mapping of the arena with CUDA: the
//! client says where that mapping is, and every slot and leased chunk lies inside it.

use orbitkv_testkit::{chain, namespace, value_for, TestServer};

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
