use std::path::PathBuf;
use std::time::Duration;

use orbitkv_proto::ErrorCode;

/// Errors of the client library. Server-side failures keep their wire [`ErrorCode`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server socket could not be reached.
    #[error("cannot connect to orbitkv-server at {socket}: {source}")]
    Connect {
        /// The socket path tried.
        socket: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A connect attempt failed a moment ago and the next one is not due yet: the call failed
    /// at once, without trying (see [`crate::ClientOptions::reconnect_backoff`]).
    #[error(
        "orbitkv-server at {socket} unavailable (next connect attempt in {retry_in:?}): {cause}"
    )]
    Unavailable {
        /// The socket path.
        socket: PathBuf,
        /// When the next attempt is due.
        retry_in: Duration,
        /// Why the last attempt failed.
        cause: String,
    },
    /// The server is starting (populating its arena, ...): no session yet, none refused;
    /// connect again after `retry_in`. [`crate::Client::connect`] waits for it (up to
    /// [`crate::ClientOptions::start_wait`]); a lazy client's calls fail fast until then.
    #[error("orbitkv-server is starting ({message}); connect again in {retry_in:?}")]
    Starting {
        /// What the server is doing, e.g. "populating the arena: 42% (...)".
        message: String,
        /// When to connect again, as the server said.
        retry_in: Duration,
    },
    /// The server refused to open a session.
    #[error("orbitkv-server refused the session ({code}): {message}")]
    Refused {
        /// Why, as a code.
        code: ErrorCode,
        /// Why, for humans.
        message: String,
    },
    /// The server answered the whole request with an error.
    #[error("orbitkv-server error ({code}): {message}")]
    Server {
        /// Why, as a code.
        code: ErrorCode,
        /// Why, for humans.
        message: String,
    },
    /// The session ended (server stopped or restarted) while a call was in flight. The next
    /// call reconnects.
    #[error("disconnected from orbitkv-server: {0}")]
    Disconnected(String),
    /// No response in time. A blocking call then drops its session (the server reclaims what
    /// it held) and the next call reconnects; waiting on a started transfer
    /// ([`crate::Client::wait_transfer`]) keeps it: wait or poll again.
    #[error("{op} got no response within {after:?}")]
    Timeout {
        /// The request.
        op: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The server broke the protocol (undecodable or unexpected message).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Shared-memory transport failure.
    #[error("iceoryx2: {0}")]
    Ipc(String),
    /// The lease or reservation belongs to an earlier session (before a reconnect).
    #[error("lease or reservation is from an earlier session; look the key up again")]
    Stale,
    /// A caller buffer is too small for the chunk.
    #[error("buffer of {got} bytes is too small for a chunk of {needed} bytes")]
    BufferTooSmall {
        /// Chunk length.
        needed: u64,
        /// Buffer length.
        got: usize,
    },
    /// Arguments that cannot be sent (mismatched lengths, too many keys).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// Whether the session this happened on is unusable after it (no answer came, or one that
    /// cannot be read): a blocking call then drops it, and the next call reconnects. The
    /// server reclaims a dropped session's holdings once its copies have finished.
    pub(crate) fn ends_session(&self) -> bool {
        matches!(
            self,
            Error::Disconnected(_) | Error::Timeout { .. } | Error::Ipc(_) | Error::Protocol(_)
        )
    }

    /// A stable snake_case name of the variant (for counters and logs); server errors give
    /// their wire code's name.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Connect { .. } => "connect",
            Error::Unavailable { .. } => "unavailable",
            Error::Starting { .. } => "starting",
            Error::Refused { code, .. } | Error::Server { code, .. } => code.as_str(),
            Error::Disconnected(_) => "disconnected",
            Error::Timeout { .. } => "timeout",
            Error::Protocol(_) => "protocol",
            Error::Ipc(_) => "ipc",
            Error::Stale => "stale",
            Error::BufferTooSmall { .. } => "buffer_too_small",
            Error::InvalidArgument(_) => "invalid_argument",
        }
    }

    /// Whether the server could not be reached (no session): a connect that failed, a server
    /// still starting, or a call refused at once while reconnects back off. Engines take it
    /// as "no cache right now".
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Connect { .. } | Error::Unavailable { .. } | Error::Starting { .. })
    }

    /// The wire code, when the server produced this error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Refused { code, .. } | Error::Server { code, .. } => Some(*code),
            _ => None,
        }
    }
}
