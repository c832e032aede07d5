//! `orbitkv-perf idle` reads a live server's CPU use through its admin socket. The number is
//! not asserted (timing belongs in reports), only that it is one.

mod common;

use common::{num, run, run_json};
use orbitkv_testkit::TestServer;

#[test]
fn idle_reports_the_cpu_of_a_running_server() {
    let server = TestServer::start(&["--dram", "16MiB", "--shards", "1"]);
    let socket = server.socket_str();
    let v = run_json(&["idle", "--socket", socket, "--duration", "1s", "--json"]);
    let cpu = num(&v, &["cpu_percent"]);
    assert!(cpu.is_finite() && cpu >= 0.0, "{v}");
    assert!(num(&v, &["duration_s"]) >= 1.0, "{v}");
}

#[test]
fn idle_without_a_server_is_a_setup_error() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("nobody.sock");
    let socket = socket.to_str().expect("temporary paths are UTF-8");
    let out = run(&["idle", "--socket", socket, "--duration", "10ms"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("nobody.sock.admin"), "{stderr}");
}
