//! Cluster peer reads against a real etcd and real Mooncake Transfer Engines (the pinned
//! wheel, TCP on loopback): a chunk put on one Manager is read on another byte-exact, reported
//! as a peer hit and then as a local one; a catalog over its bound says its coverage is
//! partial; only members take grants; an owner that restarts has a new epoch, refuses grants
//! of the old one and is followed again; a requester or an owner killed mid-read leaves nothing
//! held and nothing wrong; etcd away stops remote work (the catalog goes) while local serving
//! goes on.
//!
//! Needs a Transfer Engine: a server built with `te-python` (scripts/test runs this in the
//! Transfer Engine venv), or a TE build's C API library named by `ORBITKV_TE_LIBRARY` (then
//! every server is started with `--te-library`; see `orbitkv_testkit::etcd`). Without either
//! each test says it is skipped.

use std::time::{Duration, Instant};

use orbitkv_peer::rpc::peer_client::PeerClient;
use orbitkv_peer::rpc::{GrantRequest, Key, ReleaseRequest};
use orbitkv_proto::Tier;
use orbitkv_testkit::etcd::Etcd;
use orbitkv_testkit::{chain, namespace, put_values, value_for, TestServer};
use serde_json::Value;

const LEN: usize = 64 << 10;
const BIG: usize = 1 << 20;

fn member(etcd: &Etcd, node: &str, port: u16, extra: &[&str]) -> TestServer {
    member_env(etcd, node, port, extra, &[])
}

