//! After a server restart the client reconnects on its next call and re-registers its
//! namespaces; a call in flight when the server dies fails with a clear error.

use std::time::Duration;

use nix::sys::signal::Signal;
use orbitkv_client::{Error, PutOutcome};
use orbitkv_testkit::{chain, namespace, reconnect, value_for, TestServer};

#[test]
fn next_call_reconnects() {
    let mut server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 9, 2);
    c.put(&[(keys[0], &value_for(&keys[0], 5000))]).unwrap();
    let lease = c.lookup_leased(&keys[..1]).unwrap();
    let first = c.session_id().unwrap();

    server.signal(Signal::SIGKILL);
    server.wait_exit(Duration::from_secs(10));
    // While the server is down: a clear connection error.
    let err = c.ping().unwrap_err();
    assert!(matches!(err, Error::Disconnected(_) | Error::Connect { .. }), "{err}");

    server.spawn(&["--shards", "2", "--dram", "16MiB"]);
    // The ping above tried to connect and failed: the client backs off before the next try.
    reconnect(&mut c);
    // A session on the new server (ids restart with the server, so compare the server's view).
    assert!(c.session_id().is_some());
    assert_eq!(server.admin("stats")["sessions"], 1);
    let _ = first;
    // The namespace was re-registered: writes work without registering again.
    assert_eq!(c.put(&[(keys[1], &value_for(&keys[1], 5000))]).unwrap(), vec![PutOutcome::Stored]);
    // The old server's data is gone (DRAM only) and its leases are stale.
    assert_eq!(c.lookup(&keys).unwrap().len(), 0);
    assert!(matches!(c.chunk(&lease[0]), Err(Error::Stale)));
    assert!(matches!(c.release(&lease), Err(Error::Stale)));
}

#[test]
fn a_call_in_flight_fails_clearly_when_the_server_dies() {
    let mut server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    let mut c = server.client("in-flight");
    c.ping().unwrap();
    // Freeze the server so the next request stays in flight, then kill it.
    server.freeze();
    let caller = std::thread::spawn(move || (c.ping(), c));
    std::thread::sleep(Duration::from_millis(100));
    server.signal(Signal::SIGKILL);
    server.wait_exit(Duration::from_secs(10));
    let (result, mut c) = caller.join().unwrap();
    let err = result.unwrap_err();
    assert!(matches!(err, Error::Disconnected(_)), "{err}");
    assert_eq!(err.kind(), "disconnected");
    // And the next call after a restart reconnects.
    server.spawn(&["--shards", "1", "--dram", "8MiB"]);
    c.ping().unwrap();
}

#[test]
fn a_timed_out_call_drops_the_session_and_the_next_call_reconnects() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    let mut c = orbitkv_client::Client::connect(orbitkv_client::ClientOptions {
        request_timeout: Duration::from_millis(200),
        ..orbitkv_client::ClientOptions::with_socket(&server.socket)
    })
    .unwrap();
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 4, 1);
    c.put(&[(keys[0], &value_for(&keys[0], 4096))]).unwrap();
    let held = c.lookup_leased(&keys).unwrap();
    server.freeze();
    let err = c.ping().unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    server.signal(Signal::SIGCONT);
    // The dropped session's lease is reclaimed by the server (waited for first: the 200 ms
    // budget of the client's reconnect below is for the reconnect, not for the thawed server
    // catching up under a loaded CI machine); the client reconnects.
    server.wait_for("old session reclaimed", |s| {
        s.shard_sum("leases") == 0 && s.admin("stats")["sessions"] == 0
    });
    c.ping().unwrap();
    assert_eq!(server.admin("stats")["sessions"], 1);
    assert!(matches!(c.release(&held), Err(Error::Stale)));
    assert_eq!(c.lookup(&keys).unwrap().len(), 1);
}

#[test]
fn a_call_right_after_the_server_died_fails_clearly_and_the_next_reconnects() {
    // The client trusts an answer as proof that the server is there for a short while and
    // skips its socket check then: a call made at once after a SIGKILL may be sent to the
    // dead server. It must still fail as disconnected (not hang, not time out), and the call
    // after a restart must reconnect.
    let mut server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    let mut c = server.client("quick");
    c.ping().unwrap();
    server.signal(Signal::SIGKILL);
    // The signal lands asynchronously: a spinning shard may still answer a few pings, each
    // renewing the window, so the first failing call is made inside it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let err = loop {
        match c.ping() {
            Ok(()) => assert!(std::time::Instant::now() < deadline, "the server kept answering"),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::Disconnected(_) | Error::Connect { .. }), "{err}");
    server.wait_exit(Duration::from_secs(10));
    server.spawn(&["--shards", "1", "--dram", "8MiB"]);
    reconnect(&mut c);
    assert_eq!(server.admin("stats")["sessions"], 1);
}

