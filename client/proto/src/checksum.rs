//! The chunk checksum: XXH3-64 with seed 0 over the chunk's bytes, computed at commit, stored
//! with the chunk on SSD (and sent to peers), verified wherever the bytes are read back.
//!
//! Computed with the fastest SIMD the CPU has (chosen at run time), so the same binary is fast
//! on every host; the value is the standard XXH3-64, whatever the CPU.

/// XXH3-64 (seed 0) of `bytes`.
pub fn chunk_checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

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
