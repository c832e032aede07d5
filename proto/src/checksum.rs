//! The chunk checksum: XXH3-64 with seed 0 over the chunk's bytes, computed at commit, stored
//! with the chunk on SSD (and sent to peers), verified wherever the bytes are read back.
//!
//! Computed with the fastest SIMD the CPU has (chosen at run time), so the same binary is fast
//! on every host; the value is the standard XXH3-64, whatever the CPU.

/// XXH3-64 (seed 0) of `bytes`.
pub fn chunk_checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// [`chunk_checksum`] of a chunk given a piece at a time, in order: the value of the pieces
/// joined, whatever their sizes. For hashing a long chunk with other work between the pieces.
#[derive(Default)]
pub struct ChunkChecksum(twox_hash::XxHash3_64);

impl ChunkChecksum {
    /// Nothing hashed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the chunk's next bytes.
    pub fn update(&mut self, piece: &[u8]) {
        std::hash::Hasher::write(&mut self.0, piece);
    }

    /// The checksum of everything added.
    pub fn finish(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_give_the_checksum_of_the_whole() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(40503) >> 7) as u8).collect();
        for len in [0, 1, 64, 240, 241, 1024, 1025, 65_536, 70_000] {
            let whole = chunk_checksum(&data[..len]);
            // Pieces that split stripes, blocks and the internal buffer at odd places.
            for piece in [1, 7, 64, 100, 1024, 4093, 65_536] {
                let mut h = ChunkChecksum::new();
                for p in data[..len].chunks(piece) {
                    h.update(p);
                }
                assert_eq!(h.finish(), whole, "length {len} in pieces of {piece}");
            }
        }
    }

    #[test]
    fn standard_vectors_and_agreement_with_a_second_implementation() {
        // XXH3_64bits("") from the reference implementation.
        assert_eq!(chunk_checksum(b""), 0x2d06_8005_38d3_94c2);
        let data: Vec<u8> =
            (0..300_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        // Every size class of the algorithm: 0-16, 17-128, 129-240, and the long (striped)
        // path around its block and stripe boundaries.
        for len in
            [1, 3, 4, 8, 9, 16, 17, 64, 128, 129, 200, 240, 241, 1024, 1025, 4096, 65536, 299_999]
        {
            assert_eq!(
                chunk_checksum(&data[..len]),
                xxhash_rust::xxh3::xxh3_64(&data[..len]),
                "length {len}"
            );
        }
    }
}
