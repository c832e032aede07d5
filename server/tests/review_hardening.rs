//! Hostile or unlucky clients cannot crash the server, overshoot its bounds, or leave
//! holdings behind: sealed arena, batched calls that fail half way, concurrent handshakes,
//! slow handshakes, slow admin clients.

use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use orbitkv_client::{Client, ClientOptions, ErrorCode};
use orbitkv_proto::{encode, write_frame, Bootstrap, PROTOCOL_VERSION};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

/// Opens a session by hand and returns the descriptors the server passed.
fn raw_session(server: &TestServer) -> (UnixStream, Vec<OwnedFd>) {
    let s = UnixStream::connect(&server.socket).unwrap();
    let hello = Bootstrap::Hello { protocol_version: PROTOCOL_VERSION, client_name: "raw".into() };
    write_frame(&mut &s, &encode(&hello)).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        .unwrap();
    let mut fds = Vec::new();
    for c in msg.cmsgs().unwrap() {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: just received through SCM_RIGHTS; nothing else owns it.
                #[allow(unsafe_code)]
                fds.push(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) });
            }
        }
    }
    (s, fds)
}

#[test]
fn a_client_cannot_resize_the_arena() {
    let server =
        TestServer::start(&["--shards", "2", "--dram", "8MiB", "--arena-memfds", "per-shard"]);
    let mut c = server.client("victim");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 1, 2);
    let slot = c.reserve(&keys[..1], &[5000]).unwrap().pop().unwrap().unwrap();
    let (_s, fds) = raw_session(&server);
    assert_eq!(fds.len(), 3, "a memfd per shard and the doorbell eventfd");
    for arena_fd in &fds[..2] {
        let shrink = nix::unistd::ftruncate(arena_fd, 16384);
        assert_eq!(shrink, Err(nix::errno::Errno::EPERM), "the arena size is sealed");
        let grow = nix::unistd::ftruncate(arena_fd, 1 << 40);
        assert_eq!(grow, Err(nix::errno::Errno::EPERM));
    }
    c.slot_mut(&slot).unwrap().copy_from_slice(&value_for(&keys[0], 5000));
    c.commit(&[slot]).unwrap();
    assert_eq!(c.lookup(&keys).unwrap().len(), 1);
    server.client("newcomer").ping().unwrap();
}

#[test]
fn failed_later_batches_give_back_what_earlier_batches_took() {
    let server = TestServer::start(&[
        "--shards",
        "2",
        "--dram",
        "16MiB",
        "--max-keys-per-request",
        "2",
        "--max-leases-per-session",
        "3",
        "--max-reservations-per-session",
        "3",
    ]);
    let mut c = server.client("batcher");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 2, 4);
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 4096)).collect();
    for (k, v) in keys.iter().zip(&vals) {
        c.put(&[(*k, v)]).unwrap();
    }
    // Four keys in batches of two: the second batch exceeds the lease bound.
    let mut bufs = vec![vec![0u8; 4096]; 4];
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    let err = c.get_into(&keys, &mut refs).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::LeaseLimit), "{err}");
    assert_eq!(server.shard_sum("leases"), 0, "first batch's leases were released");
    assert_eq!(c.lookup_leased(&keys[..3]).unwrap().len(), 3, "the session can lease again");

    let fresh = chain(ns, 3, 4);
    let fresh_vals: Vec<Vec<u8>> = fresh.iter().map(|k| value_for(k, 4096)).collect();
    let items: Vec<_> = fresh.iter().zip(&fresh_vals).map(|(k, v)| (*k, v.as_slice())).collect();
    let err = c.put(&items).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::LeaseLimit), "{err}");
    assert_eq!(server.shard_sum("reservations"), 0, "first batch's reservations were aborted");
    let mut other = server.client("other");
    other.register_namespace(&namespace(16)).unwrap();
    assert!(other
        .put(&items[..2])
        .unwrap()
        .iter()
        .all(|o| *o == orbitkv_client::PutOutcome::Stored));
}

#[test]
fn concurrent_handshakes_respect_max_sessions() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB", "--max-sessions", "1"]);
    let socket = server.socket.clone();
    let attempts: Vec<_> = (0..16)
        .map(|_| {
            let socket = socket.clone();
            std::thread::spawn(move || Client::connect(ClientOptions::with_socket(socket)))
        })
        .collect();
    let results: Vec<_> = attempts.into_iter().map(|t| t.join().unwrap()).collect();
    let accepted = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(accepted, 1);
    for r in &results {
        if let Err(e) = r {
            assert_eq!(e.code(), Some(ErrorCode::TooManySessions), "{e}");
        }
    }
    assert_eq!(server.admin("stats")["sessions"], 1);
}

#[test]
fn a_dripping_handshake_is_cut_off() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    let mut s = UnixStream::connect(&server.socket).unwrap();
    // A frame header announcing 100 bytes, then one byte per second.
    s.write_all(&100u32.to_le_bytes()).unwrap();
    let started = Instant::now();
    let mut cut = false;
    while started.elapsed() < Duration::from_secs(12) {
        std::thread::sleep(Duration::from_millis(1000));
        if s.write_all(&[0]).is_err() {
            cut = true;
            break;
        }
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(_) => {
                cut = true;
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => {
                cut = true;
                break;
            }
        }
        s.set_nonblocking(false).unwrap();
    }
    assert!(cut, "the server kept a dripping handshake open");
    assert_eq!(server.admin("stats")["sessions"], 0);
}

#[test]
fn a_silent_admin_client_does_not_block_health() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    let _silent = UnixStream::connect(server.admin_path()).unwrap();
    let mut s = UnixStream::connect(server.admin_path()).unwrap();
    // Well under the 5 s a silent client may hold its own connection.
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(b"{\"cmd\":\"health\"}\n").unwrap();
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(s), &mut answer).unwrap();
    assert!(answer.contains("\"ready\":true"), "{answer}");
}
