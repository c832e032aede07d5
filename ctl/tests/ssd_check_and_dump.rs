//! `orbitkv-ctl ssd check|dump` on the files of a stopped server: a clean tier checks out, a
//! flipped payload byte is reported and fails the check.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use orbitkv_client::{ChunkKey, Client, ClientOptions, Dtype, NamespaceDescriptor};
use orbitkv_testkit::server_bin;

fn ctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_orbitkv-ctl")).args(args).output().unwrap()
}

#[test]
fn check_and_dump_a_real_tier() {
    let dir = tempfile::Builder::new().prefix("okvssdctl").tempdir_in("/tmp").unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let socket = dir.path().join("s.sock");
    let mut server = Command::new(server_bin())
        .args([
            "--no-lock-arena",
            "--shards",
            "1",
            "--dram",
            "1MiB",
            "--ssd",
            "8MiB",
            "--ssd-region-size",
            "512KiB",
        ])
        .arg("--ssd-dir")
        .arg(&ssd)
        .arg("--socket")
        .arg(&socket)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut c = loop {
        if let Ok(c) = Client::connect(ClientOptions::with_socket(&socket)) {
            break c;
        }
        assert!(Instant::now() < deadline, "server did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    let ns = c
        .register_namespace(&NamespaceDescriptor {
            model: "ctl-ssd".into(),
            dtype: Dtype::Fp32,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1024,
            kv_tensors: 1,
            tokens_per_chunk: 4,
            layout_version: 1,
            tp_rank: 0,
            tp_world_size: 1,
        })
        .unwrap();
    // Values until the tier holds more than 20 records: an eviction that finds the SSD writes
    // still busy drops its victim instead of demoting it, so on a loaded machine 120 puts may
    // leave only a few records; the server's own count decides, not a timer.
    let ssd_records = || {
        let out = Command::new(env!("CARGO_BIN_EXE_orbitkv-ctl"))
            .arg("--socket")
            .arg(&socket)
            .args(["stats", "--json"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["shards"][0]["ssd_records"].as_u64().unwrap()
    };
    let mut i = 0u32;
    while i < 120 || ssd_records() <= 20 {
        assert!(i < 5_000, "{} records on SSD after {i} puts", ssd_records());
        let key = ChunkKey::new(ns.id, *blake3::hash(&i.to_le_bytes()).as_bytes());
        let value = vec![i as u8; 12_000];
        c.put(&[(key, &value[..])]).unwrap();
        c.lookup(&[key]).unwrap();
        i += 1;
    }
    drop(c);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(server.wait().unwrap().success());

    let dir_arg = ssd.to_str().unwrap();
    let out = ctl(&["ssd", "check", "--dir", dir_arg, "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let records = v["files"][0]["records"].as_u64().unwrap();
    assert!(records > 20, "{v}");
    let dump = ctl(&["ssd", "dump", "--dir", dir_arg]);
    assert!(dump.status.success());
    assert_eq!(String::from_utf8_lossy(&dump.stdout).lines().count() as u64, records);

    // Flip a byte inside the first record's payload.
    let path = ssd.join("shard-0.okv");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = (4096..bytes.len())
        .step_by(4096)
        .find(|&at| &bytes[at..at + 8] == b"OKVREC\0\x01")
        .unwrap();
    bytes[at + 4096 + 5] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let out = ctl(&["ssd", "check", "--dir", dir_arg]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("1 bad payloads") && text.contains("CORRUPT"), "{text}");
}

#[test]
fn a_directory_without_shard_files_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = ctl(&["ssd", "check", "--dir", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no shard-*.okv files"));
}
