//! Why a command failed: each cause a variant, its message naming what was wrong.

use std::path::PathBuf;

/// An `orbitkv-ctl` failure (exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The admin socket gave no usable answer, or the server refused the request.
    #[error(transparent)]
    Admin(#[from] orbitkv_proto::admin::AdminError),
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
