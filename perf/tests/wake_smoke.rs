//! `orbitkv-perf wake` times round trips after pauses against a live server. The times are not
//! asserted (timing belongs in reports), only that every pause got its samples.

mod common;

use common::{num, run, run_json};
use orbitkv_testkit::TestServer;

#[test]
fn wake_reports_each_pause_in_order() {
    let server = TestServer::start(&["--dram", "16MiB", "--shards", "1"]);
    let socket = server.socket_str();
    let v = run_json(&["wake", "--socket", socket, "--gaps", "0,3ms", "--samples", "4", "--json"]);
    let rows = v["rows"].as_array().unwrap_or_else(|| panic!("no rows: {v}"));
    assert_eq!(rows.len(), 2, "{v}");
    for (row, gap_us) in rows.iter().zip([0.0, 3000.0]) {
        assert_eq!(num(row, &["gap_us"]), gap_us, "{v}");
        assert_eq!(num(row, &["samples"]), 4.0, "{v}");
        let (p50, max) = (num(row, &["p50_us"]), num(row, &["max_us"]));
        assert!(p50 > 0.0 && max >= p50, "{v}");
    }
}

#[test]
fn wake_names_what_is_wrong() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("nobody.sock");
    let socket = socket.to_str().expect("temporary paths are UTF-8");
    for (flags, want) in [
        (&["--samples", "0"][..], "--samples"),
        (&["--gaps", "20s"][..], "--gaps"),
        (&["--gaps", "soon"][..], "soon"),
        (&[][..], "nobody.sock"),
    ] {
        let mut a = vec!["wake", "--socket", socket];
        a.extend_from_slice(flags);
        let out = run(&a);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(want), "{flags:?}: {stderr}");
    }
}
