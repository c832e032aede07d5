//! The value types of the API: keys, namespace descriptors, hits, leases, reservations and GPU
//! registrations.

use orbitkv_client as okv;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::invalid;

/// A chunk's identity: its namespace id and 32-byte chained digest.
#[pyclass(module = "orbitkv._native", frozen, eq, hash, from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ChunkKey(pub(crate) okv::ChunkKey);

#[pymethods]
impl ChunkKey {
    #[new]
    fn new(namespace: u64, digest: &[u8]) -> PyResult<Self> {
        let digest: okv::Digest = digest
            .try_into()
            .map_err(|_| invalid(format!("a digest is 32 bytes, not {}", digest.len())))?;
        Ok(Self(okv::ChunkKey::new(namespace, digest)))
    }

    #[getter]
    fn namespace(&self) -> u64 {
        self.0.namespace
    }

    #[getter]
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.digest)
    }

    /// The shard of a server with `shards` shards that owns this key.
    fn shard(&self, shards: usize) -> PyResult<usize> {
        if shards == 0 {
            return Err(invalid("shards must be at least 1"));
        }
        Ok(self.0.shard(shards))
    }

    fn __repr__(&self) -> String {
        let hex: String = self.0.digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("ChunkKey(namespace={:#x}, digest={hex}...)", self.0.namespace)
    }
}

/// Everything that makes cached bytes compatible; its `id` is every key's namespace.
#[pyclass(module = "orbitkv._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub(crate) struct NamespaceDescriptor(pub(crate) okv::NamespaceDescriptor);

#[pymethods]
impl NamespaceDescriptor {
    #[new]
    #[pyo3(signature = (model, dtype, num_layers, num_kv_heads, head_dim, tokens_per_chunk,
        kv_tensors = 2, layout_version = 1, tp_rank = 0, tp_world_size = 1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: String,
        dtype: &str,
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        tokens_per_chunk: u32,
        kv_tensors: u32,
        layout_version: u32,
        tp_rank: u32,
        tp_world_size: u32,
    ) -> PyResult<Self> {
        let dtype = okv::Dtype::parse(dtype).ok_or_else(|| {
            invalid(format!(
                "dtype {dtype:?}: one of bf16, fp16, fp32, fp8_e4m3 (fp8), fp8_e5m2, u8"
            ))
        })?;
        let d = okv::NamespaceDescriptor {
            model,
            dtype,
            num_layers,
            num_kv_heads,
            head_dim,
            kv_tensors,
            tokens_per_chunk,
            layout_version,
            tp_rank,
            tp_world_size,
        };
        d.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(Self(d))
    }

    /// The namespace id (the same in every process and host).
    #[getter]
    fn id(&self) -> u64 {
        self.0.id()
    }

    /// The largest chunk: `tokens_per_chunk` tokens of every layer.
    #[getter]
    fn max_chunk_bytes(&self) -> u64 {
        self.0.max_chunk_bytes().expect("validated at construction")
    }

    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.0.bytes_per_token().expect("validated at construction")
    }

    #[getter]
    fn model(&self) -> &str {
        &self.0.model
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.0.dtype.as_str()
    }
    #[getter]
    fn num_layers(&self) -> u32 {
        self.0.num_layers
    }
    #[getter]
    fn num_kv_heads(&self) -> u32 {
        self.0.num_kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.0.head_dim
    }
    #[getter]
    fn kv_tensors(&self) -> u32 {
        self.0.kv_tensors
    }
    #[getter]
    fn tokens_per_chunk(&self) -> u32 {
        self.0.tokens_per_chunk
    }
    #[getter]
    fn layout_version(&self) -> u32 {
        self.0.layout_version
    }
    #[getter]
    fn tp_rank(&self) -> u32 {
        self.0.tp_rank
    }
    #[getter]
    fn tp_world_size(&self) -> u32 {
        self.0.tp_world_size
    }

    fn __repr__(&self) -> String {
        let d = &self.0;
        format!(
            "NamespaceDescriptor(model={:?}, dtype={:?}, num_layers={}, num_kv_heads={}, \
             head_dim={}, tokens_per_chunk={}, kv_tensors={}, layout_version={}, tp_rank={}, \
             tp_world_size={}, id={:#x})",
            d.model,
            d.dtype.as_str(),
            d.num_layers,
            d.num_kv_heads,
            d.head_dim,
            d.tokens_per_chunk,
            d.kv_tensors,
            d.layout_version,
            d.tp_rank,
            d.tp_world_size,
            d.id()
        )
    }
}

