//! Cluster peer reads against a real etcd and real Mooncake Transfer Engines (the pinned
//! wheel, TCP on loopback): a chunk put on one Manager is read on another byte-exact, reported
//! as a peer hit and then as a local one; a catalog over its bound says its coverage is
//! partial; an owner that restarts has a new epoch, refuses grants of the old one and is
//! followed again; grants of a requester that is not a member are returned after the lease
//! TTL; etcd away stops remote work (the catalog goes) while local serving goes on.
//!
//! Needs a server built with `te-python` (scripts/test runs this in the Transfer Engine venv).
#![cfg(feature = "te-python")]

mod common;

use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::{chain, namespace, put_values, value_for, TestServer};
use orbitkv_peer::rpc::peer_client::PeerClient;
use orbitkv_peer::rpc::{GrantRequest, Key, ReleaseRequest};
use orbitkv_proto::Tier;
use serde_json::Value;

const LEN: usize = 64 << 10;

fn member(etcd: &Etcd, node: &str, port: u16, extra: &[&str]) -> TestServer {
    let peer = format!("127.0.0.1:{port}");
    let mut args = vec![
        "--dram",
        "64MiB",
        "--etcd",
        &etcd.url,
        "--cluster",
        "reads",
        "--node-id",
        node,
        "--peer-addr",
        &peer,
        "--cluster-lease-ttl",
        "2s",
    ];
    args.extend_from_slice(extra);
    TestServer::start(&args)
}

/// Waits (up to 30 s) until `f` holds for the server's `peers` answer.
fn until(server: &TestServer, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = server.admin("peers");
        if f(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: {v}\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn grant(
    port: u16,
    owner_epoch: u64,
    keys: &[orbitkv_proto::ChunkKey],
) -> Result<Vec<u64>, tonic::Status> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = PeerClient::connect(format!("http://127.0.0.1:{port}")).await.unwrap();
        let r = c
            .grant(GrantRequest {
                requester: "ghost".into(),
                requester_epoch: 1,
                owner_epoch,
                keys: keys.iter().map(Key::from).collect(),
            })
            .await?
            .into_inner();
        Ok(r.chunks.iter().filter(|g| g.present).map(|g| g.grant_id).collect())
    })
}

fn release(port: u16, owner_epoch: u64, ids: Vec<u64>) -> Result<u32, tonic::Status> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = PeerClient::connect(format!("http://127.0.0.1:{port}")).await.unwrap();
        let r = c
            .release(ReleaseRequest {
                requester: "ghost".into(),
                requester_epoch: 1,
                owner_epoch,
                grant_ids: ids,
            })
            .await?
            .into_inner();
        Ok(r.released)
    })
}

#[test]
fn a_chunk_put_on_one_node_is_read_on_another() {
    let etcd = Etcd::start();
    let mut a = member(&etcd, "a", 7401, &["--shards", "2"]);
    let b = member(&etcd, "b", 7402, &["--shards", "1"]);
    let c = member(&etcd, "c", 7403, &["--shards", "1", "--peer-catalog-entries", "3"]);
    let mut ca = a.client("engine-a");
    let ns = ca.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 41, 8);
    put_values(&mut ca, &keys, LEN);

    let v = until(&b, "b follows a's inventory", |v| v["peers"]["a"]["catalog_entries"] == 8);
    assert_eq!(v["peering"], true);
    assert_eq!(v["peers"]["a"]["stream"], "live", "{v}");
    assert_eq!(v["peers"]["a"]["complete"], true, "{v}");
    let v = until(&c, "c's catalog is bounded", |v| v["peers"]["a"]["catalog_entries"] == 3);
    assert_eq!(v["peers"]["a"]["complete"], false, "coverage over the bound is partial: {v}");

    // b reads a's chunks: peer hits, byte-exact, then local.
    let mut cb = b.client("engine-b");
    assert_eq!(cb.register_namespace(&namespace(16)).unwrap().id, ns);
    let leases = cb.lookup_leased(&keys).unwrap();
    assert_eq!(leases.len(), 8, "every chunk found");
    for (l, k) in leases.iter().zip(&keys) {
        assert_eq!(l.hit.tier, Tier::Peer);
        assert_eq!(cb.chunk(l).unwrap(), value_for(k, LEN).as_slice(), "byte-exact");
    }
    cb.release(&leases).unwrap();
    let again = cb.lookup(&keys).unwrap();
    assert!(again.iter().all(|h| h.tier == Tier::Dram), "{again:?}");
    let v = b.admin("peers");
    assert_eq!(v["peers"]["a"]["chunks_read"], 8, "{v}");
    assert_eq!(v["peers"]["a"]["bytes_read"], 8 * LEN as u64, "{v}");
    assert_eq!(v["peers"]["a"]["grants_held"], 0, "{v}");
    until(&a, "a's grants to b returned", |v| v["peers"]["b"]["grants_given"] == 0);
    assert_eq!(a.shard_sum("leases"), 0);

    // Grants are fenced by the owner's epoch; a holder that is no member loses its grants
    // once the lease TTL has passed.
    let ids = grant(7401, 1, &keys[..2]).unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(a.shard_sum("leases"), 2);
    let stale = grant(7401, 7, &keys[..1]).unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition, "{stale:?}");
    assert!(stale.message().contains("stale"), "{stale:?}");
    a.wait_for("the ghost's grants returned", |a| a.shard_sum("leases") == 0);
    assert_eq!(release(7401, 1, ids).unwrap(), 0, "already returned");

    // The owner restarts (SIGKILL): it leaves b's catalog, comes back with epoch 2, refuses
    // epoch 1, and b follows it again.
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = a.wait_exit(Duration::from_secs(5));
    until(&b, "a dropped from b's catalog", |v| v["peers"].get("a").is_none());
    let a = member(&etcd, "a", 7401, &["--shards", "2"]);
    assert_eq!(a.admin("peers")["epoch"], 2);
    let old = grant(7401, 1, &keys[..1]).unwrap_err();
    assert_eq!(old.code(), tonic::Code::FailedPrecondition, "{old:?}");
    let mut ca = a.client("engine-a2");
    ca.register_namespace(&namespace(16)).unwrap();
    let fresh = chain(ns, 77, 2);
    put_values(&mut ca, &fresh, LEN);
    until(&b, "b follows a's new epoch", |v| {
        v["peers"]["a"]["epoch"] == 2 && v["peers"]["a"]["catalog_entries"] == 2
    });
    let leases = cb.lookup_leased(&fresh).unwrap();
    assert_eq!(leases.len(), 2);
    assert!(leases.iter().all(|l| l.hit.tier == Tier::Peer));
    assert_eq!(cb.chunk(&leases[1]).unwrap(), value_for(&fresh[1], LEN).as_slice());
    cb.release(&leases).unwrap();

    // etcd away: remote work stops (the catalog goes), local serving goes on.
    put_values(&mut ca, &chain(ns, 91, 1), LEN);
    etcd.pause();
    until(&b, "b's catalog dropped", |v| v["available"] == false && v["peers"].get("a").is_none());
    assert_eq!(cb.lookup(&keys).unwrap().len(), 8, "local hits unaffected");
    assert!(cb.lookup(&chain(ns, 91, 1)).unwrap().is_empty(), "no remote work without etcd");
    etcd.resume();
    until(&b, "b follows a again", |v| v["peers"]["a"]["stream"] == "live");
    let hit = cb.lookup(&chain(ns, 91, 1)).unwrap();
    assert_eq!(hit.len(), 1);
    assert_eq!(hit[0].tier, Tier::Peer);
}
