//! The integration tests' shared helpers (server, ctl and perf use this crate as a
//! dev-dependency only): start the real `orbitkv-server` on a temporary socket
//! ([`TestServer`]), admin requests, namespaces and keys, helper processes; [`etcd`] for the
//! cluster-mode tests, [`gpu`] for the CUDA ones.
//!
//! The server binary is the one cargo built beside the running test ([`server_bin`]): the
//! server package's own tests have cargo build it (with the package's features, `failpoints`
//! say); other packages' tests need it built first (`cargo test --workspace` does).

pub mod etcd;
pub mod gpu;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use orbitkv_client::{ChunkKey, Client, ClientOptions, Dtype, NamespaceDescriptor};
use orbitkv_proto::admin::{AdminClient, AdminError};
use serde_json::Value;

/// How long an admin request of a test waits (the server's own bounds are 8 s at most; the
/// rest is room for a loaded machine).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

pub struct TestServer {
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

impl TestServer {
    /// As [`TestServer::start`], with environment variables `env` (for example the
    /// failpoints of a `failpoints` build: `FAILPOINTS`).
    pub fn start_env(env: &[(&str, &str)], args: &[&str]) -> TestServer {
        let dir = tempfile::Builder::new().prefix("okv").tempdir_in("/tmp").unwrap();
        let socket = dir.path().join("s.sock");
        let mut s = TestServer { child: None, dir, socket };
        s.spawn_env(env, args);
        s
    }

    /// Starts the server with `args` (plus `--socket`) and waits until it serves.
    pub fn start(args: &[&str]) -> TestServer {
        let dir = tempfile::Builder::new().prefix("okv").tempdir_in("/tmp").unwrap();
        Self::start_at(dir, "s.sock", args)
    }

    /// As [`TestServer::start`], in a given directory with the socket `name` (which a client
    /// made before the server may already hold).
    pub fn start_at(dir: tempfile::TempDir, name: &str, args: &[&str]) -> TestServer {
        let socket = dir.path().join(name);
        let mut s = TestServer { child: None, dir, socket };
        s.spawn(args);
        s
    }

    pub fn spawn(&mut self, args: &[&str]) {
        self.spawn_env(&[], args)
    }

    /// Starts the server with `env` and `args` (plus `--socket`) and returns at once, before
    /// it serves ([`TestServer::wait_ready`] waits).
    pub fn launch_env(env: &[(&str, &str)], args: &[&str]) -> TestServer {
        let dir = tempfile::Builder::new().prefix("okv").tempdir_in("/tmp").unwrap();
        let socket = dir.path().join("s.sock");
        let mut s = TestServer { child: None, dir, socket };
        s.launch(env, args);
        s
    }

    /// As [`TestServer::spawn`], with environment variables `env`.
    pub fn spawn_env(&mut self, env: &[(&str, &str)], args: &[&str]) {
        self.launch(env, args);
        self.wait_ready();
    }

