//! Human tables for `stats`, `peers` and `sessions`.

use std::fmt::Write;

use orbitkv_proto::admin::{PeersReply, SessionsReply};
use orbitkv_proto::format_bytes;
use serde_json::Value;

/// Reads a u64 field of `stats`, 0 when absent.
fn u64_of(v: &Value, field: &str) -> u64 {
    v[field].as_u64().unwrap_or(0)
}

/// The `stats` table: a header line, then one row per shard and a total row.
pub fn stats(v: &Value) -> String {
    let mut out = String::new();
    header(&mut out, v);
    if v["gpu_transfers"].is_object() {
        gpu_lines(&mut out, &v["gpu_transfers"]);
    }
    render(&mut out, &shard_rows(v));
    if let Some(rows) = latency_rows(&v["latency"]) {
        out.push('\n');
        render(&mut out, &rows);
    }
    out
}

/// The server-wide latency table: one row per operation recorded (requests by kind, SSD reads
/// and writes), None when nothing was.
fn latency_rows(latency: &Value) -> Option<Vec<Vec<String>>> {
    let ops = latency.as_object().filter(|o| !o.is_empty())?;
    let mut rows: Vec<Vec<String>> = vec![["latency", "count", "p50", "p99", "p999", "max"]
        .iter()
        .map(|s| s.to_string())
        .collect()];
    for (op, l) in ops {
        let mut row = vec![op.clone(), u64_of(l, "count").to_string()];
        row.extend(["p50_ns", "p99_ns", "p999_ns", "max_ns"].map(|k| duration(u64_of(l, k))));
        rows.push(row);
    }
    Some(rows)
}

/// Nanoseconds in the unit that reads best.
fn duration(ns: u64) -> String {
    match ns {
        0..=999 => format!("{ns}ns"),
        1_000..=999_999 => format!("{:.1}us", ns as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.2}ms", ns as f64 / 1e6),
        _ => format!("{:.2}s", ns as f64 / 1e9),
    }
}

/// The server's line: state, sessions, arena, uptime, pid.
fn header(out: &mut String, v: &Value) {
    let _ = writeln!(
        out,
        "state {}  sessions {}  arena {}{}{}  uptime {:.0}s  pid {}",
        v["state"].as_str().unwrap_or("?"),
        u64_of(v, "sessions"),
        format_bytes(u64_of(v, "arena_bytes")),
        match (v["arena_locked"] == true, v["arena_pages"].as_str()) {
            (true, Some(p)) if p != "4KiB" => format!(" (locked, {p} pages)"),
            (false, Some(p)) if p != "4KiB" => format!(" ({p} pages)"),
            (true, _) => " (locked)".to_string(),
            (false, _) => String::new(),
        },
        populated(&v["arena_populate"]),
        v["uptime_s"].as_f64().unwrap_or(0.0),
        u64_of(v, "pid"),
    );
}

