//! Namespaces: everything that makes chunk bytes compatible.

use rkyv::{Archive, Deserialize, Serialize};

/// 64-bit namespace id: the first 8 bytes (little endian) of the BLAKE3 hash of the
/// descriptor's canonical encoding.
pub type NamespaceId = u64;

/// Element type of the cached KV tensors.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum Dtype {
    /// 16-bit brain float.
    Bf16 = 1,
    /// 16-bit IEEE float.
    Fp16 = 2,
    /// 32-bit IEEE float.
    Fp32 = 3,
    /// 8-bit float, e4m3.
    Fp8E4m3 = 4,
    /// 8-bit float, e5m2.
    Fp8E5m2 = 5,
    /// Bytes: state that is no KV tensor of one element type (an engine's recurrent state
    /// page, stored as the engine hands it over).
    U8 = 6,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 | Dtype::U8 => 1,
        }
    }

    /// Stable name (`bf16`, `fp16`, `fp32`, `fp8_e4m3`, `fp8_e5m2`, `u8`).
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp32 => "fp32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::U8 => "u8",
        }
    }

    /// Parses a stable name; `fp8` means `fp8_e4m3`.
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "bf16" => Dtype::Bf16,
            "fp16" | "f16" => Dtype::Fp16,
            "fp32" | "f32" => Dtype::Fp32,
            "fp8" | "fp8_e4m3" => Dtype::Fp8E4m3,
            "fp8_e5m2" => Dtype::Fp8E5m2,
            "u8" => Dtype::U8,
            _ => return None,
        })
    }
}

/// Everything that makes cached bytes compatible between writers and readers.
///
/// Chunks are stored under the id of their descriptor; two engines share chunks only if their
/// descriptors are identical field by field.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq, Hash, Debug)]
pub struct NamespaceDescriptor {
    /// Model identity (name and revision), at most 256 bytes.
    pub model: String,
    /// Element type.
    pub dtype: Dtype,
    /// Number of attention layers stored per chunk.
    pub num_layers: u32,
    /// KV heads per layer (of this TP rank).
    pub num_kv_heads: u32,
    /// Elements per head (or latent width for MLA).
    pub head_dim: u32,
    /// Tensors per layer and token: 2 for K and V, 1 for an MLA latent.
    pub kv_tensors: u32,
    /// Tokens per chunk.
    pub tokens_per_chunk: u32,
    /// Layout / format version of the stored bytes.
    pub layout_version: u32,
    /// Tensor-parallel rank of the writer.
    pub tp_rank: u32,
    /// Tensor-parallel world size.
    pub tp_world_size: u32,
}

/// A descriptor field that is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid namespace descriptor: {field} {reason}")]
pub struct NamespaceError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: &'static str,
}

const NAMESPACE_DOMAIN: &[u8] = b"orbitkv.namespace.v1";

