//! The bootstrap Unix socket: peer credential check, protocol version check, session opening,
//! arena memfd hand-over (`SCM_RIGHTS`), and watching the socket for the requester's death.

use std::io::{IoSlice, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crossbeam_channel::bounded;
use nix::sys::socket::{getsockopt, sendmsg, sockopt, ControlMessage, MsgFlags};
use orbitkv_proto::{
    decode, encode, frame_header, read_frame, Bootstrap, ErrorCode, Welcome, PROTOCOL_VERSION,
};
use orbitkv_shards::Arena;

use crate::control::shared::{ServeState, SessionInfo, Shared};
use crate::control::startup::Startup;
use crate::deadline::DeadlineReader;
use crate::requests::router::{max_request_bytes, max_response_bytes};
use crate::shard::messages::ControlMsg;

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections beyond `--max-sessions` allowed to be in their handshake at once.
pub const HANDSHAKE_HEADROOM: usize = 64;
/// Stack of a connection thread (it only reads, decodes a hello and waits).
const CONNECTION_STACK: usize = 256 << 10;

/// Accepts connections until the listener fails (it is shut down by process exit). At most
/// `limit` (`--max-sessions` + [`HANDSHAKE_HEADROOM`]) connections are served at once; beyond
/// that a connection is refused with `TooManySessions` before any thread is started for it.
/// While the server starts, a hello is answered `Welcome::Starting` (after the version and uid
/// checks): connect again later.
pub fn serve(listener: UnixListener, startup: Arc<Startup>, limit: usize) {
    let live = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                if live.load(Ordering::Acquire) >= limit {
                    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                    refuse(
                        &stream,
                        refusals(&startup),
                        ErrorCode::TooManySessions,
                        format!("{limit} connections open (--max-sessions + {HANDSHAKE_HEADROOM} handshakes)"),
                    );
                    continue;
                }
                live.fetch_add(1, Ordering::AcqRel);
                let startup = Arc::clone(&startup);
                let done = Arc::clone(&live);
                let spawned = std::thread::Builder::new()
                    .name("orbitkv-session".into())
                    .stack_size(CONNECTION_STACK)
                    .spawn(move || {
                        match startup.server() {
                            Some((shared, arena)) => handle(stream, shared, arena),
                            None => tell_to_wait(stream, &startup),
                        }
                        done.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = spawned {
                    live.fetch_sub(1, Ordering::AcqRel);
                    tracing::error!(error = %e, "cannot start a session thread");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// The count of refused sessions: the server's, or the start's until it serves.
fn refusals(startup: &Startup) -> &AtomicU64 {
    match startup.server() {
        Some((shared, _)) => &shared.refused_sessions,
        None => &startup.refused,
    }
}

/// A hello while the server starts: checked as at any time (version, uid), then answered
/// `Starting` with the progress and when to come back; no session is opened.
fn tell_to_wait(stream: UnixStream, startup: &Startup) {
    let creds = match getsockopt(&stream, sockopt::PeerCredentials) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "SO_PEERCRED failed; dropping connection");
            return;
        }
    };
    let checked = read_hello(&stream, creds.pid()).and_then(|_| {
        startup
            .access
            .may_connect(creds.uid(), creds.gid())
            .map_err(|why| (ErrorCode::PermissionDenied, why.to_string()))
    });
    if let Err((code, message)) = checked {
        return refuse(&stream, refusals(startup), code, message);
    }
    startup.told_to_wait.fetch_add(1, Ordering::Relaxed);
    let message = startup.message();
    tracing::debug!(pid = creds.pid(), %message, "hello while starting: told to wait");
    let starting = Welcome::Starting {
        populated_bytes: startup.populated.load(Ordering::Relaxed),
        arena_bytes: startup.arena_bytes(),
        retry_after_ms: startup.retry_after().as_millis() as u32,
        message,
    };
    if let Err(e) = send_welcome(&stream, &starting, &[]) {
        tracing::debug!(error = %e, "telling a client to wait failed");
    }
}

fn refuse(stream: &UnixStream, refused: &AtomicU64, code: ErrorCode, message: String) {
    refused.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(code = %code, %message, "session refused");
    let _ = send_welcome(stream, &Welcome::Refused { code, message }, &[]);
}

fn send_welcome(stream: &UnixStream, w: &Welcome, fds: &[i32]) -> std::io::Result<()> {
    let body = encode(w);
    let header = frame_header(body.len())?;
    let iov = [IoSlice::new(&header), IoSlice::new(&body)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let sent = sendmsg::<()>(stream.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
        .map_err(std::io::Error::from)?;
    let total = header.len() + body.len();
    if sent < total {
        // The descriptor went with the first bytes; the rest is plain data.
        let all: Vec<u8> = header.iter().chain(body.iter()).copied().collect();
        std::io::Write::write_all(&mut &*stream, &all[sent..])?;
    }
    Ok(())
}

/// Why a handshake is refused: the code and message the client gets.
type Refusal = (ErrorCode, String);

fn handle(stream: UnixStream, shared: &Shared, arena: &Arena) {
    let creds = match getsockopt(&stream, sockopt::PeerCredentials) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "SO_PEERCRED failed; dropping connection");
            return;
        }
    };
    let (uid, gid, pid) = (creds.uid(), creds.gid(), creds.pid());
    // The uid is checked after the hello is read, so that a refused client can finish its
    // write and read the refusal instead of a broken pipe.
    let opened = read_hello(&stream, pid)
        .and_then(|name| admit(shared, uid, gid).map(|()| name))
        .and_then(|name| open_session(shared, (uid, pid), &name).map(|o| (name, o)));
    let (name, (session, home, service)) = match opened {
        Ok(o) => o,
        Err((code, message)) => return refuse(&stream, &shared.refused_sessions, code, message),
    };
    tracing::info!(session, pid, uid, home, name = %name, "session opened");
    let fds: Vec<i32> = arena
        .fds()
        .map(|fd| fd.as_raw_fd())
        .chain([shared.doorbells.fd(home).as_raw_fd()])
        .collect();
    match send_welcome(&stream, &welcome(shared, arena, (session, home), service), &fds) {
        Err(e) => tracing::warn!(session, error = %e, "sending welcome failed"),
        Ok(()) => wait_for_close(&stream, session),
    }
    // Listed as closing until the home shard has reclaimed it (it removes the entry then).
    if let Some(info) =
        shared.sessions.lock().expect("session table lock is never poisoned").get_mut(&session)
    {
        info.closing = true;
    }
    shared.send_control(home, ControlMsg::CloseSession { session }, Duration::from_secs(3600));
}

/// The client's hello: its name (64 characters at most), or why it is refused.
fn read_hello(stream: &UnixStream, pid: i32) -> Result<String, Refusal> {
    let hello = match read_frame(&mut DeadlineReader::new(stream, HELLO_TIMEOUT), Vec::new()) {
        Ok(b) => decode::<Bootstrap>(&b).map_err(|e| e.to_string()),
        Err(e) => Err(format!("reading hello: {e}")),
    };
    match hello {
        Ok(Bootstrap::Hello { protocol_version, client_name }) => {
            if protocol_version != PROTOCOL_VERSION {
                return Err((
                    ErrorCode::VersionMismatch,
                    format!("client speaks protocol {protocol_version}, server {PROTOCOL_VERSION}"),
                ));
            }
            Ok(client_name.chars().take(64).collect())
        }
        Err(e) => Err((ErrorCode::Malformed, format!("bad hello from pid {pid}: {e}"))),
    }
}

/// Whether `uid` (of effective group `gid`) may open a session now: the allow lists
/// ([`crate::control::access::Access`]), while the server is not draining.
fn admit(shared: &Shared, uid: u32, gid: u32) -> Result<(), Refusal> {
    shared
        .access
        .may_connect(uid, gid)
        .map_err(|why| (ErrorCode::PermissionDenied, why.to_string()))?;
    if shared.state() == ServeState::Draining {
        return Err((ErrorCode::Draining, "server is draining: no new sessions".into()));
    }
    Ok(())
}

/// Counts a new session (within `--max-sessions`) and has its home shard open its service:
/// the session's id, home shard and service name.
fn open_session(
    shared: &Shared,
    (uid, pid): (u32, i32),
    name: &str,
) -> Result<(u64, usize, String), Refusal> {
    let max = shared.settings.config.max_sessions;
    let session = shared.next_session_id();
    let home = shared.pick_home_shard();
    {
        // Count the session in the same critical section as the check, so concurrent
        // handshakes cannot overshoot --max-sessions.
        let mut sessions = shared.sessions.lock().expect("session table lock is never poisoned");
        let open = sessions.len();
        if open >= max {
            return Err((
                ErrorCode::TooManySessions,
                format!("{open} sessions open (--max-sessions {max})"),
            ));
        }
        let info = SessionInfo {
            id: session,
            pid,
            uid,
            name: name.to_string(),
            home_shard: home,
            opened: SystemTime::now(),
            closing: false,
        };
        sessions.insert(session, info);
    }
    let service = format!("{}/s{session}", shared.service_prefix);
    let (reply, rx) = bounded(1);
    let msg = ControlMsg::OpenSession { session, service: service.clone(), reply };
    let queued = shared.send_control(home, msg, HELLO_TIMEOUT);
    let opened = if queued {
        rx.recv_timeout(HELLO_TIMEOUT)
            .map_err(|_| "home shard did not open the session in time".to_string())
            .and_then(|r| r.map_err(|e| format!("opening the session's service: {e}")))
    } else {
        Err("home shard is not answering".to_string())
    };
    if let Err(e) = opened {
        shared.sessions.lock().expect("session table lock is never poisoned").remove(&session);
        if queued {
            // The shard may still open it later: the close follows in the same queue.
            shared.send_control(home, ControlMsg::CloseSession { session }, HELLO_TIMEOUT);
        }
        return Err((ErrorCode::Internal, e));
    }
    Ok((session, home, service))
}

/// What an accepted client is told: its session, where to reach its service, the limits.
fn welcome(
    shared: &Shared,
    arena: &Arena,
    (session, home): (u64, usize),
    service: String,
) -> Welcome {
    let cfg = &shared.settings.config;
    Welcome::Accepted {
        protocol_version: PROTOCOL_VERSION,
        session_id: session,
        home_shard: home as u32,
        shards: shared.settings.shards as u32,
        arena_bytes: arena.len(),
        arena_files: arena.files().into_iter().map(|(_, bytes)| bytes).collect(),
        iox_root: shared.ipc.root.clone(),
        iox_prefix: shared.ipc.prefix.clone(),
        service_name: service,
        max_request_bytes: max_request_bytes(cfg.max_keys_per_request) as u64,
        max_response_bytes: max_response_bytes(cfg.max_keys_per_request) as u64,
        max_keys_per_request: cfg.max_keys_per_request,
        max_inflight: cfg.max_inflight_per_session as u32,
    }
}

/// Blocks until the client's bootstrap socket closes: it stays open for the life of the
/// session, and its close (or any protocol violation on it) means the requester is gone.
fn wait_for_close(stream: &UnixStream, session: u64) {
    let _ = stream.set_read_timeout(None);
    let mut buf = [0u8; 64];
    match (&*stream).read(&mut buf) {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            session,
            bytes = n,
            "unexpected bytes on the bootstrap socket; closing session"
        ),
        Err(e) => {
            tracing::debug!(session, error = %e, "bootstrap socket error; closing session")
        }
    }
}
