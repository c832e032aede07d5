//! SIGTERM (and SIGINT): drain, exit 0, remove the sockets and shared-memory files.

use std::time::Duration;

use nix::sys::signal::Signal;
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

/// Shared-memory objects of the server on this socket (prefix derived as the server does).
fn shm_files(server: &TestServer) -> Vec<String> {
    let hash = blake3::hash(server.socket.as_os_str().as_encoded_bytes());
    let tag: String = hash.as_bytes()[..6].iter().map(|b| format!("{b:02x}")).collect();
    let prefix = format!("okv{tag}_");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn sigterm_with_a_live_client() {
    let mut server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let k = chain(ns, 1, 1)[0];
    c.put(&[(k, &value_for(&k, 1000))]).unwrap();
    assert!(server.socket.exists());
    assert!(server.admin_path().exists());
    let iox_root = server.dir.path().join("s.sock.iox");
    assert!(iox_root.exists());
    assert!(!shm_files(&server).is_empty(), "the shm prefix derivation matches the server's");

    server.signal(Signal::SIGTERM);
    let status = server.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "exit status {status}: {}", server.log());
    assert!(!server.socket.exists(), "main socket removed");
    assert!(!server.admin_path().exists(), "admin socket removed");
    assert!(!iox_root.exists(), "iceoryx2 root removed");
    // The client notices on its next call.
    let err = c.ping().unwrap_err();
    assert!(
        matches!(
            err,
            orbitkv_client::Error::Disconnected(_) | orbitkv_client::Error::Connect { .. }
        ),
        "{err}"
    );
    drop(c);
    assert_eq!(shm_files(&server), Vec::<String>::new(), "shared memory removed");
}

#[test]
fn sigint_exits_zero_too() {
    let mut server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    server.signal(Signal::SIGINT);
    assert!(server.wait_exit(Duration::from_secs(20)).success());
    assert!(!server.socket.exists());
}

#[test]
fn a_stale_socket_file_is_replaced_and_a_live_one_refused() {
    let mut server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    // A second server on the same socket is refused while the first serves.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .args(["--no-lock-arena", "--shards", "1", "--dram", "8MiB", "--socket"])
        .arg(&server.socket)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already serving"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // After a SIGKILL the socket file stays behind; a new server replaces it.
    server.signal(Signal::SIGKILL);
    server.wait_exit(Duration::from_secs(10));
    assert!(server.socket.exists());
    server.spawn(&["--shards", "1", "--dram", "8MiB"]);
    server.client("after-restart").ping().unwrap();
}
