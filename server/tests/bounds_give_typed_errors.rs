//! Every bound answers with a typed error and a message, is counted, and leaves the server
//! serving: leases and reservations per session, sessions, chunk size, arena space, a
//! namespace's DRAM limit (with another namespace's guarantee kept).

use orbitkv_client::{Client, ClientOptions, ErrorCode, PutOutcome};
use orbitkv_testkit::{chain, namespace, put_values, value_for, TestServer};

#[test]
fn per_session_lease_and_reservation_limits() {
    let server = TestServer::start(&[
        "--shards",
        "2",
        "--dram",
        "16MiB",
        "--max-leases-per-session",
        "4",
        "--max-reservations-per-session",
        "3",
    ]);
    let mut c = server.client("greedy");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 1, 8);
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 4096)).collect();
    for (k, v) in keys.iter().zip(&vals) {
        assert_eq!(c.put(&[(*k, v)]).unwrap(), vec![PutOutcome::Stored]);
    }
    let held = c.lookup_leased(&keys[..3]).unwrap();
    let err = c.lookup_leased(&keys[3..5]).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::LeaseLimit), "{err}");
    assert!(err.to_string().contains("--max-leases-per-session"), "{err}");
    // Unleased lookups are not limited.
    assert_eq!(c.lookup(&keys).unwrap().len(), 8);
    c.release(&held).unwrap();
    assert_eq!(c.lookup_leased(&keys[..4]).unwrap().len(), 4);

    let fresh = chain(ns, 2, 4);
    let r = c.reserve(&fresh[..3], &[100; 3]).unwrap();
    assert!(r.iter().all(Result::is_ok));
    let err = c.reserve(&fresh[3..], &[100]).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::LeaseLimit), "{err}");
    assert!(err.to_string().contains("--max-reservations-per-session"), "{err}");
    let stats = server.admin("stats");
    let counted: u64 = stats["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["errors"]["lease_limit"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(counted, 2, "{stats}");
}

#[test]
fn session_limit() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB", "--max-sessions", "1"]);
    let _first = server.client("first");
    let err = Client::connect(ClientOptions::with_socket(&server.socket)).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TooManySessions), "{err}");
    assert!(err.to_string().contains("--max-sessions"), "{err}");
}

#[test]
fn chunk_size_and_space() {
    // One shard of 256 KiB: four 64 KiB chunks.
    let server =
        TestServer::start(&["--shards", "1", "--dram", "256KiB", "--max-chunk-size", "64KiB"]);
    let mut c = server.client("filler");
    // A namespace whose chunks exceed --max-chunk-size is refused, naming the flag.
    let err = c.register_namespace(&namespace(32)).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TooLarge));
    assert!(err.to_string().contains("--max-chunk-size"), "{err}");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 3, 6);
    // A chunk longer than the namespace allows.
    assert_eq!(
        c.put(&[(keys[0], &vec![1u8; 65 << 10])]).unwrap(),
        vec![PutOutcome::Failed(ErrorCode::TooLarge)]
    );
    for k in &keys[..4] {
        assert_eq!(c.put(&[(*k, &value_for(k, 64 << 10))]).unwrap(), vec![PutOutcome::Stored]);
    }
    // Everything leased: nothing can be evicted, so a fifth chunk gets NoSpace.
    let leases = c.lookup_leased(&keys[..4]).unwrap();
    assert_eq!(
        c.put(&[(keys[4], &value_for(&keys[4], 64 << 10))]).unwrap(),
        vec![PutOutcome::Failed(ErrorCode::NoSpace)]
    );
    c.release(&leases).unwrap();
    assert_eq!(
        c.put(&[(keys[4], &value_for(&keys[4], 64 << 10))]).unwrap(),
        vec![PutOutcome::Stored]
    );
    assert_eq!(server.shard_sum("evictions"), 1);
}

