//! Cluster mode's membership against a real etcd: members see each other with their epochs,
//! an epoch grows at every start, a node id held by a live member stops a second start (and
//! moves no epoch), a member that dies leaves within its lease TTL, and etcd going away leaves
//! local serving alone (health says the cluster is unavailable) until it is back.

use std::process::Command;
use std::time::{Duration, Instant};

use orbitkv_client::PutOutcome;
use orbitkv_testkit::etcd::Etcd;
use orbitkv_testkit::{chain, namespace, server_bin, value_for, TestServer};
use serde_json::Value;

fn member(etcd: &Etcd, node: &str, port: u16) -> TestServer {
    let mut args = vec!["--shards".to_string(), "1".into(), "--dram".into(), "16MiB".into()];
    args.extend(etcd.member_args("t", node, port));
    TestServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Waits (up to 20 s) until `f` holds for the server's `peers` answer.
fn until(server: &TestServer, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = server.admin("peers");
        if f(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// (node id, epoch) of each member.
fn members(v: &Value) -> Vec<(String, u64)> {
    v["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["node_id"].as_str().unwrap().to_string(), m["epoch"].as_u64().unwrap()))
        .collect()
}

#[test]
fn members_see_each_other_and_each_start_has_a_new_epoch() {
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7101);
    let mut b = member(&etcd, "b", 7102);
    let v = until(&a, "a sees a and b", |v| members(v).len() == 2);
    assert_eq!(members(&v), [("a".into(), 1), ("b".into(), 1)]);
    assert_eq!(v["available"], true);
    assert_eq!(v["epoch"], 1);
    assert_eq!(v["members"][1]["peer_addr"], "127.0.0.1:7102");

    // A second process claiming b's id is refused and moves no epoch.
    let out = Command::new(server_bin())
        .args(["--socket", "/tmp/okv-cluster-dup.sock", "--no-lock-arena", "--dram", "16MiB"])
        .args(["--etcd", &etcd.url, "--cluster", "t", "--node-id", "b"])
        .args(["--peer-addr", "127.0.0.1:7103"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--node-id b") && stderr.contains("held"), "{stderr}");

    // b stops (its key goes at once) and starts again with epoch 2.
    assert!(b.stop().success());
    until(&a, "b left", |v| members(v) == [("a".to_string(), 1)]);
    let b = member(&etcd, "b", 7102);
    let v = until(&a, "b back", |v| members(v).len() == 2);
    assert_eq!(members(&v), [("a".into(), 1), ("b".into(), 2)]);
    assert_eq!(b.admin("peers")["epoch"], 2);
}

#[test]
fn a_member_killed_leaves_within_its_lease_ttl() {
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7201);
    let b = member(&etcd, "b", 7202);
    until(&a, "a sees b", |v| members(v).len() == 2);
    b.signal(nix::sys::signal::Signal::SIGKILL);
    // The TTL is 2 s; `until` allows 20.
    until(&a, "b's key expired", |v| members(v) == [("a".to_string(), 1)]);
}

#[test]
fn etcd_away_leaves_local_serving_alone() {
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7301);
    until(&a, "a joined", |v| v["available"] == true);
    let mut c = a.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 9, 4);
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 8192)).collect();

    etcd.pause();
    until(&a, "cluster unavailable", |v| v["available"] == false);
    let health = a.admin("health");
    assert_eq!(health["ready"], true, "{health}");
    assert_eq!(health["cluster"]["available"], false, "{health}");
    assert_eq!(health["cluster"]["state"], "unavailable", "{health}");
    // Local work goes on.
    let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    assert_eq!(c.put(&items).unwrap(), vec![PutOutcome::Stored; 4]);
    assert_eq!(c.lookup(&keys).unwrap().len(), 4);

    etcd.resume();
    let v = until(&a, "rejoined", |v| v["available"] == true);
    assert_eq!(members(&v), [("a".into(), 1)], "the same epoch after a rejoin");
    assert_eq!(a.admin("health")["cluster"]["available"], true);
}

#[test]
fn cluster_flags_are_checked() {
    for (args, flag) in [
        (vec!["--node-id", "a"], "--node-id"),
        (vec!["--peer-addr", "127.0.0.1:1"], "--peer-addr"),
        (vec!["--etcd", "http://127.0.0.1:1"], "--peer-addr"),
        (vec!["--etcd", "127.0.0.1:2379", "--peer-addr", "127.0.0.1:1"], "--etcd"),
        (vec!["--etcd", "https://127.0.0.1:2379", "--peer-addr", "127.0.0.1:1"], "TLS"),
        (vec!["--cluster", "no spaces"], "--cluster"),
        (vec!["--cluster-lease-ttl", "0s"], "--cluster-lease-ttl"),
        (vec!["--peer-catalog-entries", "0"], "--peer-catalog-entries"),
        (vec!["--peer-max-grants", "0"], "--peer-max-grants"),
        (vec!["--peer-spin-window", "101ms"], "--peer-spin-window"),
        (vec!["--te-library", "libtransfer_engine.so"], "--te-library"),
        (vec!["--te-transport", "tcp"], "--te-transport"),
        (
            vec![
                "--etcd",
                "http://127.0.0.1:1",
                "--peer-addr",
                "127.0.0.1:1",
                "--te-transport",
                "tcp",
            ],
            "--te-transport",
        ),
        (vec!["--te-transport", "rdma"], "--te-transport"),
    ] {
        let out = Command::new(server_bin())
            .args(["--socket", "/tmp/okv-cluster-flags.sock", "--dram", "16MiB"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
    // A Transfer Engine library that is not there, or is not TE, stops the start, named (the
    // engine is made before etcd is asked: no etcd needed).
    for (lib, says) in [
        ("/nonexistent/libtransfer_engine.so", "/nonexistent/libtransfer_engine.so"),
        ("libc.so.6", "createTransferEngine"),
    ] {
        let out = Command::new(server_bin())
            .args(["--socket", "/tmp/okv-cluster-flags.sock", "--dram", "16MiB"])
            .args(["--etcd", "http://127.0.0.1:1", "--peer-addr", "127.0.0.1:7499"])
            .args(["--te-library", lib])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{lib}: {stderr}");
        assert!(stderr.contains("--te-library") && stderr.contains(says), "{lib}: {stderr}");
    }
    // A standalone server has no peers.
    let server = TestServer::start(&["--dram", "16MiB"]);
    let v = server.admin("peers");
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().unwrap().contains("standalone"), "{v}");
}
