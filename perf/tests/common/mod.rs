//! Helpers for `orbitkv-perf` scenario tests: run the built binary, find the server binary.
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

/// A real `orbitkv-server` on a temporary socket, stopped (SIGTERM, then SIGKILL) when dropped.
pub struct TestServer {
    child: Option<std::process::Child>,
    socket: PathBuf,
    log: PathBuf,
    // Last: removed after the server stopped.
    _dir: tempfile::TempDir,
}

impl TestServer {
    /// Starts the server next to `orbitkv-perf` with `--socket <tmp>/s.sock --no-lock-arena`
    /// and `args`, and waits until `<socket>.admin` reports it ready.
    pub fn start(args: &[&str]) -> TestServer {
        use std::time::{Duration, Instant};
        let bin = require_server();
        let dir = tempfile::Builder::new()
            .prefix("okvperf")
            .tempdir_in("/tmp")
            .expect("a temporary directory in /tmp");
        let socket = dir.path().join("s.sock");
        let log = dir.path().join("server.log");
        let log_file = std::fs::File::create(&log).expect("a log file in the temporary directory");
        let child = Command::new(bin)
            .arg("--socket")
            .arg(&socket)
            .arg("--no-lock-arena")
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("orbitkv-server starts");
        let mut server = TestServer { child: Some(child), socket, log, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if server.admin("health").is_some_and(|v| v["ready"] == true) {
                return server;
            }
            let child = server.child.as_mut().expect("the child is kept until drop");
            if let Some(status) = child.try_wait().expect("wait on the server") {
                panic!("server exited early with {status}: {}", server.log());
            }
            assert!(Instant::now() < deadline, "server did not become ready: {}", server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The bootstrap socket, as a string for command lines.
    pub fn socket(&self) -> &str {
        self.socket.to_str().expect("temporary paths are UTF-8")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One admin command's answer, or `None` when the admin socket does not answer.
    pub fn admin(&self, cmd: &str) -> Option<Value> {
        use std::io::{BufRead, BufReader, Write};
        let path = orbitkv_proto::admin_socket_path(&self.socket);
        let mut s = std::os::unix::net::UnixStream::connect(path).ok()?;
        s.write_all(format!("{{\"cmd\":\"{cmd}\"}}\n").as_bytes()).ok()?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).ok()?;
        serde_json::from_str(&line).ok()
    }

    /// Sum over the shards of one numeric `stats` field.
    pub fn shard_sum(&self, field: &str) -> u64 {
        let v = self.admin("stats").expect("the server answers stats");
        v["shards"]
            .as_array()
            .unwrap_or_else(|| panic!("stats has a shards list: {v}"))
            .iter()
            .map(|s| s[field].as_u64().unwrap_or_else(|| panic!("shard {field} in {v}")))
            .sum()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        use std::time::{Duration, Instant};
        let Some(mut child) = self.child.take() else { return };
        if let Ok(pid) = i32::try_from(child.id()) {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
