//! One session: the bootstrap socket, the mapped arena, and the iceoryx2 client port.

use std::collections::VecDeque;
use std::io::IoSliceMut;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use iceoryx2::pending_response::PendingResponse;
use iceoryx2::port::client::Client as IoxClient;
use iceoryx2::prelude::*;
use iceoryx2::service::port_factory::request_response::PortFactory;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use orbitkv_proto::{
    decode, encode, read_frame, write_frame, Bootstrap, ChunkOutcome, Request, Response, Welcome,
    PROTOCOL_VERSION,
};

use crate::mapping::ArenaMap;
use crate::{ClientOptions, Error};

/// Thread-safe flavour so that a `Client` can move between threads (engines hand sessions to
/// worker threads); the server side of the same service uses the single-threaded flavour.
type Svc = ipc_threadsafe::Service;
/// The session's request-response service and its client port.
type SessionService = PortFactory<Svc, [u8], (), [u8], ()>;
type SessionPort = IoxClient<Svc, [u8], (), [u8], ()>;
/// A request in flight.
type Pending = PendingResponse<Svc, [u8], (), [u8], ()>;

/// A request sent and not yet answered (started by the caller). It counts against the
/// session's requests in flight while held; dropped before its answer came, it still runs on
/// the server, so it goes to its connection, which collects its answer as it does a deferred
/// request's (counted in flight until then, a failure logged and counted).
pub(crate) struct PendingAnswer {
    /// Taken only by `drop`.
    pending: Option<Pending>,
    op: &'static str,
    /// Its answer arrived (taken by `poll` or `wait_answer`).
    answered: AtomicBool,
    started: Weak<Started>,
}

impl PendingAnswer {
    fn pending(&self) -> &Pending {
        self.pending.as_ref().expect("taken only when dropped")
    }
}

