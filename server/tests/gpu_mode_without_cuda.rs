//! `--gpu`: without CUDA the server serves DRAM only under `auto`, refuses to start under
//! `required` with a clear message, and never touches CUDA under `off`.

mod common;

use common::TestServer;

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
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .args([
            "--socket",
            "/tmp/orbitkv-gpu-required-test.sock",
            "--shards",
            "1",
            "--dram",
            "8MiB",
        ])
        .args(["--gpu", "required"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--gpu required") && err.contains("no CUDA device"), "{err}");
}

#[test]
fn off_and_bad_values() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB", "--gpu", "off"]);
    let stats = server.admin("stats");
    assert_eq!(stats["gpu_mode"], "off");
    assert!(stats["gpu"].is_null(), "{stats}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .args(["--gpu", "sometimes"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--gpu"));
}