/// Holdings of a session that ended while the client made no call are `Stale` when next
/// used: a commit or a release is not sent to the new session (which knows nothing of them
/// and answered `NotFound`, which an engine takes for a lasting failure instead of redoing
/// its put or lookup).
#[test]
fn holdings_of_a_session_that_ended_unnoticed_are_stale() {
    let args = ["--shards", "1", "--dram", "8MiB"];
    let mut server = TestServer::start(&args);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 4, 2);
    c.put(&[(keys[0], &value_for(&keys[0], 4096))]).unwrap();
    let leases = c.lookup_leased(&keys[..1]).unwrap();
    let r = c.reserve(&keys[1..], &[4096]).unwrap()[0].unwrap();
    c.slot_mut(&r).unwrap().copy_from_slice(&value_for(&keys[1], 4096));

    server.signal(Signal::SIGKILL);
    server.wait_exit(Duration::from_secs(10));
    server.spawn(&args);
    let got = c.commit(&[r]);
    assert!(matches!(got, Err(Error::Stale)), "{got:?}");
    let got = c.release(&leases);
    assert!(matches!(got, Err(Error::Stale)), "{got:?}");
    // The next call reconnects; nothing was left held on the new server.
    c.ping().unwrap();
    assert_eq!(server.shard_sum("reservations") + server.shard_sum("leases"), 0);
}

/// A loop of calls against a dead server does not hammer its socket: after a failed connect
/// the calls fail at once as unavailable, and attempts are spaced out (capped exponential),
/// until the server is back, when a call reconnects.
#[test]
fn calls_against_a_dead_server_back_off_then_reconnect() {
    let args = ["--shards", "1", "--dram", "8MiB"];
    let mut server = TestServer::start(&args);
    let mut c = orbitkv_client::Client::connect(orbitkv_client::ClientOptions {
        reconnect_backoff: Duration::from_millis(20),
        reconnect_backoff_max: Duration::from_millis(200),
        ..orbitkv_client::ClientOptions::with_socket(&server.socket)
    })
    .unwrap();
    c.ping().unwrap();
    let before = c.connect_attempts();
    server.signal(Signal::SIGKILL);
    server.wait_exit(Duration::from_secs(10));
    let (mut calls, mut unavailable) = (0u64, 0u64);
    let until = std::time::Instant::now() + Duration::from_millis(600);
    while std::time::Instant::now() < until {
        let err = c.ping().unwrap_err();
        calls += 1;
        if matches!(err, Error::Unavailable { .. }) {
            assert!(err.is_unavailable() && err.to_string().contains("next connect attempt"));
            unavailable += 1;
        }
    }
    let attempts = c.connect_attempts() - before;
    // 20, 40, 80, 160, 200, 200 ms...: in 600 ms about 6 attempts; a loop without backoff
    // makes one per call (tens of thousands).
    assert!(attempts <= 12, "{attempts} connect attempts in {calls} calls");
    assert!(unavailable + attempts + 2 >= calls, "{unavailable} fast failures of {calls}");
    assert!(calls > 100 && !c.is_connected());
    server.spawn(&args);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.ping().is_err() {
        assert!(std::time::Instant::now() < deadline, "no reconnect within the backoff cap");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(c.is_connected());
    assert_eq!(server.admin("stats")["sessions"], 1);
}

/// A client made before its server starts connects on its first call once the server is up,
/// and registers the namespace it was given while the server was away.
#[test]
fn a_client_made_before_its_server_connects_later() {
    let dir = tempfile::Builder::new().prefix("okv").tempdir_in("/tmp").unwrap();
    let socket = dir.path().join("late.sock");
    let mut c = orbitkv_client::Client::new(orbitkv_client::ClientOptions {
        reconnect_backoff: Duration::from_millis(10),
        ..orbitkv_client::ClientOptions::with_socket(&socket)
    });
    let d = namespace(16);
    let err = c.register_namespace(&d).unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    let server = TestServer::start_at(dir, "late.sock", &["--shards", "1", "--dram", "8MiB"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.ping().is_err() {
        assert!(std::time::Instant::now() < deadline, "never connected");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The namespace registered on connect: a put under its id needs no register call.
    let keys = chain(d.id(), 2, 1);
    assert_eq!(c.put(&[(keys[0], &value_for(&keys[0], 4096))]).unwrap(), vec![PutOutcome::Stored]);
    server.signal(Signal::SIGTERM);
}