impl Drop for PendingAnswer {
    fn drop(&mut self) {
        // A connection already gone has nothing left to count.
        let Some(started) = self.started.upgrade() else { return };
        if let Some(pending) =
            self.pending.take().filter(|_| !self.answered.load(Ordering::Relaxed))
        {
            // Handed over before the count goes down: for a moment the connection may count
            // it twice, never not at all.
            started.dropped.lock().unwrap_or_else(|e| e.into_inner()).push((pending, self.op));
        }
        started.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection shares with the requests the caller started: how many the caller holds,
/// and those dropped before their answer, for the connection to collect.
#[derive(Default)]
struct Started {
    held: AtomicUsize,
    dropped: Mutex<Vec<(Pending, &'static str)>>,
}

/// Requests a session may still send: `max_deferred + 1` in flight in all (the server's
/// `max_inflight`), less the deferred and the started ones.
fn unused_slots(max_deferred: usize, deferred: usize, started: usize) -> usize {
    (max_deferred + 1).saturating_sub(deferred + started)
}

/// [`unused_slots`], at least 1: the window of a pipelined transfer, whose first request then
/// waits for room or is refused ([`room`]).
fn free_slots(max_deferred: usize, deferred: usize, started: usize) -> usize {
    unused_slots(max_deferred, deferred, started).max(1)
}

/// What to do before sending one more request, with `max_deferred + 1` allowed in flight (the
/// server's `max_inflight`: the transport refuses a request beyond it, and a refused send
/// would end the session), `deferred` releases and `started` requests the caller holds.
#[derive(Debug, PartialEq, Eq)]
enum Room {
    /// It fits.
    Free,
    /// Wait for the oldest deferred release's answer first.
    WaitOldest,
    /// The caller's started requests alone fill the session: refuse this one.
    Full,
}

fn room(max_deferred: usize, deferred: usize, started: usize) -> Room {
    if unused_slots(max_deferred, deferred, started) > 0 {
        Room::Free
    } else if deferred > 0 {
        Room::WaitOldest
    } else {
        Room::Full
    }
}

/// How often a waiting call checks that the server is still there.
const LIVENESS_CHECK: Duration = Duration::from_millis(1);
/// How long an answer from the server (or a passed check) stands for its being there: calls
/// within this skip the socket poll, a system call, before sending. A server gone inside the
/// window is still noticed by a waiting call's own checks, which fail it as disconnected; a
/// deferred request (a release) sent inside the window is not waited for, and its loss shows
/// at the next call, which finds the session gone.
const PROOF_OF_LIFE: Duration = Duration::from_micros(500);
/// Spin this long on a pending response before napping.
const SPIN: Duration = Duration::from_micros(50);

pub(crate) struct Connection {
    stream: UnixStream,
    /// When the server last proved to be there (an answer, or a passed check).
    last_alive: std::cell::Cell<Instant>,
    pub(crate) session_id: u64,
    pub(crate) max_keys_per_request: u32,
    pub(crate) max_request_bytes: u64,
    pub(crate) arena: ArenaMap,
    /// Requests sent without waiting (releases) and started ones the caller dropped before
    /// their answer, oldest first.
    deferred: VecDeque<(Pending, &'static str)>,
    max_deferred: usize,
    /// Requests started by the caller ([`PendingAnswer`]): held, and dropped unanswered.
    started: Arc<Started>,
    /// Deferred requests that failed (a counter for the caller; each is also logged).
    pub(crate) deferred_failures: u64,
    home_shard: u32,
    /// The home shard's eventfd.
    doorbell: OwnedFd,
    // Field order matters on drop: port before service before node.
    port: SessionPort,
    _service: SessionService,
    _node: Node<Svc>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("session_id", &self.session_id).finish_non_exhaustive()
    }
}

fn ipc_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Ipc(format!("{what}: {e:?}"))
}

/// Reads the server's welcome and the descriptors it carried. `wrote` is how writing the
/// hello went, reported when the server closed without a word.
fn receive_welcome(
    stream: &UnixStream,
    (socket, timeout): (&std::path::Path, Duration),
    wrote: std::io::Result<()>,
) -> Result<(Welcome, Vec<OwnedFd>), Error> {
    let connect_err = |source: std::io::Error| Error::Connect { socket: socket.to_owned(), source };
    // The welcome carries the arena's memfds and the doorbell eventfd on its first bytes.
    let mut buf = vec![0u8; 4096];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; orbitkv_proto::MAX_ARENA_FILES + 1]);
    let (got, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| {
            connect_err(if e == nix::errno::Errno::EAGAIN {
                // The socket's read timeout: the server took the connection and never
                // answered its hello.
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no welcome from the server within {timeout:?}"),
                )
            } else {
                e.into()
            })
        })?;
        let mut fds = Vec::new();
        for c in msg.cmsgs().map_err(|e| connect_err(e.into()))? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // Own every received descriptor so none leaks.
                fds.extend(raw.into_iter().map(crate::mapping::adopt_received_fd));
            }
        }
        (msg.bytes, fds)
    };
    if got == 0 {
        return Err(match wrote {
            Err(e) => connect_err(e),
            Ok(()) => Error::Disconnected("server closed the socket during bootstrap".into()),
        });
    }
    buf.truncate(got);
    let body = read_frame(&mut &*stream, buf).map_err(connect_err)?;
    let welcome = decode::<Welcome>(&body).map_err(|e| Error::Protocol(e.to_string()))?;
    Ok((welcome, fds))
}

/// What the server's welcome gave an admitted client.
struct Admitted {
    session_id: u64,
    home_shard: u32,
    arena_bytes: u64,
    arena_files: Vec<u64>,
    iox_root: String,
    iox_prefix: String,
    service_name: String,
    max_request_bytes: u64,
    max_keys_per_request: u32,
    /// Requests that may wait unanswered besides the one being made.
    max_deferred: usize,
}

