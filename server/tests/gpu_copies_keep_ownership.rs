//! GPU save/load against a real server on a CUDA device: byte-exact round trips, registrations
//! wrong in one field refused naming it, stale registrations refused, an unregister during a
//! save waiting for its copies, a save dropped by its client completing. This process acts as
//! the engine (tensors allocated here, shared with the server by CUDA IPC).
//!
//! Needs a CUDA device; without one each test says so and passes. On a CUDA host:
//! `cargo test -p orbitkv-server --test gpu_copies_keep_ownership`; on one without a Rust
//! toolchain, the test binary (`cargo test --release -p orbitkv-server --test
//! gpu_copies_keep_ownership --no-run` prints its path) with `ORBITKV_TEST_SERVER_BIN` naming a
//! release build of the server.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{chain, TestServer};
use cudarc::driver::CudaContext;
use orbitkv_client::{
    ChunkKey, ChunkOutcome, Client, Dtype, GpuRegistration, GpuTensor, KvLayoutKind, KvLayoutSpec,
    NamespaceDescriptor,
};
use orbitkv_gpu::dma::EngineMemory;
use orbitkv_gpu::{DeviceInfo, KvLayout, LayoutDesc, Probe};

/// flash-nhd, 8 layers, 2048 blocks of 16 tokens, 8 KV heads of 128 (bf16): 32 KiB pages,
/// 16 tensors of 64 MiB; a chunk is one block (16 pages, 512 KiB).
const LAYOUT: LayoutDesc = LayoutDesc {
    layout: KvLayout::FlashAttnNhd,
    num_layers: 8,
    num_blocks: 2048,
    block_size: 16,
    kv_heads: 8,
    head_dim: 128,
    elem_bytes: 2,
};

/// The first CUDA device, or None (said on stderr) where there is none.
fn device() -> Option<DeviceInfo> {
    match orbitkv_gpu::probe() {
        Probe::Present { devices } => devices.into_iter().next(),
        Probe::Absent { reason } => {
            eprintln!("skipped: no CUDA device ({reason})");
            None
        }
    }
}

/// This process as an engine rank: its tensors (seeded bytes), their IPC exports.
struct Engine {
    memory: Arc<EngineMemory>,
    originals: Vec<Vec<u8>>,
    tensors: Vec<GpuTensor>,
    uuid: String,
}

