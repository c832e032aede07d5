//! The peer control RPC (`proto/orbitkv/peer/v1/peer.proto`, generated into
//! `src/generated/`) and its conversions.

#![allow(missing_docs, clippy::all)]

include!("generated/orbitkv.peer.v1.rs");

use orbitkv_proto::ChunkKey;

impl From<&ChunkKey> for Key {
    fn from(k: &ChunkKey) -> Self {
        Key { namespace: k.namespace, digest: k.digest.to_vec() }
    }
}

impl Key {
    /// The chunk key, or None when the digest is not 32 bytes.
    pub fn to_chunk_key(&self) -> Option<ChunkKey> {
        let digest: [u8; 32] = self.digest.as_slice().try_into().ok()?;
        Some(ChunkKey::new(self.namespace, digest))
    }
}