impl Admitted {
    /// The admission, or the server's refusal, or a protocol mismatch, as an error.
    fn from_welcome(welcome: Welcome) -> Result<Self, Error> {
        match welcome {
            Welcome::Refused { code, message } => Err(Error::Refused { code, message }),
            Welcome::Starting { message, retry_after_ms, .. } => Err(Error::Starting {
                message,
                retry_in: Duration::from_millis(u64::from(retry_after_ms)),
            }),
            Welcome::Accepted { protocol_version, .. } if protocol_version != PROTOCOL_VERSION => {
                Err(Error::Protocol(format!(
                    "server speaks protocol {protocol_version}, client {PROTOCOL_VERSION}"
                )))
            }
            Welcome::Accepted {
                session_id,
                home_shard,
                arena_bytes,
                arena_files,
                iox_root,
                iox_prefix,
                service_name,
                max_request_bytes,
                max_keys_per_request,
                max_inflight,
                ..
            } => Ok(Self {
                session_id,
                home_shard,
                arena_bytes,
                arena_files,
                iox_root,
                iox_prefix,
                service_name,
                max_request_bytes,
                max_keys_per_request,
                max_deferred: (max_inflight as usize).saturating_sub(1),
            }),
        }
    }
}

/// The session's iceoryx2 node, its service and the client port its requests go through.
fn open_port(admitted: &Admitted) -> Result<(Node<Svc>, SessionService, SessionPort), Error> {
    // iceoryx2 logs through its own logger; keep it to errors unless IOX2_LOG_LEVEL says
    // otherwise, so that an engine's stderr is not flooded when the server goes away.
    set_log_level_from_env_or(LogLevel::Error);
    let mut cfg = Config::default();
    let root = iceoryx2::prelude::Path::new(admitted.iox_root.as_bytes())
        .map_err(|e| ipc_err("root path", e))?;
    cfg.global.set_root_path(&root);
    cfg.global.prefix =
        FileName::new(admitted.iox_prefix.as_bytes()).map_err(|e| ipc_err("prefix", e))?;
    let node_name = NodeName::new(&format!("orbitkv-client-{}", std::process::id()))
        .map_err(|e| ipc_err("node name", e))?;
    let node = NodeBuilder::new()
        .name(&node_name)
        .config(&cfg)
        .create::<Svc>()
        .map_err(|e| ipc_err("node", e))?;
    let svc_name =
        ServiceName::new(&admitted.service_name).map_err(|e| ipc_err("service name", e))?;
    let service = node
        .service_builder(&svc_name)
        .request_response::<[u8], [u8]>()
        .open()
        .map_err(|e| ipc_err("opening session service", e))?;
    let port = service
        .client_builder()
        .initial_max_slice_len(4096)
        .allocation_strategy(AllocationStrategy::PowerOfTwo)
        .create()
        .map_err(|e| ipc_err("client port", e))?;
    Ok((node, service, port))
}

