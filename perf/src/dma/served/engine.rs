//! The stand-in engine as the server sees it ([`Engine`]): the namespace and keys its chunks
//! go under, and the checks of every byte after a series, the saved chunks through the mapped
//! arena and the tensors by reading them back. Shared by the series through the server and
//! the engine-side copies.

use std::sync::Arc;

use orbitkv_client::{ChunkKey, ChunkOutcome, Client, Dtype, KvLayoutSpec, NamespaceDescriptor};
use orbitkv_gpu::dma::EngineMemory;
use orbitkv_gpu::LayoutGeometry;

use crate::args::{DmaArgs, DtypeArg};
use crate::error::Error;

/// The stand-in engine the server copies from and to.
pub(crate) struct Engine<'a> {
    /// Its tensors.
    pub memory: &'a Arc<EngineMemory>,
    /// Their contents.
    pub originals: &'a [Vec<u8>],
    /// Block ids of each chunk.
    pub chunks: Vec<Vec<u64>>,
    /// Bytes per chunk.
    pub chunk_len: u64,
    /// The device.
    pub device_uuid: &'a str,
}

pub(crate) fn client_err(op: &'static str) -> impl Fn(orbitkv_client::Error) -> Error {
    move |e| Error::Gpu(format!("{op} through the server: {e}"))
}

fn expected_chunk(l: &KvLayoutSpec, originals: &[Vec<u8>], blocks: &[u64], out: &mut Vec<u8>) {
    out.clear();
    for &block in blocks {
        for s in l.block_segments(block) {
            let t = &originals[s.tensor as usize];
            out.extend_from_slice(&t[s.offset as usize..(s.offset + s.len) as usize]);
        }
    }
}

pub(crate) fn not_done(o: &[ChunkOutcome]) -> u64 {
    o.iter().filter(|o| **o != ChunkOutcome::Done).count() as u64
}

/// The namespace of the stand-in engine's chunks.
pub(crate) fn descriptor(
    a: &DmaArgs,
    layout: &KvLayoutSpec,
    per_chunk: u32,
) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: format!("orbitkv-perf-dma/{:?}", layout.kind),
        dtype: match a.dtype {
            DtypeArg::Bf16 => Dtype::Bf16,
            DtypeArg::Fp16 => Dtype::Fp16,
            DtypeArg::Fp8 => Dtype::Fp8E4m3,
        },
        num_layers: layout.num_layers,
        num_kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        kv_tensors: layout.kv() as u32,
        tokens_per_chunk: layout.block_size * per_chunk,
        layout_version: 1,
        tp_rank: a.tp_rank,
        tp_world_size: a.tp_world_size,
    }
}

/// The keys of the run's `n` chunks in namespace `ns` (the same prompt for every rank).
pub(crate) fn chunk_keys(ns: u64, seed: u64, n: usize) -> Vec<ChunkKey> {
    (0..n as u64)
        .map(|i| {
            let mut h = blake3::Hasher::new();
            h.update(b"orbitkv-perf-dma");
            h.update(&seed.to_le_bytes());
            h.update(&i.to_le_bytes());
            ChunkKey::new(ns, *h.finalize().as_bytes())
        })
        .collect()
}

/// Mismatched bytes between the engine's tensors and what they held before any load.
pub(crate) fn tensor_mismatches(e: &Engine<'_>) -> Result<u64, Error> {
    let mut bad = 0;
    let mut got = vec![0u8; e.originals[0].len()];
    for (i, want) in e.originals.iter().enumerate() {
        e.memory.read_tensor(i, &mut got).map_err(|x| Error::Gpu(x.to_string()))?;
        bad += got.iter().zip(want).filter(|(x, y)| x != y).count() as u64;
    }
    Ok(bad)
}

/// Counts the bytes of chunks `keys` (blocks `chunks`) that differ from what the engine saved,
/// read through the mapped arena; a missing chunk counts whole.
pub(crate) fn saved_mismatches(
    client: &mut Client,
    e: &Engine<'_>,
    keys: &[ChunkKey],
    chunks: &[Vec<u64>],
) -> Result<u64, Error> {
    let layout = *e.memory.layout();
    let mut bad = 0;
    let mut want = Vec::new();
    for (kb, cb) in keys.chunks(256).zip(chunks.chunks(256)) {
        let leases = client.lookup_leased(kb).map_err(client_err("lookup"))?;
        for (lease, blocks) in leases.iter().zip(cb) {
            expected_chunk(&layout, e.originals, blocks, &mut want);
            let got = client.chunk(lease).map_err(client_err("chunk"))?;
            bad += got.iter().zip(&want).filter(|(x, y)| x != y).count() as u64;
        }
        bad += (kb.len() - leases.len()) as u64 * e.chunk_len;
        client.release(&leases).map_err(client_err("release"))?;
    }
    Ok(bad)
}
