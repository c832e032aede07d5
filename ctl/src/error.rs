//! Why a command failed: each cause a variant, its message naming what was wrong.

use std::path::PathBuf;

/// An `orbitkv-ctl` failure (exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The admin socket could not be connected to (no server, or another socket).
    #[error("cannot reach orbitkv-server admin socket {}: {source}", path.display())]
    Unreachable {
        /// The admin socket.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Reading or writing the admin socket failed (or timed out).
    #[error("admin socket {}: {source}", path.display())]
    Io {
        /// The admin socket.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The server's answer was not JSON.
    #[error("admin socket {} answered non-JSON: {source}", path.display())]
    NotJson {
        /// The admin socket.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// The server answered `"ok": false`.
    #[error("server: {0}")]
    Server(String),
    /// A flag's value did not parse.
    #[error("{flag}: {source}")]
    Flag {
        /// The flag (`--timeout`).
        flag: &'static str,
        /// What was wrong with it.
        source: orbitkv_proto::UnitError,
    },
    /// `--dir` could not be listed.
    #[error("--dir {}: {source}", dir.display())]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--dir` has no shard files.
    #[error("--dir {}: no shard-*.okv files", .0.display())]
    NoShardFiles(PathBuf),
    /// A shard file could not be read (`step`: what was being read, empty for opening it).
    #[error("{}: {step}{source}", path.display())]
    ShardFile {
        /// The file.
        path: PathBuf,
        /// What was being read, ending in `": "` (`"reading superblock: "`), or empty.
        step: String,
        /// What failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}