impl Connection {
    /// Connects to the server's bootstrap socket, is admitted (the welcome brings the arena and
    /// the home shard's doorbell), maps the arena and opens the session's request port.
    pub(crate) fn open(opts: &ClientOptions) -> Result<Self, Error> {
        let (socket, timeout) = (opts.socket.as_path(), opts.request_timeout);
        let stream = UnixStream::connect(socket)
            .map_err(|source| Error::Connect { socket: socket.to_owned(), source })?;
        let connect_err =
            |source: std::io::Error| Error::Connect { socket: socket.to_owned(), source };
        stream.set_read_timeout(Some(timeout)).map_err(connect_err)?;
        let hello = Bootstrap::Hello {
            protocol_version: PROTOCOL_VERSION,
            client_name: opts.name.as_str().into(),
        };
        // A server that refuses early may close before our write lands; its refusal is still
        // waiting to be read, so a failed write is only reported if there is nothing to read.
        let wrote = write_frame(&mut &stream, &encode(&hello));
        let (welcome, fds) = receive_welcome(&stream, (socket, timeout), wrote)?;
        let admitted = Admitted::from_welcome(welcome)?;
        // The arena's memfds, then the doorbell eventfd.
        let mut arena_fds = fds;
        let Some(doorbell) = arena_fds.pop().filter(|_| !arena_fds.is_empty()) else {
            return Err(Error::Protocol(
                "welcome carried no arena and doorbell descriptors".into(),
            ));
        };
        let arena = ArenaMap::new(
            arena_fds,
            &admitted.arena_files,
            admitted.arena_bytes,
            opts.prefault_arena,
        )
        .map_err(Error::from)?;
        arena.doorbell(admitted.home_shard).map_err(Error::from)?;
        stream.set_read_timeout(None).map_err(connect_err)?;
        let (node, service, port) = open_port(&admitted)?;
        Ok(Self {
            stream,
            last_alive: std::cell::Cell::new(Instant::now()),
            session_id: admitted.session_id,
            max_keys_per_request: admitted.max_keys_per_request,
            max_request_bytes: admitted.max_request_bytes,
            arena,
            deferred: VecDeque::new(),
            max_deferred: admitted.max_deferred,
            started: Arc::default(),
            deferred_failures: 0,
            home_shard: admitted.home_shard,
            doorbell,
            port,
            _service: service,
            _node: node,
        })
    }

    /// True while the server holds the session open: it answered or passed a check within
    /// [`PROOF_OF_LIFE`], or its socket shows no EOF or error now.
    pub(crate) fn recently_alive(&self) -> bool {
        self.last_alive.get().elapsed() < PROOF_OF_LIFE || self.alive()
    }

