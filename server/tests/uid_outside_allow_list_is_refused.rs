//! A uid outside `--allow-uid` is refused with a clear message; an allowed one gets in.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::TestServer;
use orbitkv_client::{Client, ClientOptions, ErrorCode};

const CHILD_ENV: &str = "ORBITKV_TEST_UID_SOCKET";
const NOBODY: u32 = 65534;

/// Child process of the tests below, run as uid 65534: prints what connecting gave.
#[test]
#[ignore = "helper process for the uid tests"]
fn connect_as_child() {
    let socket = std::env::var(CHILD_ENV).expect("run by a uid test");
    match Client::connect(ClientOptions::with_socket(socket)) {
        Ok(c) => println!("RESULT accepted session {:?}", c.session_id()),
        Err(e) => println!("RESULT refused code={:?} message={e}", e.code()),
    }
}

fn connect_as_nobody(server: &TestServer) -> Option<String> {
    if !nix::unistd::getuid().is_root() {
        println!("skipped: switching to uid {NOBODY} needs root");
        return None;
    }
    std::fs::set_permissions(server.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "connect_as_child", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, &server.socket)
        .env("HOME", "/tmp")
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Some(
        stdout
            .lines()
            .find_map(|l| l.find("RESULT").map(|i| &l[i..]))
            .unwrap_or_else(|| {
                panic!("child printed no result: {stdout} {}", String::from_utf8_lossy(&out.stderr))
            })
            .to_string(),
    )
}

#[test]
fn uid_outside_the_allow_list_is_refused() {
    // In the sockets' group, so that the allow list is what refuses it.
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB", "--socket-group", "65534"]);
    let Some(result) = connect_as_nobody(&server) else {
        return;
    };
    assert!(result.contains(&format!("{:?}", Some(ErrorCode::PermissionDenied))), "{result}");
    assert!(result.contains(&format!("uid {NOBODY} (gid {NOBODY}) is not allowed")), "{result}");
    assert!(result.contains("--allow-uid") && result.contains("--allow-gid"), "{result}");
    assert_eq!(server.admin("stats")["refused_sessions"], 1);
    assert_eq!(server.admin("stats")["sessions"], 0);
    server.client("root").ping().unwrap();
}

/// An allowed uid passes the bootstrap check and gets a session opened for it. (Opening the
/// iceoryx2 request channel from a second non-root uid is a known limitation, see
/// docs/operations.md: its shared memory is owner-only.)
#[test]
fn allowed_uid_passes_the_bootstrap_check() {
    let server = TestServer::start(&[
        "--shards",
        "1",
        "--dram",
        "8MiB",
        "--allow-uid",
        "65534",
        "--socket-group",
        "65534",
    ]);
    let Some(result) = connect_as_nobody(&server) else {
        return;
    };
    assert!(!result.contains("PermissionDenied"), "{result}");
    assert_eq!(server.admin("stats")["refused_sessions"], 0);
    let log = server.log();
    assert!(log.lines().any(|l| l.contains("session opened") && l.contains("uid=65534")), "{log}");
}
