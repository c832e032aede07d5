//! The one error type of `orbitkv-perf`: everything that stops a benchmark before it can report.

use std::path::PathBuf;

/// Why a benchmark could not run (exit status 2). Failures *during* a run are counted in the
/// report instead.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// A command-line value is out of range or conflicts with another.
    #[error("invalid {flag}: {reason}")]
    InvalidArgument {
        /// The flag, as typed on the command line.
        flag: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An OS operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The server's admin socket did not answer usefully.
    #[error(transparent)]
    Admin(#[from] orbitkv_proto::admin::AdminError),
    /// CUDA is missing or a CUDA call failed.
    #[error("{0}")]
    Gpu(String),
    /// The embedded server could not be started.
    #[error("embedded orbitkv-server: {0}")]
    Embedded(String),
    /// A client could not open its session or register the benchmark namespace.
    #[error("client {client}: {source}")]
    Client {
        /// Which benchmark client.
        client: usize,
        /// The client library's error.
        source: orbitkv_client::Error,
    },
    /// Anything else that makes the run impossible (a benchmark thread died, ...).
    #[error("{0}")]
    Setup(String),
}

/// Shorthand for an [`Error::InvalidArgument`].
pub(crate) fn invalid(flag: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument { flag, reason: reason.into() }
}
