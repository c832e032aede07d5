//! `orbitkv-perf idle` reads a live server's CPU use through its admin socket. The number is
//! not asserted (timing belongs in reports), only that it is one.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{num, require_server, run, run_json};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn idle_reports_the_cpu_of_a_running_server() {
    let bin = require_server();
    let dir = tempfile::Builder::new()
        .prefix("okvperf")
        .tempdir_in("/tmp")
        .expect("a temporary directory");
    let socket = dir.path().join("s.sock");
    let socket = socket.to_str().expect("temporary paths are UTF-8");
    let mut server = Server(
        Command::new(bin)
            .args(["--socket", socket, "--dram", "16MiB", "--shards", "1"])
            .arg("--no-lock-arena")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("orbitkv-server starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !run(&["idle", "--socket", socket, "--duration", "10ms"]).status.success() {
        assert!(server.0.try_wait().expect("wait on the server").is_none(), "server exited");
        assert!(Instant::now() < deadline, "server never answered stats");
        std::thread::sleep(Duration::from_millis(50));
    }
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
