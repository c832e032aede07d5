//! A session may name only namespaces it registered; sessions of one uid (a tenant) share the
//! namespaces they register, and a shared model's namespaces are everyone's. (That another
//! uid's registration of a tenant's namespace is refused is unit-tested in `access.rs`: two
//! uids cannot both hold sessions here, iceoryx2 0.10's shared memory being owner-only.)

use orbitkv_client::{ErrorCode, NamespaceDescriptor};
use orbitkv_testkit::{chain, namespace, put_values, TestServer};

#[test]
fn a_session_names_only_namespaces_it_registered() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut a = server.client("a");
    let ns = a.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 5, 4);
    put_values(&mut a, &keys, 4096);
    // Same uid, not registered yet: refused, naming the namespace; nothing is touched.
    let mut b = server.client("b");
    for e in [b.lookup(&keys).unwrap_err(), b.evict(&keys).unwrap_err()] {
        assert_eq!(e.code(), Some(ErrorCode::UnknownNamespace), "{e}");
        assert!(e.to_string().contains(&format!("{ns:#018x}")), "{e}");
    }
    // Registered: the same tenant shares it.
    b.register_namespace(&namespace(16)).unwrap();
    assert_eq!(b.lookup(&keys).unwrap().len(), 4);
}

#[test]
fn a_shared_model_is_registered_and_used_by_every_session() {
    let server = TestServer::start(&["--shards", "1", "--dram", "16MiB", "--shared-model", "m"]);
    let d = NamespaceDescriptor { model: "m".into(), ..namespace(4) };
    let mut a = server.client("a");
    let ns = a.register_namespace(&d).unwrap().id;
    let keys = chain(ns, 9, 2);
    put_values(&mut a, &keys, 4096);
    let mut b = server.client("b");
    b.register_namespace(&d).unwrap();
    assert_eq!(b.lookup(&keys).unwrap().len(), 2);
}
