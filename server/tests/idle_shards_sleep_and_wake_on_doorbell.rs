//! An idle shard sleeps on its doorbell instead of polling, and work wakes it: a request sent
//! to a sleeping shard (directly, or across the mesh) is served.

use orbitkv_testkit::{chain, namespace, put_values, TestServer};

#[test]
fn sleeping_shards_are_woken_by_requests() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("sleepy");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 11, 16);
    for round in 0..3 {
        // Let every shard fall asleep on its doorbell.
        server.wait_for("both shards asleep", |s| {
            let v = s.admin("stats");
            v["shards"]
                .as_array()
                .unwrap()
                .iter()
                .all(|sh| sh["deep_sleeps"].as_u64().unwrap() > round)
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        // Keys span both shards: the home shard is woken by the client, the other by the mesh.
        put_values(&mut c, &keys, 8192);
        assert_eq!(c.lookup(&keys).unwrap().len(), keys.len());
    }
    let v = server.admin("stats");
    let wakeups: u64 = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["doorbell_wakeups"].as_u64().unwrap())
        .sum();
    assert!(wakeups >= 3, "{v}");
}

/// Past its spin window, a shard with no task in flight goes straight to its doorbell, which
/// the next request rings: it never naps on a timer, which would keep a request that comes a
/// few milliseconds later waiting for the nap's end.
#[test]
fn a_shard_with_nothing_in_flight_sleeps_without_napping_first() {
    let server = TestServer::start(&["--shards", "1", "--dram", "16MiB"]);
    let mut c = server.client("no-naps");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 12, 4);
    put_values(&mut c, &keys, 8192);
    let shard =
        |s: &TestServer, field: &str| s.admin("stats")["shards"][0][field].as_u64().unwrap();
    let asleep_after = |s: &TestServer, sleeps: u64| {
        s.wait_for("the shard asleep on its doorbell", |s| shard(s, "deep_sleeps") > sleeps)
    };
    asleep_after(&server, 0);
    let naps = shard(&server, "naps");
    for _ in 0..5 {
        let sleeps = shard(&server, "deep_sleeps");
        assert_eq!(c.lookup(&keys).unwrap().len(), keys.len());
        asleep_after(&server, sleeps);
    }
    assert_eq!(shard(&server, "naps"), naps, "{}", server.admin("stats"));
}
