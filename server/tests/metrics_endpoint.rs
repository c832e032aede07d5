//! `--metrics-addr`: the Prometheus exposition agrees with `ctl stats`, `/healthz` and
//! `/readyz` follow the server's state, scrapers that misbehave hold up nobody, and a bad
//! address stops the server at start with exit code 2 naming the flag.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use orbitkv_testkit::{chain, namespace, server_bin, value_for, TestServer};

/// A port free now (bound, then let go).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start(port: u16) -> TestServer {
    let addr = format!("127.0.0.1:{port}");
    TestServer::start(&["--shards", "2", "--dram", "16MiB", "--metrics-addr", &addr])
}

/// Sends `request` as is and reads the whole answer (the listener closes after one).
fn raw(port: u16, request: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

/// (status, headers and body) of `GET path`.
fn get(port: u16, path: &str) -> (u16, String) {
    let answer = raw(port, format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes());
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, answer)
}

/// The samples of an exposition: `name{labels}` to value.
fn samples(exposition: &str) -> HashMap<String, f64> {
    let body = exposition.split("\r\n\r\n").nth(1).expect("an HTTP body");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a sample line");
            (series.to_string(), value.parse().expect("a number"))
        })
        .collect()
}

#[test]
fn metrics_agree_with_stats() {
    let port = free_port();
    let server = start(port);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 1, 24);
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 20_000)).collect();
    let items: Vec<_> = keys[..16].iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    c.put(&items).unwrap();
    let leases = c.lookup_leased(&keys[..8]).unwrap();
    assert_eq!(leases.len(), 8);
    c.release(&leases).unwrap();
    // Keys 16.. are misses.
    assert_eq!(c.lookup(&keys).unwrap().len(), 16);

    let (status, answer) = get(port, "/metrics");
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("application/openmetrics-text"), "{answer}");
    assert!(answer.trim_end().ends_with("# EOF"), "{answer}");
    let m = samples(&answer);
    let stats = server.admin("stats");
    for shard in stats["shards"].as_array().unwrap() {
        let id = shard["id"].as_u64().unwrap();
        let at = |series: &str| {
            *m.get(series).unwrap_or_else(|| panic!("no {series} in the exposition: {answer}"))
        };
        let dram = format!("{{shard=\"{id}\",tier=\"dram\"}}");
        let plain = format!("{{shard=\"{id}\"}}");
        assert_eq!(at(&format!("orbitkv_hits_total{dram}")), shard["hits"].as_f64().unwrap());
        assert_eq!(at(&format!("orbitkv_misses_total{plain}")), shard["misses"].as_f64().unwrap());
        assert_eq!(
            at(&format!("orbitkv_commits_total{plain}")),
            shard["commits"].as_f64().unwrap()
        );
        assert_eq!(at(&format!("orbitkv_entries{dram}")), shard["entries"].as_f64().unwrap());
        assert_eq!(
            at(&format!("orbitkv_used_bytes{dram}")),
            shard["dram_used_bytes"].as_f64().unwrap()
        );
        assert_eq!(at(&format!("orbitkv_leases{plain}")), 0.0);
        for op in ["lookup", "reserve", "commit", "release"] {
            let count = shard["latency"][op]["count"].as_f64().unwrap_or(0.0);
            let series = format!("orbitkv_op_latency_seconds_count{{shard=\"{id}\",op=\"{op}\"}}");
            assert_eq!(m.get(&series).copied().unwrap_or(0.0), count, "{series}");
            if count > 0.0 {
                let inf = format!(
                    "orbitkv_op_latency_seconds_bucket{{le=\"+Inf\",shard=\"{id}\",op=\"{op}\"}}"
                );
                assert_eq!(at(&inf), count);
            }
        }
    }
    // Every lookup key counted once as a hit or a miss: 8 leased + 24 looked up.
    let total =
        |name: &str| -> f64 { m.iter().filter(|(k, _)| k.starts_with(name)).map(|(_, v)| v).sum() };
    assert_eq!(total("orbitkv_hits_total") + total("orbitkv_misses_total"), 32.0);
    assert_eq!(total("orbitkv_commits_total"), 16.0);
    // The server-wide quantiles in stats come from the same histograms.
    assert_eq!(
        stats["latency"]["commit"]["count"].as_f64().unwrap(),
        total("orbitkv_op_latency_seconds_count{shard=\"0\",op=\"commit\"}")
            + total("orbitkv_op_latency_seconds_count{shard=\"1\",op=\"commit\"}")
    );
    assert_eq!(m["orbitkv_sessions"], 1.0);
    assert_eq!(m["orbitkv_ready"], 1.0);
}

#[test]
fn health_endpoints_follow_drain_and_resume() {
    let port = free_port();
    let server = start(port);
    let (status, answer) = get(port, "/healthz");
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = get(port, "/readyz");
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"ready\":true"), "{answer}");

    server.admin("drain");
    let (status, answer) = get(port, "/readyz");
    assert_eq!(status, 503, "{answer}");
    assert!(answer.contains("\"ready\":false") && answer.contains("draining"), "{answer}");
    // Alive while draining.
    assert_eq!(get(port, "/healthz").0, 200);
    assert_eq!(samples(&get(port, "/metrics").1)["orbitkv_ready"], 0.0);

    server.admin("resume");
    assert_eq!(get(port, "/readyz").0, 200);
    // Other paths and methods are refused, named.
    let (status, answer) = get(port, "/nothing");
    assert_eq!(status, 404, "{answer}");
    assert!(answer.contains("/metrics"), "{answer}");
    let answer = raw(port, b"POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
}

#[test]
fn scrapers_that_misbehave_hold_up_nobody() {
    let port = free_port();
    let server = start(port);
    // One connects and says nothing; one asks and never reads its answer.
    let silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut unread = TcpStream::connect(("127.0.0.1", port)).unwrap();
    unread.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
    // Garbage gets a 400 and a closed connection.
    let answer = raw(port, b"\x16\x03\x01 not http at all\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    // Meanwhile scrapes and engine work go on.
    for _ in 0..3 {
        let (status, answer) = get(port, "/metrics");
        assert_eq!(status, 200, "{answer}");
    }
    let mut c = server.client("engine");
    c.ping().unwrap();
    drop((silent, unread));
    assert_eq!(get(port, "/readyz").0, 200);
}

#[test]
fn a_bad_metrics_address_stops_the_start_naming_the_flag() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::Builder::new().prefix("okv").tempdir_in("/tmp").unwrap();
    let socket = dir.path().join("s.sock");
    for value in [addr.as_str(), "not-an-address", "127.0.0.1"] {
        let out = Command::new(server_bin())
            .arg("--socket")
            .arg(&socket)
            .args(["--no-lock-arena", "--dram", "16MiB", "--metrics-addr", value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{value}: {stderr}");
        assert!(stderr.contains("--metrics-addr"), "{value}: {stderr}");
    }
    // Nothing left behind: the socket is free for a server that starts.
    drop(taken);
    let port = free_port();
    let server = TestServer::start_at(
        dir,
        "s.sock",
        &["--dram", "16MiB", "--metrics-addr", &format!("127.0.0.1:{port}")],
    );
    assert_eq!(get(port, "/healthz").0, 200);
    drop(server);
}
