//! A CUDA engine rank for the GPU tests: its tensors (seeded bytes), their IPC exports, a
//! server with the GPU in use and the layout's namespace. Each test skips (saying so) where
//! there is no CUDA device.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use orbitkv_client::{
    ChunkKey, ChunkOutcome, Client, Dtype, GpuRegistration, GpuTensor, KvLayoutKind, KvLayoutSpec,
    NamespaceDescriptor,
};
use orbitkv_gpu::dma::EngineMemory;
use orbitkv_gpu::{DeviceInfo, LayoutGeometry, Probe};

use crate::{chain, TestServer};

/// flash-nhd, 8 layers, 2048 blocks of 16 tokens, 8 KV heads of 128 (bf16): 32 KiB pages,
/// 16 tensors of 64 MiB; a chunk is one block (16 pages, 512 KiB).
pub const LAYOUT: KvLayoutSpec = KvLayoutSpec {
    kind: KvLayoutKind::FlashAttnNhd,
    num_layers: 8,
    num_blocks: 2048,
    block_size: 16,
    kv_heads: 8,
    head_dim: 128,
    elem_bytes: 2,
};

/// The first CUDA device, or None (said on stderr) where there is none.
pub fn device() -> Option<DeviceInfo> {
    match orbitkv_gpu::probe() {
        Probe::Present { devices } => devices.into_iter().next(),
        Probe::Absent { reason } => {
            eprintln!("skipped: no CUDA device ({reason})");
            None
        }
    }
}

/// This process as an engine rank: its tensors (seeded bytes), their IPC exports.
pub struct Engine {
    pub memory: Arc<EngineMemory>,
    pub originals: Vec<Vec<u8>>,
    pub tensors: Vec<GpuTensor>,
    pub uuid: String,
}

impl Engine {
    pub fn new(dev: &DeviceInfo, seed: u64) -> Self {
        let ctx = CudaContext::new(dev.ordinal as usize).unwrap();
        let memory = Arc::new(EngineMemory::allocate(&ctx, LAYOUT).unwrap());
        let bytes = LAYOUT.tensor_bytes().unwrap() as usize;
        let originals: Vec<Vec<u8>> =
            (0..LAYOUT.tensor_count() as u64).map(|i| seeded(seed * 1000 + i, bytes)).collect();
        for (i, t) in originals.iter().enumerate() {
            memory.write_tensor(i, t).unwrap();
        }
        let tensors = memory
            .exports()
            .unwrap()
            .into_iter()
            .map(|e| GpuTensor { handle: e.handle, offset: e.offset, len: e.len })
            .collect();
        Self { memory, originals, tensors, uuid: dev.uuid.clone() }
    }

    pub fn register(&self, c: &mut Client) -> GpuRegistration {
        c.register_gpu(&self.uuid, LAYOUT, &self.tensors).unwrap()
    }

    /// The bytes chunk `block` holds: its pages, layer by layer, K before V.
    pub fn chunk(&self, block: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for s in LAYOUT.block_segments(block) {
            let t = &self.originals[s.tensor as usize];
            out.extend_from_slice(&t[s.offset as usize..(s.offset + s.len) as usize]);
        }
        out
    }

    /// Every tensor overwritten with `byte`.
    pub fn scribble(&self, byte: u8) {
        let junk = vec![byte; self.originals[0].len()];
        for i in 0..self.originals.len() {
            self.memory.write_tensor(i, &junk).unwrap();
        }
    }

    pub fn restore(&self) {
        for (i, t) in self.originals.iter().enumerate() {
            self.memory.write_tensor(i, t).unwrap();
        }
    }

    /// Tensors that differ from the originals.
    pub fn tensors_changed(&self) -> usize {
        let mut got = vec![0u8; self.originals[0].len()];
        let mut changed = 0;
        for (i, want) in self.originals.iter().enumerate() {
            self.memory.read_tensor(i, &mut got).unwrap();
            changed += usize::from(got != *want);
        }
        changed
    }
}

pub fn seeded(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A server with the GPU in use, a client of it with the layout's namespace, and `n` keys.
pub fn setup(name: &str, n: usize, seed: u32) -> (TestServer, Client, Vec<ChunkKey>) {
    setup_env(name, n, seed, &[])
}

/// The layout's namespace.
pub fn namespace() -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: "test/gpu".into(),
        dtype: Dtype::Bf16,
        num_layers: LAYOUT.num_layers,
        num_kv_heads: LAYOUT.kv_heads,
        head_dim: LAYOUT.head_dim,
        kv_tensors: 2,
        tokens_per_chunk: LAYOUT.block_size,
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    }
}

/// [`setup`], the server started with `env` (its failpoints, say).
pub fn setup_env(
    name: &str,
    n: usize,
    seed: u32,
    env: &[(&str, &str)],
) -> (TestServer, Client, Vec<ChunkKey>) {
    let server =
        TestServer::start_env(env, &["--shards", "2", "--dram", "4GiB", "--gpu", "required"]);
    let mut c = server.client(name);
    let ns = c.register_namespace(&namespace()).unwrap().id;
    (server, c, chain(ns, seed, n))
}

pub fn all_done(outcomes: &[ChunkOutcome]) -> bool {
    outcomes.iter().all(|o| *o == ChunkOutcome::Done)
}

/// Chunks of `keys` (chunk `i` is block `i`) that are missing or differ from the engine's.
pub fn saved_wrong(c: &mut Client, e: &Engine, keys: &[ChunkKey]) -> usize {
    let leases = c.lookup_leased(keys).unwrap();
    let mut wrong = keys.len() - leases.len();
    for (i, lease) in leases.iter().enumerate() {
        wrong += usize::from(c.chunk(lease).unwrap() != e.chunk(i as u64).as_slice());
    }
    c.release(&leases).unwrap();
    wrong
}
