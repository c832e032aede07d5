//! Wire types and identities shared by every OrbitKV process.
//!
//! This crate links no runtime (no executor, no CUDA) so that engines can link it: it defines
//! the chunk identity ([`ChunkKey`], chained prefix hashing), the namespace descriptor, the
//! bootstrap and request/response messages (rkyv, validated on receipt), error codes, latency
//! recorders, the human units used by every command line, and the admin socket's requests,
//! replies and client ([`admin`]).

#![deny(unsafe_code)]

pub mod admin;
mod checksum;
mod codec;
mod error;
mod hashing;
mod key;
mod latency;
mod mapping;
mod messages;
mod namespace;
mod paths;
mod peering;
mod units;

pub use checksum::{chunk_checksum, ChunkChecksum};
pub use codec::{decode, encode, frame_header, read_frame, write_frame, DecodeError, MAX_FRAME};
pub use error::ErrorCode;
pub use hashing::{engine_digest, prefix_digests, PrefixHasher, PREFIX_SEED};
pub use key::{ChunkKey, Digest};
pub use latency::{LatencyHistogram, LatencySummary};
pub use mapping::HostMapping;
pub use messages::{
    Bootstrap, ChunkOutcome, GpuTensor, Hit, KvLayoutKind, KvLayoutSpec, Request, Reservation,
    Response, SlotRef, Tier, Welcome, ARENA_HEADER_BYTES, DOORBELL_STRIDE, MAX_ARENA_FILES,
    PROTOCOL_VERSION,
};
pub use namespace::{Dtype, NamespaceDescriptor, NamespaceError, NamespaceId};
pub use paths::{admin_socket_path, default_socket_path, SOCKET_ENV};
pub use peering::{InventoryChunk, InventoryDelta, PeerFetch};
pub use units::{format_bytes, parse_duration, parse_size, UnitError, PAGE_SIZE};
