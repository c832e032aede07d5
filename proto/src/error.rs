use rkyv::{Archive, Deserialize, Serialize};

/// Error codes carried on the wire. Every error reply has one code plus a human message.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u16)]
pub enum ErrorCode {
    /// The message could not be decoded or violates the protocol.
    Malformed = 1,
    /// Client and server speak different protocol versions.
    VersionMismatch = 2,
    /// The peer's uid is not in the server's allow list.
    PermissionDenied = 3,
    /// The namespace id was never registered on this server.
    UnknownNamespace = 4,
    /// A different descriptor is already registered under this namespace id.
    NamespaceConflict = 5,
    /// The arena (or a shard's slice of it) cannot hold the chunk even after eviction.
    NoSpace = 6,
    /// A queue or in-flight bound is full, or the key is being written by another session.
    Busy = 7,
    /// The session holds as many leases or reservations as the server allows.
    LeaseLimit = 8,
    /// A request, key list or chunk exceeds its configured bound.
    TooLarge = 9,
    /// The server is draining: no new sessions or writes are admitted.
    Draining = 10,
    /// The slot was reused or released since the caller saw it; nothing was served.
    StaleGeneration = 11,
    /// The key or lease does not exist (or does not belong to this session).
    NotFound = 12,
    /// The key is already present (or reserved) and was not written again.
    AlreadyPresent = 13,
    /// Too many sessions are open.
    TooManySessions = 14,
    /// An argument is out of range (zero length, bad offset, ...).
    InvalidArgument = 15,
    /// An internal invariant failed; the request was not applied. For an evict: the chunk is
    /// gone, but the SSD tier failed to record its deletion (it may come back after a
    /// restart).
    Internal = 16,
    /// The server cannot serve this request here: no usable GPU, or not the device named.
    Unavailable = 17,
    /// A GPU copy failed (CUDA error); the chunk was not saved or loaded.
    DeviceError = 18,
    /// A checksum given with a commit differs from the chunk's bytes; the chunk was not
    /// stored.
    ChecksumMismatch = 19,
    /// The namespace holds as much DRAM as `--namespace-dram-limit` allows and none of its own
    /// chunks could be evicted to make room (all leased or being written).
    QuotaExceeded = 20,
}

impl ErrorCode {
    /// Stable lower-case name used in logs, stats and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::VersionMismatch => "version_mismatch",
            Self::PermissionDenied => "permission_denied",
            Self::UnknownNamespace => "unknown_namespace",
            Self::NamespaceConflict => "namespace_conflict",
            Self::NoSpace => "no_space",
            Self::Busy => "busy",
            Self::LeaseLimit => "lease_limit",
            Self::TooLarge => "too_large",
            Self::Draining => "draining",
            Self::StaleGeneration => "stale_generation",
            Self::NotFound => "not_found",
            Self::AlreadyPresent => "already_present",
            Self::TooManySessions => "too_many_sessions",
            Self::InvalidArgument => "invalid_argument",
            Self::Internal => "internal",
            Self::Unavailable => "unavailable",
            Self::DeviceError => "device_error",
            Self::ChecksumMismatch => "checksum_mismatch",
            Self::QuotaExceeded => "quota_exceeded",
        }
    }

    /// Every code, in wire order (for counters indexed by code).
    pub const ALL: [ErrorCode; 20] = [
        Self::Malformed,
        Self::VersionMismatch,
        Self::PermissionDenied,
        Self::UnknownNamespace,
        Self::NamespaceConflict,
        Self::NoSpace,
        Self::Busy,
        Self::LeaseLimit,
        Self::TooLarge,
        Self::Draining,
        Self::StaleGeneration,
        Self::NotFound,
        Self::AlreadyPresent,
        Self::TooManySessions,
        Self::InvalidArgument,
        Self::Internal,
        Self::Unavailable,
        Self::DeviceError,
        Self::ChecksumMismatch,
        Self::QuotaExceeded,
    ];

    /// Dense index in `0..ALL.len()`.
    pub fn index(self) -> usize {
        self as usize - 1
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_is_dense_and_names_unique() {
        let mut names = std::collections::HashSet::new();
        for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
            assert_eq!(code.index(), i);
            assert!(names.insert(code.as_str()));
        }
    }
}
