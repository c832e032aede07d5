//! Bootstrap (Unix socket) and request/response (iceoryx2) messages.
//!
//! Messages carry keys, arena offsets, lengths and generations, never payload bytes.

use rkyv::{Archive, Deserialize, Serialize};

use crate::{ChunkKey, ErrorCode, NamespaceDescriptor};

/// Version of this protocol; a client and server must agree exactly.
pub const PROTOCOL_VERSION: u32 = 5;

/// Most memfds an arena is made of (a server with more shards makes one); with the doorbell's
/// eventfd they travel in one `SCM_RIGHTS` message.
pub const MAX_ARENA_FILES: usize = 128;

/// Bytes at the start of the arena memfd before chunk data: one doorbell word per shard.
pub const ARENA_HEADER_BYTES: u64 = 256 * DOORBELL_STRIDE;
/// Distance between two shards' doorbell words in the arena header (one cache line).
///
/// A shard that sleeps waiting for work stores a non-zero u32 at `shard * DOORBELL_STRIDE`;
/// a client that has just sent a request to that shard and reads non-zero writes 1 to the
/// shard's eventfd (passed at bootstrap after the arena memfd).
pub const DOORBELL_STRIDE: u64 = 64;

/// Messages on the bootstrap Unix socket, client to server. Framed as a u32 little-endian
/// length followed by the rkyv bytes.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
pub enum Bootstrap {
    /// Opens a session.
    Hello {
        /// [`PROTOCOL_VERSION`] of the client.
        protocol_version: u32,
        /// Free-form client name for `ctl sessions` (at most 64 bytes are kept).
        client_name: String,
    },
}

/// The server's answer to [`Bootstrap::Hello`]. The arena's memfds and the home shard's
/// doorbell eventfd travel with it (`SCM_RIGHTS`, in that order) when the session was opened.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
pub enum Welcome {
    /// The session is open.
    Accepted {
        /// [`PROTOCOL_VERSION`] of the server.
        protocol_version: u32,
        /// Session id, unique for the server's lifetime.
        session_id: u64,
        /// The shard that serves this session's requests.
        home_shard: u32,
        /// Shard count of this server run.
        shards: u32,
        /// Size of the arena in bytes (header and data, every memfd).
        arena_bytes: u64,
        /// Bytes of each of the arena's memfds, in the order they are mapped one after another
        /// (and sent); they add up to `arena_bytes`. Version 5.
        arena_files: Vec<u64>,
        /// iceoryx2 root path shared by server and clients.
        iox_root: String,
        /// iceoryx2 shared-memory name prefix shared by server and clients.
        iox_prefix: String,
        /// iceoryx2 request-response service of this session.
        service_name: String,
        /// Largest encoded request the server accepts.
        max_request_bytes: u64,
        /// Largest encoded response the server may send.
        max_response_bytes: u64,
        /// Most keys per request.
        max_keys_per_request: u32,
        /// Requests the session may have in flight at once.
        max_inflight: u32,
    },
    /// The session was refused.
    Refused {
        /// Why, as a code.
        code: ErrorCode,
        /// Why, for humans.
        message: String,
    },
    /// The server is starting (populating its arena, registering it with CUDA, opening its
    /// shards): no session yet; connect again after `retry_after_ms`. Version 4.
    Starting {
        /// Arena bytes populated so far.
        populated_bytes: u64,
        /// The arena's size.
        arena_bytes: u64,
        /// When to try again, in milliseconds.
        retry_after_ms: u32,
        /// What the server is doing, for humans (e.g. "populating the arena: 42% ...").
        message: String,
    },
}

/// A reference to a reserved or leased slot: the key plus the generation the server issued.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SlotRef {
    /// The chunk.
    pub key: ChunkKey,
    /// Generation of the slot allocation that the caller saw.
    pub generation: u64,
}

/// Where a hit lives.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum Tier {
    /// Host DRAM arena.
    Dram = 1,
    /// Local SSD.
    Ssd = 2,
    /// Another host.
    Peer = 3,
}

impl Tier {
    /// Stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Dram => "dram",
            Tier::Ssd => "ssd",
            Tier::Peer => "peer",
        }
    }
}

/// A present chunk: where its bytes are in the arena and which allocation it is.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub struct Hit {
    /// Byte offset in the arena memfd.
    pub offset: u64,
    /// Length of the chunk in bytes.
    pub len: u64,
    /// Generation of the allocation.
    pub generation: u64,
    /// xxh3-64 of the bytes, computed at commit.
    pub checksum: u64,
    /// Tier the chunk was found in.
    pub tier: Tier,
}

/// The outcome of one chunk in a batched request.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub enum ChunkOutcome {
    /// Applied.
    Done,
    /// Not applied, for this reason.
    Failed(ErrorCode),
}

