//! `orbitkv-ctl` against a real `orbitkv-server`: health exit status, stats table and JSON,
//! drain with an in-flight write, resume, sessions, evict.

use std::path::Path;
use std::process::{Command, Output};

use orbitkv_client::{Client, ClientOptions, Dtype, NamespaceDescriptor};
use orbitkv_testkit::TestServer;
use serde_json::Value;

fn ctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_orbitkv-ctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn health_stats_drain_resume_sessions() {
    let dir = tempfile::Builder::new().prefix("okvctl").tempdir_in("/tmp").unwrap();
    let socket = dir.path().join("s.sock");

    // No server: health fails with exit 1 and says why.
    let out = ctl(&socket, &["health"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("cannot reach"), "{out:?}");
    // Other commands exit 2 with an error naming the socket.
    let out = ctl(&socket, &["stats"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("s.sock.admin"), "{out:?}");

    let _server = start(dir, "2");

    let stats = json(&ctl(&socket, &["stats", "--json"]));
    assert_eq!(stats["state"], "serving");
    assert_eq!(stats["sessions"], 0);
    let shards = stats["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2);
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(s["id"], i);
        for field in [
            "core",
            "dram_capacity_bytes",
            "dram_used_bytes",
            "entries",
            "hits",
            "misses",
            "evictions",
            "leases",
        ] {
            assert!(s.get(field).is_some(), "shard field {field} missing: {s}");
        }
        assert_eq!(s["dram_capacity_bytes"], 8 << 20);
    }
    let table = String::from_utf8(ctl(&socket, &["stats"]).stdout).unwrap();
    assert!(table.starts_with("state serving"), "{table}");
    assert_eq!(table.lines().count(), 5, "{table}");

    // A session with an in-flight (reserved, uncommitted) write.
    let mut c = Client::connect(ClientOptions {
        name: "ctl-test".into(),
        ..ClientOptions::with_socket(&socket)
    })
    .unwrap();
    let ns = c.register_namespace(&descriptor("ctl")).unwrap();
    let key = orbitkv_client::ChunkKey::new(ns.id, [7; 32]);
    let slot = c.reserve(&[key], &[1000]).unwrap().pop().unwrap().unwrap();

    let sessions = json(&ctl(&socket, &["sessions", "--json"]));
    assert_eq!(sessions.as_array().unwrap().len(), 1);
    assert_eq!(sessions[0]["name"], "ctl-test");
    assert_eq!(sessions[0]["pid"], std::process::id());
    assert!(String::from_utf8_lossy(&ctl(&socket, &["sessions"]).stdout).contains("ctl-test"));

    // Drain cannot finish while the write is in flight.
    let out = ctl(&socket, &["drain", "--timeout", "300ms"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 uncommitted reservations"), "{out:?}");
    let out = ctl(&socket, &["health"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("draining"), "{out:?}");
    // Completing the write lets drain finish.
    c.commit(&[slot]).unwrap();
    let out = ctl(&socket, &["drain", "--timeout", "5s"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "drained");
    assert_eq!(json(&ctl(&socket, &["stats", "--json"]))["state"], "drained");

    let out = ctl(&socket, &["resume"]);
    assert!(out.status.success());
    assert!(ctl(&socket, &["health"]).status.success());
    assert_eq!(json(&ctl(&socket, &["health", "--json"]))["ready"], true);
}

/// A small bf16 namespace of model `model`.
fn descriptor(model: &str) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: model.into(),
        dtype: Dtype::Bf16,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 64,
        kv_tensors: 2,
        tokens_per_chunk: 16,
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    }
}

/// A server on the socket `s.sock` of `dir` with `--gpu off` (nothing below depends on the
/// machine having a GPU), healthy.
fn start(dir: tempfile::TempDir, shards: &str) -> TestServer {
    TestServer::start_at(dir, "s.sock", &["--gpu", "off", "--shards", shards, "--dram", "16MiB"])
}

#[test]
fn evict_removes_one_namespace_or_all_and_keeps_what_is_leased() {
    let dir = tempfile::Builder::new().prefix("okvctl").tempdir_in("/tmp").unwrap();
    let socket = dir.path().join("s.sock");
    let server = start(dir, "2");
    let mut c = Client::connect(ClientOptions::with_socket(&socket)).unwrap();
    let a = c.register_namespace(&descriptor("a")).unwrap().id;
    let b = c.register_namespace(&descriptor("b")).unwrap().id;
    let keys = |ns: u64| -> Vec<orbitkv_client::ChunkKey> {
        (0..10u8).map(|i| orbitkv_client::ChunkKey::new(ns, [i; 32])).collect()
    };
    let value = vec![0xabu8; 1000];
    for k in keys(a).into_iter().chain(keys(b)) {
        c.put(&[(k, &value)]).unwrap();
    }
    let present = |c: &mut Client, ns: u64| {
        keys(ns).iter().filter(|k| c.lookup(&[**k]).unwrap().len() == 1).count()
    };
    assert_eq!((present(&mut c, a), present(&mut c, b)), (10, 10));
    let leased = c.lookup_leased(&keys(a)[3..4]).unwrap();
    assert_eq!(leased.len(), 1);
    // The audit's full scan agrees with the counters: 20 entries, the one lease.
    let out = ctl(&socket, &["audit"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("consistent: 2 shards, 20 entries, 1 leases"), "{text}");

    // Namespace a: all but the leased chunk go, on every shard; b stays whole.
    let out = ctl(&socket, &["evict", "--namespace", &a.to_string(), "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v = json(&out);
    assert_eq!((v["removed"].as_u64(), v["busy"].as_u64()), (Some(9), Some(1)), "{v}");
    assert_eq!(v["shards"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!((present(&mut c, a), present(&mut c, b)), (1, 10));
    assert_eq!(c.chunk(&leased[0]).unwrap(), &value[..], "the leased chunk is intact");
    c.release(&leased).unwrap();

    // Released, it goes too (the id in hex this time); then everything.
    let out = ctl(&socket, &["evict", "--namespace", &format!("{a:#x}")]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "removed 1 chunks");
    let out = ctl(&socket, &["evict", "--all"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "removed 10 chunks", "{out:?}");
    assert_eq!((present(&mut c, a), present(&mut c, b)), (0, 0));
    let stats = json(&ctl(&socket, &["stats", "--json"]));
    let removals: u64 =
        stats["shards"].as_array().unwrap().iter().map(|s| s["removals"].as_u64().unwrap()).sum();
    assert_eq!(removals, 20);

    // Bad requests on the admin socket name what is wrong; the server keeps serving.
    for (line, says) in [
        (r#"{"cmd":"evict"}"#, "give \"namespace\": ID or \"all\": true"),
        (r#"{"cmd":"evict","namespace":"x"}"#, "\"namespace\" must be a namespace id"),
        (r#"{"cmd":"evict","namespace":-1}"#, "\"namespace\" must be a namespace id"),
        (r#"{"cmd":"evict","all":false}"#, "\"all\" must be true"),
        (r#"{"cmd":"evict","all":true,"namespace":1}"#, "not both"),
    ] {
        let v = server.try_admin_request(&serde_json::from_str(line).unwrap()).unwrap();
        assert_eq!(v["ok"], false, "{line}: {v}");
        assert!(v["error"].as_str().unwrap().contains(says), "{line}: {v}");
    }
    assert!(ctl(&socket, &["health"]).status.success());
    c.put(&[(keys(a)[0], &value)]).unwrap();
    assert_eq!(present(&mut c, a), 1);
    let v = json(&ctl(&socket, &["audit", "--json"]));
    assert_eq!(
        (v["ok"].as_bool(), v["problems"].as_array().map(Vec::len)),
        (Some(true), Some(0)),
        "{v}"
    );
    let entries: u64 =
        v["shards"].as_array().unwrap().iter().map(|s| s["entries"].as_u64().unwrap()).sum();
    assert_eq!(entries, 1, "{v}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = ctl(Path::new("/tmp/nowhere.sock"), &["drain", "--timeout", "soon"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--timeout"), "{out:?}");
    let out = ctl(Path::new("/tmp/nowhere.sock"), &["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    // evict needs exactly one of --namespace and --all, and a namespace id.
    for args in
        [&["evict"][..], &["evict", "--all", "--namespace", "1"], &["evict", "--namespace", "x1"]]
    {
        let out = ctl(Path::new("/tmp/nowhere.sock"), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--namespace") && !err.contains("nowhere"), "{args:?}: {err}");
    }
}
