//! Deletion is durable: a chunk evicted by a client (a tombstone per key on SSD) or by the
//! admin socket (a tombstone per namespace) is answered only once its tombstone is on disk,
//! and never comes back after a restart or a SIGKILL; chunks not evicted are served again,
//! byte-exact. An evict whose tombstone is still being written when the server is killed may
//! go either way, but every byte served afterwards is right.

use std::time::Duration;

use nix::sys::signal::Signal;
use orbitkv_client::{ChunkKey, ChunkOutcome, Client, Tier};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

const LEN: usize = 16 << 10;

/// Two MiB of DRAM over two shards and 24 MiB of SSD in 1 MiB regions under `dir`.
fn args(dir: &std::path::Path) -> Vec<String> {
    ["--shards", "2", "--dram", "2MiB", "--ssd", "24MiB", "--ssd-region-size", "1MiB", "--ssd-dir"]
        .iter()
        .map(|s| s.to_string())
        .chain([dir.display().to_string()])
        .collect()
}

fn strs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

/// Puts every key (read once right away: reuse evidence for SSD admission), then waits until
/// the shards have written victims out. After each put the demotions it started land before
/// the next: a put that finds DRAM full while writes lag evicts its victim outright (a cache
/// may), and every key put must still be there for the counts these tests check.
fn fill(server: &TestServer, c: &mut Client, keys: &[ChunkKey]) {
    for k in keys {
        c.put(&[(*k, &value_for(k, LEN))]).unwrap();
        assert_eq!(c.lookup(std::slice::from_ref(k)).unwrap().len(), 1);
        server.wait_for("demotions landed", |s| s.shard_sum("ssd_in_flight") == 0);
    }
    server.wait_for("demotions", |s| s.shard_sum("demotions") > 0);
}

/// The keys found, each checked byte for byte, and which of them came from SSD.
fn found(c: &mut Client, keys: &[ChunkKey]) -> (Vec<ChunkKey>, Vec<ChunkKey>) {
    let (mut hits, mut ssd) = (Vec::new(), Vec::new());
    for k in keys {
        let leases = c.lookup_leased(std::slice::from_ref(k)).unwrap();
        if let Some(l) = leases.first() {
            assert_eq!(c.chunk(l).unwrap(), &value_for(k, LEN)[..], "wrong bytes");
            hits.push(*k);
            if l.hit.tier == Tier::Ssd {
                ssd.push(*k);
            }
        }
        c.release(&leases).unwrap();
    }
    (hits, ssd)
}

fn kill_and_restart(server: &mut TestServer, dir: &std::path::Path) {
    server.signal(Signal::SIGKILL);
    server.wait_exit(Duration::from_secs(10));
    server.spawn(&strs(&args(dir)));
    assert!(server.log().contains("SSD tier recovered"), "{}", server.log());
}

