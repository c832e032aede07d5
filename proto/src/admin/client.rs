//! The one client of the admin socket (`<socket>.admin`): a request line out, one answer line
//! back, on a blocking Unix stream with timeouts and a bound on the answer's size.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::admin::reply::{
    AuditReply, EvictReply, HealthReply, PeersReply, RefusalCode, SessionsReply, StartingProgress,
    StateReply, StatsReply,
};
use crate::admin::request::{AdminRequest, EvictTarget};

/// How long the client waits to send its request and for the answer, unless told otherwise
/// ([`AdminClient::with_timeout`]): `stats` asks every shard (2 s each at most), `audit` and
/// `evict` wait up to 8 s for theirs.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest answer read unless told otherwise ([`AdminClient::with_max_answer`]): 16 MiB.
/// A longer one is [`AdminError::TooLong`].
pub const MAX_ANSWER: u64 = 16 << 20;

/// Why an admin request got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// Nothing to connect to at the path (no server, or another socket).
    #[error("cannot reach orbitkv-server admin socket {}: {source}", path.display())]
    Unreachable {
        /// The admin socket.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Sending the request or reading the answer failed, or timed out.
    #[error("admin socket {}: {source}", path.display())]
    Io {
        /// The admin socket.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The answer was not JSON (or the connection closed before a whole line).
    #[error("admin socket {} answered non-JSON: {source}", path.display())]
    NotJson {
        /// The admin socket.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// The answer passed the client's bound ([`MAX_ANSWER`]) without ending its line.
    #[error("admin socket {}: answer longer than {limit} bytes", path.display())]
    TooLong {
        /// The admin socket.
        path: PathBuf,
        /// The bound.
        limit: u64,
    },
    /// The server answered `"ok": false` (or an answer without `"ok": true`).
    #[error("server: {error}")]
    Refused {
        /// The server's message (`unknown error` when it gave none).
        error: String,
        /// Why, for programs.
        code: Option<RefusalCode>,
        /// While the server starts: how far it got.
        starting: Option<StartingProgress>,
    },
    /// An `"ok": true` answer that is not the command's reply (another server version?).
    #[error("admin socket {}: unexpected answer to {cmd}: {source}", path.display())]
    Unexpected {
        /// The admin socket.
        path: PathBuf,
        /// The command asked.
        cmd: &'static str,
        /// What did not fit.
        source: serde_json::Error,
    },
}

/// A client of one admin socket. Each request is its own connection.
#[derive(Clone, Debug)]
pub struct AdminClient {
    path: PathBuf,
    timeout: Duration,
    max_answer: u64,
}

impl AdminClient {
    /// A client of the admin socket at `path` (`admin_socket_path` of the server's socket),
    /// waiting [`ADMIN_TIMEOUT`] at most.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into(), timeout: ADMIN_TIMEOUT, max_answer: MAX_ANSWER }
    }

    /// The same client, waiting `timeout` at most to send a request and for its answer.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// The same client, reading answers of `max_answer` bytes at most.
    pub fn with_max_answer(self, max_answer: u64) -> Self {
        Self { max_answer, ..self }
    }

    /// The admin socket.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends `request` (any JSON: tests send malformed ones) as one line and returns the
    /// answer as it came, whatever its `"ok"` says.
    pub fn send(&self, request: &Value) -> Result<Value, AdminError> {
        self.exchange(request.to_string())
    }

    /// Sends `request`; its answer, which says `"ok": true` (else [`AdminError::Refused`]).
    pub fn request(&self, request: &AdminRequest) -> Result<Value, AdminError> {
        let line = serde_json::to_string(request).expect("admin requests serialize to JSON");
        let answer = self.exchange(line)?;
        if answer.get("ok") != Some(&Value::Bool(true)) {
            return Err(refusal(&answer));
        }
        Ok(answer)
    }

    /// `answer` (an ok answer to `request`) as the reply type `R`.
    pub fn read<R: DeserializeOwned>(
        &self,
        request: &AdminRequest,
        answer: &Value,
    ) -> Result<R, AdminError> {
        R::deserialize(answer).map_err(|source| AdminError::Unexpected {
            path: self.path.clone(),
            cmd: request.cmd(),
            source,
        })
    }

    /// Sends `request` and reads its ok answer as `R`.
    fn call<R: DeserializeOwned>(&self, request: AdminRequest) -> Result<R, AdminError> {
        let answer = self.request(&request)?;
        self.read(&request, &answer)
    }

    /// `health`.
    pub fn health(&self) -> Result<HealthReply, AdminError> {
        self.call(AdminRequest::Health)
    }

    /// `stats`, the part programs read (all of it: [`AdminClient::request`]).
    pub fn stats(&self) -> Result<StatsReply, AdminError> {
        self.call(AdminRequest::Stats)
    }

    /// `drain`: the server stops admitting sessions and writes.
    pub fn drain(&self) -> Result<StateReply, AdminError> {
        self.call(AdminRequest::Drain)
    }

    /// `resume`: the server admits them again.
    pub fn resume(&self) -> Result<StateReply, AdminError> {
        self.call(AdminRequest::Resume)
    }

    /// `sessions`.
    pub fn sessions(&self) -> Result<SessionsReply, AdminError> {
        self.call(AdminRequest::Sessions)
    }

    /// `peers` (refused by a standalone server).
    pub fn peers(&self) -> Result<PeersReply, AdminError> {
        self.call(AdminRequest::Peers)
    }

    /// `audit`: refused, with the count and the first problem, when anything does not add up.
    pub fn audit(&self) -> Result<AuditReply, AdminError> {
        self.call(AdminRequest::Audit)
    }

    /// `evict`: refused when a shard did not answer in time.
    pub fn evict(&self, target: EvictTarget) -> Result<EvictReply, AdminError> {
        self.call(AdminRequest::Evict(target))
    }

    /// One connection: `line` out, one line back, parsed.
    fn exchange(&self, mut line: String) -> Result<Value, AdminError> {
        let stream = UnixStream::connect(&self.path)
            .map_err(|source| AdminError::Unreachable { path: self.path.clone(), source })?;
        let io = |source| AdminError::Io { path: self.path.clone(), source };
        stream.set_read_timeout(Some(self.timeout)).map_err(io)?;
        stream.set_write_timeout(Some(self.timeout)).map_err(io)?;
        line.push('\n');
        (&stream).write_all(line.as_bytes()).map_err(io)?;
        let mut answer = Vec::new();
        BufReader::new((&stream).take(self.max_answer))
            .read_until(b'\n', &mut answer)
            .map_err(io)?;
        if answer.len() as u64 == self.max_answer && answer.last() != Some(&b'\n') {
            return Err(AdminError::TooLong { path: self.path.clone(), limit: self.max_answer });
        }
        serde_json::from_slice(&answer)
            .map_err(|source| AdminError::NotJson { path: self.path.clone(), source })
    }
}

/// The refusal an answer without `"ok": true` says.
fn refusal(answer: &Value) -> AdminError {
    AdminError::Refused {
        error: answer.get("error").and_then(Value::as_str).unwrap_or("unknown error").to_owned(),
        code: member(answer, "code"),
        starting: member(answer, "starting"),
    }
}

/// A member of `answer` as `T`; None when absent or of another shape.
fn member<T: DeserializeOwned>(answer: &Value, name: &str) -> Option<T> {
    answer.get(name).and_then(|v| T::deserialize(v).ok())
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::thread::JoinHandle;

    use super::*;
    use crate::admin::reply::ServerState;

    /// A one-connection admin socket in a temporary directory: it reads the request line,
    /// answers `answer` (as is), and returns the request it read.
    fn serve_once(answer: &'static [u8]) -> (tempfile::TempDir, AdminClient, JoinHandle<String>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock.admin");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).unwrap();
            (&stream).write_all(answer).unwrap();
            line
        });
        (dir, AdminClient::new(path).with_timeout(Duration::from_secs(5)), server)
    }

    #[test]
    fn an_ok_answer_is_the_typed_reply() {
        let (_dir, client, server) = serve_once(b"{\"ok\":true,\"state\":\"drained\"}\n");
        let reply = client.drain().unwrap();
        assert_eq!(reply, StateReply { ok: true, state: ServerState::Drained });
        assert_eq!(server.join().unwrap(), "{\"cmd\":\"drain\"}\n");

        let (_dir, client, server) = serve_once(
            b"{\"ok\":true,\"namespace\":7,\"removed\":3,\"busy\":1,\"not_durable\":0,\
                         \"shards\":[{\"id\":0,\"removed\":3,\"busy\":1,\"not_durable\":0},\
                         {\"id\":1,\"answering\":false}]}\n",
        );
        let reply = client.evict(EvictTarget::Namespace(7)).unwrap();
        assert_eq!((reply.removed, reply.busy, reply.namespace), (3, 1, Some(7)));
        assert_eq!(reply.shards[0].answer.map(|s| s.removed), Some(3));
        assert_eq!((reply.shards[1].id, reply.shards[1].answer), (1, None));
        let sent: Value = serde_json::from_str(&server.join().unwrap()).unwrap();
        assert_eq!(sent, serde_json::json!({"cmd": "evict", "namespace": 7}));
    }

    #[test]
    fn an_ok_false_answer_is_refused_with_the_message() {
        let (_dir, client, _server) = serve_once(
            b"{\"ok\":false,\"code\":\"permission_denied\",\"error\":\"uid 7 may not drain\"}\n",
        );
        let e = client.drain().unwrap_err();
        assert!(
            matches!(&e, AdminError::Refused { error, code: Some(RefusalCode::PermissionDenied), starting: None }
                if error == "uid 7 may not drain"),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "server: uid 7 may not drain");

        let (_dir, client, _server) = serve_once(
            b"{\"ok\":false,\"code\":\"starting\",\"error\":\"the server is starting\",\"starting\":\
              {\"phase\":\"populate_arena\",\"percent\":42,\"populated_bytes\":42,\
              \"arena_bytes\":100,\"seconds\":1.5,\"told_to_wait\":0}}\n",
        );
        match client.request(&AdminRequest::Stats).unwrap_err() {
            AdminError::Refused {
                code: Some(RefusalCode::Starting), starting: Some(p), ..
            } => {
                assert_eq!((p.phase.as_str(), p.percent), ("populate_arena", 42));
            }
            e => panic!("{e:?}"),
        }
        // An answer that does not say ok is no answer either.
        let (_dir, client, _server) = serve_once(b"[1,2]\n");
        let e = client.health().unwrap_err();
        assert!(
            matches!(&e, AdminError::Refused { error, .. } if error == "unknown error"),
            "{e:?}"
        );
        // `send` hands any answer back as it came.
        let (_dir, client, server) =
            serve_once(b"{\"ok\":false,\"error\":\"unknown command \\\"x\\\"\"}\n");
        let answer = client.send(&serde_json::json!({"cmd": "x"})).unwrap();
        assert_eq!(answer["error"], "unknown command \"x\"");
        assert_eq!(server.join().unwrap(), "{\"cmd\":\"x\"}\n");
    }

    #[test]
    fn garbage_is_not_json_and_a_wrong_shape_is_unexpected() {
        let (_dir, client, _server) = serve_once(b"hello\n");
        let e = client.health().unwrap_err();
        assert!(matches!(e, AdminError::NotJson { .. }), "{e:?}");
        assert!(e.to_string().contains("s.sock.admin answered non-JSON"), "{e}");
        // Closed without a line.
        let (_dir, client, _server) = serve_once(b"");
        assert!(matches!(client.health(), Err(AdminError::NotJson { .. })));
        // Ok, but not a health reply.
        let (_dir, client, _server) = serve_once(b"{\"ok\":true,\"ready\":\"yes\"}\n");
        let e = client.health().unwrap_err();
        assert!(matches!(e, AdminError::Unexpected { cmd: "health", .. }), "{e:?}");
    }

    #[test]
    fn an_answer_past_the_bound_is_too_long() {
        let (_dir, client, _server) = serve_once(b"{\"ok\":true,\"state\":\"serving\"}\n");
        let e = client.with_max_answer(16).resume().unwrap_err();
        assert!(matches!(e, AdminError::TooLong { limit: 16, .. }), "{e:?}");
        // At the bound exactly, with its newline, it is read.
        let (_dir, client, _server) = serve_once(b"{\"ok\":true,\"state\":\"serving\"}\n");
        let reply = client.with_max_answer(30).resume().unwrap();
        assert_eq!(reply.state, ServerState::Serving);
    }

    #[test]
    fn nothing_listening_is_unreachable() {
        let dir = tempfile::tempdir().unwrap();
        let client = AdminClient::new(dir.path().join("none.sock.admin"));
        let e = client.health().unwrap_err();
        assert!(
            matches!(&e, AdminError::Unreachable { path, .. } if path.ends_with("none.sock.admin"))
        );
        assert!(e.to_string().starts_with("cannot reach orbitkv-server admin socket "), "{e}");
    }

    #[test]
    fn a_silent_server_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock.admin");
        let _listener = UnixListener::bind(&path).unwrap();
        let client = AdminClient::new(path).with_timeout(Duration::from_millis(50));
        // Connected (the backlog holds it), never answered.
        let e = client.health().unwrap_err();
        assert!(matches!(e, AdminError::Io { .. }), "{e:?}");
    }
}
