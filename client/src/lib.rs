//! `orbitkv-client`: the engine-side library of OrbitKV.
//!
//! A [`Client`] opens a session with the local `orbitkv-server` over its Unix socket, maps the
//! server's DRAM arena, and sends requests over the session's iceoryx2 service. Payload bytes
//! never travel in messages: `put` writes into reserved arena slots and commits them, `get`
//! reads leased slots (a zero-copy view, or a copy into caller buffers).
//!
//! One `Client` is one session and is used from one thread at a time. If the server restarts,
//! the call that notices fails with [`Error::Disconnected`] and the next call reconnects
//! (re-registering the namespaces this client registered). A connect that fails makes the
//! calls after it fail at once with [`Error::Unavailable`] until the next attempt is due; the
//! wait between attempts doubles up to a cap (`ClientOptions::reconnect_backoff*`).

#![deny(unsafe_code)]

mod backoff;
mod client;
mod connection;
mod copies;
mod error;
mod gpu;
mod group;
mod host;
mod mapping;

pub use client::{Client, ClientOptions, Lease, NamespaceInfo, PutOutcome, Reserved};
pub use error::Error;
pub use gpu::{GpuRegistration, Transfer};
pub use group::GroupPrefix;
pub use host::BlockLayout;
pub use mapping::{copy_chunk, HostArena};
pub use orbitkv_proto::{
    chunk_checksum, engine_digest, prefix_digests, ChunkKey, ChunkOutcome, Digest, Dtype,
    ErrorCode, GpuTensor, Hit, HostMapping, KvLayoutKind, KvLayoutSpec, NamespaceDescriptor,
    PrefixHasher, Request, Response, Tier, PREFIX_SEED,
};
