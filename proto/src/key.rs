use rkyv::{Archive, Deserialize, Serialize};

/// A 32-byte chained prefix digest (BLAKE3 output).
pub type Digest = [u8; 32];

/// The identity of one cached chunk: its namespace and its chained prefix digest.
///
/// Two keys are equal only if both parts are equal, so chunks never cross namespaces.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ChunkKey {
    /// Namespace id ([`crate::NamespaceDescriptor::id`]).
    pub namespace: u64,
    /// Chained prefix digest of the chunk.
    pub digest: Digest,
}

impl ChunkKey {
    /// Builds a key from its parts.
    pub const fn new(namespace: u64, digest: Digest) -> Self {
        Self { namespace, digest }
    }

    /// The shard that owns this key when the server runs `shards` shards.
    ///
    /// `shard = u64::from_le_bytes(digest[0..8]) % shards`, identical in every process.
    pub fn shard(&self, shards: usize) -> usize {
        debug_assert!(shards > 0, "shard count is validated to be non-zero at start");
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.digest[..8]);
        (u64::from_le_bytes(head) % shards.max(1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_uses_first_eight_digest_bytes_little_endian() {
        let mut digest = [0xffu8; 32];
        digest[..8].copy_from_slice(&10u64.to_le_bytes());
        let key = ChunkKey::new(7, digest);
        assert_eq!(key.shard(4), 2);
        assert_eq!(key.shard(3), 1);
        assert_eq!(key.shard(1), 0);
    }
}
