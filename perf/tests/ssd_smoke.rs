//! `orbitkv-perf ssd` drives a real O_DIRECT file under /tmp through the shard's io_uring ring
//! in every mode without an I/O error, runs fio beside it when fio is installed (and does
//! without it when not), and refuses bad flags naming them. No timing is asserted.

mod common;

use std::process::Command;

use common::{num, perf, run, run_json};
use serde_json::Value;

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("okvperf-ssd").tempdir_in("/tmp").expect("a directory in /tmp")
}

fn ssd(dir: &str, mode: &str) -> Value {
    run_json(&[
        "ssd",
        "--dir",
        dir,
        "--file-size",
        "8MiB",
        "--block-size",
        "64KiB",
        "--qd",
        "4",
        "--mode",
        mode,
        "--duration",
        "1s",
        "--json",
    ])
}

fn assert_clean(v: &Value, mode: &str) {
    assert_eq!(v["mode"], mode, "{v}");
    assert!(num(v, &["ops"]) > 0.0, "{v}");
    assert_eq!(num(v, &["errors"]), 0.0, "{v}");
    assert!(v["first_error"].is_null(), "{v}");
    assert_eq!(num(v, &["latency", "count"]), num(v, &["ops"]), "{v}");
    assert_eq!(num(v, &["bytes"]), num(v, &["ops"]) * 65536.0, "{v}");
    assert!(num(v, &["gbps"]) > 0.0 && num(v, &["iops"]) > 0.0, "{v}");
    // fio is optional: when it ran, its numbers are there and the ratio is computed.
    if v["fio"].is_null() {
        assert!(v["fio_gbps"].is_null() && v["ratio_vs_fio"].is_null(), "{v}");
    } else {
        assert!(num(v, &["fio", "ops"]) > 0.0, "{v}");
        assert!(num(v, &["fio_gbps"]) > 0.0, "{v}");
        assert!(num(v, &["ratio_vs_fio"]) > 0.0, "{v}");
    }
}

#[test]
fn every_mode_moves_blocks_without_errors() {
    let dir = tmp();
    let dir = dir.path().to_str().expect("temporary paths are UTF-8");
    for (i, mode) in ["read", "write", "randread", "randwrite"].into_iter().enumerate() {
        let v = ssd(dir, mode);
        assert_clean(&v, mode);
        // The first run creates and fills the file; later runs reuse it.
        assert_eq!(v["file_created"], i == 0, "{v}");
        assert_eq!(v["fill_s"].is_null(), i > 0, "{v}");
    }
}

#[test]
fn without_fio_on_path_the_baseline_is_null_and_the_run_still_succeeds() {
    let dir = tmp();
    let dir = dir.path().to_str().expect("temporary paths are UTF-8");
    let out = Command::new(perf())
        .args(["ssd", "--dir", dir, "--file-size", "1MiB", "--block-size", "16KiB"])
        .args(["--qd", "2", "--mode", "randread", "--duration", "1s", "--json"])
        .env("PATH", "")
        .output()
        .expect("orbitkv-perf starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("one JSON report");
    assert!(num(&v, &["ops"]) > 0.0, "{v}");
    assert!(v["fio"].is_null() && v["fio_gbps"].is_null() && v["ratio_vs_fio"].is_null(), "{v}");
    assert!(stderr.contains("fio is not on PATH"), "{stderr}");
}

fn refused(args: &[&str], flag: &str, also: &str) {
    let mut all = vec!["ssd", "--mode", "read", "--duration", "1s", "--no-fio", "--json"];
    all.extend_from_slice(args);
    let out = run(&all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(flag) && stderr.contains(also), "{args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?}");
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    let dir = tmp();
    let d = dir.path().to_str().expect("temporary paths are UTF-8");
    let small = ["--file-size", "1MiB"];
    refused(&[&["--dir", d, "--block-size", "6000"][..], &small].concat(), "--block-size", "4 KiB");
    refused(&[&["--dir", d, "--block-size", "0"][..], &small].concat(), "--block-size", "4 KiB");
    refused(&[&["--dir", d, "--qd", "0"][..], &small].concat(), "--qd", "0");
    refused(&["--dir", d, "--file-size", "64KiB", "--block-size", "1MiB"], "--file-size", "65536");
    let missing = dir.path().join("missing");
    let missing = missing.to_str().expect("temporary paths are UTF-8");
    refused(&[&["--dir", missing][..], &small].concat(), "--dir", missing);
    let plain = dir.path().join("plain-file");
    std::fs::write(&plain, b"not a directory").expect("a file in the temporary directory");
    let plain = plain.to_str().expect("temporary paths are UTF-8");
    refused(&[&["--dir", plain][..], &small].concat(), "--dir", "not a directory");
    // Nothing was created by the refused runs.
    assert!(!dir.path().join("orbitkv-perf-ssd.dat").exists());
}

#[test]
fn an_unwritable_dir_exits_2_naming_the_flag() {
    use std::os::unix::fs::PermissionsExt;
    if nix::unistd::geteuid().is_root() {
        eprintln!("skipped: root writes into any directory, so none is unwritable here");
        return;
    }
    let dir = tmp();
    let locked = dir.path().join("locked");
    std::fs::create_dir(&locked).expect("a directory");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500))
        .expect("chmod the directory");
    let locked = locked.to_str().expect("temporary paths are UTF-8");
    refused(&["--dir", locked, "--file-size", "1MiB"], "--dir", locked);
}
