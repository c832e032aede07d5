//! Faults on the GPU path, injected by failpoints (builds with the `failpoints` feature) on a
//! CUDA device: a copy job that fails, a DMA thread that panics, completions that come late
//! while their client vanishes. Whatever a request reserved comes back, nothing is served
//! that was not copied, the shards' bookkeeping stays consistent (`audit`), and serving goes
//! on. Skipped (saying so) without a CUDA device or without the feature. On a CUDA host:
//! `cargo test -p orbitkv-server --features failpoints --test gpu_faults_are_contained`, or
//! the test binary with `ORBITKV_TEST_SERVER_BIN` naming a release build with the feature.

use std::time::{Duration, Instant};

use orbitkv_client::{ChunkOutcome, ErrorCode};
use orbitkv_testkit::gpu::{all_done, device, saved_wrong, setup_env, Engine};
use orbitkv_testkit::{value_for, TestServer};

fn built_with_failpoints() -> bool {
    if !cfg!(feature = "failpoints") {
        eprintln!("skipped: build with --features failpoints");
    }
    cfg!(feature = "failpoints")
}

/// No reservation or lease left, the audit clean.
fn at_rest(server: &TestServer) {
    server.wait_for("reservations and leases back", |s| {
        s.shard_sum("reservations") == 0 && s.shard_sum("leases") == 0
    });
    let audit = server.try_admin_request(&serde_json::json!({"cmd": "audit"})).unwrap();
    assert_eq!(audit["ok"], true, "{audit}");
}

#[test]
fn a_failed_copy_job_fails_its_chunks_only_and_their_slots_come_back() {
    let Some(dev) = device() else { return };
    if !built_with_failpoints() {
        return;
    }
    let e = Engine::new(&dev, 11);
    let (server, mut c, keys) =
        setup_env("job-error", 2048, 11, &[("FAILPOINTS", "dma-job-error=1*return")]);
    let reg = e.register(&mut c);
    let blocks: Vec<u64> = (0..keys.len() as u64).collect();
    let out = c.save(&reg, &keys, &blocks).unwrap();
    let failed = out.iter().filter(|o| **o == ChunkOutcome::Failed(ErrorCode::DeviceError)).count();
    let done = out.iter().filter(|o| **o == ChunkOutcome::Done).count();
    assert!(failed > 0 && done > 0 && failed + done == keys.len(), "{failed} failed, {done} done");
    assert_eq!(server.admin("stats")["gpu_transfers"]["failed_jobs"], 1);
    at_rest(&server);
    // The failed chunks are not there; saved again, every chunk is right.
    assert!(all_done(
        &c.save(&reg, &keys, &blocks)
            .unwrap()
            .iter()
            .map(|o| match o {
                ChunkOutcome::Failed(ErrorCode::AlreadyPresent) => ChunkOutcome::Done,
                o => *o,
            })
            .collect::<Vec<_>>()
    ));
    assert_eq!(saved_wrong(&mut c, &e, &keys), 0);
    c.unregister_gpu(&reg).unwrap();
}

#[test]
fn a_panicking_dma_thread_fails_its_copies_and_dram_serving_goes_on() {
    let Some(dev) = device() else { return };
    if !built_with_failpoints() {
        return;
    }
    let e = Engine::new(&dev, 12);
    let (server, mut c, keys) =
        setup_env("panic", 256, 12, &[("FAILPOINTS", "dma-thread-panic=1*panic")]);
    let reg = e.register(&mut c);
    let blocks: Vec<u64> = (0..keys.len() as u64).collect();
    let out = c.save(&reg, &keys, &blocks).unwrap();
    assert!(out.iter().all(|o| *o == ChunkOutcome::Failed(ErrorCode::DeviceError)), "{out:?}");
    let stats = server.admin("stats");
    assert_eq!(stats["gpu_transfers"]["threads_lost"], 1, "{stats}");
    assert!(server.log().contains("GPU DMA thread panicked"), "{}", server.log());
    at_rest(&server);
    // Later saves fail at once, said so; DRAM puts and gets serve on.
    let out = c.save(&reg, &keys[..4], &blocks[..4]).unwrap();
    assert!(out.iter().all(|o| *o == ChunkOutcome::Failed(ErrorCode::DeviceError)), "{out:?}");
    let k = keys[0];
    c.put(&[(k, &value_for(&k, 64 << 10))]).unwrap();
    let leases = c.lookup_leased(&[k]).unwrap();
    assert_eq!(c.chunk(&leases[0]).unwrap(), &value_for(&k, 64 << 10)[..]);
    c.release(&leases).unwrap();
    let health = server.admin("health");
    assert!(health.to_string().contains("DMA"), "health names the lost DMA thread: {health}");
    at_rest(&server);
}

#[test]
fn late_completions_keep_their_slots_until_they_land_after_the_client_is_gone() {
    let Some(dev) = device() else { return };
    if !built_with_failpoints() {
        return;
    }
    let e = Engine::new(&dev, 13);
    let (server, mut c, keys) =
        setup_env("late", 512, 13, &[("FAILPOINTS", "dma-late-completion=sleep(300)")]);
    let reg = e.register(&mut c);
    let blocks: Vec<u64> = (0..keys.len() as u64).collect();
    let t = c.start_save(&reg, &keys, &blocks).unwrap();
    server.wait_for("save jobs started", |s| {
        s.admin("stats")["gpu_transfers"]["save_jobs"].as_u64().unwrap_or(0) > 0
    });
    // The client goes while its copies' answers wait: their slots stay reserved meanwhile.
    drop(t);
    drop(c);
    assert!(server.shard_sum("reservations") > 0, "slots freed before their copies landed");
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.shard_sum("reservations") > 0 {
        assert!(Instant::now() < deadline, "the late copies never landed");
        std::thread::sleep(Duration::from_millis(20));
    }
    at_rest(&server);
    assert_eq!(server.admin("stats")["sessions"], 0);
    // A new client finds whatever landed byte-exact (a dropped save completes).
    let mut c = server.client("after");
    c.register_namespace(&orbitkv_testkit::gpu::namespace()).unwrap();
    let leases = c.lookup_leased(&keys).unwrap();
    for (i, l) in leases.iter().enumerate() {
        assert_eq!(c.chunk(l).unwrap(), e.chunk(i as u64).as_slice(), "chunk {i}");
    }
    c.release(&leases).unwrap();
}