    /// True while the server holds the session open (no EOF or error on the socket).
    pub(crate) fn alive(&self) -> bool {
        let mut fds = [PollFd::new(self.stream.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => {
                self.last_alive.set(Instant::now());
                true
            }
            Ok(_) => {
                // Readable means EOF or an error: the server never sends after the welcome.
                false
            }
            Err(_) => false,
        }
    }

    /// Sends one request and waits for its response.
    pub(crate) fn call(&mut self, req: &Request, timeout: Duration) -> Result<Response, Error> {
        let bytes = self.encode_checked(req)?;
        self.call_bytes(&bytes, req.op_name(), timeout)
    }

    /// Encodes a request, refusing one over the server's size limit.
    fn encode_checked(&self, req: &Request) -> Result<impl std::ops::Deref<Target = [u8]>, Error> {
        let bytes = encode(req);
        if bytes.len() as u64 > self.max_request_bytes {
            return Err(Error::InvalidArgument(format!(
                "{} request of {} bytes exceeds the server's {}-byte limit",
                req.op_name(),
                bytes.len(),
                self.max_request_bytes
            )));
        }
        Ok(bytes)
    }

    /// Sends already-encoded request bytes (any bytes) and waits for the response.
    pub(crate) fn call_bytes(
        &mut self,
        bytes: &[u8],
        op: &'static str,
        timeout: Duration,
    ) -> Result<Response, Error> {
        self.reap_deferred();
        self.make_room(op, timeout)?;
        let pending = self.send(bytes)?;
        self.wait(&pending, op, timeout)
    }

    /// Makes room for one more request among those in flight (see [`Room`]): waits for the
    /// oldest deferred releases while they are in the way; refuses, leaving the session as it
    /// is, when the requests the caller started and still holds fill it.
    fn make_room(&mut self, op: &'static str, timeout: Duration) -> Result<(), Error> {
        loop {
            self.take_dropped();
            let started = self.started.held.load(Ordering::Relaxed);
            match room(self.max_deferred, self.deferred.len(), started) {
                Room::Free => return Ok(()),
                Room::WaitOldest => {
                    let (pending, was) =
                        self.deferred.pop_front().expect("WaitOldest: one deferred");
                    let answer = self.wait(&pending, was, timeout)?;
                    self.check_deferred(was, answer);
                }
                Room::Full => {
                    return Err(Error::InvalidArgument(format!(
                        "{op}: the {started} requests started and not yet taken fill the \
                         session's {} in flight; take or drop one first",
                        self.max_deferred + 1
                    )))
                }
            }
        }
    }

    /// Sends a request and returns its pending answer (for [`Connection::poll`] or
    /// [`Connection::wait`]).
    pub(crate) fn start(
        &mut self,
        req: &Request,
        timeout: Duration,
    ) -> Result<PendingAnswer, Error> {
        let bytes = self.encode_checked(req)?;
        self.reap_deferred();
        self.make_room(req.op_name(), timeout)?;
        let pending = self.send(&bytes)?;
        self.started.held.fetch_add(1, Ordering::Relaxed);
        Ok(PendingAnswer {
            pending: Some(pending),
            op: req.op_name(),
            answered: AtomicBool::new(false),
            started: Arc::downgrade(&self.started),
        })
    }

    /// The answer of a started request, if it has arrived.
    pub(crate) fn poll(&self, p: &PendingAnswer) -> Result<Option<Response>, Error> {
        match p.pending().receive() {
            Ok(Some(resp)) => {
                p.answered.store(true, Ordering::Relaxed);
                decode::<Response>(resp.payload())
                    .map(Some)
                    .map_err(|e| Error::Protocol(e.to_string()))
            }
            Ok(None) if !self.recently_alive() => {
                Err(Error::Disconnected(format!("server went away during {}", p.op)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(ipc_err("receive", e)),
        }
    }

    /// Waits for the answer of a started request.
    pub(crate) fn wait_answer(
        &self,
        p: &PendingAnswer,
        timeout: Duration,
    ) -> Result<Response, Error> {
        let answer = self.wait(p.pending(), p.op, timeout);
        // An answer that did not decode was still the answer.
        if matches!(answer, Ok(_) | Err(Error::Protocol(_))) {
            p.answered.store(true, Ordering::Relaxed);
        }
        answer
    }

    /// Sends a request whose answer nobody waits for now (a release). Its answer is collected
    /// by later calls; a failure is logged and counted, never lost silently. At most
    /// `max_inflight - 1` are outstanding: beyond that the oldest is awaited first.
    pub(crate) fn send_deferred(&mut self, req: &Request, timeout: Duration) -> Result<(), Error> {
        if self.max_deferred == 0 {
            // One request in flight allowed: nothing can be deferred.
            let answer = self.call(req, timeout)?;
            self.check_deferred(req.op_name(), answer);
            return Ok(());
        }
        self.reap_deferred();
        self.make_room(req.op_name(), timeout)?;
        let bytes = encode(req);
        let pending = self.send(&bytes)?;
        self.deferred.push_back((pending, req.op_name()));
        Ok(())
    }

    /// Requests that can be sent now besides the deferred ones and those the caller started and
    /// still holds (at least 1).
    pub(crate) fn free_request_slots(&mut self) -> usize {
        self.reap_deferred();
        free_slots(
            self.max_deferred,
            self.deferred.len(),
            self.started.held.load(Ordering::Relaxed),
        )
    }

    /// Waits for the answers of every deferred request (started ones dropped unanswered
    /// among them).
    pub(crate) fn flush_deferred(&mut self, timeout: Duration) -> Result<(), Error> {
        self.take_dropped();
        while let Some((pending, op)) = self.deferred.pop_front() {
            let answer = self.wait(&pending, op, timeout)?;
            self.check_deferred(op, answer);
        }
        Ok(())
    }

    /// Moves the started requests the caller dropped unanswered to the deferred ones.
    fn take_dropped(&mut self) {
        let mut dropped = self.started.dropped.lock().unwrap_or_else(|e| e.into_inner());
        self.deferred.extend(dropped.drain(..));
    }

    /// Collects answers of deferred requests that have arrived, oldest first.
    fn reap_deferred(&mut self) {
        self.take_dropped();
        while let Some((pending, op)) = self.deferred.front() {
            let op = *op;
            let answer = match pending.receive() {
                Ok(Some(resp)) => {
                    decode::<Response>(resp.payload()).map_err(|e| Error::Protocol(e.to_string()))
                }
                Ok(None) => return,
                Err(e) => Err(ipc_err("receive", e)),
            };
            self.deferred.pop_front();
            match answer {
                Ok(r) => self.check_deferred(op, r),
                Err(e) => self.deferred_failure(op, &e.to_string()),
            }
        }
    }

    fn check_deferred(&mut self, op: &'static str, answer: Response) {
        match answer {
            Response::Outcomes { outcomes } => {
                let failed = outcomes.iter().filter(|o| **o != ChunkOutcome::Done).count();
                if failed > 0 {
                    self.deferred_failure(
                        op,
                        &format!("{failed} of {} chunks failed", outcomes.len()),
                    );
                }
            }
            other => self.deferred_failure(op, &format!("unexpected answer {other:?}")),
        }
    }

    fn deferred_failure(&mut self, op: &'static str, what: &str) {
        self.deferred_failures += 1;
        tracing::warn!(op, what, "deferred request failed");
    }

    fn send(&mut self, bytes: &[u8]) -> Result<Pending, Error> {
        if !self.recently_alive() {
            return Err(Error::Disconnected("server closed the session".into()));
        }
        let pending = self
            .port
            .loan_slice_uninit(bytes.len())
            .map_err(|e| ipc_err("loan", e))?
            .write_from_slice(bytes)
            .send()
            .map_err(|e| ipc_err("send", e))?;
        // Wake the home shard if it sleeps (see orbitkv_proto::DOORBELL_STRIDE): publish, fence,
        // then read its doorbell word.
        fence(Ordering::SeqCst);
        let asleep = self.arena.doorbell(self.home_shard).map_err(Error::from)?;
        if asleep.load(Ordering::SeqCst) != 0 {
            let _ = nix::unistd::write(&self.doorbell, &1u64.to_ne_bytes());
        }
        Ok(pending)
    }

    fn wait(
        &self,
        pending: &Pending,
        op: &'static str,
        timeout: Duration,
    ) -> Result<Response, Error> {
        let start = Instant::now();
        let mut last_check = start;
        loop {
            match pending.receive() {
                Ok(Some(resp)) => {
                    self.last_alive.set(Instant::now());
                    return decode::<Response>(resp.payload())
                        .map_err(|e| Error::Protocol(e.to_string()));
                }
                Ok(None) => {}
                Err(e) => return Err(ipc_err("receive", e)),
            }
            let now = Instant::now();
            if now.duration_since(last_check) >= LIVENESS_CHECK {
                last_check = now;
                if !self.alive() {
                    return Err(Error::Disconnected(format!("server went away during {op}")));
                }
                if now.duration_since(start) >= timeout {
                    return Err(Error::Timeout { op, after: timeout });
                }
            }
            let waited = now.duration_since(start);
            if waited < SPIN {
                std::hint::spin_loop();
            } else if waited < LIVENESS_CHECK {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that takes the connection and never answers: the error says so, not the OS's
    /// "resource temporarily unavailable".
    #[test]
    fn a_bootstrap_without_an_answer_says_the_server_never_answered() {
        let dir = std::env::temp_dir().join(format!("orbitkv-silent-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let held = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_millis(800));
            drop(s);
        });
        let opts = ClientOptions {
            request_timeout: Duration::from_millis(200),
            ..ClientOptions::with_socket(&path)
        };
        let err = Connection::open(&opts).unwrap_err().to_string();
        assert!(err.contains("no welcome from the server within 200ms"), "{err}");
        held.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn free_slots_leave_room_for_deferred_and_started_requests() {
        assert_eq!(free_slots(7, 0, 0), 8);
        assert_eq!(free_slots(7, 5, 0), 3);
        assert_eq!(free_slots(7, 5, 2), 1);
        assert_eq!(free_slots(7, 7, 3), 1, "never below one");
        assert_eq!(free_slots(0, 0, 0), 1);
    }

    #[test]
    fn a_request_waits_for_deferred_releases_or_is_refused_when_started_ones_fill_the_session() {
        // Eight in flight (max_deferred 7).
        assert_eq!(room(7, 0, 0), Room::Free);
        assert_eq!(room(7, 7, 0), Room::Free, "the seven releases and this one");
        assert_eq!(room(7, 5, 2), Room::Free);
        assert_eq!(room(7, 6, 2), Room::WaitOldest);
        assert_eq!(room(7, 1, 7), Room::WaitOldest);
        // The caller's held transfers alone fill it: refused, where sending would have had
        // the transport refuse it and end the session.
        assert_eq!(room(7, 0, 8), Room::Full);
        assert_eq!(room(0, 0, 0), Room::Free);
        assert_eq!(room(0, 0, 1), Room::Full);
    }

    /// A started request counts while held; dropped, it goes to the connection unless its
    /// answer came; once the connection is gone, a drop counts nothing.
    #[test]
    fn a_started_request_dropped_unanswered_goes_to_its_connection() {
        let dir = std::env::temp_dir().join(format!("orbitkv-started-{}", std::process::id()));
        let mut cfg = iceoryx2::config::Config::default();
        cfg.global.set_root_path(
            &iceoryx2::prelude::Path::new(dir.to_str().unwrap().as_bytes()).unwrap(),
        );
        cfg.global.prefix = FileName::new(b"okvstarted_").unwrap();
        let node = NodeBuilder::new().config(&cfg).create::<Svc>().unwrap();
        let service = node
            .service_builder(&ServiceName::new("started").unwrap())
            .request_response::<[u8], [u8]>()
            .max_active_requests_per_client(4)
            .create()
            .unwrap();
        let server = service.server_builder().create().unwrap();
        let client = service.client_builder().create().unwrap();
        let started = Arc::new(Started::default());
        let start = |b: u8| {
            started.held.fetch_add(1, Ordering::Relaxed);
            let pending =
                client.loan_slice_uninit(1).unwrap().write_from_slice(&[b]).send().unwrap();
            PendingAnswer {
                pending: Some(pending),
                op: "save",
                answered: AtomicBool::new(false),
                started: Arc::downgrade(&started),
            }
        };
        let (unanswered, answered) = (start(1), start(2));
        assert_eq!(started.held.load(Ordering::Relaxed), 2);
        for _ in 0..2 {
            let req = server.receive().unwrap().expect("a request");
            let answer = req.loan_slice_uninit(1).unwrap().write_from_slice(&[0]);
            answer.send().unwrap();
        }
        assert!(answered.pending().receive().unwrap().is_some());
        answered.answered.store(true, Ordering::Relaxed);
        drop(answered);
        assert_eq!(started.held.load(Ordering::Relaxed), 1);
        assert!(started.dropped.lock().unwrap().is_empty(), "an answered one is done");
        drop(unanswered);
        assert_eq!(started.held.load(Ordering::Relaxed), 0);
        let dropped = std::mem::take(&mut *started.dropped.lock().unwrap());
        assert_eq!(dropped.len(), 1, "its answer is still to collect");
        assert!(dropped[0].0.receive().unwrap().is_some(), "and it comes");
        assert_eq!(dropped[0].1, "save");
        // The connection gone: nothing to hand over or count.
        let orphan = start(3);
        drop(started);
        drop(orphan);
        drop((dropped, client, server, service, node));
        let _ = std::fs::remove_dir_all(&dir);
        for entry in std::fs::read_dir("/dev/shm").into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with("okvstarted_") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}
