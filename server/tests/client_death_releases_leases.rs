//! A client killed with SIGKILL while holding leases and reservations: its session, leases and
//! reserved bytes go back to zero, and other clients are unaffected.

use orbitkv_client::{Client, ClientOptions};
use orbitkv_testkit::{chain, helper_process, kill9, namespace, value_for, TestServer};

const CHILD_ENV: &str = "ORBITKV_TEST_HOLDER_SOCKET";

/// Runs only as the child process of `sigkill_reclaims_everything` (it is ignored otherwise):
/// takes leases and reservations, says so, then waits to be killed.
#[test]
#[ignore = "helper process for sigkill_reclaims_everything"]
fn holder_process() {
    let socket = std::env::var(CHILD_ENV).expect("run by sigkill_reclaims_everything");
    let mut c = Client::connect(ClientOptions::with_socket(socket)).unwrap();
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 1, 10);
    let leases = c.lookup_leased(&keys).unwrap();
    assert_eq!(leases.len(), 10);
    let fresh = chain(ns, 2, 5);
    let reserved = c.reserve(&fresh, &[60_000; 5]).unwrap();
    assert!(reserved.iter().all(Result::is_ok));
    println!("HOLDING");
    std::thread::sleep(std::time::Duration::from_secs(600));
}

#[test]
fn sigkill_reclaims_everything() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut other = server.client("bystander");
    let ns = other.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 1, 10);
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 50_000)).collect();
    let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    other.put(&items).unwrap();
    let mine = other.lookup_leased(&keys[..3]).unwrap();
    let used_before = server.shard_sum("dram_used_bytes");

    let child = helper_process("holder_process", (CHILD_ENV, &server.socket), "HOLDING");
    assert_eq!(server.shard_sum("leases"), 13);
    assert_eq!(server.shard_sum("reservations"), 5);
    assert_eq!(server.admin("stats")["sessions"], 2);
    assert!(server.shard_sum("dram_used_bytes") > used_before);

    kill9(child);
    server.wait_for("reclaim", |s| s.shard_sum("leases") == 3 && s.shard_sum("reservations") == 0);
    assert_eq!(server.admin("stats")["sessions"], 1);
    assert_eq!(server.shard_sum("dram_used_bytes"), used_before, "reserved bytes returned");
    // It died between requests: none of its requests outlived it.
    assert_eq!(server.shard_sum("orphaned_requests"), 0);

    // The bystander's leases and data are untouched, and it keeps working.
    for (lease, v) in mine.iter().zip(&values) {
        assert_eq!(other.chunk(lease).unwrap(), &v[..]);
    }
    other.release(&mine).unwrap();
    assert_eq!(other.lookup(&keys).unwrap().len(), 10);
    assert_eq!(server.shard_sum("leases"), 0);
    drop(other);
    server.wait_for("all sessions closed", |s| s.admin("stats")["sessions"] == 0);
}

/// The iceoryx2 prefix of the server on `socket` (as the server derives it).
fn ipc_prefix(socket: &std::path::Path) -> String {
    let hash = blake3::hash(socket.as_os_str().as_encoded_bytes());
    let tag: String = hash.as_bytes()[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("okv{tag}_")
}

/// An empty shared memory object is what a client killed while creating one leaves, and
/// iceoryx2's dead-node cleanup waits on such an object without a bound: the server's janitor
/// (a thread of its own, never a shard) removes the server's stale empty objects, leaves a
/// young one alone, and sessions keep opening, serving and closing meanwhile.
#[test]
fn stale_empty_ipc_objects_are_removed_off_the_shards() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let prefix = ipc_prefix(&server.socket);
    let stale = std::path::Path::new("/dev/shm").join(format!("{prefix}test-stale.connection"));
    let young = std::path::Path::new("/dev/shm").join(format!("{prefix}test-young.connection"));
    std::fs::write(&stale, b"").unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    std::fs::File::options().write(true).open(&stale).unwrap().set_modified(old).unwrap();
    std::fs::write(&young, b"").unwrap();
    for i in 0..3 {
        let mut c = server.client("passer-by");
        let ns = c.register_namespace(&namespace(16)).unwrap().id;
        let keys = chain(ns, 10 + i, 2);
        let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 4096)).collect();
        let items: Vec<_> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
        c.put(&items).unwrap();
        assert_eq!(c.lookup(&keys).unwrap().len(), 2);
    }
    server.wait_for("the stale empty object removed", |_| !stale.exists());
    assert!(young.exists(), "a young empty object may be one being created");
    assert!(server.log().contains("removed an empty iceoryx2 shared memory object"));
    server.wait_for("every session closed", |s| s.admin("stats")["sessions"] == 0);
    std::fs::remove_file(&young).unwrap();
}