#[test]
fn acknowledged_evictions_never_come_back_after_sigkill() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut server = TestServer::start(&strs(&args(dir.path())));
    let mut c = server.client("tenant-a");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 41, 300); // 4.7 MiB over 2 MiB of DRAM
    fill(&server, &mut c, &keys);
    let mut d = server.client("tenant-b");
    let ns_b = d.register_namespace(&namespace(8)).unwrap().id;
    let keys_b = chain(ns_b, 42, 120);
    fill(&server, &mut d, &keys_b);

    // Evict every fourth key of tenant a that is on SSD now (read back: in DRAM and on SSD),
    // and all of tenant b through the admin socket.
    let (_, on_ssd) = found(&mut c, &keys);
    assert!(on_ssd.len() > 40, "only {} on SSD: {}", on_ssd.len(), server.admin("stats"));
    let evicted: Vec<ChunkKey> = on_ssd.iter().step_by(4).copied().collect();
    let out = c.evict(&evicted).unwrap();
    assert!(out.iter().all(|o| *o == ChunkOutcome::Done), "{out:?}");
    let tombstones = server.shard_sum("ssd_tombstones");
    assert_eq!(tombstones, evicted.len() as u64);
    // What the namespace holds now: on a loaded machine a put may still evict a victim outright
    // while SSD writes lag (a cache may), so the evict is checked against what is there.
    let (present_b, _) = found(&mut d, &keys_b);
    assert!(present_b.len() > keys_b.len() / 2, "{} of tenant b's keys", present_b.len());
    let reply =
        server.try_admin_request(&serde_json::json!({"cmd": "evict", "namespace": ns_b})).unwrap();
    assert_eq!((reply["ok"].as_bool(), reply["busy"].as_u64()), (Some(true), Some(0)), "{reply}");
    assert_eq!(reply["removed"].as_u64(), Some(present_b.len() as u64), "{reply}");
    assert_eq!(reply["not_durable"].as_u64(), Some(0), "{reply}");
    assert!(server.shard_sum("ssd_tombstones") > tombstones, "a namespace tombstone per shard");
    drop((c, d));

    for round in 0..2 {
        kill_and_restart(&mut server, dir.path());
        let mut c = server.client("after");
        c.register_namespace(&namespace(16)).unwrap();
        c.register_namespace(&namespace(8)).unwrap();
        let (hits, _) = found(&mut c, &evicted);
        assert!(hits.is_empty(), "round {round}: {} evicted chunks came back", hits.len());
        let (hits, _) = found(&mut c, &keys_b);
        assert!(
            hits.is_empty(),
            "round {round}: {} of the evicted namespace came back",
            hits.len()
        );
        let kept: Vec<ChunkKey> = on_ssd.iter().filter(|k| !evicted.contains(k)).copied().collect();
        let (hits, _) = found(&mut c, &kept);
        assert!(
            hits.len() * 2 > kept.len(),
            "round {round}: {} of {} kept",
            hits.len(),
            kept.len()
        );
        // Recovery found the tombstones and deleted what they cover.
        let log = server.log();
        let deleted = log.match_indices("deleted=").any(|(i, _)| !log[i + 8..].starts_with('0'));
        assert!(deleted, "{log}");
    }
}

/// A server filled in `dir`, stopped, and started again with `env`; the keys that were on
/// SSD when it stopped, and a client that registered their namespace.
fn restarted_with_records(
    dir: &std::path::Path,
    env: &[(&str, &str)],
) -> (TestServer, Client, Vec<ChunkKey>) {
    let mut server = TestServer::start(&strs(&args(dir)));
    let mut c = server.client("w");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 43, 300);
    fill(&server, &mut c, &keys);
    let (_, on_ssd) = found(&mut c, &keys);
    assert!(on_ssd.len() > 40, "only {} on SSD", on_ssd.len());
    drop(c);
    assert!(server.stop().success());
    server.spawn_env(env, &strs(&args(dir)));
    let mut c = server.client("r");
    c.register_namespace(&namespace(16)).unwrap();
    (server, c, on_ssd)
}

#[test]
fn a_failed_tombstone_write_is_reported_and_serving_goes_on() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // Every SSD I/O after recovery fails: the tombstones' writes among them.
    let env = [("FAILPOINTS", "ssd-io-errors-every=return(1)")];
    let (mut server, mut c, on_ssd) = restarted_with_records(dir.path(), &env);
    let out = c.evict(&on_ssd[..3]).unwrap();
    assert!(
        out.iter().all(|o| *o == ChunkOutcome::Failed(orbitkv_client::ErrorCode::Internal)),
        "{out:?}"
    );
    let reply =
        server.try_admin_request(&serde_json::json!({"cmd": "evict", "all": true})).unwrap();
    assert!(reply["not_durable"].as_u64().unwrap() > 0, "{reply}");
    assert!(server.log().contains("SSD tombstone write failed"), "{}", server.log());
    // Gone now; the server serves on.
    assert!(found(&mut c, &on_ssd).0.is_empty());
    c.put(&[(on_ssd[0], &value_for(&on_ssd[0], LEN))]).unwrap();
    assert_eq!(found(&mut c, &on_ssd[..1]).0.len(), 1);
    drop(c);
    // What was not durably deleted may come back after a restart: byte-exact if it does.
    kill_and_restart(&mut server, dir.path());
    let mut c = server.client("after");
    c.register_namespace(&namespace(16)).unwrap();
    found(&mut c, &on_ssd);
}

