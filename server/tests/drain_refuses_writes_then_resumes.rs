//! Drain: new sessions and writes are refused with `Draining`, in-flight writes complete,
//! health is not ready, reads keep working; resume restores everything.

use orbitkv_client::{ChunkOutcome, Client, ClientOptions, ErrorCode, PutOutcome};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

#[test]
fn drain_then_resume() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 5, 6);
    let v: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 30_000)).collect();
    c.put(&[(keys[0], &v[0])]).unwrap();
    // An in-flight write: reserved and written, not yet committed.
    let inflight = c.reserve(&keys[1..3], &[30_000, 30_000]).unwrap();
    let inflight: Vec<_> = inflight.into_iter().map(Result::unwrap).collect();
    for (r, bytes) in inflight.iter().zip(&v[1..3]) {
        c.slot_mut(r).unwrap().copy_from_slice(bytes);
    }

    let answer = server.admin("drain");
    assert_eq!(answer["state"], "draining");
    let health = server.admin("health");
    assert_eq!(health["ready"], false);
    assert_eq!(health["state"], "draining");

    // New writes are refused with Draining; reads still work.
    let err = c.put(&[(keys[4], &v[4])]).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Draining), "{err}");
    assert_eq!(c.lookup(&keys[..1]).unwrap().len(), 1);
    // New sessions are refused with Draining.
    let refused = Client::connect(ClientOptions::with_socket(&server.socket)).unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Draining), "{refused}");

    // The in-flight write completes; then the server reports drained.
    assert_eq!(server.admin("stats")["state"], "draining");
    assert_eq!(c.commit(&inflight).unwrap(), vec![ChunkOutcome::Done; 2]);
    assert_eq!(server.admin("stats")["state"], "drained");
    assert_eq!(c.lookup(&keys[..3]).unwrap().len(), 3);

    assert_eq!(server.admin("resume")["state"], "serving");
    assert_eq!(server.admin("health")["ready"], true);
    assert_eq!(c.put(&[(keys[4], &v[4])]).unwrap(), vec![PutOutcome::Stored]);
    Client::connect(ClientOptions::with_socket(&server.socket)).unwrap().ping().unwrap();
}
