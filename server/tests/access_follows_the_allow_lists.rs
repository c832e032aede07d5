//! The sockets are mode 0660 in `--socket-group`; sessions are for the server's uid, root,
//! `--allow-uid` and `--allow-gid`; admin commands that read are for the same set, those that
//! change state (drain, resume, evict) for the server's uid, root and `--admin-uid`. Checked
//! from a child process running as nobody (65534, group nogroup 65534): needs root.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;

use orbitkv_client::{Client, ClientOptions};
use orbitkv_testkit::TestServer;

const CHILD_ENV: &str = "ORBITKV_TEST_ACCESS_SOCKET";
const NOBODY: u32 = 65534;

/// Child process of the tests below, run as nobody: a session, then `health` and `drain` on
/// the admin socket; prints one line per attempt.
#[test]
#[ignore = "helper process for the access tests"]
fn attempts_as_child() {
    let socket = std::env::var(CHILD_ENV).expect("run by an access test");
    match Client::connect(ClientOptions::with_socket(&socket)) {
        Ok(_) => println!("SESSION accepted"),
        Err(e) => println!("SESSION refused: {e}"),
    }
    for cmd in ["health", "drain"] {
        let answer = UnixStream::connect(format!("{socket}.admin")).and_then(|mut s| {
            s.write_all(format!("{{\"cmd\":\"{cmd}\"}}\n").as_bytes())?;
            let mut line = String::new();
            BufReader::new(s).read_line(&mut line)?;
            Ok(line)
        });
        match answer {
            Ok(line) => println!("ADMIN {cmd} {}", line.trim()),
            Err(e) => println!("ADMIN {cmd} cannot connect: {e}"),
        }
    }
}

/// What the child printed, by line prefix (`SESSION`, `ADMIN health`, `ADMIN drain`).
fn attempts_as_nobody(server: &TestServer) -> Option<Vec<String>> {
    let prefixes = ["SESSION", "ADMIN health", "ADMIN drain"];
    orbitkv_testkit::run_as_nobody(server, "attempts_as_child", CHILD_ENV, &prefixes)
}

fn start(extra: &[&str]) -> TestServer {
    let mut args = vec!["--shards", "1", "--dram", "8MiB"];
    args.extend_from_slice(extra);
    TestServer::start(&args)
}

#[test]
fn sockets_are_0660_in_the_socket_group() {
    let server = start(&["--socket-group", "65534"]);
    for path in [server.socket.clone(), server.admin_path()] {
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o660, "{}", path.display());
        assert_eq!(meta.gid(), 65534, "{}", path.display());
    }
    let plain = start(&[]);
    let meta = std::fs::metadata(&plain.socket).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), nix::unistd::getgid().as_raw());
}

#[test]
fn outside_the_socket_group_nothing_connects() {
    let server = start(&[]);
    let Some(lines) = attempts_as_nobody(&server) else { return };
    if nix::unistd::getgid().as_raw() == NOBODY {
        return;
    }
    assert!(lines[0].contains("refused"), "{lines:?}");
    assert!(
        lines[1].contains("cannot connect") && lines[1].contains("ermission denied"),
        "{lines:?}"
    );
}

#[test]
fn in_the_group_but_not_allowed_is_refused_with_the_flags_named() {
    let server = start(&["--socket-group", "65534"]);
    let Some(lines) = attempts_as_nobody(&server) else { return };
    assert!(lines[0].contains("refused") && lines[0].contains("--allow-gid"), "{lines:?}");
    assert!(
        lines[1].contains("\"ok\":false") && lines[1].contains("uid 65534 (gid 65534)"),
        "{lines:?}"
    );
    assert!(lines[2].contains("\"ok\":false") && lines[2].contains("--admin-uid"), "{lines:?}");
    assert_eq!(server.admin("health")["state"], "serving");
}

#[test]
fn an_allowed_group_reads_and_only_an_admin_uid_drains() {
    let server = start(&["--socket-group", "65534", "--allow-gid", "65534"]);
    let Some(lines) = attempts_as_nobody(&server) else { return };
    let log = server.log();
    assert!(log.lines().any(|l| l.contains("session opened") && l.contains("uid=65534")), "{log}");
    assert!(lines[1].contains("\"ok\":true") && lines[1].contains("\"ready\""), "{lines:?}");
    assert!(lines[2].contains("uid 65534 may not drain"), "{lines:?}");
    assert_eq!(server.admin("health")["state"], "serving", "the refused drain changed nothing");

    let admin = start(&["--socket-group", "65534", "--allow-gid", "65534", "--admin-uid", "65534"]);
    let Some(lines) = attempts_as_nobody(&admin) else { return };
    assert!(lines[2].contains("\"ok\":true"), "{lines:?}");
    assert_ne!(admin.admin("health")["state"], "serving", "drained by an admin uid");
}