impl NamespaceDescriptor {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), NamespaceError> {
        let bad = |field, reason| Err(NamespaceError { field, reason });
        if self.model.is_empty() {
            return bad("model", "must not be empty");
        }
        if self.model.len() > 256 {
            return bad("model", "must be at most 256 bytes");
        }
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("tokens_per_chunk", self.tokens_per_chunk),
            ("tp_world_size", self.tp_world_size),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1");
            }
        }
        if !(1..=2).contains(&self.kv_tensors) {
            return bad("kv_tensors", "must be 1 (MLA latent) or 2 (K and V)");
        }
        if self.tp_rank >= self.tp_world_size {
            return bad("tp_rank", "must be below tp_world_size");
        }
        if self.max_chunk_bytes().is_none() {
            return bad("tokens_per_chunk", "makes the chunk size overflow 64 bits");
        }
        Ok(())
    }

    /// The canonical encoding: fixed field order, little-endian integers, length-prefixed model.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(NAMESPACE_DOMAIN.len() + 4 + self.model.len() + 36);
        out.extend_from_slice(NAMESPACE_DOMAIN);
        out.extend_from_slice(&(self.model.len() as u32).to_le_bytes());
        out.extend_from_slice(self.model.as_bytes());
        out.push(self.dtype as u8);
        for v in [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.kv_tensors,
            self.tokens_per_chunk,
            self.layout_version,
            self.tp_rank,
            self.tp_world_size,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// The namespace id of this descriptor.
    pub fn id(&self) -> NamespaceId {
        let hash = blake3::hash(&self.canonical_bytes());
        let mut head = [0u8; 8];
        head.copy_from_slice(&hash.as_bytes()[..8]);
        u64::from_le_bytes(head)
    }

    /// Bytes of one token across all layers.
    pub fn bytes_per_token(&self) -> Option<u64> {
        (self.num_layers as u64)
            .checked_mul(self.kv_tensors as u64)?
            .checked_mul(self.num_kv_heads as u64)?
            .checked_mul(self.head_dim as u64)?
            .checked_mul(self.dtype.size())
    }

    /// The largest chunk this namespace can hold: `tokens_per_chunk * bytes_per_token`.
    pub fn max_chunk_bytes(&self) -> Option<u64> {
        self.bytes_per_token()?.checked_mul(self.tokens_per_chunk as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn llama_8b() -> NamespaceDescriptor {
        NamespaceDescriptor {
            model: "meta-llama/Llama-3.1-8B".into(),
            dtype: Dtype::Bf16,
            num_layers: 32,
            num_kv_heads: 8,
            head_dim: 128,
            kv_tensors: 2,
            tokens_per_chunk: 256,
            layout_version: 1,
            tp_rank: 0,
            tp_world_size: 1,
        }
    }

    #[test]
    fn chunk_size_of_a_llama_chunk() {
        // 32 layers * 2 * 8 heads * 128 * 2 bytes = 128 KiB per token, 32 MiB per 256 tokens.
        assert_eq!(llama_8b().bytes_per_token(), Some(128 << 10));
        assert_eq!(llama_8b().max_chunk_bytes(), Some(32 << 20));
    }

    #[test]
    fn dtype_names_round_trip_and_sizes() {
        for d in [Dtype::Bf16, Dtype::Fp16, Dtype::Fp32, Dtype::Fp8E4m3, Dtype::Fp8E5m2, Dtype::U8]
        {
            assert_eq!(Dtype::parse(d.as_str()), Some(d));
        }
        assert_eq!(Dtype::U8.size(), 1);
        assert_eq!(Dtype::parse("int8"), None);
        // A page of bytes (an engine's state page): its length is the chunk size.
        let state = NamespaceDescriptor {
            dtype: Dtype::U8,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 4000,
            kv_tensors: 1,
            tokens_per_chunk: 1,
            ..llama_8b()
        };
        assert_eq!(state.max_chunk_bytes(), Some(4000));
        assert_ne!(state.id(), NamespaceDescriptor { dtype: Dtype::Fp8E4m3, ..state.clone() }.id());
    }

    #[test]
    fn every_field_changes_the_id() {
        let base = llama_8b();
        let variants = [
            NamespaceDescriptor { model: "other".into(), ..base.clone() },
            NamespaceDescriptor { dtype: Dtype::Fp16, ..base.clone() },
            NamespaceDescriptor { num_layers: 31, ..base.clone() },
            NamespaceDescriptor { num_kv_heads: 4, ..base.clone() },
            NamespaceDescriptor { head_dim: 64, ..base.clone() },
            NamespaceDescriptor { kv_tensors: 1, ..base.clone() },
            NamespaceDescriptor { tokens_per_chunk: 16, ..base.clone() },
            NamespaceDescriptor { layout_version: 2, ..base.clone() },
            NamespaceDescriptor { tp_rank: 1, tp_world_size: 2, ..base.clone() },
            NamespaceDescriptor { tp_world_size: 2, ..base.clone() },
        ];
        let mut ids = std::collections::HashSet::new();
        ids.insert(base.id());
        for v in &variants {
            assert!(ids.insert(v.id()), "{v:?} collides");
        }
    }

    #[test]
    fn golden_namespace_id() {
        // Pinned: changing the canonical encoding changes every stored id.
        assert_eq!(llama_8b().id(), GOLDEN_LLAMA_ID);
    }

    const GOLDEN_LLAMA_ID: u64 = 0x2881_a422_009e_6af4;

    #[test]
    fn validation_names_the_field() {
        let e = NamespaceDescriptor { head_dim: 0, ..llama_8b() }.validate().unwrap_err();
        assert_eq!(e.field, "head_dim");
        let e = NamespaceDescriptor { tp_rank: 1, ..llama_8b() }.validate().unwrap_err();
        assert_eq!(e.field, "tp_rank");
        let e = NamespaceDescriptor { kv_tensors: 3, ..llama_8b() }.validate().unwrap_err();
        assert_eq!(e.field, "kv_tensors");
        let e = NamespaceDescriptor { model: String::new(), ..llama_8b() }.validate().unwrap_err();
        assert_eq!(e.field, "model");
        let e =
            NamespaceDescriptor { tokens_per_chunk: u32::MAX, num_layers: u32::MAX, ..llama_8b() }
                .validate()
                .unwrap_err();
        assert_eq!(e.field, "tokens_per_chunk");
        assert!(llama_8b().validate().is_ok());
    }
}
