//! Why the arena could not be mapped, or a range of it not used: the server announced memfds
//! that do not match what it sent, or named a range outside the chunk area.

use nix::errno::Errno;

/// A mapping of the arena that cannot be made, or a range of it that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    /// The welcome's memfd count is not the count of descriptors that came with it.
    #[error("server announced {announced} arena memfds and sent {sent}")]
    Announced { announced: usize, sent: usize },
    /// The announced file lengths do not add up to the arena's.
    #[error("arena memfds of {files:?} bytes do not add up to {len}")]
    FilesDoNotAddUp { files: Vec<u64>, len: u64 },
    /// A memfd could not be inspected.
    #[error("fstat arena memfd {index}: {source}")]
    Fstat { index: usize, source: Errno },
    /// A memfd is shorter than announced (or announced empty, or not in whole pages).
    #[error("arena memfd {index} has {size} bytes, server announced {announced}")]
    FileSize { index: usize, size: i64, announced: u64 },
    /// The arena's length does not fit this process's address space.
    #[error("arena size {len} is not mappable")]
    NotMappable { len: u64 },
    /// `mmap` refused.
    #[error("mmap arena: {0}")]
    Mmap(Errno),
    /// `mmap` answered address 0.
    #[error("mmap arena: address 0")]
    AtZero,
    /// A range the server named lies outside the chunk area (or in the header).
    #[error("range {offset}+{len} outside the {arena}-byte arena's chunk area (from {header})")]
    OutsideChunkArea { offset: u64, len: u64, arena: usize, header: u64 },
    /// Two slots of one write overlap.
    #[error("slot at {offset} overlaps another slot (up to {end})")]
    Overlap { offset: u64, end: u64 },
    /// A shard number past the header's doorbell words.
    #[error("shard {shard} has no doorbell word in the arena header")]
    NoDoorbell { shard: u32 },
    /// The memfds could not be duplicated (for a mapping of one's own).
    #[error("duplicating the arena's memfds: {0}")]
    Dup(std::io::Error),
}

impl From<MappingError> for crate::Error {
    /// What the server sent cannot be used: a protocol error (mapping one's own: see
    /// `Client::map_arena`).
    fn from(e: MappingError) -> Self {
        crate::Error::Protocol(e.to_string())
    }
}
