//! `orbitkv-perf checksum` hashes chunks with several threads and reports a rate per thread
//! count beside its memcpy baseline; the numbers are not asserted (timing belongs in reports),
//! only that they are there, and that bad flags are refused naming the flag.

mod common;

use common::{num, run, run_json};

#[test]
fn checksum_reports_a_row_per_thread_count() {
    let v = run_json(&[
        "checksum",
        "--value-size",
        "64KiB",
        "--working-set",
        "4MiB",
        "--threads",
        "1,3",
        "--duration",
        "50ms",
        "--json",
    ]);
    assert_eq!(num(&v, &["value_size"]), 65536.0, "{v}");
    assert_eq!(num(&v, &["working_set"]), 4194304.0, "{v}");
    assert!(num(&v, &["memcpy_gbps"]) > 0.0, "{v}");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{v}");
    for (row, threads) in rows.iter().zip([1.0, 3.0]) {
        assert_eq!(num(row, &["threads"]), threads, "{v}");
        assert!(num(row, &["chunks"]) >= threads, "{v}");
        let gbps = num(row, &["gbps"]);
        assert!(gbps.is_finite() && gbps > 0.0, "{v}");
        assert!((num(row, &["gbps_per_thread"]) * threads - gbps).abs() < 1e-6 * gbps, "{v}");
    }
}

#[test]
fn checksum_refuses_bad_flags_naming_them() {
    for (args, flag) in [
        (vec!["--threads", "0"], "--threads"),
        (vec!["--value-size", "0"], "--value-size"),
        (vec!["--value-size", "1MiB", "--working-set", "2MiB", "--threads", "4"], "--working-set"),
        (vec!["--duration", "0s"], "--duration"),
        // More than this machine can hold: refused before anything is allocated.
        (
            vec!["--value-size", "1MiB", "--working-set", "1024TiB", "--threads", "1"],
            "--working-set",
        ),
    ] {
        let mut all = vec!["checksum"];
        all.extend(args);
        let out = run(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{all:?}: {stderr}");
        assert!(stderr.contains(flag), "{all:?}: {stderr}");
    }
}
