//! `orbitkv-perf arena` starts private servers by arena size and shard count and reads their
//! start steps back. The times are not asserted (timing belongs in reports), only that every
//! start and baseline reported one, and that bad flags are named.

mod common;

use common::{num, require_server, run, run_json};

#[test]
fn arena_reports_each_start_and_its_baselines() {
    require_server();
    let v = run_json(&[
        "arena",
        "--sizes",
        "32MiB",
        "--shards",
        "1,2",
        "--no-lock-arena",
        "--one-memfd",
        "--arena-memfds",
        "per-shard",
        "--json",
    ]);
    let sizes = v["sizes"].as_array().unwrap_or_else(|| panic!("no sizes: {v}"));
    assert_eq!(sizes.len(), 1, "{v}");
    assert_eq!(num(&sizes[0], &["bytes"]), (32u64 << 20) as f64, "{v}");
    assert!(num(&sizes[0], &["memset_fresh_gbps"]) > 0.0, "{v}");
    let rows = sizes[0]["rows"].as_array().unwrap_or_else(|| panic!("no rows: {v}"));
    assert_eq!(rows.len(), 2, "{v}");
    for (row, shards) in rows.iter().zip([1.0, 2.0]) {
        assert_eq!(num(row, &["shards"]), shards, "{v}");
        assert_eq!(row["locked"], false, "{v}");
        assert!(row["pages"].is_string(), "{v}");
        for field in ["populate_s", "limit_s", "memset_parallel_gbps", "one_memfd_gbps", "total_s"]
        {
            assert!(num(row, &[field]) > 0.0, "{field}: {v}");
        }
        assert!(row["register_cuda_s"].is_null(), "--gpu off registers nothing: {v}");
        assert_eq!(num(row, &["lock_s"]), 0.0, "--no-lock-arena locks nothing: {v}");
    }
}

#[test]
fn arena_without_one_memfd_leaves_that_baseline_out() {
    require_server();
    let v = run_json(&["arena", "--sizes", "16MiB", "--shards", "1", "--no-lock-arena", "--json"]);
    let row = &v["sizes"][0]["rows"][0];
    assert!(row["one_memfd_gbps"].is_null() && row["vs_memfd_each"].is_null(), "{v}");
}

#[test]
fn arena_names_what_is_wrong() {
    for (flags, want) in [
        (&["--shards", "0"][..], "--shards"),
        (&["--sizes", "0"][..], "--sizes"),
        (&["--repeat", "0"][..], "--repeat"),
        (&["--hugepages", "sometimes"][..], "--hugepages"),
        (&["--gpu", "maybe"][..], "--gpu"),
        (&["--arena-memfds", "two"][..], "--arena-memfds"),
    ] {
        let mut a = vec!["arena"];
        a.extend_from_slice(flags);
        let out = run(&a);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(want), "{flags:?}: {stderr}");
    }
}
