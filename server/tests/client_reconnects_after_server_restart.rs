//! After a server restart the client reconnects on its next call and re-registers its
//! namespaces; a call in flight when the server dies fails with a clear error.

mod common;

use std::time::Duration;

use common::{chain, namespace, value_for, TestServer};
use nix::sys::signal::Signal;
use orbitkv_client::{Error, PutOutcome};

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
    c.ping().unwrap();
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