    fn launch(&mut self, env: &[(&str, &str)], args: &[&str]) {
        let log = std::fs::File::create(self.dir.path().join("server.log")).unwrap();
        let child = Command::new(server_bin())
            .envs(env.iter().copied())
            .arg("--socket")
            .arg(&self.socket)
            .args(["--no-lock-arena"])
            .args(args)
            // The SSD ring's descriptor (debug) goes into the log, for the failure dump.
            .env("ORBITKV_LOG", "info,orbitkv_ssd::ring=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Waits (up to 20 s) until the server says it is ready.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(v) = self.try_admin("health") {
                if v["ready"] == true {
                    return;
                }
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("server exited early with {status}: {}", self.log());
            }
            assert!(Instant::now() < deadline, "server did not become ready: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    pub fn admin_path(&self) -> PathBuf {
        orbitkv_proto::admin_socket_path(&self.socket)
    }

    /// The admin client of this server.
    pub fn admin_client(&self) -> AdminClient {
        AdminClient::new(self.admin_path()).with_timeout(ADMIN_TIMEOUT)
    }

    /// `{"cmd": cmd}` on the admin socket; the answer as it came (`"ok"` true or not).
    pub fn try_admin(&self, cmd: &str) -> std::io::Result<Value> {
        self.try_admin_request(&serde_json::json!({ "cmd": cmd }))
    }

    /// One admin request with arguments (`{"cmd": ..., ...}`, any JSON); the answer as it
    /// came (`"ok"` true or not).
    pub fn try_admin_request(&self, request: &Value) -> std::io::Result<Value> {
        self.admin_client().send(request).map_err(|e| match e {
            AdminError::Unreachable { source, .. } | AdminError::Io { source, .. } => source,
            other => std::io::Error::other(other),
        })
    }

    /// [`TestServer::try_admin`], which must get an answer.
    pub fn admin(&self, cmd: &str) -> Value {
        self.try_admin(cmd).unwrap()
    }

    /// Sum of a per-shard stats field.
    pub fn shard_sum(&self, field: &str) -> u64 {
        let v = self.admin("stats");
        v["shards"].as_array().unwrap().iter().map(|s| s[field].as_u64().unwrap()).sum()
    }

    /// Polls until `f` holds or 10 s pass.
    pub fn wait_for(&self, what: &str, mut f: impl FnMut(&TestServer) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {}",
                self.admin("stats")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn client(&self, name: &str) -> Client {
        Client::connect(ClientOptions {
            name: name.into(),
            ..ClientOptions::with_socket(&self.socket)
        })
        .unwrap()
    }

    pub fn client_try(&self) -> Result<Client, orbitkv_client::Error> {
        Client::connect(ClientOptions::with_socket(&self.socket))
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).unwrap();
    }

    /// SIGTERM, then wait (up to 20 s) for the exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        self.wait_exit(Duration::from_secs(20))
    }

    /// SIGSTOP, then wait until every thread of the server is stopped.
    pub fn freeze(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
        let deadline = Instant::now() + Duration::from_secs(10);
        let task_dir = format!("/proc/{}/task", self.pid());
        loop {
            let all_stopped = std::fs::read_dir(&task_dir).unwrap().flatten().all(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the parenthesised command name.
                stat.rsplit(") ").next().is_some_and(|rest| rest.starts_with('T'))
            });
            if all_stopped {
                return;
            }
            assert!(Instant::now() < deadline, "server did not stop");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return s;
            }
            assert!(Instant::now() < deadline, "server did not exit: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The bootstrap socket as a string, for command lines.
    pub fn socket_str(&self) -> &str {
        self.socket.to_str().expect("temporary paths are UTF-8")
    }
}

impl Drop for TestServer {
    /// SIGTERM first (the server removes its shared-memory files), SIGKILL after 5 s. When the
    /// test is failing, the server's log is printed first (the harness shows it with the
    /// failure; the temporary directory that holds it goes with the test).
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- server log ({}) ---\n{}", self.socket.display(), self.log());
            if let Some(c) = &self.child {
                for _ in 0..2 {
                    match self.try_admin("stats") {
                        Ok(v) => eprintln!("--- server stats ---\n{v}"),
                        Err(e) => eprintln!("--- server stats: {e} ---"),
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
                // What each server thread is doing (state and kernel wait channel).
                let tasks = format!("/proc/{}/task", c.id());
                for t in std::fs::read_dir(&tasks).into_iter().flatten().flatten() {
                    let p = t.path();
                    let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
                    let stat = read("stat");
                    let state = stat.rsplit(')').next().unwrap_or("").split_whitespace().next();
                    // `syscall`: the number and arguments of a blocking call (the fd an
                    // io_uring_enter waits on, to tell glommio's rings from the SSD ring).
                    eprintln!(
                        "thread {} {:?} state {:?} wchan {} syscall {}",
                        t.file_name().to_string_lossy(),
                        read("comm").trim(),
                        state,
                        read("wchan"),
                        read("syscall").trim()
                    );
                }
                // Where in user space, when gdb is installed (it is not needed otherwise).
                let bt = Command::new("gdb")
                    .args(["-batch", "-p", &c.id().to_string(), "-ex", "thread apply all bt 30"])
                    .stdin(Stdio::null())
                    .output();
                if let Ok(out) = bt {
                    eprintln!("--- gdb backtraces ---\n{}", String::from_utf8_lossy(&out.stdout));
                }
            }
        }
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A namespace whose chunks are `tokens * 4 KiB` bytes at most.
pub fn namespace(tokens_per_chunk: u32) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: "test/model".into(),
        dtype: Dtype::Fp32,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 512,
        kv_tensors: 2,
        tokens_per_chunk,
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    }
}

/// The `i`-th chunk key of a chain of `n` chunks of 16 tokens starting at token `seed`.
pub fn chain(ns: u64, seed: u32, n: usize) -> Vec<ChunkKey> {
    let tokens: Vec<u32> =
        (0..n as u32 * 16).map(|t| t.wrapping_mul(2654435761).wrapping_add(seed)).collect();
    orbitkv_client::prefix_digests(&tokens, 16, b"")
        .into_iter()
        .map(|d| ChunkKey::new(ns, d))
        .collect()
}

/// Puts `keys` with their [`value_for`] bytes of `len` each; panics if the put call fails.
pub fn put_values(c: &mut Client, keys: &[ChunkKey], len: usize) {
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, len)).collect();
    let items: Vec<_> = keys.iter().zip(&vals).map(|(k, v)| (*k, v.as_slice())).collect();
    c.put(&items).unwrap();
}

