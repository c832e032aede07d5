//! Malformed, truncated, oversized and out-of-range input on both sockets: an error reply or a
//! closed session, never a crash; the server keeps serving.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use orbitkv_client::{ChunkKey, ChunkOutcome, ErrorCode, Request, Response};
use orbitkv_proto::{encode, SlotRef};
use orbitkv_testkit::{chain, namespace, TestServer};
use rand::{Rng, SeedableRng};

fn error_code(r: Response) -> ErrorCode {
    match r {
        Response::Error { code, message } => {
            assert!(!message.is_empty());
            code
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn garbage_on_the_bootstrap_socket() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let inputs: Vec<Vec<u8>> = vec![
        vec![],
        vec![1, 2],
        u32::MAX.to_le_bytes().to_vec(),
        {
            let mut v = 100u32.to_le_bytes().to_vec();
            v.extend_from_slice(&[0xab; 10]);
            v
        },
        {
            let mut v = 64u32.to_le_bytes().to_vec();
            v.extend_from_slice(&[0x5a; 64]);
            v
        },
    ];
    for input in inputs {
        let mut s = UnixStream::connect(&server.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&input).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        // Whatever it answered, it closed the connection and opened no session.
    }
    assert_eq!(server.admin("stats")["sessions"], 0);
    assert!(server.admin("stats")["refused_sessions"].as_u64().unwrap() >= 4);
    let mut c = server.client("after-garbage");
    c.ping().unwrap();
}

#[test]
fn malformed_and_out_of_range_requests_get_error_replies() {
    let server =
        TestServer::start(&["--shards", "2", "--dram", "16MiB", "--max-keys-per-request", "64"]);
    let mut c = server.client("fuzzer");
    let ns = c.register_namespace(&namespace(4)).unwrap().id;
    let keys = chain(ns, 3, 4);

    // Garbage, truncated and mutated encodings.
    assert_eq!(error_code(c.call_raw(&[]).unwrap()), ErrorCode::Malformed);
    assert_eq!(error_code(c.call_raw(&[0xff; 100]).unwrap()), ErrorCode::Malformed);
    let good = encode(&Request::Lookup { keys: keys.clone(), lease: true }).to_vec();
    for cut in [1, good.len() / 2, good.len() - 1] {
        assert_eq!(
            error_code(c.call_raw(&good[..cut]).unwrap()),
            ErrorCode::Malformed,
            "cut {cut}"
        );
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    for _ in 0..300 {
        let mut bytes = good.clone();
        for _ in 0..rng.gen_range(1..6) {
            let i = rng.gen_range(0..bytes.len());
            bytes[i] = rng.gen();
        }
        // Either a clean decode of some other valid request or an error: never a crash.
        let _ = c.call_raw(&bytes).unwrap();
    }
    // Oversized: more keys than allowed, and more bytes than allowed.
    let many = chain(ns, 4, 65);
    let r = c.call_raw(&encode(&Request::Lookup { keys: many, lease: false })).unwrap();
    assert_eq!(error_code(r), ErrorCode::TooLarge);
    assert_eq!(error_code(c.call_raw(&vec![0u8; 1 << 20]).unwrap()), ErrorCode::TooLarge);
    // Out of range values.
    let r = c.call_raw(&encode(&Request::Reserve { keys: keys.clone(), lens: vec![1] })).unwrap();
    assert_eq!(error_code(r), ErrorCode::Malformed);
    let r = c
        .call_raw(&encode(&Request::Reserve { keys: keys[..2].to_vec(), lens: vec![0, 1 << 40] }))
        .unwrap();
    assert_eq!(
        r,
        Response::Reserved {
            slots: vec![
                orbitkv_proto::Reservation::Failed(ErrorCode::InvalidArgument),
                orbitkv_proto::Reservation::Failed(ErrorCode::TooLarge),
            ]
        }
    );
    let bogus = vec![SlotRef { key: keys[0], generation: 12345 }];
    for req in [
        Request::Commit { slots: bogus.clone() },
        Request::Abort { slots: bogus.clone() },
        Request::Release { slots: bogus.clone() },
    ] {
        let r = c.call_raw(&encode(&req)).unwrap();
        assert_eq!(
            r,
            Response::Outcomes { outcomes: vec![ChunkOutcome::Failed(ErrorCode::NotFound)] },
            "{req:?}"
        );
    }
    let bad_ns = namespace(0);
    let r = c.call_raw(&encode(&Request::RegisterNamespace { descriptor: bad_ns })).unwrap();
    assert_eq!(error_code(r), ErrorCode::InvalidArgument);
    let r = c
        .call_raw(&encode(&Request::Reserve {
            keys: vec![ChunkKey::new(ns ^ 5, [0; 32])],
            lens: vec![10],
        }))
        .unwrap();
    // A namespace the session did not register: the whole request is refused.
    assert_eq!(error_code(r), ErrorCode::UnknownNamespace);

    // Still serving, and nothing leaked.
    c.ping().unwrap();
    assert!(c.lookup(&keys).is_ok());
    let stats = server.admin("stats");
    let rejected: u64 = stats["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["rejected_requests"].as_u64().unwrap())
        .sum();
    assert!(rejected >= 7, "{stats}");
    drop(c);
    server.wait_for("session reclaimed", |s| {
        s.shard_sum("leases") == 0 && s.shard_sum("reservations") == 0
    });
}

#[test]
fn silent_connections_are_bounded_and_time_out() {
    // max-sessions 2 + 64 handshakes: the 67th silent connection is refused at once.
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB", "--max-sessions", "2"]);
    let silent: Vec<UnixStream> =
        (0..66).map(|_| UnixStream::connect(&server.socket).unwrap()).collect();
    let mut extra = UnixStream::connect(&server.socket).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = Vec::new();
    extra.read_to_end(&mut answer).unwrap();
    let welcome: orbitkv_proto::Welcome = orbitkv_proto::decode(&answer[4..]).unwrap();
    assert!(
        matches!(welcome, orbitkv_proto::Welcome::Refused { code: ErrorCode::TooManySessions, .. }),
        "{welcome:?}"
    );
    // Silent connections are dropped after the hello timeout; then sessions open again.
    drop(silent);
    server.wait_for("handshakes released", |s| s.client_try().is_ok());
}
