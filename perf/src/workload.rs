//! The stable derivations of the benchmark's namespace, keys and values.
//!
//! A later run (a verify-only pass, another client) re-derives exactly these from the same
//! seed to check what an earlier run wrote, so nothing here may change silently: the golden
//! tests below pin every derivation.
//!
//! - namespace: model `orbitkv-perf`, fp32, 1 layer, 1 KV tensor, 1 head, head dim 1024
//!   (4 KiB per token), `tokens_per_chunk = ceil(value_size / 4 KiB)`, layout 1, TP 0 of 1;
//! - main key `i`: digest `blake3("orbitkv-perf" || seed LE || i LE)`;
//! - lookup-set key `j` of client `c`: digest
//!   `blake3("orbitkv-perf/lookup-set" || seed LE || c LE || j LE)` (a separate domain, so the
//!   two sets never share a key);
//! - value of a key: four interleaved xorshift64 (13, 7, 17) lanes seeded by the four
//!   little-endian words of `blake3("orbitkv-perf/value" || digest)` (a zero word becomes
//!   `0x9E37_79B9_7F4A_7C15`); each step advances every lane once and emits the lanes in order
//!   as little-endian bytes (32 bytes per step), truncated to the value's length.

use orbitkv_client::{ChunkKey, Digest, Dtype, NamespaceDescriptor};

/// Model name of the benchmark namespace.
pub(crate) const MODEL: &str = "orbitkv-perf";
/// Bytes per token of the benchmark namespace.
pub(crate) const BYTES_PER_TOKEN: u64 = 4096;

const KEY_DOMAIN: &[u8] = b"orbitkv-perf";
const LOOKUP_KEY_DOMAIN: &[u8] = b"orbitkv-perf/lookup-set";
const VALUE_DOMAIN: &[u8] = b"orbitkv-perf/value";
const ZERO_LANE: u64 = 0x9E37_79B9_7F4A_7C15;

/// The benchmark namespace for values of `value_size` bytes (its chunks hold at least that).
pub(crate) fn namespace(value_size: u64) -> Result<NamespaceDescriptor, String> {
    let tokens = u32::try_from(value_size.div_ceil(BYTES_PER_TOKEN))
        .map_err(|_| format!("{value_size} bytes need more than 2^32 tokens of 4 KiB"))?;
    let d = NamespaceDescriptor {
        model: MODEL.into(),
        dtype: Dtype::Fp32,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: (BYTES_PER_TOKEN / Dtype::Fp32.size()) as u32,
        kv_tensors: 1,
        tokens_per_chunk: tokens.max(1),
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    };
    d.validate().map_err(|e| e.to_string())?;
    Ok(d)
}

/// Where benchmark keys live: a namespace id and a seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeySpace {
    /// Namespace id of every key.
    pub namespace: u64,
    /// The run's seed.
    pub seed: u64,
}

impl KeySpace {
    /// Main key `i`.
    pub fn key(&self, i: u64) -> ChunkKey {
        let mut h = blake3::Hasher::new();
        h.update(KEY_DOMAIN);
        h.update(&self.seed.to_le_bytes());
        h.update(&i.to_le_bytes());
        ChunkKey::new(self.namespace, *h.finalize().as_bytes())
    }

    /// Key `j` of client `client`'s lookup set.
    pub fn lookup_key(&self, client: u64, j: u64) -> ChunkKey {
        let mut h = blake3::Hasher::new();
        h.update(LOOKUP_KEY_DOMAIN);
        h.update(&self.seed.to_le_bytes());
        h.update(&client.to_le_bytes());
        h.update(&j.to_le_bytes());
        ChunkKey::new(self.namespace, *h.finalize().as_bytes())
    }
}

/// The value generator of one key.
struct ValueStream {
    lanes: [u64; 4],
}

impl ValueStream {
    fn new(digest: &Digest) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(VALUE_DOMAIN);
        h.update(digest);
        let seed = h.finalize();
        let mut lanes = [0u64; 4];
        for (lane, word) in lanes.iter_mut().zip(seed.as_bytes().chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            *lane = match u64::from_le_bytes(w) {
                0 => ZERO_LANE,
                v => v,
            };
        }
        Self { lanes }
    }

    /// Advances every lane once and returns the lanes (the next 32 bytes, little endian).
    #[inline(always)]
    fn next_words(&mut self) -> [u64; 4] {
        for x in &mut self.lanes {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
        }
        self.lanes
    }

    /// The next 32 bytes.
    fn next_bytes(&mut self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (w, dst) in self.next_words().iter().zip(out.chunks_exact_mut(8)) {
            dst.copy_from_slice(&w.to_le_bytes());
        }
        out
    }
}

fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(bytes);
    u64::from_le_bytes(w)
}

