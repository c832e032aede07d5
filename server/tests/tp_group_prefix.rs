//! A tensor-parallel group's prefix is what every rank has: two ranks under their own
//! namespaces (tp_rank 0 and 1), rank 1 behind rank 0, the group prefix follows rank 1; an
//! eviction on one rank shortens it; bad groups are refused naming what is wrong.

use orbitkv_client::{ChunkOutcome, Error, NamespaceDescriptor};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

#[test]
fn the_group_prefix_is_what_every_rank_has() {
    let server = TestServer::start(&["--shards", "2", "--dram", "64MiB"]);
    let mut c = server.client("tp-group");
    let rank = |r: u32| NamespaceDescriptor { tp_rank: r, tp_world_size: 2, ..namespace(16) };
    let ns0 = c.register_namespace(&rank(0)).unwrap().id;
    let ns1 = c.register_namespace(&rank(1)).unwrap().id;
    assert_ne!(ns0, ns1, "the rank is part of the namespace");
    // The same prompt (same token chain) for both ranks.
    let k0 = chain(ns0, 5, 10);
    let k1 = chain(ns1, 5, 10);
    let put = |c: &mut orbitkv_client::Client, keys: &[orbitkv_client::ChunkKey]| {
        let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 4096)).collect();
        let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, &v[..])).collect();
        c.put(&items).unwrap();
    };
    put(&mut c, &k0);
    put(&mut c, &k1[..6]);

    let g = c.lookup_group(&[&k0, &k1]).unwrap();
    assert_eq!(g.chunks, 6);
    assert_eq!(g.per_rank[0], 10);
    assert_eq!(g.per_rank[1], 6);
    // Rank 0 alone would claim 10: that is not the group's.
    assert_eq!(c.lookup(&k0).unwrap().len(), 10);

    assert_eq!(c.evict(&k0[2..3]).unwrap(), vec![ChunkOutcome::Done]);
    let g = c.lookup_group(&[&k0, &k1]).unwrap();
    assert_eq!(g.chunks, 2);
    assert_eq!(g.per_rank[0], 2);

    // Bad groups.
    let msg = |r: Result<_, Error>| match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    assert!(msg(c.lookup_group(&[&k0, &k1[..5]])).contains("rank 1 has 5 keys"));
    assert!(msg(c.lookup_group(&[&k0, &k0])).contains("same namespace"));
    let mixed: Vec<_> = k0[..3].iter().chain(&k1[3..]).copied().collect();
    assert!(msg(c.lookup_group(&[&k0, &mixed])).contains("several namespaces"));
    assert!(msg(c.lookup_group(&[])).contains("at least one rank"));
    // An empty prompt has an empty prefix.
    assert_eq!(c.lookup_group(&[&[], &[]]).unwrap().chunks, 0);
}
