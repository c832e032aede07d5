//! `orbitkv-ctl stats --json` is documented: every key the server answers is in
//! docs/operations.md's reference tables, and every key there is answered.

use std::collections::BTreeSet;

use orbitkv_testkit::{chain, namespace, value_for, TestServer};

/// The keys in the first column of the markdown tables of the `stats --json` section: the
/// server-wide table, then the per-shard one.
fn documented() -> (BTreeSet<String>, BTreeSet<String>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let section = doc.split("## `stats --json`").nth(1).expect("the stats --json section");
    let section = section.split("\n## ").next().unwrap();
    let mut tables: Vec<BTreeSet<String>> = Vec::new();
    let mut in_table = false;
    for line in section.lines() {
        let Some(cells) = line.strip_prefix("| ") else {
            in_table = false;
            continue;
        };
        if !in_table {
            tables.push(BTreeSet::new());
            in_table = true;
        }
        let first = cells.split(" | ").next().unwrap();
        for key in first.split(", ") {
            if let Some(k) = key.strip_prefix('`').and_then(|k| k.strip_suffix('`')) {
                tables.last_mut().unwrap().insert(k.to_string());
            }
        }
    }
    assert_eq!(tables.len(), 2, "two tables in the section");
    (tables.remove(0), tables.remove(0))
}

#[test]
fn every_stats_key_is_documented_and_every_documented_key_answered() {
    let ssd = tempfile::tempdir_in("/tmp").unwrap();
    let server = TestServer::start(&[
        "--shards",
        "1",
        "--dram",
        "16MiB",
        "--ssd-dir",
        ssd.path().to_str().unwrap(),
        "--ssd",
        "64MiB",
        "--ssd-region-size",
        "8MiB",
    ]);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 3, 4);
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 10_000)).collect();
    let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    c.put(&items).unwrap();
    assert_eq!(c.lookup(&keys).unwrap().len(), 4);

    let stats = server.admin("stats");
    let (top_doc, shard_doc) = documented();
    let top: BTreeSet<String> = stats.as_object().unwrap().keys().cloned().collect();
    let shard: BTreeSet<String> = stats["shards"][0].as_object().unwrap().keys().cloned().collect();
    assert_eq!(
        top.symmetric_difference(&top_doc).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "server-wide keys answered vs documented"
    );
    assert_eq!(
        shard.symmetric_difference(&shard_doc).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "per-shard keys answered vs documented"
    );
    // The server-wide latency has the documented fields for each operation seen.
    let lookup = &stats["latency"]["lookup"];
    for field in ["count", "p50_ns", "p99_ns", "p999_ns", "max_ns"] {
        assert!(lookup[field].is_u64(), "latency.lookup.{field}: {lookup}");
    }
}
