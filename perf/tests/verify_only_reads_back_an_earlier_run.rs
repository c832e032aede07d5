//! `orbitkv-perf serve --verify-only` checks what an earlier run left in a live server: it
//! finds and verifies those values byte for byte and writes nothing. No timing is asserted.

mod common;

use common::{num, run, run_json};
use orbitkv_testkit::TestServer;

/// The workload both runs share: 128 keys of 64 KiB, well inside the server's 64 MiB.
const WORKLOAD: [&str; 6] = ["--seed", "7", "--value-size", "64KiB", "--working-set", "8MiB"];

fn serve(socket: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["serve", "--socket", socket, "--duration", "1s", "--json"];
    args.extend_from_slice(&WORKLOAD);
    args.extend_from_slice(extra);
    run_json(&args)
}

#[test]
fn verify_only_finds_an_earlier_runs_values_and_puts_nothing() {
    let server = TestServer::start(&["--shards", "1", "--dram", "64MiB"]);
    let socket = server.socket_str();

    let written = serve(socket, &[]);
    assert_eq!(num(&written, &["verify_failures"]), 0.0, "{written}");
    assert!(num(&written, &["put_stored"]) > 0.0, "{written}");
    assert_eq!(written["verify_only"], false, "{written}");

    let commits_before = server.shard_sum("commits");
    let checked = serve(socket, &["--verify-only"]);
    assert_eq!(checked["verify_only"], true, "{checked}");
    assert!(num(&checked, &["hits"]) > 0.0, "{checked}");
    assert_eq!(num(&checked, &["verify_failures"]), 0.0, "{checked}");
    assert_eq!(num(&checked, &["errors"]), 0.0, "{checked}");
    // Every hit was a timed, verified get; not one put was tried or stored.
    assert_eq!(num(&checked, &["hits"]), num(&checked, &["get", "count"]), "{checked}");
    assert_eq!(num(&checked, &["put", "count"]), 0.0, "{checked}");
    assert_eq!(num(&checked, &["put_stored"]), 0.0, "{checked}");
    assert_eq!(num(&checked, &["put_already_present"]), 0.0, "{checked}");
    assert_eq!(num(&checked, &["put_rejected"]), 0.0, "{checked}");
    // The server agrees: nothing was committed during the verify-only run.
    assert_eq!(server.shard_sum("commits"), commits_before, "{}", server.log());

    // Another seed names keys nobody wrote: all misses, none put, nothing fails.
    let mut other = vec!["serve", "--socket", socket, "--duration", "1s", "--json"];
    other.extend_from_slice(&["--value-size", "64KiB", "--working-set", "8MiB"]);
    other.extend_from_slice(&["--seed", "8", "--verify-only"]);
    let unseen = run_json(&other);
    assert_eq!(num(&unseen, &["hits"]), 0.0, "{unseen}");
    assert!(num(&unseen, &["misses"]) > 0.0, "{unseen}");
    assert_eq!(num(&unseen, &["put", "count"]), 0.0, "{unseen}");
    assert_eq!(server.shard_sum("commits"), commits_before, "{}", server.log());
}

#[test]
fn verify_only_refuses_flags_that_would_write_or_start_empty() {
    let cases: [&[&str]; 2] =
        [&["--embedded", "--verify-only"], &["--lookup-batch", "4", "--verify-only"]];
    for flags in cases {
        let mut args = vec!["serve"];
        args.extend_from_slice(flags);
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains("--verify-only"), "{flags:?}: {stderr}");
    }
}