/// A present chunk (no lease: it may go at any time).
#[pyclass(module = "orbitkv._native", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct Hit {
    /// Chunk length in bytes.
    pub(crate) len: u64,
    /// Tier it was found in: `dram`, `ssd` or `peer`.
    pub(crate) tier: &'static str,
    /// xxh3-64 of its bytes.
    pub(crate) checksum: u64,
}

#[pymethods]
impl Hit {
    fn __repr__(&self) -> String {
        format!("Hit(len={}, tier={:?})", self.len, self.tier)
    }
}

impl From<okv::Hit> for Hit {
    fn from(h: okv::Hit) -> Self {
        Self { len: h.len, tier: h.tier.as_str(), checksum: h.checksum }
    }
}

/// A leased chunk: readable, unchanged, until released (or its session ends).
#[pyclass(module = "orbitkv._native", frozen, from_py_object)]
#[derive(Clone, Copy)]
pub(crate) struct Lease(pub(crate) okv::Lease);

#[pymethods]
impl Lease {
    #[getter]
    fn key(&self) -> ChunkKey {
        ChunkKey(self.0.key)
    }
    #[getter]
    fn len(&self) -> u64 {
        self.0.hit.len
    }
    #[getter]
    fn tier(&self) -> &'static str {
        self.0.hit.tier.as_str()
    }
    #[getter]
    fn checksum(&self) -> u64 {
        self.0.hit.checksum
    }
    /// Where the chunk lies in the arena (see `Client.arena`).
    #[getter]
    fn offset(&self) -> u64 {
        self.0.hit.offset
    }
    fn __len__(&self) -> usize {
        self.0.hit.len as usize
    }
    fn __repr__(&self) -> String {
        format!(
            "Lease({}, len={}, tier={:?})",
            ChunkKey(self.0.key).__repr__(),
            self.0.hit.len,
            self.tier()
        )
    }
}

/// A reserved slot: write `len` bytes into it, then commit (or abort).
#[pyclass(module = "orbitkv._native", frozen, from_py_object)]
#[derive(Clone, Copy)]
pub(crate) struct Reserved(pub(crate) okv::Reserved);

#[pymethods]
impl Reserved {
    #[getter]
    fn key(&self) -> ChunkKey {
        ChunkKey(self.0.key)
    }
    #[getter]
    fn len(&self) -> u64 {
        self.0.len
    }
    /// Where the slot lies in the arena (see `Client.arena`).
    #[getter]
    fn offset(&self) -> u64 {
        self.0.offset
    }
    fn __len__(&self) -> usize {
        self.0.len as usize
    }
    fn __repr__(&self) -> String {
        format!("Reserved({}, len={})", ChunkKey(self.0.key).__repr__(), self.0.len)
    }
}

/// An engine rank's GPU KV tensors registered with the server.
#[pyclass(module = "orbitkv._native", frozen, from_py_object)]
#[derive(Clone, Copy)]
pub(crate) struct GpuRegistration(pub(crate) okv::GpuRegistration);

#[pymethods]
impl GpuRegistration {
    #[getter]
    fn id(&self) -> u64 {
        self.0.id
    }
    #[getter]
    fn generation(&self) -> u64 {
        self.0.generation
    }
    fn __repr__(&self) -> String {
        format!("GpuRegistration(id={}, generation={})", self.0.id, self.0.generation)
    }
}

/// A GPU save or load sent and not yet answered (see `Client.start_save`).
#[pyclass(module = "orbitkv._native")]
pub(crate) struct Transfer(pub(crate) std::sync::Mutex<Option<okv::Transfer>>);

