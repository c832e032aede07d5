//! The arena at start: each shard's slice populated by its own thread and reported (seconds,
//! core, NUMA node) in the log and `stats`; `--hugepages` on a host with too few reserved
//! pages says so, naming the setting, and serves on 4 KiB pages.

use orbitkv_testkit::{chain, namespace, value_for, TestServer};

#[test]
fn every_shards_slice_is_populated_and_reported() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB", "--hugepages", "off"]);
    server.client("populated").ping().unwrap();
    let stats = server.admin("stats");
    assert_eq!(stats["arena_pages"], "4KiB", "{stats}");
    assert_eq!(stats["arena_memfds"], 2, "a memfd per shard by default: {stats}");
    let p = &stats["arena_populate"];
    assert!(p["seconds"].as_f64().unwrap() >= 0.0, "{stats}");
    let slices = p["slices"].as_array().unwrap();
    assert_eq!(slices.len(), 2, "{stats}");
    let bytes: u64 = slices.iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    assert!(bytes >= 16 << 20, "the slices cover the arena: {stats}");
    for (i, s) in slices.iter().enumerate() {
        assert_eq!(s["shard"], i, "{stats}");
        // Pinned like the shard it serves (when the shards are pinned).
        assert_eq!(s["core"], stats["shards"][i]["core"], "{stats}");
        assert!(s["numa_node"].is_null() || s["numa_node"].as_u64().is_some(), "{stats}");
        // The mlock's seconds are part of the slice's.
        let (secs, lock) = (s["seconds"].as_f64().unwrap(), s["lock_seconds"].as_f64().unwrap());
        assert!((0.0..=secs).contains(&lock), "{stats}");
    }
    let log = server.log();
    assert_eq!(log.matches("arena slice populated").count(), 2, "{log}");
    assert!(log.contains("arena populated") && log.contains("threads=2"), "{log}");
}

/// Chunks on every shard, written by one client and read back by another: an offset names
/// the same byte in every process's mapping of the arena's `memfds` files (`layout`).
fn every_client_sees_the_same_bytes(layout: &str, memfds: u64) {
    let server = TestServer::start(&[
        "--shards",
        "3",
        "--dram",
        "24MiB",
        "--hugepages",
        "off",
        "--arena-memfds",
        layout,
    ]);
    let stats = server.admin("stats");
    assert_eq!(stats["arena_memfds"], memfds, "{stats}");
    assert!(server.log().contains(&format!("memfds={memfds}")), "{}", server.log());
    let mut writer = server.client("writer");
    assert_eq!(writer.arena_files().expect("connected").len() as u64, memfds);
    let ns = writer.register_namespace(&namespace(16)).unwrap().id;
    let keys: Vec<_> = (0..24).flat_map(|seed| chain(ns, seed, 1)).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 60_000)).collect();
    let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    let stored = writer.put(&items).unwrap();
    assert!(stored.iter().all(|o| *o == orbitkv_client::PutOutcome::Stored), "{stored:?}");
    let mut reader = server.client("reader");
    reader.register_namespace(&namespace(16)).unwrap();
    for (k, v) in keys.iter().zip(&values) {
        let leases = reader.lookup_leased(std::slice::from_ref(k)).unwrap();
        assert_eq!(leases.len(), 1, "{k:?} is present");
        assert_eq!(reader.chunk(&leases[0]).unwrap(), v.as_slice());
        reader.release(&leases).unwrap();
    }
    let shards = server.admin("stats")["shards"].clone();
    let holding = shards.as_array().unwrap().iter().filter(|s| s["entries"] != 0).count();
    assert_eq!(holding, 3, "every shard holds chunks: {shards}");
}

#[test]
fn a_memfd_per_shard_serves_every_client_the_same_bytes() {
    every_client_sees_the_same_bytes("per-shard", 3);
}

#[test]
fn one_memfd_when_asked() {
    every_client_sees_the_same_bytes("one", 1);
}

#[test]
fn too_few_huge_pages_are_said_and_the_arena_falls_back() {
    let free = |size: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-{size}/free_hugepages"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    if free("1048576kB") > 0 {
        println!("skipped: 1 GiB pages are free on this host");
        return;
    }
    // More 2 MiB pages than are free.
    let want = format!("{}MiB", (free("2048kB") + 1) * 2);
    let server = TestServer::start(&["--shards", "1", "--dram", &want, "--hugepages", "on"]);
    server.client("fallback").ping().unwrap();
    let stats = server.admin("stats");
    assert_eq!(stats["arena_pages"], "4KiB", "{stats}");
    let log = server.log();
    assert!(
        log.contains("--hugepages on: too few hugetlb pages are free")
            && log.contains("vm.nr_hugepages")
            && log.contains("the arena is on 4KiB pages instead"),
        "{log}"
    );
}

/// `GET path` on the metrics listener at `port`: the status and the whole answer.
fn http_get(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, answer)
}

