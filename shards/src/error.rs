/// Errors of the shard layer that are not per-chunk outcomes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call on the arena failed.
    #[error("arena {op} failed: {source}")]
    Arena {
        /// The operation (`memfd_create`, `ftruncate`, `mmap`).
        op: &'static str,
        /// The OS error.
        source: nix::Error,
    },
    /// The requested arena size is unusable.
    #[error("arena size {bytes} bytes is invalid: {reason}")]
    ArenaSize {
        /// The size asked for.
        bytes: u64,
        /// Why it cannot be used.
        reason: &'static str,
    },
}