/// The result of reserving one chunk.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Reservation {
    /// A slot the client now writes and then commits.
    Slot {
        /// Byte offset in the arena memfd.
        offset: u64,
        /// Reserved length.
        len: u64,
        /// Generation to quote in commit/abort.
        generation: u64,
    },
    /// Nothing reserved, for this reason (`AlreadyPresent` when the key exists).
    Failed(ErrorCode),
}

/// Engine KV layouts the server can copy (see `orbitkv_gpu::KvLayout` for their shapes).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum KvLayoutKind {
    /// vLLM FlashAttention per layer, `[2, blocks, block_size, kv_heads, head_dim]`.
    FlashAttnNhd = 1,
    /// vLLM FlashAttention per layer, `[2, blocks, kv_heads, block_size, head_dim]`.
    FlashAttnHnd = 2,
    /// vLLM cross-layer, `[blocks, layers, 2, block_size, kv_heads, head_dim]`.
    CrossLayer = 3,
    /// MLA per layer, `[blocks, block_size, latent_dim]` (`head_dim` = latent width).
    MlaPerLayer = 4,
    /// SGLang K and V per layer, `[tokens, kv_heads, head_dim]`, page size 1.
    SglangPerLayer = 5,
    /// vLLM paged per layer, `[blocks, page]`, a page of `block_size x kv_heads x 2 x
    /// head_dim` elements (vLLM >= 0.32).
    Paged = 6,
}

/// The shape of an engine rank's KV cache on one GPU.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub struct KvLayoutSpec {
    /// Layout.
    pub kind: KvLayoutKind,
    /// Attention layers.
    pub num_layers: u32,
    /// Blocks per tensor (token slots for SGLang).
    pub num_blocks: u64,
    /// Tokens per block (1 for SGLang).
    pub block_size: u32,
    /// KV heads (1 for MLA).
    pub kv_heads: u32,
    /// Elements per head (latent width for MLA).
    pub head_dim: u32,
    /// Bytes per element.
    pub elem_bytes: u32,
}

/// One engine tensor shared with CUDA IPC.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub struct GpuTensor {
    /// `cuIpcGetMemHandle` of the allocation holding the tensor (64 bytes).
    pub handle: [u8; 64],
    /// Byte offset of the tensor in that allocation.
    pub offset: u64,
    /// Bytes of the tensor.
    pub len: u64,
}

/// Requests, client to server, over the session's iceoryx2 service.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
pub enum Request {
    /// Liveness check.
    Ping,
    /// Registers a namespace; answered with [`Response::Registered`].
    RegisterNamespace {
        /// The descriptor to register.
        descriptor: NamespaceDescriptor,
    },
    /// Longest present prefix of `keys`, optionally leasing it.
    Lookup {
        /// Keys in prefix order.
        keys: Vec<ChunkKey>,
        /// Take a lease on every hit returned.
        lease: bool,
    },
    /// Reserves slots for new chunks (`lens[i]` bytes for `keys[i]`).
    Reserve {
        /// Keys to write.
        keys: Vec<ChunkKey>,
        /// Byte length of each chunk.
        lens: Vec<u64>,
    },
    /// Makes written reservations visible (atomically per chunk).
    Commit {
        /// Reservations to commit.
        slots: Vec<SlotRef>,
    },
    /// Gives up reservations.
    Abort {
        /// Reservations to drop.
        slots: Vec<SlotRef>,
    },
    /// Releases leases taken by a leased lookup.
    Release {
        /// Leases to release.
        slots: Vec<SlotRef>,
    },
    /// Removes chunks (leased chunks are not removed: `Busy`).
    Evict {
        /// Keys to remove.
        keys: Vec<ChunkKey>,
    },
    /// Registers an engine rank's KV tensors on one GPU for save/load; answered with
    /// [`Response::GpuRegistered`]. The registration lives until unregistered or until the
    /// session ends.
    RegisterGpu {
        /// The device, as `GPU-xxxxxxxx-...` (what `nvidia-smi -L` prints).
        device_uuid: String,
        /// The tensors' shape.
        layout: KvLayoutSpec,
        /// One per tensor of the layout, in the layout's order.
        tensors: Vec<GpuTensor>,
    },
    /// Ends a registration after its copies in flight have completed.
    UnregisterGpu {
        /// Registration id.
        registration: u64,
        /// Its generation.
        generation: u64,
    },
    /// Copies engine blocks into new chunks: chunk `i` is blocks
    /// `blocks[i * n .. (i + 1) * n]` (n = blocks / keys), packed block after block, each block
    /// layer by layer, K before V. One outcome per key (`AlreadyPresent` keys are not copied).
    Save {
        /// Registration id.
        registration: u64,
        /// Its generation.
        generation: u64,
        /// Chunk keys.
        keys: Vec<ChunkKey>,
        /// Engine block ids, `n` per key.
        blocks: Vec<u64>,
    },
    /// Copies chunks back into engine blocks (same packing as [`Request::Save`]): the longest
    /// present prefix of `keys` is loaded; keys after it are `NotFound`.
    Load {
        /// Registration id.
        registration: u64,
        /// Its generation.
        generation: u64,
        /// Chunk keys.
        keys: Vec<ChunkKey>,
        /// Engine block ids, `n` per key.
        blocks: Vec<u64>,
    },
    /// Makes written reservations visible with checksums the writer computed
    /// (`checksums[i]`: xxh3-64 of `slots[i]`'s bytes, as `chunk_checksum`), so that the
    /// shards need not read every chunk. The first is checked against its bytes; if it is
    /// wrong it answers `ChecksumMismatch` (not stored) and the others are committed with
    /// checksums the shards compute. The others are otherwise taken as given: a wrong one
    /// makes its chunk fail later checks (SSD, peers), it never makes wrong bytes served.
    CommitChecked {
        /// Reservations to commit.
        slots: Vec<SlotRef>,
        /// One checksum per reservation.
        checksums: Vec<u64>,
    },
}

