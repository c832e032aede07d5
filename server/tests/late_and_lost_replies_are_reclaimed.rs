//! Replies that come late or never (failpoints `session-reply-delay`, `session-reply-drop`, in
//! builds with the `failpoints` feature) and clients that vanish meanwhile: whatever the server
//! granted is reclaimed once the session is gone, counted, and other sessions serve on.
//! `cargo test -p orbitkv-server --features failpoints --test late_and_lost_replies_are_reclaimed`.

use std::time::Duration;

use orbitkv_client::{Client, ClientOptions};
use orbitkv_testkit::{chain, helper_process, kill9, namespace, value_for, TestServer};

const CHILD_ENV: &str = "ORBITKV_TEST_WAITER_SOCKET";

fn failpoints_built(server: &TestServer) -> bool {
    // A build without the feature ignores FAILPOINTS: the server logs nothing of it, and the
    // replies come at once; such a build cannot run these tests.
    if cfg!(feature = "failpoints") {
        return true;
    }
    eprintln!("skipped: build with --features failpoints ({})", server.socket.display());
    false
}

/// Runs only as the child of `a_client_killed_while_its_reply_is_late_is_reclaimed`: asks for
/// leases (whose answer the server holds back), says so, and waits to be killed.
#[test]
#[ignore = "helper process for a_client_killed_while_its_reply_is_late_is_reclaimed"]
fn late_reply_waiter() {
    let socket = std::env::var(CHILD_ENV).expect("run by the test that spawns it");
    let mut c = Client::connect(ClientOptions::with_socket(socket)).unwrap();
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    println!("ASKING");
    let _ = c.lookup_leased(&chain(ns, 1, 10));
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_client_killed_while_its_reply_is_late_is_reclaimed() {
    let server = TestServer::start_env(
        &[("FAILPOINTS", "session-reply-delay=return(2s)")],
        &["--shards", "2", "--dram", "16MiB"],
    );
    if !failpoints_built(&server) {
        return;
    }
    let mut writer = server.client("writer");
    let ns = writer.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 1, 10);
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 50_000)).collect();
    let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    writer.put(&items).unwrap(); // one reserve, answered 2 s late
    let child = helper_process("late_reply_waiter", (CHILD_ENV, &server.socket), "ASKING");
    // The leases are taken; the answer waits. The client dies meanwhile.
    server.wait_for("leases taken", |s| s.shard_sum("leases") > 0);
    kill9(child);
    server.wait_for("reclaim", |s| s.shard_sum("leases") == 0 && s.admin("stats")["sessions"] == 1);
    assert!(server.shard_sum("orphaned_requests") >= 1, "its request outlived it, counted");
    let audit = server.try_admin_request(&serde_json::json!({"cmd": "audit"})).unwrap();
    assert_eq!(audit["ok"], true, "{audit}");
    // The other session serves on (its replies late too).
    assert_eq!(writer.lookup(&keys[..2]).unwrap().len(), 2);
}

#[test]
fn a_lost_reply_times_the_client_out_and_what_it_held_comes_back() {
    let server = TestServer::start_env(
        &[("FAILPOINTS", "session-reply-drop=1*return")],
        &["--shards", "2", "--dram", "16MiB"],
    );
    if !failpoints_built(&server) {
        return;
    }
    let mut c = Client::connect(ClientOptions {
        request_timeout: Duration::from_millis(500),
        ..ClientOptions::with_socket(&server.socket)
    })
    .unwrap();
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 2, 4);
    // The first reserve's answer is lost: the call times out and drops its session.
    let err = c.reserve(&keys, &[50_000; 4]).unwrap_err();
    assert!(matches!(err, orbitkv_client::Error::Timeout { .. }), "{err}");
    server.wait_for("reclaim", |s| {
        s.shard_sum("reservations") == 0 && s.shard_sum("dropped_replies") == 1
    });
    // The next call reconnects, and the same keys can be written.
    c.register_namespace(&namespace(16)).unwrap();
    for k in &keys {
        c.put(&[(*k, &value_for(k, 50_000))]).unwrap();
    }
    assert_eq!(c.lookup(&keys).unwrap().len(), 4);
    let audit = server.try_admin_request(&serde_json::json!({"cmd": "audit"})).unwrap();
    assert_eq!(audit["ok"], true, "{audit}");
}
