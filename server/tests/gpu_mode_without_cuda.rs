//! `--gpu`: without CUDA the server serves DRAM only under `auto`, refuses to start under
//! `required` with a clear message, and never touches CUDA under `off`.

use orbitkv_testkit::TestServer;

fn cuda_present() -> bool {
    matches!(orbitkv_gpu::probe(), orbitkv_gpu::Probe::Present { .. })
}

#[test]
fn auto_serves_without_a_gpu_and_reports_why() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB", "--gpu", "auto"]);
    server.client("dram-only").ping().unwrap();
    let stats = server.admin("stats");
    assert_eq!(stats["gpu_mode"], "auto");
    if cuda_present() {
        assert_eq!(stats["gpu"]["state"], "present", "{stats}");
    } else {
        assert_eq!(stats["gpu"]["state"], "absent", "{stats}");
        assert!(!stats["gpu"]["reason"].as_str().unwrap().is_empty());
    }
}

#[test]
fn required_refuses_to_start_without_a_gpu() {
    if cuda_present() {
        println!("skipped: this machine has a CUDA device");
        return;
    }
    let err = refused_at_start(&[
        "--socket",
        "/tmp/orbitkv-gpu-required-test.sock",
        "--shards",
        "1",
        "--dram",
        "8MiB",
        "--gpu",
        "required",
    ]);
    assert!(err.contains("--gpu required") && err.contains("no CUDA device"), "{err}");
}

/// Starts the server with `args`, expects it to stop at once with exit status 2, and returns
/// what it printed on stderr.
fn refused_at_start(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    err
}

#[test]
fn off_and_bad_values() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB", "--gpu", "off"]);
    let stats = server.admin("stats");
    assert_eq!(stats["gpu_mode"], "off");
    assert!(stats["gpu"].is_null(), "{stats}");
    assert!(refused_at_start(&["--gpu", "sometimes"]).contains("--gpu"));
    let err = refused_at_start(&["--gpu-checksums", "gpu2"]);
    assert!(err.contains("--gpu-checksums") && err.contains("gpu2"), "{err}");
    // Experiments that lost are no options: `direct` copies, the table-driven checksums.
    let err = refused_at_start(&["--gpu-copy", "direct"]);
    assert!(err.contains("--gpu-copy") && err.contains("direct"), "{err}");
    let err = refused_at_start(&["--gpu-checksums", "tables"]);
    assert!(err.contains("--gpu-checksums") && err.contains("tables"), "{err}");
    let err = refused_at_start(&["--gpu-copy", "fastest"]);
    assert!(err.contains("--gpu-copy") && err.contains("fastest"), "{err}");
}

/// GPU requests on a server without a GPU in use: each is answered `Unavailable` with a
/// message saying why, and the session and server keep serving DRAM requests.
#[test]
fn gpu_requests_without_a_gpu_are_unavailable() {
    use orbitkv_client::{ErrorCode, GpuTensor, KvLayoutKind, KvLayoutSpec, Request, Response};
    let server = TestServer::start(&["--shards", "2", "--dram", "8MiB", "--gpu", "off"]);
    let mut c = server.client("gpu-less");
    let ns = c.register_namespace(&orbitkv_testkit::namespace(16)).unwrap().id;
    let keys = orbitkv_testkit::chain(ns, 3, 4);
    let layout = KvLayoutSpec {
        kind: KvLayoutKind::FlashAttnNhd,
        num_layers: 2,
        num_blocks: 8,
        block_size: 16,
        kv_heads: 1,
        head_dim: 64,
        elem_bytes: 2,
    };
    let tensors = [GpuTensor { handle: [7; 64], offset: 0, len: 1 << 20 }; 2];
    match c.register_gpu("GPU-00000000-0000-0000-0000-000000000000", layout, &tensors) {
        Err(orbitkv_client::Error::Server { code: ErrorCode::Unavailable, message }) => {
            assert!(message.contains("no GPU"), "{message}")
        }
        other => panic!("register_gpu on a GPU-less server: {other:?}"),
    }
    for req in [
        Request::Save {
            registration: 0,
            generation: 1,
            keys: keys.clone(),
            blocks: vec![0, 1, 2, 3],
        },
        Request::Load {
            registration: 0,
            generation: 1,
            keys: keys.clone(),
            blocks: vec![0, 1, 2, 3],
        },
        Request::UnregisterGpu { registration: 0, generation: 1 },
    ] {
        let answer = c.call_raw(&orbitkv_proto::encode(&req)).unwrap();
        assert!(
            matches!(answer, Response::Error { code: ErrorCode::Unavailable, .. }),
            "{answer:?}"
        );
    }
    // Refused saves and loads give back the reservation and lease budget they were charged at
    // dispatch: many of them in a row never run into the session's bounds.
    let many = orbitkv_testkit::chain(ns, 4, 4096);
    let blocks: Vec<u64> = (0..4096).collect();
    for _ in 0..5 {
        let save = Request::Save {
            registration: 0,
            generation: 1,
            keys: many.clone(),
            blocks: blocks.clone(),
        };
        let answer = c.call_raw(&orbitkv_proto::encode(&save)).unwrap();
        assert!(
            matches!(answer, Response::Error { code: ErrorCode::Unavailable, .. }),
            "{answer:?}"
        );
    }
    for _ in 0..17 {
        let load = Request::Load {
            registration: 0,
            generation: 1,
            keys: many.clone(),
            blocks: blocks.clone(),
        };
        let answer = c.call_raw(&orbitkv_proto::encode(&load)).unwrap();
        assert!(
            matches!(answer, Response::Error { code: ErrorCode::Unavailable, .. }),
            "{answer:?}"
        );
    }
    // Nothing was reserved or leased by the refused saves and loads; DRAM still works.
    let stats = server.admin("stats");
    assert_eq!(server.shard_sum("leases"), 0, "{stats}");
    let value = orbitkv_testkit::value_for(&keys[0], 4096);
    c.put(&[(keys[0], &value[..])]).unwrap();
    let mut buf = vec![0u8; 4096];
    assert_eq!(c.get_into(&keys[..1], &mut [&mut buf[..]]).unwrap(), vec![4096]);
    assert_eq!(buf, value);
}