/// The name of a per-chunk outcome: `done` or the error code's name.
pub(crate) fn outcome_name(o: okv::ChunkOutcome) -> &'static str {
    match o {
        okv::ChunkOutcome::Done => "done",
        okv::ChunkOutcome::Failed(code) => code.as_str(),
    }
}

/// Every name [`outcome_name`] and [`put_outcome_name`] can give (the package's `Outcome`).
pub(crate) fn outcome_names() -> Vec<&'static str> {
    let mut names = vec!["done", "stored"];
    names.extend(okv::ErrorCode::ALL.iter().map(|c| c.as_str()));
    names
}

/// The name of a put outcome: `stored`, `already_present` or the error code's name.
pub(crate) fn put_outcome_name(o: okv::PutOutcome) -> &'static str {
    match o {
        okv::PutOutcome::Stored => "stored",
        okv::PutOutcome::AlreadyPresent => "already_present",
        okv::PutOutcome::Failed(code) => code.as_str(),
    }
}

/// The GPU KV layout kinds by name (the Python `KvLayout`'s `kind`).
const LAYOUT_KINDS: [(&str, okv::KvLayoutKind); 6] = [
    ("paged", okv::KvLayoutKind::Paged),
    ("flash_nhd", okv::KvLayoutKind::FlashAttnNhd),
    ("flash_hnd", okv::KvLayoutKind::FlashAttnHnd),
    ("cross_layer", okv::KvLayoutKind::CrossLayer),
    ("mla", okv::KvLayoutKind::MlaPerLayer),
    ("sglang", okv::KvLayoutKind::SglangPerLayer),
];

/// A layout kind by its name.
fn layout_kind(name: &str) -> PyResult<okv::KvLayoutKind> {
    LAYOUT_KINDS.iter().find(|(n, _)| *n == name).map(|&(_, k)| k).ok_or_else(|| {
        const KINDS: &str = "paged, flash_nhd, flash_hnd, cross_layer, mla, sglang";
        invalid(format!("layout kind {name:?}: one of {KINDS}"))
    })
}

/// The shape of an engine rank's KV cache on one GPU: `orbitkv_proto::KvLayoutSpec` itself
/// (see docs/operations.md). `kind`: paged (vLLM >= 0.32, per layer), flash_nhd, flash_hnd,
/// cross_layer, mla or sglang.
#[pyclass(module = "orbitkv._native", frozen, eq, from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct KvLayout(pub(crate) okv::KvLayoutSpec);

#[pymethods]
impl KvLayout {
    #[new]
    fn new(
        kind: &str,
        num_layers: u32,
        num_blocks: u64,
        block_size: u32,
        kv_heads: u32,
        head_dim: u32,
        elem_bytes: u32,
    ) -> PyResult<Self> {
        let kind = layout_kind(kind)?;
        Ok(Self(okv::KvLayoutSpec {
            kind,
            num_layers,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            elem_bytes,
        }))
    }

    #[getter]
    fn kind(&self) -> &'static str {
        LAYOUT_KINDS.iter().find(|(_, k)| *k == self.0.kind).map_or("?", |&(n, _)| n)
    }

    #[getter]
    fn num_layers(&self) -> u32 {
        self.0.num_layers
    }

    #[getter]
    fn num_blocks(&self) -> u64 {
        self.0.num_blocks
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.0.block_size
    }

    #[getter]
    fn kv_heads(&self) -> u32 {
        self.0.kv_heads
    }

    #[getter]
    fn head_dim(&self) -> u32 {
        self.0.head_dim
    }

    #[getter]
    fn elem_bytes(&self) -> u32 {
        self.0.elem_bytes
    }

    fn __repr__(&self) -> String {
        let l = &self.0;
        format!(
            "KvLayout(kind={:?}, num_layers={}, num_blocks={}, block_size={}, kv_heads={}, \
             head_dim={}, elem_bytes={})",
            self.kind(),
            l.num_layers,
            l.num_blocks,
            l.block_size,
            l.kv_heads,
            l.head_dim,
            l.elem_bytes
        )
    }
}