impl Engine {
    fn new(dev: &DeviceInfo, seed: u64) -> Self {
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

    fn register(&self, c: &mut Client) -> GpuRegistration {
        c.register_gpu(&self.uuid, spec(), &self.tensors).unwrap()
    }

    /// The bytes chunk `block` holds: its pages, layer by layer, K before V.
    fn chunk(&self, block: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for s in LAYOUT.block_segments(block) {
            let t = &self.originals[s.tensor as usize];
            out.extend_from_slice(&t[s.offset as usize..(s.offset + s.len) as usize]);
        }
        out
    }

    /// Every tensor overwritten with `byte`.
    fn scribble(&self, byte: u8) {
        let junk = vec![byte; self.originals[0].len()];
        for i in 0..self.originals.len() {
            self.memory.write_tensor(i, &junk).unwrap();
        }
    }

    fn restore(&self) {
        for (i, t) in self.originals.iter().enumerate() {
            self.memory.write_tensor(i, t).unwrap();
        }
    }

    /// Tensors that differ from the originals.
    fn tensors_changed(&self) -> usize {
        let mut got = vec![0u8; self.originals[0].len()];
        let mut changed = 0;
        for (i, want) in self.originals.iter().enumerate() {
            self.memory.read_tensor(i, &mut got).unwrap();
            changed += usize::from(got != *want);
        }
        changed
    }
}

fn seeded(seed: u64, len: usize) -> Vec<u8> {
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

fn spec() -> KvLayoutSpec {
    KvLayoutSpec {
        kind: KvLayoutKind::FlashAttnNhd,
        num_layers: LAYOUT.num_layers,
        num_blocks: LAYOUT.num_blocks,
        block_size: LAYOUT.block_size,
        kv_heads: LAYOUT.kv_heads,
        head_dim: LAYOUT.head_dim,
        elem_bytes: LAYOUT.elem_bytes,
    }
}

/// A server with the GPU in use, a client of it with the layout's namespace, and `n` keys.
fn setup(name: &str, n: usize, seed: u32) -> (TestServer, Client, Vec<ChunkKey>) {
    let server = TestServer::start(&["--shards", "2", "--dram", "4GiB", "--gpu", "required"]);
    let mut c = server.client(name);
    let ns = c
        .register_namespace(&NamespaceDescriptor {
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
        })
        .unwrap()
        .id;
    (server, c, chain(ns, seed, n))
}

fn all_done(outcomes: &[ChunkOutcome]) -> bool {
    outcomes.iter().all(|o| *o == ChunkOutcome::Done)
}

/// Chunks of `keys` (chunk `i` is block `i`) that are missing or differ from the engine's.
fn saved_wrong(c: &mut Client, e: &Engine, keys: &[ChunkKey]) -> usize {
    let leases = c.lookup_leased(keys).unwrap();
    let mut wrong = keys.len() - leases.len();
    for (i, lease) in leases.iter().enumerate() {
        wrong += usize::from(c.chunk(lease).unwrap() != e.chunk(i as u64).as_slice());
    }
    c.release(&leases).unwrap();
    wrong
}

#[test]
fn saves_and_loads_are_byte_exact_and_bad_registrations_name_their_field() {
    let Some(dev) = device() else { return };
    let e = Engine::new(&dev, 1);
    let (server, mut c, keys) = setup("round-trip", 256, 1);
    let need = LAYOUT.tensor_bytes().unwrap();
    let with_first = |f: &dyn Fn(&mut GpuTensor)| {
        let mut t = e.tensors.clone();
        f(&mut t[0]);
        t
    };
    let bad: Vec<(&str, &str, Vec<GpuTensor>)> = vec![
        ("device_uuid", "GPU-00000000-0000-0000-0000-000000000000", e.tensors.clone()),
        ("tensors", &e.uuid, e.tensors[..e.tensors.len() - 1].to_vec()),
        ("tensors[0].len", &e.uuid, with_first(&|t| t.len = need - 1)),
        ("tensors[0].offset", &e.uuid, with_first(&|t| t.offset = u64::MAX / 2)),
        ("tensors[0].handle", &e.uuid, with_first(&|t| t.handle = [0; 64])),
    ];
    for (field, uuid, tensors) in bad {
        match c.register_gpu(uuid, spec(), &tensors) {
            Err(orbitkv_client::Error::Server { message, .. }) => {
                assert!(message.contains(field), "{field}: {message}")
            }
            other => panic!("a registration with a bad {field} was not refused: {other:?}"),
        }
    }
    let reg = e.register(&mut c);
    let blocks: Vec<u64> = (0..keys.len() as u64).collect();
    assert!(all_done(&c.save(&reg, &keys, &blocks).unwrap()));
    assert_eq!(saved_wrong(&mut c, &e, &keys), 0, "saved chunks hold the engine's pages");
    // Loaded back into tensors overwritten meanwhile: the pages come back.
    e.scribble(0x5a);
    assert!(all_done(&c.load(&reg, &keys, &blocks).unwrap()));
    let mut got = vec![0u8; e.originals[0].len()];
    let page = e.chunk(0).len() / (2 * LAYOUT.num_layers as usize);
    for (i, want) in e.originals.iter().enumerate() {
        e.memory.read_tensor(i, &mut got).unwrap();
        let n = keys.len() * page;
        assert!(got[..n] == want[..n], "tensor {i}: the loaded blocks differ");
    }
    c.unregister_gpu(&reg).unwrap();
    let stats = server.admin("stats");
    assert_eq!(stats["gpu_transfers"]["failed_jobs"], 0, "{stats}");
}

#[test]
fn a_stale_registration_is_refused_and_a_new_one_is_newer() {
    use orbitkv_client::ErrorCode;
    let Some(dev) = device() else { return };
    let e = Engine::new(&dev, 2);
    let (_server, mut c, keys) = setup("stale", 1, 2);
    let old = e.register(&mut c);
    c.unregister_gpu(&old).unwrap();
    let refused = |r: Result<Vec<ChunkOutcome>, orbitkv_client::Error>| {
        matches!(
            r,
            Err(orbitkv_client::Error::Server {
                code: ErrorCode::NotFound | ErrorCode::StaleGeneration,
                ..
            })
        )
    };
    assert!(refused(c.save(&old, &keys, &[0])), "a save through an ended registration");
    let again = e.register(&mut c);
    assert!(again.generation > old.generation);
    assert!(refused(c.save(&old, &keys, &[0])), "the old registration after a new one");
    assert!(all_done(&c.save(&again, &keys, &[0]).unwrap()));
    c.unregister_gpu(&again).unwrap();
}

/// Starts a save of `keys` (chunk `i` from block `i`) and returns it once the server has it
/// copying (its first job taken by the DMA thread, not answered).
fn save_copying(
    server: &TestServer,
    c: &mut Client,
    reg: &GpuRegistration,
    keys: &[ChunkKey],
) -> orbitkv_client::Transfer {
    let jobs = |s: &TestServer| s.admin("stats")["gpu_transfers"]["save_jobs"].as_u64().unwrap();
    let before = jobs(server);
    let blocks: Vec<u64> = (0..keys.len() as u64).collect();
    let t = c.start_save(reg, keys, &blocks).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    // 1 GiB in 16 jobs of 64 MiB: the first completes long before the last is answered.
    while jobs(server) == before {
        assert!(Instant::now() < deadline, "the save never reached the GPU");
        std::thread::sleep(Duration::from_micros(100));
    }
    assert!(c.poll_transfer(&t).unwrap().is_none(), "a 1 GiB save answered at its first job");
    t
}

#[test]
fn unregistering_during_a_save_returns_once_its_copies_are_done() {
    let Some(dev) = device() else { return };
    let e = Engine::new(&dev, 3);
    let (server, mut c, keys) = setup("unregister", 2048, 3);
    let reg = e.register(&mut c);
    let t = save_copying(&server, &mut c, &reg, &keys);
    c.unregister_gpu(&reg).unwrap();
    // The engine's memory is its own again: what it writes now must not reach the chunks.
    e.scribble(0x3c);
    assert!(all_done(&c.wait_transfer(&t).unwrap()));
    assert_eq!(saved_wrong(&mut c, &e, &keys), 0, "every chunk holds the bytes from before");
    e.restore();
    assert_eq!(e.tensors_changed(), 0);
}

#[test]
fn a_save_dropped_by_its_client_completes_with_the_right_bytes() {
    let Some(dev) = device() else { return };
    let e = Engine::new(&dev, 4);
    let (server, mut c, keys) = setup("dropped", 2048, 4);
    let reg = e.register(&mut c);
    drop(save_copying(&server, &mut c, &reg, &keys));
    let deadline = Instant::now() + Duration::from_secs(30);
    while saved_wrong(&mut c, &e, &keys) != 0 {
        assert!(Instant::now() < deadline, "the dropped save's chunks never all appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    c.unregister_gpu(&reg).unwrap();
    let stats = server.admin("stats");
    assert_eq!(stats["gpu_transfers"]["failed_jobs"], 0, "{stats}");
}
