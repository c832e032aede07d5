//! Chained prefix hashing: `d_i = BLAKE3(d_{i-1} || tokens_i || extra)`.
//!
//! Tokens are encoded as u32 little endian. The chain starts from [`PREFIX_SEED`], a fixed
//! constant, so every process on every host derives the same digests for the same tokens.

use crate::key::Digest;

/// The chain's starting value: BLAKE3 of the ASCII string `orbitkv.prefix.v1`.
pub const PREFIX_SEED: Digest = [
    186, 107, 130, 164, 232, 204, 91, 84, 2, 129, 160, 230, 253, 124, 52, 91, 20, 92, 106, 210,
    168, 133, 35, 180, 226, 31, 206, 100, 56, 195, 186, 216,
];

/// Incremental chained hasher: feed one full chunk of tokens at a time.
#[derive(Clone, Debug)]
pub struct PrefixHasher {
    prev: Digest,
}

impl Default for PrefixHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixHasher {
    /// Starts a chain at [`PREFIX_SEED`].
    pub fn new() -> Self {
        Self { prev: PREFIX_SEED }
    }

    /// Continues a chain after `prev` (for example an engine-supplied parent hash).
    pub fn resume(prev: Digest) -> Self {
        Self { prev }
    }

    /// Hashes the next chunk and returns its digest; `extra` carries anything besides the
    /// tokens that changes the KV (LoRA id, multimodal content hash), empty if none.
    pub fn next_chunk(&mut self, tokens: &[u32], extra: &[u8]) -> Digest {
        let mut h = blake3::Hasher::new();
        h.update(&self.prev);
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.update(extra);
        self.prev = *h.finalize().as_bytes();
        self.prev
    }
}

/// Digests of every full chunk of `tokens` (a trailing partial chunk is not hashed).
pub fn prefix_digests(tokens: &[u32], tokens_per_chunk: usize, extra: &[u8]) -> Vec<Digest> {
    assert!(tokens_per_chunk > 0, "tokens_per_chunk is validated to be non-zero");
    let mut hasher = PrefixHasher::new();
    tokens.chunks_exact(tokens_per_chunk).map(|c| hasher.next_chunk(c, extra)).collect()
}

/// Domain tag of [`engine_digest`].
const ENGINE_HASH_DOMAIN: &[u8] = b"orbitkv.engine-hash.v1";

/// The digest of a chunk that an engine names by its own block hash (vLLM's
/// `request.block_hashes`, SGLang's page hashes): BLAKE3 of a domain tag, the hash's length
/// (u32 little endian) and its bytes. Engine hashes chain already; this maps them into
/// OrbitKV's 32-byte digests, the same in every process and host.
pub fn engine_digest(hash: &[u8]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(ENGINE_HASH_DOMAIN);
    h.update(&(hash.len() as u32).to_le_bytes());
    h.update(hash);
    *h.finalize().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &Digest) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn seed_is_blake3_of_its_name() {
        assert_eq!(PREFIX_SEED, *blake3::hash(b"orbitkv.prefix.v1").as_bytes());
    }

    #[test]
    fn digests_chain_and_ignore_partial_chunks() {
        let tokens: Vec<u32> = (0..10).collect();
        let d = prefix_digests(&tokens, 4, b"");
        assert_eq!(d.len(), 2);
        let mut h = PrefixHasher::new();
        assert_eq!(h.next_chunk(&[0, 1, 2, 3], b""), d[0]);
        assert_eq!(h.next_chunk(&[4, 5, 6, 7], b""), d[1]);
        // Same second chunk after a different first chunk gives a different digest.
        let other = prefix_digests(&[9, 1, 2, 3, 4, 5, 6, 7], 4, b"");
        assert_eq!(other.len(), 2);
        assert_ne!(other[1], d[1]);
        // extra bytes change the digest.
        assert_ne!(prefix_digests(&tokens, 4, b"lora:7")[0], d[0]);
    }

    /// Golden vectors, cross-checked against an independent BLAKE3 implementation
    /// (see docs/protocol.md for how they were produced).
    #[test]
    fn golden_vectors() {
        let tokens: Vec<u32> = (0..8).collect();
        let d = prefix_digests(&tokens, 4, b"");
        assert_eq!(hex(&d[0]), GOLDEN_0);
        assert_eq!(hex(&d[1]), GOLDEN_1);
        let e = prefix_digests(&[1, 2, 3, 4], 4, b"lora:7");
        assert_eq!(hex(&e[0]), GOLDEN_EXTRA);
    }

    /// The vectors in `golden/hashing.json`, which the Python package's tests check too.
    #[test]
    fn shared_golden_vectors() {
        let v: serde_json::Value =
            serde_json::from_str(include_str!("../golden/hashing.json")).expect("valid json");
        let unhex = |s: &serde_json::Value| -> Vec<u8> {
            let s = s.as_str().expect("hex string");
            (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
        };
        for case in v["prefix"].as_array().expect("prefix cases") {
            let tokens: Vec<u32> = case["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let per = case["tokens_per_chunk"].as_u64().unwrap() as usize;
            let got: Vec<String> =
                prefix_digests(&tokens, per, &unhex(&case["extra"])).iter().map(hex).collect();
            let want: Vec<String> = case["digests"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_str().unwrap().to_owned())
                .collect();
            assert_eq!(got, want, "{case}");
        }
        for case in v["engine"].as_array().expect("engine cases") {
            assert_eq!(hex(&engine_digest(&unhex(&case["hash"]))), case["digest"], "{case}");
        }
    }

    const GOLDEN_0: &str = "eff812c3db193ea0ace6ed249a59c7ea92ad1b9ee1033347ff03e982c5f130c4";
    const GOLDEN_1: &str = "c9d5ac81999c790ef37b0c53cdae2bd8f1c8e835a7832a5d7376e9f67d665b3e";
    const GOLDEN_EXTRA: &str = "8419da241ce7874ab321755586f4e59a65be71f2039630f60fce2e99abbf5e61";
}