#[test]
fn a_starting_server_says_how_far_it_got_and_tells_engines_to_wait() {
    use orbitkv_client::{Client, ClientOptions, Error};
    use std::time::{Duration, Instant};
    if !cfg!(feature = "failpoints") {
        println!("skipped: build with --features failpoints (it holds the start)");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    // 2 parts of 512 MiB, 2 steps each, every step held 700 ms: the start takes over a second.
    let mut server = TestServer::launch_env(
        &[("FAILPOINTS", "arena-populate-step=sleep(700)")],
        &["--shards", "2", "--dram", "1GiB", "--hugepages", "off", "--metrics-addr", &addr],
    );
    // The admin socket answers while the arena is populated: not ready, how far along.
    let deadline = Instant::now() + Duration::from_secs(20);
    let health = loop {
        if let Ok(v) = server.try_admin("health") {
            break v;
        }
        assert!(Instant::now() < deadline, "no admin socket: {}", server.log());
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        (&health["ready"], &health["state"]),
        (&false.into(), &"starting".into()),
        "{health}"
    );
    assert!(health["reason"].as_str().unwrap().starts_with("populating the arena: "), "{health}");
    let starting = &health["starting"];
    assert_eq!(starting["phase"], "populate_arena", "{health}");
    assert!(starting["percent"].as_u64().unwrap() < 100, "{health}");
    assert!(starting["arena_bytes"].as_u64().unwrap() >= 1 << 30, "{health}");
    // Commands that need the shards say the server is starting.
    let stats = server.admin("stats");
    assert_eq!((&stats["ok"], &stats["code"]), (&false.into(), &"starting".into()), "{stats}");
    assert!(stats["error"].as_str().unwrap().contains("orbitkv-ctl health"), "{stats}");
    // `ctl health` (built beside the server) says "starting: populating the arena: N%".
    let ctl = orbitkv_testkit::server_bin().with_file_name("orbitkv-ctl");
    if ctl.exists() {
        let out = std::process::Command::new(&ctl)
            .arg("--socket")
            .arg(&server.socket)
            .arg("health")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{text}");
        assert!(text.starts_with("starting: populating the arena: "), "{text}");
    }
    // Metrics: /healthz alive, /readyz 503 with the same object, the exposition says starting.
    assert_eq!(http_get(port, "/healthz").0, 200);
    let (status, body) = http_get(port, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"state\":\"starting\""), "{body}");
    let (status, body) = http_get(port, "/metrics");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("orbitkv_ready 0") && body.contains("orbitkv_starting 1"), "{body}");
    assert!(body.contains("orbitkv_arena_bytes "), "{body}");
    // An engine's lazy client is told to wait: no session, no refusal counted.
    let mut lazy = Client::new(ClientOptions::with_socket(&server.socket));
    match lazy.ping() {
        Err(e @ Error::Starting { .. }) => {
            assert!(e.is_unavailable(), "{e}");
            assert!(e.to_string().contains("populating the arena"), "{e}");
        }
        other => panic!("a hello while starting: {other:?} ({})", server.log()),
    }
    // A connecting client waits, and has its session once the server serves.
    let socket = server.socket.clone();
    let waiter = std::thread::spawn(move || Client::connect(ClientOptions::with_socket(&socket)));
    let mut waited = waiter.join().unwrap().unwrap_or_else(|e| panic!("{e}: {}", server.log()));
    waited.ping().unwrap();
    server.wait_ready();
    // The lazy client connects at its next call once its wait is over.
    let deadline = Instant::now() + Duration::from_secs(10);
    while lazy.ping().is_err() {
        assert!(Instant::now() < deadline, "the lazy client never connected");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The steps' durations are kept: stats, the exposition, the log.
    let stats = server.admin("stats");
    let start = &stats["startup"];
    for step in ["populate_arena", "start_shards"] {
        assert!(start["steps_s"][step].as_f64().unwrap() >= 0.0, "{stats}");
    }
    assert!(
        start["steps_s"]["populate_arena"].as_f64().unwrap() >= 1.4,
        "held 2 x 700 ms: {stats}"
    );
    assert!(start["total_s"].as_f64().unwrap() > 0.0, "{stats}");
    assert!(start["told_to_wait"].as_u64().unwrap() >= 2, "{stats}");
    let refused = stats["refused_sessions"].as_u64();
    assert!(refused.is_none_or(|n| n == 0), "a wait is no refusal: {stats}");
    let (_, body) = http_get(port, "/metrics");
    assert!(body.contains("orbitkv_ready 1") && body.contains("orbitkv_starting 0"), "{body}");
    assert!(body.contains("orbitkv_start_step_seconds{step=\"populate_arena\"}"), "{body}");
    assert!(body.contains("orbitkv_arena_slice_populate_seconds{shard=\"1\""), "{body}");
    assert!(server.log().contains("start step done"), "{}", server.log());
}
