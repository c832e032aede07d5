//! `orbitkv-perf serve --embedded` runs end to end against the real server: every byte read
//! back verifies, with the working set inside the arena and with one four times larger
//! (evicting). No timing is asserted, and the evicting case needs few operations (a slow or
//! busy machine still gets there).

mod common;

use std::sync::Mutex;

use common::{num, require_server, run, run_json};

/// The cases share the CPUs with their servers; running them one at a time keeps each close
/// to what it would do alone.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Two shards sharing this arena in every case but the evicting one.
const DRAM: &str = "64MiB";

fn serve(working_set: &str, duration: &str) -> serde_json::Value {
    serve_with(DRAM, working_set, duration, &[])
}

fn serve_with(dram: &str, working_set: &str, duration: &str, extra: &[&str]) -> serde_json::Value {
    require_server();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut args = vec![
        "serve",
        "--embedded",
        "--embedded-dram",
        dram,
        "--embedded-shards",
        "2",
        "--no-lock-arena",
        "--clients",
        "2",
        "--duration",
        duration,
        "--value-size",
        "64KiB",
        "--working-set",
        working_set,
        "--lookup-batch",
        "16",
        "--json",
    ];
    args.extend_from_slice(extra);
    run_json(&args)
}

fn assert_clean(v: &serde_json::Value) {
    assert_eq!(num(v, &["verify_failures"]), 0.0, "{v}");
    assert_eq!(num(v, &["errors"]), 0.0, "{v}");
    assert!(num(v, &["get", "count"]) > 0.0, "{v}");
    assert!(num(v, &["hits"]) > 0.0, "{v}");
    // Every hit is verified; with one key per get, every hit is one timed get.
    if num(v, &["get_batch"]) == 1.0 {
        assert_eq!(num(v, &["hits"]), num(v, &["get", "count"]), "{v}");
    }
    assert_eq!(num(v, &["shards"]), 2.0, "{v}");
    assert!(num(v, &["lookup_batch", "count"]) > 0.0, "{v}");
    assert!(num(v, &["memcpy_gbps"]) > 0.0, "{v}");
}

#[test]
fn working_set_inside_the_arena_verifies_without_evictions() {
    let v = serve("16MiB", "1s");
    assert_clean(&v);
    assert_eq!(num(&v, &["nkeys"]), 256.0, "{v}");
    // 16 MiB of values and 2 MiB of lookup sets fit 2 shards of 32 MiB.
    assert_eq!(num(&v, &["evictions"]), 0.0, "{v}");
    assert_eq!(num(&v, &["lookup_batch", "lookup_short"]), 0.0, "{v}");
    assert_eq!(num(&v, &["put_rejected"]), 0.0, "{v}");
}

#[test]
fn working_set_larger_than_the_arena_evicts_and_still_verifies() {
    // An 8 MiB arena and 4x that in values: the run must store more than the arena holds,
    // which takes about 130 puts of 64 KiB (an unoptimised build beside two CPU hogs on 2
    // vCPUs makes about 700 in 3 s).
    let v = serve_with("8MiB", "32MiB", "3s", &[]);
    assert_clean(&v);
    let stored = num(&v, &["put_stored"]) * num(&v, &["value_size"]);
    assert!(
        stored > (8u64 << 20) as f64,
        "the run stored only {stored} bytes, not more than the arena: too slow to test eviction: {v}"
    );
    assert!(num(&v, &["evictions"]) > 0.0, "{v}");
}

#[test]
fn gets_of_consecutive_key_runs_verify() {
    let v = serve_with(DRAM, "16MiB", "2s", &["--get-batch", "8"]);
    assert_clean(&v);
    assert_eq!(num(&v, &["get_batch"]), 8.0, "{v}");
    // Batches hit several keys each once the working set is stored.
    assert!(num(&v, &["hits"]) > 2.0 * num(&v, &["get", "count"]), "{v}");
    // A batch larger than the key count is refused naming the flag.
    let stderr = refused(&["--get-batch", "17", "--duration", "1s"]);
    assert!(stderr.contains("--get-batch"), "{stderr}");
}

/// Runs an embedded-server benchmark of 16 keys of 64 KiB with `extra`, which must be refused
/// as a usage error (exit 2) with nothing on stdout; returns its stderr.
fn refused(extra: &[&str]) -> String {
    let mut args =
        vec!["serve", "--embedded", "--working-set", "1MiB", "--value-size", "64KiB", "--json"];
    args.extend_from_slice(extra);
    let out = run(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{extra:?}");
    stderr
}

#[test]
fn the_yardstick_inside_the_run_brackets_the_gets() {
    // Two clients, a window every second of a 3 s phase: each client has a window first, one
    // or more between its gets, and one at the end.
    let v = serve_with(DRAM, "16MiB", "3s", &["--baseline-every", "1s"]);
    assert_clean(&v);
    assert_eq!(num(&v, &["baseline_every_s"]), 1.0, "{v}");
    let windows = v["baseline_windows_gbps"].as_array().expect("windows");
    assert!(windows.len() >= 6, "{v}");
    assert!(windows.iter().all(|w| w.as_f64().is_some_and(|w| w > 0.0)), "{v}");
    let ratios = v["bracketed_ratios"].as_array().expect("ratios");
    assert!(!ratios.is_empty() && ratios.len() <= windows.len() - 2, "{v}");
    assert!(num(&v, &["ratio_get_vs_memcpy_bracketed"]) > 0.0, "{v}");
    // Without the flag there are none.
    let plain = serve(DRAM, "1s");
    assert!(plain["ratio_get_vs_memcpy_bracketed"].is_null(), "{plain}");
    assert!(plain["bracketed_ratios"].as_array().is_some_and(|r| r.is_empty()), "{plain}");
    // A period of zero, or longer than the phase, is refused naming the flag.
    for every in ["0s", "5s"] {
        let stderr = refused(&["--duration", "2s", "--baseline-every", every]);
        assert!(stderr.contains("--baseline-every"), "{stderr}");
    }
}

#[test]
fn an_unreachable_server_is_a_setup_error() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("nobody.sock");
    let socket = socket.to_str().expect("temporary paths are UTF-8");
    let out =
        run(&["serve", "--socket", socket, "--duration", "1s", "--working-set", "1MiB", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(socket), "{stderr}");
    assert!(out.stdout.is_empty());
}
