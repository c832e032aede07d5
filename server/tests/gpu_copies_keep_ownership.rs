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

use std::time::{Duration, Instant};

use orbitkv_client::{ChunkKey, ChunkOutcome, Client, GpuRegistration, GpuTensor};
use orbitkv_gpu::LayoutGeometry;
use orbitkv_testkit::gpu::{all_done, device, saved_wrong, setup, Engine, LAYOUT};
use orbitkv_testkit::TestServer;

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
        match c.register_gpu(uuid, LAYOUT, &tensors) {
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
