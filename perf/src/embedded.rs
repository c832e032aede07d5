//! A private `orbitkv-server` for one benchmark run: the binary next to this executable, on a
//! temporary socket, stopped (SIGTERM, then SIGKILL) when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::admin;
use crate::error::Error;

/// Longest wait for the server to say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the server to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of the server's log quoted in an error.
const LOG_TAIL: usize = 2000;

/// How to start the embedded server.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    /// `--dram`, in bytes.
    pub dram: u64,
    /// `--shards`; 0 leaves the server's default.
    pub shards: usize,
    /// Pass `--no-lock-arena`.
    pub no_lock_arena: bool,
    /// An SSD tier of (bytes, region bytes) in the server's temporary directory.
    pub ssd: Option<(u64, u64)>,
    /// More flags, as given (e.g. `--hugepages on`).
    pub extra: Vec<String>,
    /// Longest wait for it to be ready (default: 30 s).
    pub ready_timeout: Option<Duration>,
}

/// A running private server; dropping it stops the server and removes its directory.
pub(crate) struct EmbeddedServer {
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
    // Last: removed after the server stopped.
    _dir: tempfile::TempDir,
}

/// The `orbitkv-server` binary that belongs to this `orbitkv-perf`: the one in its directory.
pub(crate) fn server_binary() -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().map_err(|source| Error::Io {
        op: "locating",
        path: "the orbitkv-perf executable".into(),
        source,
    })?;
    let dir = exe
        .parent()
        .ok_or_else(|| Error::Embedded(format!("{} has no parent directory", exe.display())))?;
    let bin = dir.join("orbitkv-server");
    if !bin.is_file() {
        return Err(Error::Embedded(format!(
            "no orbitkv-server binary at {} (--embedded runs the server built next to \
             orbitkv-perf; build it with `cargo build -p orbitkv-server` in the same profile)",
            bin.display()
        )));
    }
    Ok(bin)
}

impl EmbeddedServer {
    /// Starts the server and waits until its admin socket reports it ready.
    pub fn start(opts: Options) -> Result<Self, Error> {
        let bin = server_binary()?;
        let dir = tempfile::Builder::new().prefix("orbitkv-perf-").tempdir_in("/tmp").map_err(
            |source| Error::Io {
                op: "creating a temporary directory in",
                path: "/tmp".into(),
                source,
            },
        )?;
        let socket = dir.path().join("s.sock");
        let log = dir.path().join("server.log");
        let log_file = std::fs::File::create(&log).map_err(|source| Error::Io {
            op: "creating",
            path: log.clone(),
            source,
        })?;
        let mut cmd = Command::new(&bin);
        cmd.arg("--socket").arg(&socket).arg("--dram").arg(opts.dram.to_string());
        if opts.shards > 0 {
            cmd.arg("--shards").arg(opts.shards.to_string());
        }
        if opts.no_lock_arena {
            cmd.arg("--no-lock-arena");
        }
        if let Some((bytes, region)) = opts.ssd {
            cmd.arg("--ssd")
                .arg(bytes.to_string())
                .arg("--ssd-region-size")
                .arg(region.to_string());
            cmd.arg("--ssd-dir").arg(dir.path());
        }
        cmd.args(&opts.extra);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|source| Error::Io { op: "starting", path: bin.clone(), source })?;
        let mut server = Self { child: Some(child), socket, log, _dir: dir };
        server.wait_ready(opts.ready_timeout.unwrap_or(READY_TIMEOUT))?;
        Ok(server)
    }

    /// The server's bootstrap socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(LOG_TAIL);
        let start = (start..text.len()).find(|i| text.is_char_boundary(*i)).unwrap_or(text.len());
        text[start..].trim().to_string()
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match admin::client(&self.socket).health() {
                Ok(h) if h.ready => return Ok(()),
                Ok(h) => serde_json::to_string(&h).expect("health replies serialize to JSON"),
                Err(e) => e.to_string(),
            };
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(Error::Embedded(format!(
                        "exited with {status} before it was ready; its log:\n{}",
                        self.log_tail()
                    )));
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Embedded(format!(
                    "not ready after {timeout:?} (last health: {last}); its log:\n{}",
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for EmbeddedServer {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SIGTERM drains and removes the socket; SIGKILL only if that takes too long.
        if let Ok(pid) = i32::try_from(child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => break,
            }
        }
        eprintln!("orbitkv-perf: embedded server did not stop after SIGTERM; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }
}