#[test]
fn bad_flags_are_refused_naming_the_flag() {
    for (args, flag) in [
        (&["--dram", "lots"][..], "--dram"),
        (&["--max-sessions", "0"][..], "--max-sessions"),
        (&["--shards", "1", "--dram", "4KiB"][..], "--dram"),
        (&["--idle-poll-max", "5s"][..], "--idle-poll-max"),
        (
            &["--namespace-dram-limit", "1MiB", "--namespace-dram-guarantee", "2MiB"][..],
            "--namespace-dram-guarantee",
        ),
        (
            &["--dram", "8MiB", "--namespace-dram-guarantee", "8MiB"][..],
            "--namespace-dram-guarantee",
        ),
        (&["--namespace-dram-limit", "x"][..], "--namespace-dram-limit"),
        (&["--model-quota", "noisy"][..], "--model-quota"),
        (&["--model-quota", "noisy:dram-limit=1MiB,ssd-guarantee=1MiB"][..], "needs an SSD tier"),
        (&["--namespace-ssd-guarantee", "1MiB"][..], "--namespace-ssd-guarantee"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
            .args(["--socket", "/tmp/orbitkv-bad-flags-test.sock"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn config_file_with_flag_override() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("orbitkv.toml");
    std::fs::write(&cfg, "shards = 2\ndram = \"32MiB\"\nmax-sessions = 7\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .arg("--config")
        .arg(&cfg)
        .args(["--max-sessions", "9", "--print-config"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("dram = \"32MiB\""), "{text}");
    assert!(text.contains("max-sessions = 9"), "{text}");
    std::fs::write(&cfg, "dram = 5\nunknown-key = 1\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid config file"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Started requests the caller drops before their answer still count against the session's
/// requests in flight until the server answers; later calls collect those answers and count
/// their failures, the session goes on, and the server never holds more than the bound.
#[test]
fn dropped_started_requests_count_until_answered() {
    use orbitkv_client::{Error, Request};
    use orbitkv_proto::SlotRef;
    let server =
        TestServer::start(&["--shards", "1", "--dram", "16MiB", "--max-inflight-per-session", "2"]);
    let mut c = server.client("canceller");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let session = c.session_id();
    // A release of a slot never leased: answered with one failed chunk.
    let unheld =
        Request::Release { slots: vec![SlotRef { key: chain(ns, 7, 1)[0], generation: 1 }] };
    for _ in 0..64 {
        drop(c.start_raw(&unheld).unwrap());
    }
    c.flush().unwrap();
    assert_eq!(c.deferred_failures(), 64, "every dropped request's answer was collected");
    // Two held fill the session: a third is refused, the session as it was.
    let (a, b) = (c.start_raw(&unheld).unwrap(), c.start_raw(&unheld).unwrap());
    let err = c.start_raw(&unheld).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // Dropping one makes room once its answer is in.
    drop(a);
    let d = c.start_raw(&unheld).unwrap();
    drop((b, d));
    c.flush().unwrap();
    assert_eq!(c.deferred_failures(), 67, "a, b and d");
    // One whose answer the caller took (waited or polled) is done when dropped.
    for _ in 0..8 {
        let t = c.start_raw(&unheld).unwrap();
        assert_eq!(c.wait_transfer(&t).unwrap().len(), 1);
        drop(t);
        let t = c.start_raw(&unheld).unwrap();
        while c.poll_transfer(&t).unwrap().is_none() {}
        drop(t);
    }
    c.flush().unwrap();
    assert_eq!(c.deferred_failures(), 67, "taken answers are not collected again");
    c.ping().unwrap();
    assert_eq!(c.session_id(), session, "no reconnect");
    assert_eq!(server.admin("stats")["sessions"], 1);
    assert!(!server.log().contains("receive failed"), "{}", server.log());
}

/// A namespace at `--namespace-dram-limit` evicts its own chunks for its writes; with every one
/// of them leased its next write is refused with `QuotaExceeded`, counted; another namespace
/// keeps its `--namespace-dram-guarantee` through it all, and writes on.
#[test]
fn a_namespace_over_its_dram_limit_gets_quota_exceeded() {
    let server = TestServer::start(&[
        "--shards",
        "1",
        "--dram",
        "4MiB",
        "--namespace-dram-limit",
        "1MiB",
        "--namespace-dram-guarantee",
        "512KiB",
    ]);
    let mut quiet = server.client("quiet");
    let q = quiet.register_namespace(&namespace(16)).unwrap().id;
    let quiet_keys = chain(q, 1, 8); // 8 x 64 KiB: 512 KiB, its guarantee
    for k in &quiet_keys {
        quiet.put(&[(*k, &value_for(k, 64 << 10))]).unwrap();
    }
    let mut noisy = server.client("noisy");
    let other = orbitkv_client::NamespaceDescriptor { model: "noisy".into(), ..namespace(16) };
    let n = noisy.register_namespace(&other).unwrap().id;
    let noisy_keys = chain(n, 2, 64); // 4 MiB through a 1 MiB limit
    for k in &noisy_keys {
        assert_eq!(noisy.put(&[(*k, &value_for(k, 64 << 10))]).unwrap(), vec![PutOutcome::Stored]);
    }
    assert_eq!(quiet.lookup(&quiet_keys).unwrap().len(), 8, "the quiet namespace kept all");
    let present: Vec<_> = noisy_keys
        .iter()
        .filter(|k| noisy.lookup(std::slice::from_ref(*k)).unwrap().len() == 1)
        .copied()
        .collect();
    assert_eq!(present.len(), 16, "1 MiB of 64 KiB chunks");
    let held = noisy.lookup_leased(&present).unwrap();
    let more = chain(n, 3, 1);
    let out = noisy.put(&[(more[0], &value_for(&more[0], 64 << 10))]).unwrap();
    assert_eq!(out, vec![PutOutcome::Failed(ErrorCode::QuotaExceeded)]);
    noisy.release(&held).unwrap();
    assert_eq!(server.shard_sum("quota_refusals"), 1);
    let stats = server.admin("stats");
    assert_eq!(stats["shards"][0]["errors"]["quota_exceeded"].as_u64(), Some(1), "{stats}");
    // Released, its own chunks make room again; the quiet namespace writes on.
    assert_eq!(
        noisy.put(&[(more[0], &value_for(&more[0], 64 << 10))]).unwrap(),
        vec![PutOutcome::Stored]
    );
    let k = chain(q, 4, 1)[0];
    assert_eq!(quiet.put(&[(k, &value_for(&k, 64 << 10))]).unwrap(), vec![PutOutcome::Stored]);
}

/// `--model-quota` gives one model's namespaces their own limit: the other model, under the
/// default (none), fills the arena; the limited one is held to its share and refused with
/// `QuotaExceeded` when none of its own chunks can go.
#[test]
fn a_model_quota_limits_that_models_namespaces_only() {
    let server = TestServer::start(&[
        "--shards",
        "1",
        "--dram",
        "4MiB",
        "--model-quota",
        "noisy:dram-limit=1MiB",
    ]);
    let mut c = server.client("two-models");
    let free = c.register_namespace(&namespace(16)).unwrap().id;
    let other = orbitkv_client::NamespaceDescriptor { model: "noisy".into(), ..namespace(16) };
    let noisy = c.register_namespace(&other).unwrap().id;
    let free_keys = chain(free, 1, 40); // 2.5 MiB: past the other model's limit, no refusal
    put_values(&mut c, &free_keys, 64 << 10);
    assert_eq!(c.lookup(&free_keys).unwrap().len(), 40);
    let noisy_keys = chain(noisy, 2, 32); // 2 MiB through its 1 MiB
    for k in &noisy_keys {
        assert_eq!(c.put(&[(*k, &value_for(k, 64 << 10))]).unwrap(), vec![PutOutcome::Stored]);
    }
    let present: Vec<_> = noisy_keys
        .iter()
        .filter(|k| c.lookup(std::slice::from_ref(*k)).unwrap().len() == 1)
        .copied()
        .collect();
    assert_eq!(present.len(), 16, "1 MiB of 64 KiB chunks");
    assert_eq!(c.lookup(&free_keys).unwrap().len(), 40, "the limit took only its own");
    let held = c.lookup_leased(&present).unwrap();
    let more = chain(noisy, 3, 1)[0];
    let out = c.put(&[(more, &value_for(&more, 64 << 10))]).unwrap();
    assert_eq!(out, vec![PutOutcome::Failed(ErrorCode::QuotaExceeded)]);
    c.release(&held).unwrap();
    assert_eq!(server.shard_sum("quota_refusals"), 1);
}