/// Responses, server to client.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq, Debug)]
pub enum Response {
    /// Answer to [`Request::Ping`].
    Pong,
    /// The namespace is registered.
    Registered {
        /// Its id.
        namespace: u64,
        /// Largest chunk accepted in it.
        max_chunk_bytes: u64,
    },
    /// Hits of the longest present prefix, in key order.
    Lookup {
        /// One hit per prefix key.
        hits: Vec<Hit>,
    },
    /// One reservation per requested key.
    Reserved {
        /// In request order.
        slots: Vec<Reservation>,
    },
    /// An engine rank's tensors are registered.
    GpuRegistered {
        /// Registration id.
        registration: u64,
        /// Its generation (a re-registration never reuses one).
        generation: u64,
    },
    /// The registration is gone and no copy uses the engine's memory any more.
    GpuUnregistered,
    /// One outcome per chunk of a commit, abort, release or evict.
    Outcomes {
        /// In request order.
        outcomes: Vec<ChunkOutcome>,
    },
    /// The whole request failed.
    Error {
        /// Why, as a code.
        code: ErrorCode,
        /// Why, for humans.
        message: String,
    },
}

impl Response {
    /// An error response.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Response::Error { code, message: message.into() }
    }
}

impl Request {
    /// Stable operation name (for metrics and logs).
    pub fn op_name(&self) -> &'static str {
        match self {
            Request::Ping => "ping",
            Request::RegisterNamespace { .. } => "register",
            Request::Lookup { .. } => "lookup",
            Request::Reserve { .. } => "reserve",
            Request::Commit { .. } => "commit",
            Request::CommitChecked { .. } => "commit_checked",
            Request::Abort { .. } => "abort",
            Request::Release { .. } => "release",
            Request::Evict { .. } => "evict",
            Request::RegisterGpu { .. } => "register_gpu",
            Request::UnregisterGpu { .. } => "unregister_gpu",
            Request::Save { .. } => "save",
            Request::Load { .. } => "load",
        }
    }

    /// The first key (or slot's key) of the request that `refused` picks.
    pub fn find_key(&self, mut refused: impl FnMut(&ChunkKey) -> bool) -> Option<ChunkKey> {
        match self {
            Request::Ping
            | Request::RegisterNamespace { .. }
            | Request::RegisterGpu { .. }
            | Request::UnregisterGpu { .. } => None,
            Request::Save { keys, .. }
            | Request::Load { keys, .. }
            | Request::Lookup { keys, .. }
            | Request::Evict { keys }
            | Request::Reserve { keys, .. } => keys.iter().find(|k| refused(k)).copied(),
            Request::Commit { slots }
            | Request::Abort { slots }
            | Request::Release { slots }
            | Request::CommitChecked { slots, .. } => {
                slots.iter().map(|s| s.key).find(|k| refused(k))
            }
        }
    }

    /// Number of keys or slots the request names.
    pub fn key_count(&self) -> usize {
        match self {
            Request::Ping
            | Request::RegisterNamespace { .. }
            | Request::RegisterGpu { .. }
            | Request::UnregisterGpu { .. } => 0,
            // Block ids are bounded by the request size, not the key count.
            Request::Save { keys, .. } | Request::Load { keys, .. } => keys.len(),
            Request::Lookup { keys, .. } | Request::Evict { keys } => keys.len(),
            Request::Reserve { keys, lens } => keys.len().max(lens.len()),
            Request::Commit { slots } | Request::Abort { slots } | Request::Release { slots } => {
                slots.len()
            }
            Request::CommitChecked { slots, checksums } => slots.len().max(checksums.len()),
        }
    }
}
