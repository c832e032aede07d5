//! `orbitkv-perf soak` end to end, short: client processes killed with SIGKILL, namespace
//! evictions, drains and audits against a private server with an SSD tier smaller than the
//! working set; the server comes to rest with nothing held and its audits clean. No timing is
//! asserted.

mod common;

use common::{num, require_server, run_json};

#[test]
fn a_short_soak_ends_at_rest_with_every_byte_verified() {
    require_server();
    let v = run_json(&[
        "soak",
        "--duration",
        "8s",
        "--clients",
        "3",
        "--keys",
        "3000",
        "--dram",
        "16MiB",
        "--ssd",
        "32MiB",
        "--ssd-region-size",
        "1MiB",
        "--shards",
        "2",
        "--kill-every",
        "1s",
        "--admin-every",
        "700ms",
        "--json",
    ]);
    assert_eq!(v["failures"].as_array().map(Vec::len), Some(0), "{v}");
    assert!(num(&v, &["client_kills"]) >= 3.0, "{v}");
    assert!(num(&v, &["totals", "hits"]) > 0.0, "{v}");
    assert_eq!(num(&v, &["totals", "mismatches"]), 0.0, "{v}");
    assert_eq!(num(&v, &["totals", "errors"]), 0.0, "{v}");
    for at_rest in ["final_sessions", "final_leases", "final_reservations", "final_pins"] {
        assert_eq!(num(&v, &[at_rest]), 0.0, "{at_rest}: {v}");
    }
    assert!(num(&v, &["working_set_bytes"]) > num(&v, &["capacity_bytes"]), "{v}");
    assert!(num(&v, &["server_evictions"]) > 0.0, "{v}");
    assert!(num(&v, &["audits"]) + num(&v, &["admin_evicts"]) + num(&v, &["drains"]) >= 3.0, "{v}");
}

#[test]
fn bad_soak_settings_are_refused_naming_the_flag() {
    let out = common::run(&["soak", "--clients", "0", "--duration", "1s"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--clients"), "{out:?}");
}