/// Deterministic bytes for a key.
pub fn value_for(key: &ChunkKey, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = u64::from_le_bytes(key.digest[..8].try_into().unwrap()) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Pings until `c` has reconnected to a server that is up again: a client whose connect
/// attempts failed while the server was down backs off (calls fail fast as `Unavailable` until
/// its next attempt is due), so the first call after a restart may not reconnect yet. Any
/// other error, or no reconnect within 10 s, fails the test.
pub fn reconnect(c: &mut Client) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.ping() {
            Ok(()) => return,
            Err(e) if e.is_unavailable() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("no reconnect: {e}"),
        }
    }
}

/// Runs the ignored test `helper` of this test binary as uid and gid 65534 (nobody), with
/// `env` = the server's socket, and returns, for each of `prefixes`, the first line of its
/// output holding it (from the prefix on). None (saying so) when this process is not root.
pub fn run_as_nobody(
    server: &TestServer,
    helper: &str,
    env: &str,
    prefixes: &[&str],
) -> Option<Vec<String>> {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !nix::unistd::getuid().is_root() {
        println!("skipped: switching to uid 65534 needs root");
        return None;
    }
    std::fs::set_permissions(server.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", helper, "--nocapture", "--test-threads", "1"])
        .env(env, &server.socket)
        .env("HOME", "/tmp")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines = prefixes
        .iter()
        .map(|p| {
            stdout.lines().find_map(|l| l.find(p).map(|i| l[i..].to_string())).unwrap_or_else(
                || panic!("no {p} line: {stdout} {}", String::from_utf8_lossy(&out.stderr)),
            )
        })
        .collect();
    Some(lines)
}

/// The server binary the tests start: the one named by `ORBITKV_TEST_SERVER_BIN` (a test binary
/// run on another machine, e.g. a CUDA host without a Rust toolchain, with a release build of
/// the server beside it), else the one cargo built into the running test's target directory
/// (`<target>/<profile>/orbitkv-server`, the parent of the test's `deps/`): for the server
/// package's own tests cargo builds it, with the features they run with (`failpoints`). It is
/// another package's binary for ctl's and perf's tests, so `cargo test -p orbitkv-ctl` alone
/// does not build it: fail (not skip) with the fix.
pub fn server_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("ORBITKV_TEST_SERVER_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("the running test's path");
    let mut dir = exe.parent().expect("a test binary lives in a target directory");
    if dir.file_name().is_some_and(|name| name == "deps") {
        dir = dir.parent().expect("deps/ lives in a target directory");
    }
    let bin = dir.join("orbitkv-server");
    assert!(
        bin.is_file(),
        "no orbitkv-server binary at {}: these tests run the real server from their target \
         directory. Run `cargo test --workspace`, or `cargo build -p orbitkv-server` (same \
         profile) first, or name a server binary with ORBITKV_TEST_SERVER_BIN.",
        bin.display()
    );
    bin
}

/// Runs the ignored test `helper` of this test binary as a child process with `env` (a client
/// that takes holdings, says `marker` on stdout and waits to be killed); returns once it has
/// said so.
pub fn helper_process(helper: &str, env: (&str, &Path), marker: &str) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", helper, "--nocapture", "--test-threads", "1"])
        .env(env.0, env.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().contains(marker)), "{helper} never said {marker}");
    child
}

/// Kills `child` with SIGKILL and reaps it.
pub fn kill9(mut child: Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();
}
