//! Messages a shard executes: from its own sessions and, over the mesh, from other shards.

use orbitkv_proto::{
    ChunkKey, ChunkOutcome, ErrorCode, Hit, NamespaceDescriptor, Reservation, SlotRef,
};

/// Server-wide session id.
pub type SessionId = u64;

/// One operation on one shard's key range. Keys in an op all belong to that shard.
#[derive(Debug, Clone)]
pub enum ShardOp {
    /// Registers a namespace on this shard.
    Register {
        /// The descriptor (already validated).
        descriptor: NamespaceDescriptor,
    },
    /// Looks keys up, leasing hits for `session` when `lease` is set.
    Lookup {
        /// Requesting session.
        session: SessionId,
        /// Keys, all owned by this shard.
        keys: Vec<ChunkKey>,
        /// Lease each hit.
        lease: bool,
    },
    /// Reserves slots for `session`.
    Reserve {
        /// Requesting session.
        session: SessionId,
        /// Keys to reserve.
        keys: Vec<ChunkKey>,
        /// Lengths, one per key.
        lens: Vec<u64>,
    },
    /// Commits reservations of `session`.
    Commit {
        /// Requesting session.
        session: SessionId,
        /// Reservations.
        slots: Vec<SlotRef>,
    },
    /// Commits reservations of `session` whose checksums were computed elsewhere (on the GPU,
    /// during a save's copy): per slot the checksum and whether to check it against the bytes
    /// first (a mismatch is counted and the reservation dropped: `ChecksumMismatch`, which
    /// the GPU save path answers its client as `DeviceError`).
    CommitSummed {
        /// Requesting session.
        session: SessionId,
        /// Reservations, their checksums and whether to verify them.
        slots: Vec<(SlotRef, u64, bool)>,
    },
    /// Aborts reservations of `session`.
    Abort {
        /// Requesting session.
        session: SessionId,
        /// Reservations.
        slots: Vec<SlotRef>,
    },
    /// Releases leases of `session`.
    Release {
        /// Requesting session.
        session: SessionId,
        /// Leases.
        slots: Vec<SlotRef>,
    },
    /// Removes unleased chunks.
    Evict {
        /// Keys.
        keys: Vec<ChunkKey>,
    },
    /// The session is gone: drop all its leases and reservations on this shard.
    SessionClosed {
        /// The session.
        session: SessionId,
    },
}

/// The reply to a [`ShardOp`], in the op's key order.
#[derive(Debug, Clone)]
pub enum ShardReply {
    /// Reply to `Register`: the namespace's max chunk bytes, or why it was refused.
    Registered(Result<u64, (ErrorCode, String)>),
    /// Reply to `Lookup`: a hit or a miss per key.
    Hits(Vec<Option<Hit>>),
    /// Reply to `Reserve`.
    Reserved(Vec<Reservation>),
    /// Reply to `Commit`, `Abort`, `Release`, `Evict`.
    Outcomes(Vec<ChunkOutcome>),
    /// Reply to `SessionClosed`: what was reclaimed.
    Closed {
        /// Leases dropped.
        leases: u64,
        /// Reservations freed.
        reservations: u64,
    },
}