/// As [`member`], with environment variables `env`; `extra` may replace the lease TTL.
fn member_env(
    etcd: &Etcd,
    node: &str,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> TestServer {
    let mut args = etcd.member_args("reads", node, port);
    if extra.contains(&"--cluster-lease-ttl") {
        let at = args.iter().position(|a| a == "--cluster-lease-ttl").unwrap();
        args.drain(at..at + 2);
    }
    if !extra.contains(&"--dram") {
        args.extend(["--dram".into(), "64MiB".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    TestServer::start_env(env, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Whether the servers have a Transfer Engine; if not, says the test is skipped.
fn have_te() -> bool {
    let have = cfg!(feature = "te-python") || std::env::var_os("ORBITKV_TE_LIBRARY").is_some();
    if !have {
        eprintln!("skipped: no Transfer Engine (build with te-python or set ORBITKV_TE_LIBRARY)");
    }
    have
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

/// A grant at the owner on loopback `port`, asked as `(requester, its epoch)`.
fn grant(
    port: u16,
    (requester, requester_epoch): (&str, u64),
    owner_epoch: u64,
    keys: &[orbitkv_proto::ChunkKey],
    request_id: u64,
) -> Result<Vec<u64>, tonic::Status> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = PeerClient::connect(format!("http://127.0.0.1:{port}")).await.unwrap();
        let r = c
            .grant(GrantRequest {
                requester: requester.into(),
                requester_epoch,
                owner_epoch,
                keys: keys.iter().map(Key::from).collect(),
                request_id,
            })
            .await?
            .into_inner();
        Ok(r.chunks.iter().filter(|g| g.present).map(|g| g.grant_id).collect())
    })
}

fn release(
    port: u16,
    (requester, requester_epoch): (&str, u64),
    owner_epoch: u64,
    ids: Vec<u64>,
    requests: Vec<u64>,
) -> Result<u32, tonic::Status> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = PeerClient::connect(format!("http://127.0.0.1:{port}")).await.unwrap();
        let r = c
            .release(ReleaseRequest {
                requester: requester.into(),
                requester_epoch,
                owner_epoch,
                grant_ids: ids,
                requests,
            })
            .await?
            .into_inner();
        Ok(r.released)
    })
}

#[test]
fn a_chunk_put_on_one_node_is_read_on_another() {
    if !have_te() {
        return;
    }
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
    // Group reads (a wait in the queue, a grant, the Transfer Engine read, the handoff each),
    // timed: the peer thread takes the lookup's reads in one group or, when it wakes between
    // them, more.
    let groups = v["peers"]["a"]["group_reads"].as_u64().unwrap();
    assert!((1..=8).contains(&groups), "{v}");
    for part in ["queue_us_mean", "grant_us_mean", "te_read_us_mean", "handoff_us_mean"] {
        assert!(v["peers"]["a"][part].as_f64().unwrap() > 0.0, "{part}: {v}");
    }
    until(&b, "b's grants at a returned", |v| v["peers"]["a"]["grants_held"] == 0);
    assert_eq!(b.shard_sum("peer_reads"), 8);
    assert_eq!(b.shard_sum("peer_hits"), 8);
    assert_eq!(b.shard_sum("peer_read_bytes"), 8 * LEN as u64);
    assert_eq!(
        b.shard_sum("catalog_entries"),
        8,
        "stored locally, the catalog still lists a's copies"
    );
    until(&a, "a's grants to b returned", |v| v["peers"]["b"]["grants_given"] == 0);
    assert_eq!(a.shard_sum("leases"), 0);

    // Only members take grants: a stranger, or a member at another epoch, is refused.
    for who in [("ghost", 1), ("b", 7)] {
        let e = grant(7401, who, 1, &keys[..2], 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{who:?}: {e:?}");
        assert!(e.message().contains("not a member"), "{e:?}");
    }
    assert_eq!(a.shard_sum("leases"), 0);
    // As b (request ids far from b's own): a grant cancelled before it is answered gives back
    // what it takes; a release by request id gives back all the request got; grants are
    // fenced by the owner's epoch.
    let b1 = ("b", 1);
    assert_eq!(release(7401, b1, 1, vec![], vec![1_000_009]).unwrap(), 0);
    let cancelled = grant(7401, b1, 1, &keys[..2], 1_000_009).unwrap_err();
    assert_eq!(cancelled.code(), tonic::Code::Cancelled, "{cancelled:?}");
    assert_eq!(a.shard_sum("leases"), 0);
    assert_eq!(grant(7401, b1, 1, &keys[..3], 1_000_010).unwrap().len(), 3);
    assert_eq!(a.shard_sum("leases"), 3);
    assert_eq!(release(7401, b1, 1, vec![], vec![1_000_010]).unwrap(), 3);
    assert_eq!(a.shard_sum("leases"), 0);
    let ids = grant(7401, b1, 1, &keys[..2], 1_000_011).unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(a.shard_sum("leases"), 2);
    let stale = grant(7401, b1, 7, &keys[..1], 1_000_012).unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition, "{stale:?}");
    assert!(stale.message().contains("stale"), "{stale:?}");
    assert_eq!(release(7401, b1, 1, ids.clone(), vec![]).unwrap(), 2);
    assert_eq!(release(7401, b1, 1, ids, vec![]).unwrap(), 0, "already returned");
    assert_eq!(a.shard_sum("leases"), 0);

    // The owner restarts (SIGKILL): it leaves b's catalog, comes back with epoch 2, refuses
    // epoch 1, and b follows it again.
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = a.wait_exit(Duration::from_secs(5));
    until(&b, "a dropped from b's catalog", |v| v["peers"].get("a").is_none());
    let a = member(&etcd, "a", 7401, &["--shards", "2"]);
    assert_eq!(a.admin("peers")["epoch"], 2);
    let old = grant(7401, b1, 1, &keys[..1], 1_000_013).unwrap_err();
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

/// 4 prefixes of 96 chunks of 1 MiB put on `a` (chains from `seed`), once `b` lists them: each
/// lookup of a prefix on `b` reads 96 MiB from `a`. The client that put them, and the keys.
fn big_prefixes(
    a: &TestServer,
    b: &TestServer,
    seed: u32,
) -> (orbitkv_client::Client, Vec<Vec<orbitkv_proto::ChunkKey>>) {
    let mut ca = a.client("engine-a");
    let ns = ca.register_namespace(&namespace(256)).unwrap().id;
    let prefixes: Vec<Vec<orbitkv_proto::ChunkKey>> =
        (0..4).map(|p| chain(ns, seed + p, 96)).collect();
    for keys in &prefixes {
        put_values(&mut ca, keys, BIG);
    }
    until(b, "b follows a", |v| v["peers"]["a"]["catalog_entries"] == 384);
    (ca, prefixes)
}

/// Looks up every prefix on `b` from a client thread, back to back (the bytes are checked
/// after, so that what happens to the owner meanwhile lands during a read): each chunk found
/// is a peer hit with the owner's bytes. How many chunks each prefix found.
fn read_in_background(
    b: &TestServer,
    prefixes: &[Vec<orbitkv_proto::ChunkKey>],
) -> std::thread::JoinHandle<Vec<usize>> {
    let socket = b.socket().to_owned();
    let prefixes = prefixes.to_vec();
    std::thread::spawn(move || {
        let mut cb =
            orbitkv_client::Client::connect(orbitkv_client::ClientOptions::with_socket(socket))
                .unwrap();
        cb.register_namespace(&namespace(256)).unwrap();
        let leased: Vec<_> = prefixes.iter().map(|keys| cb.lookup_leased(keys).unwrap()).collect();
        let mut found = Vec::new();
        for (leases, keys) in leased.iter().zip(&prefixes) {
            for (l, k) in leases.iter().zip(keys) {
                assert_eq!(l.hit.tier, Tier::Peer);
                assert!(cb.chunk(l).unwrap() == value_for(k, BIG).as_slice(), "never wrong bytes");
            }
            found.push(leases.len());
            cb.release(leases).unwrap();
        }
        found
    })
}

/// Waits (up to 30 s) until `b` holds grants at `a` and has read some chunks (a read under
/// way); false when the reads were over first.
fn until_reading(b: &TestServer) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = b.admin("peers");
        let p = &v["peers"]["a"];
        if p["grants_held"].as_u64().unwrap_or(0) > 0 && p["chunks_read"].as_u64().unwrap_or(0) > 0
        {
            return true;
        }
        if p["chunks_read"].as_u64().unwrap_or(0) >= 384 || Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every chunk of `prefixes` that `b` holds is a local DRAM chunk with the owner's bytes.
fn assert_held_locally_right(b: &TestServer, prefixes: &[Vec<orbitkv_proto::ChunkKey>]) {
    let mut cb = b.client("check");
    cb.register_namespace(&namespace(256)).unwrap();
    for keys in prefixes {
        let leases = cb.lookup_leased(keys).unwrap();
        for (l, k) in leases.iter().zip(keys) {
            assert_eq!(l.hit.tier, Tier::Dram);
            assert!(cb.chunk(l).unwrap() == value_for(k, BIG).as_slice(), "never wrong bytes");
        }
        cb.release(&leases).unwrap();
    }
}

#[test]
fn an_owner_killed_while_read_gives_misses_never_wrong_bytes() {
    if !have_te() {
        return;
    }
    let etcd = Etcd::start();
    let mut a = member(&etcd, "a", 7411, &["--shards", "1", "--dram", "512MiB"]);
    let b = member(&etcd, "b", 7412, &["--shards", "2", "--dram", "512MiB"]);
    let (_ca, prefixes) = big_prefixes(&a, &b, 1000);

    let reader = read_in_background(&b, &prefixes);
    // Kill a while b reads its second prefix: grants taken, the Transfer Engine moving bytes
    // (or, if the reads outran this poll, after them: the checks below hold either way).
    let mid_read = until_reading(&b);
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = a.wait_exit(Duration::from_secs(5));
    let found = reader.join().unwrap();
    eprintln!("killed mid-read: {mid_read}; prefix lengths found: {found:?}");
    // What b stored are a's bytes (partly read groups included); nothing is left reserved
    // or leased; b keeps serving what it has.
    until(&b, "a dropped", |v| v["peers"].get("a").is_none());
    b.wait_for("nothing held", |b| b.shard_sum("reservations") == 0 && b.shard_sum("leases") == 0);
    assert!(b.shard_sum("peer_reads") as usize >= found.iter().sum::<usize>());
    assert_held_locally_right(&b, &prefixes);
    assert_eq!(b.shard_sum("peer_checksum_failures"), 0);
    assert_eq!(b.admin("health")["ready"], true);
}

/// An owner stopped (SIGSTOP, shorter than its lease) while its chunks are read, then let go
/// on: the reads wait for it rather than give up under a transfer, every chunk read is right,
/// and nothing stays held on either side.
#[test]
fn an_owner_paused_while_read_gives_right_bytes_and_holds_nothing() {
    if !have_te() {
        return;
    }
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7441, &["--shards", "1", "--dram", "512MiB"]);
    let b = member(&etcd, "b", 7442, &["--shards", "2", "--dram", "512MiB"]);
    let (_ca, prefixes) = big_prefixes(&a, &b, 3000);

    // Stop `a` once b reads from it, for a second.
    pause_owner_while_read(&a, &b, &prefixes, Duration::from_secs(1));
    assert_nothing_held_and_right(&a, &b, &prefixes);
}

/// Reads `prefixes` on `b` in the background and stops `a` for `pause` once `b` reads from
/// it (if the reads are not over first), then waits for the reads.
fn pause_owner_while_read(
    a: &TestServer,
    b: &TestServer,
    prefixes: &[Vec<orbitkv_proto::ChunkKey>],
    pause: Duration,
) {
    let reader = read_in_background(b, prefixes);
    let mid_read = until_reading(b);
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    std::thread::sleep(pause);
    a.signal(nix::sys::signal::Signal::SIGCONT);
    let found: usize = reader.join().unwrap().iter().sum();
    eprintln!("paused mid-read: {mid_read}; chunks found: {found} of 384");
}

/// After reads of `prefixes` from `a`: nothing stays reserved or leased on `b`, grants are
/// returned on both sides, and what `b` holds is `a`'s bytes, read again from its DRAM.
fn assert_nothing_held_and_right(
    a: &TestServer,
    b: &TestServer,
    prefixes: &[Vec<orbitkv_proto::ChunkKey>],
) {
    b.wait_for("nothing held on b", |b| {
        b.shard_sum("reservations") == 0 && b.shard_sum("leases") == 0
    });
    until(b, "b's grants at a returned", |v| v["peers"]["a"]["grants_held"] == 0);
    until(a, "a's grants to b returned", |v| v["peers"]["b"]["grants_given"] == 0);
    assert_held_locally_right(b, prefixes);
}

/// The wheel's engine gives up on a read after `MC_TRANSFER_TIMEOUT` seconds (5 at least)
/// unless the server sets it: `b` is started with 5 and `a` stopped for longer while `b`
/// reads from it. No Transfer Engine read is given up (they wait for `a`; only grants asked
/// during the pause time out, as misses), and nothing stays held or wrong. Through the C API
/// reads wait regardless.
#[test]
fn reads_wait_for_a_paused_owner_past_the_wheels_own_timeout() {
    if !have_te() {
        return;
    }
    let etcd = Etcd::start();
    let ttl = ["--cluster-lease-ttl", "30s"];
    let a = member(&etcd, "a", 7451, &[&ttl[..], &["--shards", "1", "--dram", "512MiB"]].concat());
    let b = member_env(
        &etcd,
        "b",
        7452,
        &[&ttl[..], &["--shards", "1", "--dram", "512MiB"]].concat(),
        &[("MC_TRANSFER_TIMEOUT", "5")],
    );
    let (_ca, prefixes) = big_prefixes(&a, &b, 4000);

    pause_owner_while_read(&a, &b, &prefixes, Duration::from_millis(6500));
    let log = b.log();
    assert!(
        !log.contains("what was not read is answered as misses"),
        "a Transfer Engine read was given up under the paused owner:\n{log}"
    );
    assert_nothing_held_and_right(&a, &b, &prefixes);
}

#[test]
fn a_requester_killed_while_reading_has_its_grants_returned() {
    if !have_te() {
        return;
    }
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7421, &["--shards", "1", "--dram", "512MiB"]);
    let mut b = member(&etcd, "b", 7422, &["--shards", "1", "--dram", "512MiB"]);
    let (mut ca, prefixes) = big_prefixes(&a, &b, 2000);
    let socket = b.socket().to_owned();
    let read = prefixes.clone();
    let reader = std::thread::spawn(move || {
        let Ok(mut cb) =
            orbitkv_client::Client::connect(orbitkv_client::ClientOptions::with_socket(socket))
        else {
            return;
        };
        if cb.register_namespace(&namespace(256)).is_err() {
            return;
        }
        // b dies under these: whatever they answer is not the point.
        for keys in &read {
            let _ = cb.lookup_leased(keys);
        }
    });
    // Kill b while a holds grants for it (or, if the reads outran this poll, after them).
    let deadline = Instant::now() + Duration::from_secs(30);
    let granted = loop {
        let v = a.admin("peers");
        if v["peers"]["b"]["grants_given"].as_u64().unwrap_or(0) > 0 {
            break true;
        }
        if Instant::now() > deadline || reader.is_finished() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    b.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = b.wait_exit(Duration::from_secs(5));
    let _ = reader.join();
    eprintln!("killed while a held grants for b: {granted}");
    // b's member key expires (2 s), a lease TTL more proves it gone: its grants come back.
    a.wait_for("b's grants returned", |a| a.shard_sum("leases") == 0);
    until(&a, "b gone", |v| v["peers"].get("b").is_none_or(|p| p["grants_given"] == 0));
    // a serves everything it had.
    for keys in &prefixes {
        assert_eq!(ca.lookup(keys).unwrap().len(), 96);
    }
    assert_eq!(a.admin("health")["ready"], true);
}

/// Failpoint `peer-te-read` (builds with `failpoints`): every Transfer Engine read of the
/// requester fails. Its lookups answer misses, its reserved slots and the owner's grants are
/// given back, the failures are counted, and local serving goes on.
#[cfg(feature = "failpoints")]
#[test]
fn failing_transfer_engine_reads_are_misses_and_hold_nothing() {
    if !have_te() {
        return;
    }
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7431, &["--shards", "1"]);
    let mut args = etcd.member_args("reads", "b", 7432);
    args.extend(["--dram".into(), "64MiB".into(), "--shards".into(), "2".into()]);
    let b = TestServer::start_env(
        &[("FAILPOINTS", "peer-te-read=return")],
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let mut ca = a.client("engine-a");
    let ns = ca.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 51, 6);
    put_values(&mut ca, &keys, LEN);
    until(&b, "b follows a", |v| v["peers"]["a"]["catalog_entries"] == 6);
    let mut cb = b.client("engine-b");
    cb.register_namespace(&namespace(16)).unwrap();
    assert!(cb.lookup_leased(&keys).unwrap().is_empty(), "every read failed: misses");
    let v = until(&b, "failures counted", |v| v["peers"]["a"]["read_failures"] == 6);
    assert_eq!(v["peers"]["a"]["chunks_read"], 0, "{v}");
    b.wait_for("nothing reserved", |b| b.shard_sum("reservations") == 0);
    assert_eq!(b.shard_sum("peer_read_failures"), 6);
    a.wait_for("the grants given back", |a| a.shard_sum("leases") == 0);
    // b's own chunks are untouched by it.
    let mine = chain(ns, 52, 2);
    put_values(&mut cb, &mine, LEN);
    assert_eq!(cb.lookup(&mine).unwrap().len(), 2);
}

/// An engine that finds no free port (here TE's port range is one port, and it needs two)
/// stops the start, exit 2, with TE's log and a hint naming the port range.
#[test]
fn no_free_transfer_engine_port_stops_the_start_saying_so() {
    if !have_te() {
        return;
    }
    let mut args = vec!["--socket", "/tmp/okv-te-ports.sock", "--dram", "16MiB"];
    args.extend(["--etcd", "http://127.0.0.1:1", "--peer-addr", "127.0.0.1:7498"]);
    let lib = std::env::var("ORBITKV_TE_LIBRARY").ok();
    if let Some(lib) = &lib {
        args.extend(["--te-library", lib]);
    }
    let out = std::process::Command::new(orbitkv_testkit::server_bin())
        .args(&args)
        .envs([("MC_MIN_RPC_PORT", "7481"), ("MC_MAX_RPC_PORT", "7481")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Transfer Engine") || stderr.contains("--te-library"), "{stderr}");
    assert!(stderr.contains("MC_MIN_RPC_PORT..MC_MAX_RPC_PORT"), "{stderr}");
}
