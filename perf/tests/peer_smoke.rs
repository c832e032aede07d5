//! `orbitkv-perf peer` between two Managers of one cluster (a real etcd, Transfer Engine on
//! loopback TCP): every chunk read on the requester is a verified peer hit, both rates and the
//! latencies are reported. Rates are not asserted (timing belongs in reports). Needs a
//! Transfer Engine: `te-python` builds of orbitkv-perf and of the orbitkv-server beside it
//! (scripts/test builds both in its Transfer Engine step), or a TE build's C API library named
//! by `ORBITKV_TE_LIBRARY` (given to the Managers and the baseline); skipped, saying so,
//! without either.

mod common;

use common::{num, run, run_json};
use orbitkv_testkit::etcd::Etcd;
use orbitkv_testkit::TestServer;

fn member(etcd: &Etcd, node: &str, port: u16) -> TestServer {
    let mut args = vec!["--shards".to_string(), "1".into(), "--dram".into(), "64MiB".into()];
    args.extend(etcd.member_args("perf", node, port));
    TestServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn peer_reads_are_verified_peer_hits_with_a_raw_baseline() {
    let library = std::env::var("ORBITKV_TE_LIBRARY").ok();
    if !cfg!(feature = "te-python") && library.is_none() {
        eprintln!("skipped: no Transfer Engine (build with te-python or set ORBITKV_TE_LIBRARY)");
        return;
    }
    let etcd = Etcd::start();
    let a = member(&etcd, "a", 7501);
    let b = member(&etcd, "b", 7502);
    let mut args = vec![
        "peer",
        "--owner",
        a.socket_str(),
        "--requester",
        b.socket_str(),
        "--chunk-size",
        "256KiB",
        "--chunks",
        "24",
        "--batch",
        "8",
        "--latency-samples",
        "4",
        "--json",
    ];
    args.extend(library.iter().flat_map(|l| ["--te-library", l.as_str()]));
    let v = run_json(&args);
    assert_eq!(v["owner"], "a", "{v}");
    assert_eq!(v["requester"], "b", "{v}");
    assert_eq!(num(&v, &["verified_chunks"]), 28.0, "{v}");
    assert_eq!(num(&v, &["wrong_chunks"]), 0.0, "{v}");
    assert_eq!(num(&v, &["missed_chunks"]), 0.0, "{v}");
    assert_eq!(num(&v, &["first_byte", "samples"]), 4.0, "{v}");
    for key in ["remote_gbps", "te_gbps", "ratio", "lookup_us_p50", "te_batch_us_p50"] {
        assert!(num(&v, &[key]) > 0.0, "{key}: {v}");
    }
    let paired: Vec<f64> =
        v["paired_ratio"].as_array().unwrap().iter().map(|r| r.as_f64().unwrap()).collect();
    assert!(paired.len() == 3 && paired[0] > 0.0, "{v}");
    assert!(paired[0] <= paired[1] && paired[1] <= paired[2], "p10 <= p50 <= p90: {v}");
    assert_eq!(b.shard_sum("peer_reads"), 28);

    // A socket that is no peering member is named.
    let mut args = vec!["peer", "--owner", a.socket_str(), "--requester", "/nowhere/x.sock"];
    args.extend(library.iter().flat_map(|l| ["--te-library", l.as_str()]));
    let out = run(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--requester"), "{stderr}");
}
