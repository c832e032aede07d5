//! The arena at start: each shard's slice populated by its own thread and reported (seconds,
//! core, NUMA node) in the log and `stats`; `--hugepages` on a host with too few reserved
//! pages says so, naming the setting, and serves on 4 KiB pages.

mod common;

use common::TestServer;

#[test]
fn every_shards_slice_is_populated_and_reported() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB", "--hugepages", "off"]);
    server.client("populated").ping().unwrap();
    let stats = server.admin("stats");
    assert_eq!(stats["arena_pages"], "4KiB", "{stats}");
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
    }
    let log = server.log();
    assert_eq!(log.matches("arena slice populated").count(), 2, "{log}");
    assert!(log.contains("arena populated") && log.contains("threads=2"), "{log}");
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
