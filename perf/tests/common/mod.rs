//! Helpers for `orbitkv-perf` scenario tests: run the built binary, find the server binary
//! beside it. A live server to run against is `orbitkv_testkit::TestServer`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// The `orbitkv-perf` binary under test.
pub fn perf() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_orbitkv-perf"))
}

/// The `orbitkv-server` binary that `--embedded` uses: the one next to `orbitkv-perf`. It is
/// another package's binary, so `cargo test -p orbitkv-perf` alone does not build it: fail
/// (not skip) with the fix.
pub fn require_server() -> PathBuf {
    let bin =
        perf().parent().expect("a built binary lives in a target directory").join("orbitkv-server");
    assert!(
        bin.is_file(),
        "no orbitkv-server binary at {}: these tests run the real server next to orbitkv-perf. \
         Run `cargo test --workspace`, or `cargo build -p orbitkv-server` (same profile) before \
         `cargo test -p orbitkv-perf`.",
        bin.display()
    );
    bin
}

/// Runs `orbitkv-perf` with `args`.
pub fn run(args: &[&str]) -> Output {
    Command::new(perf())
        .args(args)
        .output()
        .expect("the orbitkv-perf binary built by cargo can be started")
}

/// Runs `orbitkv-perf` with `args` (which include `--json`), expects success and returns the
/// one JSON object it printed.
pub fn run_json(args: &[&str]) -> Value {
    let out = run(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "orbitkv-perf {args:?} failed with {}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    assert_eq!(stdout.lines().count(), 1, "not exactly one line: {stdout}");
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {stdout}\nstderr: {stderr}"))
}

/// A numeric field, or a panic that shows the report.
pub fn num(v: &Value, path: &[&str]) -> f64 {
    let mut at = v;
    for p in path {
        at = &at[*p];
    }
    at.as_f64().unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}