#[test]
fn a_server_killed_while_its_tombstone_is_written_serves_right_bytes_after() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // Every SSD I/O after recovery waits 2 s: the evict is still waiting for its tombstone.
    let env = [("FAILPOINTS", "ssd-io-delay=return(2s)")];
    let (mut server, c, on_ssd) = restarted_with_records(dir.path(), &env);
    drop(c);
    let socket = server.socket.clone();
    let victims: Vec<ChunkKey> = on_ssd[..8].to_vec();
    let evicting = std::thread::spawn(move || {
        let mut c = Client::connect(orbitkv_client::ClientOptions::with_socket(&socket)).unwrap();
        c.register_namespace(&namespace(16)).unwrap();
        c.evict(&victims)
    });
    server.wait_for("tombstones started", |s| s.shard_sum("ssd_tombstones") > 0);
    kill_and_restart(&mut server, dir.path());
    assert!(evicting.join().unwrap().is_err(), "no answer before its tombstones landed");
    let mut c = server.client("after");
    c.register_namespace(&namespace(16)).unwrap();
    let (hits, _) = found(&mut c, &on_ssd); // every byte served is right
    assert!(hits.len() + 8 >= on_ssd.len(), "only the evicted ones may be gone");
}

/// A full disk: every SSD write fails with `ENOSPC` (failpoint `ssd-write-no-space`; the
/// files are preallocated, so a real one comes from a thin-provisioned or copy-on-write file
/// system). Reads go on: every chunk on SSD is served byte-exact; an evict whose tombstone
/// cannot be written is answered `Internal`, the log naming the full disk; new puts are
/// stored and served from DRAM; health is degraded, the server serving.
#[test]
fn a_full_disk_fails_writes_only_and_the_server_serves_on() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let env = [("FAILPOINTS", "ssd-write-no-space=return(1)")];
    let (server, mut c, on_ssd) = restarted_with_records(dir.path(), &env);
    let (hits, from_ssd) = found(&mut c, &on_ssd);
    assert_eq!(hits.len(), on_ssd.len(), "reads are not affected");
    assert!(from_ssd.len() > 40, "{} read back from SSD", from_ssd.len());
    let out = c.evict(&on_ssd[..3]).unwrap();
    assert!(
        out.iter().all(|o| *o == ChunkOutcome::Failed(orbitkv_client::ErrorCode::Internal)),
        "{out:?}"
    );
    let log = server.log();
    assert!(log.contains("SSD tombstone write failed") && log.contains("No space left"), "{log}");
    // New chunks: stored, and their demotions fail as the disk is full.
    let ns = on_ssd[0].namespace;
    let more = chain(ns, 77, 200);
    for k in &more {
        let out = c.put(&[(*k, &value_for(k, LEN))]).unwrap();
        assert_eq!(out, vec![orbitkv_client::PutOutcome::Stored]);
        c.lookup(std::slice::from_ref(k)).unwrap();
    }
    server.wait_for("failed demotions", |s| s.shard_sum("ssd_io_errors") > 3);
    // What DRAM holds (2 MiB: at most 128 of them) is served, byte-exact.
    let (hits, _) = found(&mut c, &more);
    assert!(hits.len() >= 64, "{} of the new chunks served: {}", hits.len(), server.admin("stats"));
    let health = server.admin("health");
    assert_eq!(health["ready"], true, "{health}");
    assert!(health["degraded"][0].as_str().unwrap().contains("SSD I/O errors"), "{health}");
}