/// How the arena was populated: seconds, and the NUMA nodes its slices landed on.
fn populated(p: &Value) -> String {
    let Some(seconds) = p["seconds"].as_f64() else { return String::new() };
    let mut nodes: Vec<u64> = p["slices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["numa_node"].as_u64())
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    let nodes = match nodes.len() {
        0 => String::new(),
        1 => format!(", NUMA node {}", nodes[0]),
        _ => format!(
            ", NUMA nodes {}",
            nodes.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        ),
    };
    format!(" populated in {seconds:.2}s{nodes}")
}

/// The GPU line, and the `--gpu-timeline` lines when the server keeps a timeline.
fn gpu_lines(out: &mut String, g: &Value) {
    // Host-side copies per job, when the server counts them and has run a job.
    let runs =
        |way: &str, jobs: &str| match (g[format!("{way}_host_runs")].as_u64(), u64_of(g, jobs)) {
            (Some(r), j) if j > 0 => format!(", {:.1} host copies/job", r as f64 / j as f64),
            _ => String::new(),
        };
    let _ = writeln!(
        out,
        "gpu {} device(s), {} registration(s)  saves {} ({}, busy {:.1}s{})  loads {} ({}, \
         busy {:.1}s{})  failed {}  checksums {}  copy {}",
        u64_of(g, "devices"),
        u64_of(g, "registrations"),
        u64_of(g, "save_jobs"),
        format_bytes(u64_of(g, "saved_bytes")),
        g["save_busy_s"].as_f64().unwrap_or(0.0),
        runs("save", "save_jobs"),
        u64_of(g, "load_jobs"),
        format_bytes(u64_of(g, "loaded_bytes")),
        g["load_busy_s"].as_f64().unwrap_or(0.0),
        runs("load", "load_jobs"),
        u64_of(g, "failed_jobs"),
        g["checksums"].as_str().unwrap_or("?"),
        g["copy"].as_str().unwrap_or("?"),
    );
    // `--gpu-timeline`: what the staged batches did on the GPU.
    for way in ["save", "load"] {
        let t = &g["timeline"][way];
        if !t.is_object() {
            continue;
        }
        let f = |k: &str| t[k].as_f64().unwrap_or(0.0);
        let _ = writeln!(
            out,
            "gpu timeline {way}s: {} batches, copies {:.2} GB/s while copying, copy busy \
             {:.3}s, copy stream idle between copies {:.2} ms, kernels {:.3}s, on the GPU {:.3}s",
            u64_of(t, "batches"),
            f("copy_gbps"),
            f("copy_busy_s"),
            f("copy_gaps_s") * 1e3,
            f("kernel_busy_s"),
            f("span_s"),
        );
    }
}

/// The shard table: the column names, one row per shard and a total row.
fn shard_rows(v: &Value) -> Vec<Vec<String>> {
    let cols = [
        "shard",
        "core",
        "used",
        "capacity",
        "entries",
        "hits",
        "misses",
        "evictions",
        "leases",
        "reserved",
        "sessions",
        "ssd",
        "ssd-hits",
        "demoted",
        "promoted",
    ];
    let mut rows: Vec<Vec<String>> = vec![cols.iter().map(|c| c.to_string()).collect()];
    let mut totals = [0u64; COLS];
    for s in v["shards"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        if s["answering"] != true {
            let stage = match s["loop_stage"].as_str() {
                Some(stage) => {
                    format!(
                        "not answering (loop {stage}, iteration {}, watchdog nudges {})",
                        u64_of(s, "loop_iteration"),
                        u64_of(s, "executor_nudges")
                    )
                }
                None => "not answering".into(),
            };
            rows.push(vec![u64_of(s, "id").to_string(), "-".into(), stage]);
            continue;
        }
        let nums = [
            u64_of(s, "dram_used_bytes"),
            u64_of(s, "dram_capacity_bytes"),
            u64_of(s, "entries"),
            u64_of(s, "hits"),
            u64_of(s, "misses"),
            u64_of(s, "evictions"),
            u64_of(s, "leases"),
            u64_of(s, "reservations"),
            u64_of(s, "sessions"),
            u64_of(s, "ssd_used_bytes"),
            u64_of(s, "ssd_hits"),
            u64_of(s, "demotions"),
            u64_of(s, "promotions"),
        ];
        for (t, n) in totals.iter_mut().zip(nums) {
            *t += n;
        }
        rows.push(row(
            u64_of(s, "id").to_string(),
            s["core"].as_u64().map_or("-".into(), |c| c.to_string()),
            &nums,
        ));
    }
    rows.push(row("total".into(), String::new(), &totals));
    rows
}

/// Numeric columns of a shard row.
const COLS: usize = 13;

fn row(first: String, core: String, n: &[u64; COLS]) -> Vec<String> {
    let mut r = vec![first, core, format_bytes(n[0]), format_bytes(n[1])];
    r.extend(n[2..9].iter().map(u64::to_string));
    r.push(format_bytes(n[9]));
    r.extend(n[10..].iter().map(u64::to_string));
    r
}

/// The `peers` table: this node's membership, then one row per member with what peering
/// knows of it (its inventory stream, catalog entries and coverage, grants each way, reads).
pub fn peers(v: &PeersReply) -> String {
    let c = &v.cluster;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cluster {}  node {}  epoch {}  {}{}{}",
        c.cluster,
        c.node_id,
        c.epoch.map_or("-".into(), |e| e.to_string()),
        c.state,
        if c.reason.is_empty() { String::new() } else { format!(": {}", c.reason) },
        if v.peering { "" } else { "  (peering off: membership only)" }
    );
    let mut rows = vec![[
        "node",
        "epoch",
        "peer address",
        "shards",
        "pid",
        "stream",
        "catalog",
        "held",
        "given",
        "read",
        "failed",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect::<Vec<_>>()];
    for m in &c.members {
        let mut row = vec![
            m.node_id.clone(),
            m.epoch.to_string(),
            m.peer_addr.clone(),
            m.shards.to_string(),
            m.pid.to_string(),
        ];
        match v.peers.get(&m.node_id).filter(|_| m.node_id != c.node_id) {
            None => row.extend(["-"; 6].iter().map(|s| s.to_string())),
            Some(p) => {
                let entries = p.catalog_entries.to_string();
                row.extend([
                    p.stream.clone(),
                    if p.complete { entries } else { format!("{entries} (partial)") },
                    p.grants_held.to_string(),
                    p.grants_given.to_string(),
                    format_bytes(p.bytes_read),
                    p.read_failures.to_string(),
                ]);
            }
        }
        rows.push(row);
    }
    render(&mut out, &rows);
    out
}

/// The `sessions` table.
pub fn sessions(v: &SessionsReply) -> String {
    let mut rows = vec![["id", "pid", "uid", "shard", "name"]
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()];
    for s in &v.sessions {
        rows.push(vec![
            s.id.to_string(),
            s.pid.to_string(),
            s.uid.to_string(),
            s.home_shard.to_string(),
            s.name.clone(),
        ]);
    }
    let mut out = String::new();
    render(&mut out, &rows);
    out
}

fn render(out: &mut String, rows: &[Vec<String>]) {
    let ncols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..ncols)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(String::len).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> =
            r.iter().enumerate().map(|(i, cell)| format!("{cell:>w$}", w = widths[i])).collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_says_how_the_arena_was_populated() {
        let p = serde_json::json!({"seconds": 1.234, "slices": [
            {"shard": 0, "numa_node": 1}, {"shard": 1, "numa_node": 0}, {"shard": 2, "numa_node": 1}]});
        assert_eq!(populated(&p), " populated in 1.23s, NUMA nodes 0,1");
        let one = serde_json::json!({"seconds": 0.5, "slices": [{"shard": 0, "numa_node": 0}]});
        assert_eq!(populated(&one), " populated in 0.50s, NUMA node 0");
        let unknown =
            serde_json::json!({"seconds": 0.5, "slices": [{"shard": 0, "numa_node": null}]});
        assert_eq!(populated(&unknown), " populated in 0.50s");
    }

    #[test]
    fn stats_table_has_a_row_per_shard_and_a_total() {
        let v = serde_json::json!({
            "state": "serving", "sessions": 1, "arena_bytes": 1u64 << 30, "arena_locked": true,
            "uptime_s": 3.0, "pid": 42,
            "shards": [
                {"id": 0, "answering": true, "core": 0, "dram_used_bytes": 4096, "dram_capacity_bytes": 1u64 << 29,
                 "entries": 1, "hits": 5, "misses": 2, "evictions": 0, "leases": 0, "reservations": 0, "sessions": 1},
                {"id": 1, "answering": false, "loop_stage": "yield-after-work", "loop_iteration": 7,
                 "executor_nudges": 3}
            ]
        });
        let t = stats(&v);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("state serving"), "{t}");
        assert!(!lines[0].contains("populated"), "a server that says nothing of it: {t}");
        assert_eq!(lines.len(), 5, "{t}");
        assert!(
            lines[3]
                .contains("not answering (loop yield-after-work, iteration 7, watchdog nudges 3)"),
            "{t}"
        );
        assert!(lines[4].trim_start().starts_with("total"));
        assert!(lines[4].contains(" 5 "), "{t}");
        // Every column has a header.
        let header: Vec<&str> = lines[1].split_whitespace().collect();
        let first: Vec<&str> = lines[2].split_whitespace().collect();
        // Three cells of the row are sizes of two words each ("4.0 KiB", "512.0 MiB", "0 B").
        assert_eq!(header.len(), first.len() - 3, "{t}");
        assert_eq!(header.last(), Some(&"promoted"), "{t}");
    }

    /// A `peers` reply of `fields` (a peering node, joining, nothing else, where they say
    /// nothing; the members' and peers' other fields zero).
    fn peers_reply(fields: &Value) -> PeersReply {
        let mut v = serde_json::json!({"ok": true, "available": false, "state": "joining",
            "reason": "", "since_s": 0.0, "cluster": "", "node_id": "", "epoch": null,
            "members": [], "peering": true, "peers": {}});
        for (k, x) in fields.as_object().unwrap() {
            v[k] = x.clone();
        }
        for m in v["members"].as_array_mut().unwrap() {
            m["te_segment"] = serde_json::json!("");
            m["started_unix_s"] = serde_json::json!(0);
        }
        for p in v["peers"].as_object_mut().unwrap().values_mut() {
            for k in ["group_reads", "queue_us_mean", "grant_us_mean", "te_read_us_mean"] {
                p[k] = serde_json::json!(0);
            }
            p["handoff_us_mean"] = serde_json::json!(0);
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn peers_table_has_the_membership_line_and_a_row_per_member() {
        let v = serde_json::json!({
            "ok": true, "available": false, "state": "unavailable",
            "reason": "etcd lease grant: timed out", "cluster": "prod", "node_id": "a", "epoch": 3,
            "members": [
                {"node_id": "a", "epoch": 3, "peer_addr": "10.0.0.1:7000", "shards": 4, "pid": 11},
                {"node_id": "b", "epoch": 7, "peer_addr": "10.0.0.2:7000", "shards": 8, "pid": 22}
            ]
        });
        let t = peers(&peers_reply(&v));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0], "cluster prod  node a  epoch 3  unavailable: etcd lease grant: timed out",
            "{t}"
        );
        assert_eq!(lines.len(), 4, "{t}");
        let b: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(b, ["b", "7", "10.0.0.2:7000", "8", "22", "-", "-", "-", "-", "-", "-"], "{t}");
        // Peering: this node's row has no peer columns, a peer's has its stream and catalog.
        let mut v = v;
        v["peering"] = serde_json::json!(true);
        v["peers"] = serde_json::json!({"b": {
            "epoch": 7, "stream": "live", "complete": false, "catalog_entries": 3,
            "grants_held": 1, "grants_given": 2, "chunks_read": 8, "bytes_read": 524288,
            "read_failures": 4}});
        let t = peers(&peers_reply(&v));
        let lines: Vec<&str> = t.lines().collect();
        let a: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(a[5..], ["-"; 6], "{t}");
        let b: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(b[5..], ["live", "3", "(partial)", "1", "2", "512.0", "KiB", "4"], "{t}");
        v["peering"] = serde_json::json!(false);
        assert!(peers(&peers_reply(&v))
            .lines()
            .next()
            .unwrap()
            .ends_with("(peering off: membership only)"));
        // Joined, before the first epoch: no reason, epoch shown as -.
        let joining = peers(&peers_reply(
            &serde_json::json!({"cluster": "c", "node_id": "n", "state": "joining",
                                                "reason": "", "epoch": null, "members": []}),
        ));
        assert!(joining.starts_with("cluster c  node n  epoch -  joining\n"), "{joining}");
    }

    #[test]
    fn stats_table_has_the_latency_quantiles_of_each_operation() {
        let v = serde_json::json!({
            "state": "serving", "shards": [],
            "latency": {
                "lookup": {"count": 10, "p50_ns": 4200, "p99_ns": 950, "p999_ns": 2_500_000, "max_ns": 3_000_000_000u64},
            }
        });
        let t = stats(&v);
        let row = t.lines().find(|l| l.trim_start().starts_with("lookup")).expect("a lookup row");
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells, ["lookup", "10", "4.2us", "950ns", "2.50ms", "3.00s"], "{t}");
        assert!(
            t.lines().any(|l| l.trim_start().starts_with("latency") && l.contains("p999")),
            "{t}"
        );
        // No table when nothing was recorded.
        let quiet = stats(&serde_json::json!({"state": "serving", "shards": [], "latency": {}}));
        assert!(!quiet.contains("latency"), "{quiet}");
    }

    #[test]
    fn stats_table_has_a_gpu_line_when_a_gpu_is_in_use() {
        let v = serde_json::json!({
            "state": "serving", "sessions": 0, "arena_bytes": 1u64 << 30, "uptime_s": 1.0, "pid": 7,
            "gpu_transfers": {"devices": 1, "registrations": 2, "save_jobs": 3, "saved_bytes": 3u64 << 26,
                              "load_jobs": 4, "loaded_bytes": 1u64 << 28, "failed_jobs": 0,
                              "checksums": "gpu", "copy": "batched", "save_busy_s": 0.25,
                              "save_host_runs": 12, "load_host_runs": 0},
            "shards": []
        });
        let t = stats(&v);
        let gpu = t.lines().nth(1).unwrap();
        assert!(gpu.starts_with("gpu 1 device(s), 2 registration(s)"), "{t}");
        assert!(
            gpu.contains("saves 3 (192.0 MiB, busy 0.2s, 4.0 host copies/job)")
                && gpu.contains("loads 4 (256.0 MiB, busy 0.0s, 0.0 host copies/job)")
                && gpu.contains("copy batched"),
            "{t}"
        );
        assert!(!t.contains("timeline"), "{t}");
    }

    #[test]
    fn stats_table_shows_the_gpu_timeline_when_the_server_keeps_one() {
        let timed = serde_json::json!({"batches": 64, "bytes": 1u64 << 31, "span_s": 0.04,
            "copy_busy_s": 0.039, "copy_gaps_s": 0.0002, "kernel_busy_s": 0.002,
            "copy_gbps": 55.06});
        let v = serde_json::json!({
            "state": "serving", "sessions": 0, "arena_bytes": 1u64 << 30, "uptime_s": 1.0, "pid": 7,
            "gpu_transfers": {"devices": 1, "registrations": 0, "save_jobs": 0, "saved_bytes": 0,
                              "load_jobs": 0, "loaded_bytes": 0, "failed_jobs": 0,
                              "checksums": "gpu", "copy": "auto",
                              "timeline": {"save": timed, "load": {"batches": 0, "bytes": 0,
                                  "span_s": 0.0, "copy_busy_s": 0.0, "copy_gaps_s": 0.0,
                                  "kernel_busy_s": 0.0, "copy_gbps": 0.0}}},
            "shards": []
        });
        let t = stats(&v);
        let saves = t.lines().find(|l| l.starts_with("gpu timeline saves")).expect("a line");
        assert!(
            saves.contains("64 batches")
                && saves.contains("copies 55.06 GB/s while copying")
                && saves.contains("idle between copies 0.20 ms"),
            "{t}"
        );
        assert!(t.lines().any(|l| l.starts_with("gpu timeline loads: 0 batches")), "{t}");
    }
}