/// Writes the value of the key with `digest` into `buf` (its length is the value's length).
pub(crate) fn fill_value(digest: &Digest, buf: &mut [u8]) {
    let mut stream = ValueStream::new(digest);
    let mut blocks = buf.chunks_exact_mut(32);
    for block in &mut blocks {
        let w = stream.next_words();
        block[0..8].copy_from_slice(&w[0].to_le_bytes());
        block[8..16].copy_from_slice(&w[1].to_le_bytes());
        block[16..24].copy_from_slice(&w[2].to_le_bytes());
        block[24..32].copy_from_slice(&w[3].to_le_bytes());
    }
    let tail = blocks.into_remainder();
    if !tail.is_empty() {
        let last = stream.next_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }
}

/// The offset of the first byte of `buf` that differs from the value of the key with
/// `digest` (of `buf.len()` bytes); `None` when all match.
pub(crate) fn first_mismatch(digest: &Digest, buf: &[u8]) -> Option<usize> {
    let mut stream = ValueStream::new(digest);
    let mut blocks = buf.chunks_exact(32);
    let mut at = 0;
    for block in &mut blocks {
        let w = stream.next_words();
        let diff = (word(&block[0..8]) ^ w[0])
            | (word(&block[8..16]) ^ w[1])
            | (word(&block[16..24]) ^ w[2])
            | (word(&block[24..32]) ^ w[3]);
        if diff != 0 {
            let want: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
            return Some(at + diff_at(block, &want));
        }
        at += 32;
    }
    let tail = blocks.remainder();
    if !tail.is_empty() {
        let want = stream.next_bytes();
        if tail != &want[..tail.len()] {
            return Some(at + diff_at(tail, &want));
        }
    }
    None
}

fn diff_at(got: &[u8], want: &[u8]) -> usize {
    got.iter().zip(want).take_while(|(a, b)| a == b).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    const SPACE: KeySpace = KeySpace { namespace: 7, seed: 1 };

    #[test]
    fn golden_key_0_of_seed_1() {
        // Pinned: changing it orphans everything earlier runs wrote.
        assert_eq!(hex(&SPACE.key(0).digest), GOLDEN_KEY_0);
        assert_eq!(SPACE.key(0).namespace, 7);
    }

    #[test]
    fn golden_value_of_key_0() {
        let mut v = vec![0u8; 40];
        fill_value(&SPACE.key(0).digest, &mut v);
        assert_eq!(hex(&v), GOLDEN_VALUE_0);
    }

    #[test]
    fn golden_namespace() {
        let d = namespace(1 << 20).unwrap();
        assert_eq!(d.max_chunk_bytes(), Some(1 << 20));
        assert_eq!(d.id(), GOLDEN_NAMESPACE_1MIB);
        assert_eq!(namespace(1).unwrap().max_chunk_bytes(), Some(4096));
        assert_eq!(namespace(4097).unwrap().max_chunk_bytes(), Some(8192));
    }

    const GOLDEN_KEY_0: &str = "933a38621d7b78d7c66e4d3cb83adf128aa7e9f102f448e1f569133199f4dd45";
    const GOLDEN_VALUE_0: &str =
        "073c3bd1bd928e7092fa7100540a5bfaf1810f0541d0c2a62ada891d7e90786abfaba8d4669d0b96";
    const GOLDEN_NAMESPACE_1MIB: u64 = 0x333f_7a66_a32c_640b;

    #[test]
    fn keys_differ_by_index_seed_and_domain() {
        let other_seed = KeySpace { seed: 2, ..SPACE };
        assert_ne!(SPACE.key(0), SPACE.key(1));
        assert_ne!(SPACE.key(0), other_seed.key(0));
        assert_ne!(SPACE.key(0), SPACE.lookup_key(0, 0));
        assert_ne!(SPACE.lookup_key(0, 0), SPACE.lookup_key(1, 0));
    }

    #[test]
    fn values_verify_and_mismatches_are_located() {
        for len in [0usize, 1, 31, 32, 33, 4096, 65_537] {
            let key = SPACE.key(len as u64);
            let mut v = vec![0u8; len];
            fill_value(&key.digest, &mut v);
            assert_eq!(first_mismatch(&key.digest, &v), None, "len {len}");
            if len > 0 {
                let at = len / 2;
                v[at] ^= 0x40;
                assert_eq!(first_mismatch(&key.digest, &v), Some(at), "len {len}");
                v[at] ^= 0x40;
                assert!(first_mismatch(&SPACE.key(len as u64 + 1).digest, &v).is_some());
            }
        }
    }

    #[test]
    fn a_shorter_value_is_a_prefix_of_a_longer_one() {
        let key = SPACE.key(3);
        let mut long = vec![0u8; 100];
        let mut short = vec![0u8; 45];
        fill_value(&key.digest, &mut long);
        fill_value(&key.digest, &mut short);
        assert_eq!(&long[..45], &short[..]);
    }
}
