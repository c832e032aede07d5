//! The SSD tier: chunks evicted from DRAM are demoted to SSD and served from there, survive a
//! restart (clean or SIGKILL), never exceed the cap, and a corrupted record is never served.
//! Slow disks and failing I/O are injected in builds with the `failpoints` feature
//! (`cargo test --features orbitkv-server/failpoints`, as `scripts/test` runs it).

use std::time::Duration;

use nix::sys::signal::Signal;
use orbitkv_client::{ChunkKey, Client, Tier};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

const LEN: usize = 16 << 10;

fn ssd_args(dir: &std::path::Path) -> Vec<String> {
    ssd_args_with(dir, 2)
}

/// Two MiB of DRAM over `shards` shards and 24 MiB of SSD in 1 MiB regions under `dir`.
fn ssd_args_with(dir: &std::path::Path, shards: usize) -> Vec<String> {
    let shards = shards.to_string();
    [
        "--shards",
        &shards,
        "--dram",
        "2MiB",
        "--ssd",
        "24MiB",
        "--ssd-region-size",
        "1MiB",
        "--ssd-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.display().to_string()])
    .collect()
}

fn start(dir: &std::path::Path) -> TestServer {
    let args = ssd_args(dir);
    TestServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Puts every key, reading each once right away (reuse evidence for SSD admission), and
/// waits until the shards have written their victims out.
fn fill(server: &TestServer, c: &mut Client, keys: &[ChunkKey]) {
    for k in keys {
        c.put(&[(*k, &value_for(k, LEN))]).unwrap();
        assert_eq!(c.lookup(std::slice::from_ref(k)).unwrap().len(), 1);
    }
    server.wait_for("demotions", |s| s.shard_sum("demotions") > 0);
}

/// Starts a tiered server in `dir`, stores 300 chunks (so that some are demoted), stops it
/// cleanly; returns the stopped server (restart it with `spawn`) and the keys.
fn filled_then_stopped(dir: &std::path::Path, seed: u32) -> (TestServer, Vec<ChunkKey>) {
    let mut server = start(dir);
    let mut c = server.client("w");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, seed, 300);
    fill(&server, &mut c, &keys);
    drop(c);
    assert!(server.stop().success());
    (server, keys)
}

/// Gets every key; returns how many came back (each byte-exact) and how many from SSD.
fn read_all(c: &mut Client, keys: &[ChunkKey]) -> (usize, usize) {
    let (mut found, mut from_ssd) = (0, 0);
    for k in keys {
        let leases = c.lookup_leased(std::slice::from_ref(k)).unwrap();
        if let Some(l) = leases.first() {
            assert_eq!(c.chunk(l).unwrap(), &value_for(k, LEN)[..], "wrong bytes");
            found += 1;
            if l.hit.tier == Tier::Ssd {
                from_ssd += 1;
            }
        }
        c.release(&leases).unwrap();
    }
    (found, from_ssd)
}

#[test]
fn demoted_chunks_are_served_from_ssd_and_survive_restarts() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut server = start(dir.path());
    let mut c = server.client("tiered");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 77, 400); // 6.4 MiB over 2 MiB of DRAM
    fill(&server, &mut c, &keys);
    let (found, from_ssd) = read_all(&mut c, &keys);
    assert!(from_ssd > 100, "found {found}, from SSD {from_ssd}: {}", server.admin("stats"));
    let stats = server.admin("stats");
    for s in stats["shards"].as_array().unwrap() {
        assert!(s["ssd_capacity_bytes"].as_u64().unwrap() > 0);
        assert!(s["ssd_used_bytes"].as_u64().unwrap() <= s["ssd_capacity_bytes"].as_u64().unwrap());
        assert_eq!(s["checksum_failures"], 0);
    }
    let on_ssd_before = server.shard_sum("ssd_records");

    // Clean restart: everything that was on SSD is served again.
    drop(c);
    assert!(server.stop().success());
    let args = ssd_args(dir.path());
    server.spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(server.log().contains("SSD tier recovered"), "{}", server.log());
    let mut c = server.client("after-restart");
    c.register_namespace(&namespace(16)).unwrap();
    let (found, from_ssd) = read_all(&mut c, &keys);
    assert!(found as u64 >= on_ssd_before, "found {found} of {on_ssd_before} SSD records");
    assert_eq!(found, from_ssd, "DRAM starts empty: every hit comes from SSD");

    // SIGKILL at an arbitrary moment while writing: every byte served afterwards is right.
    for round in 0..3u32 {
        let more = chain(ns, 1000 + round, 150);
        let mut c = server.client("writer");
        c.register_namespace(&namespace(16)).unwrap();
        for k in &more {
            c.put(&[(*k, &value_for(k, LEN))]).unwrap();
            c.lookup(std::slice::from_ref(k)).unwrap();
        }
        server.signal(Signal::SIGKILL);
        server.wait_exit(Duration::from_secs(10));
        server.spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let mut c = server.client("checker");
        c.register_namespace(&namespace(16)).unwrap();
        let (found_old, _) = read_all(&mut c, &keys);
        let (found_new, _) = read_all(&mut c, &more);
        assert!(found_old + found_new > 0, "round {round}: nothing survived");
        assert_eq!(server.shard_sum("checksum_failures"), 0);
    }
    // The files never exceed the cap.
    let total: u64 =
        std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.metadata().unwrap().len()).sum();
    assert!(total <= 24 << 20, "{total} bytes on disk");
}

#[test]
fn a_corrupted_record_is_never_served() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut server, keys) = filled_then_stopped(dir.path(), 5);
    // Flip one payload byte of every record in shard 0's file.
    let path = dir.path().join("shard-0.okv");
    let mut bytes = std::fs::read(&path).unwrap();
    let mut flipped = 0;
    let mut at = 4096;
    while at + 8192 <= bytes.len() {
        if &bytes[at..at + 8] == b"OKVREC\0\x01" {
            bytes[at + 4096 + 100] ^= 0x5a;
            flipped += 1;
        }
        at += 4096;
    }
    assert!(flipped > 0);
    std::fs::write(&path, &bytes).unwrap();
    let args = ssd_args(dir.path());
    server.spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut c = server.client("r");
    c.register_namespace(&namespace(16)).unwrap();
    let (found, _) = read_all(&mut c, &keys); // asserts every served byte is right
    assert!(found > 0, "shard 1's records are intact");
    assert!(server.shard_sum("checksum_failures") > 0);
}

#[test]
fn bad_ssd_settings_are_refused_naming_the_flag() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    for (args, flag) in [
        (vec!["--ssd-dir", "/nonexistent/okv", "--ssd", "64MiB"], "--ssd-dir"),
        (vec!["--ssd-dir", dir.path().to_str().unwrap()], "--ssd"),
        (vec!["--ssd-dir", dir.path().to_str().unwrap(), "--ssd", "1MiB"], "--ssd"),
        (vec!["--ssd", "1GiB"], "--ssd-dir"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
            .args(["--socket", "/tmp/orbitkv-bad-ssd.sock", "--shards", "1", "--dram", "8MiB"])
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn the_cap_holds_under_a_working_set_ten_times_larger() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let server = TestServer::start(&[
        "--shards",
        "1",
        "--dram",
        "1MiB",
        "--ssd",
        "4MiB",
        "--ssd-region-size",
        "256KiB",
        "--ssd-dir",
        dir.path().to_str().unwrap(),
    ]);
    let mut c = server.client("flood");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 3, 2600); // 41 MiB of values over a 4 MiB cap
    for (i, k) in keys.iter().enumerate() {
        c.put(&[(*k, &value_for(k, LEN))]).unwrap();
        c.lookup(std::slice::from_ref(k)).unwrap();
        if i % 200 == 0 {
            let on_disk: u64 = std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .map(|e| e.metadata().unwrap().len())
                .sum();
            assert!(on_disk <= 4 << 20, "{on_disk} bytes on disk after {i} chunks");
            let s = &server.admin("stats")["shards"][0];
            assert!(
                s["ssd_used_bytes"].as_u64().unwrap() <= s["ssd_capacity_bytes"].as_u64().unwrap(),
                "{s}"
            );
        }
    }
    assert!(server.shard_sum("ssd_reclaimed") > 0, "{}", server.admin("stats"));
    // Whatever is still cached comes back exact (read_all asserts every byte). Every key is
    // read: a victim is dropped rather than written when the SSD writes fall behind the flood
    // (a reservation never waits for them), so on a busy machine the last keys' victims may
    // all be dropped while earlier ones are still on SSD. Reading only the last 600 once
    // found 52 in DRAM and none on SSD, in a full CI run; likely that, not reproduced.
    let (found, from_ssd) = read_all(&mut c, &keys);
    assert!(found > 0 && from_ssd > 0, "found {found}, from SSD {from_ssd}");
}

#[test]
fn another_shard_count_starts_cold_and_removes_orphan_files() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut server, keys) = filled_then_stopped(dir.path(), 8);
    assert!(dir.path().join("shard-1.okv").exists());
    let one = ssd_args_with(dir.path(), 1);
    server.spawn(&one.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(server.log().contains("started afresh"), "{}", server.log());
    assert!(!dir.path().join("shard-1.okv").exists(), "orphan file removed");
    let mut c = server.client("r");
    c.register_namespace(&namespace(16)).unwrap();
    assert_eq!(read_all(&mut c, &keys), (0, 0), "nothing is read through the wrong placement");
}

/// A small loop-mounted ext4 filesystem, unmounted on drop.
struct TinyFs {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl TinyFs {
    /// None (with the reason printed) where loop mounts are not available.
    fn new(bytes: u64) -> Option<TinyFs> {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let img = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        std::fs::File::create(&img).unwrap().set_len(bytes).unwrap();
        let ok = |cmd: &mut std::process::Command| {
            cmd.output().map(|o| o.status.success()).unwrap_or(false)
        };
        if !ok(std::process::Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img)) {
            println!("skipped: mkfs.ext4 is not available");
            return None;
        }
        if !ok(std::process::Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt)) {
            println!("skipped: cannot loop-mount a filesystem here (needs root and loop devices)");
            return None;
        }
        Some(TinyFs { dir, mounted: true })
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        if self.mounted {
            let _ = std::process::Command::new("umount").arg(self.path()).output();
        }
    }
}

#[test]
fn a_full_filesystem_is_reported_at_start() {
    let Some(fs) = TinyFs::new(16 << 20) else { return };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbitkv-server"))
        .args([
            "--socket",
            "/tmp/orbitkv-enospc-test.sock",
            "--no-lock-arena",
            "--shards",
            "1",
            "--dram",
            "8MiB",
        ])
        .args(["--ssd", "64MiB", "--ssd-region-size", "1MiB", "--ssd-dir"])
        .arg(fs.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("preallocating") && err.contains("No space left"), "{err}");
    // With a cap that fits, the same filesystem serves.
    let server = TestServer::start(&[
        "--shards",
        "1",
        "--dram",
        "1MiB",
        "--ssd",
        "8MiB",
        "--ssd-region-size",
        "1MiB",
        "--ssd-dir",
        fs.path().to_str().unwrap(),
    ]);
    server.client("fits").ping().unwrap();
}

/// A one-shard tiered server in `dir` with 200 chunks stored, restarted on a disk where every
/// I/O takes 2 s (DRAM starts empty, so the demoted ones are on the slow disk only); returns
/// it, the namespace and the keys (the first ones demoted).
#[cfg(feature = "failpoints")]
fn on_a_slow_disk(dir: &std::path::Path) -> (TestServer, u64, Vec<ChunkKey>) {
    let base = ["--shards", "1", "--dram", "2MiB", "--ssd", "24MiB", "--ssd-region-size", "1MiB"];
    let dir_arg = dir.to_str().unwrap().to_string();
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--ssd-dir", &dir_arg]);
    let mut server = TestServer::start(&args);
    let mut c = server.client("w");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let cold = chain(ns, 41, 200);
    fill(&server, &mut c, &cold);
    drop(c);
    assert!(server.stop().success());
    server.spawn_env(&[("FAILPOINTS", "ssd-io-delay=return(2s)")], &args);
    (server, ns, cold)
}

#[cfg(feature = "failpoints")]
#[test]
fn a_slow_disk_does_not_hold_up_dram_hits() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (server, ns, cold) = on_a_slow_disk(dir.path());
    let mut c = server.client("dram");
    c.register_namespace(&namespace(16)).unwrap();
    let hot = chain(ns, 42, 20);
    for k in &hot {
        c.put(&[(*k, &value_for(k, LEN))]).unwrap();
    }
    // One client waits on the slow disk...
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let socket = server.socket.clone();
    let (slow_key, flag) = (cold[0], done.clone());
    let slow = std::thread::spawn(move || {
        let mut s = Client::connect(orbitkv_client::ClientOptions::with_socket(socket)).unwrap();
        s.register_namespace(&namespace(16)).unwrap();
        let leases = s.lookup_leased(&[slow_key]).unwrap();
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let got = leases.first().map(|l| (l.hit.tier, s.chunk(l).unwrap().to_vec()));
        s.release(&leases).unwrap();
        got
    });
    server.wait_for("the slow lookup to reach the disk", |s| s.shard_sum("ssd_hits") >= 1);
    // ...while another keeps getting DRAM hits, all done before the disk answers.
    for _ in 0..5 {
        let (found, from_ssd) = read_all(&mut c, &hot);
        assert_eq!((found, from_ssd), (hot.len(), 0));
    }
    assert!(!done.load(std::sync::atomic::Ordering::SeqCst), "DRAM hits waited for the slow disk");
    let (tier, bytes) = slow.join().unwrap().expect("the chunk comes back from SSD");
    assert_eq!(tier, Tier::Ssd);
    assert_eq!(bytes, value_for(&slow_key, LEN));
}

#[cfg(feature = "failpoints")]
#[test]
fn ssd_io_errors_leave_the_server_serving_and_are_reported() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let args = ssd_args_with(dir.path(), 1);
    let server = TestServer::start_env(
        &[("FAILPOINTS", "ssd-io-errors-every=return(3)")],
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let mut c = server.client("faulty-disk");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 61, 300);
    fill(&server, &mut c, &keys);
    // Every byte that is served is right; failed writes kept their chunk in DRAM or lost it.
    let (found, from_ssd) = read_all(&mut c, &keys);
    assert!(found > 0 && from_ssd > 0, "found {found}, from SSD {from_ssd}");
    assert!(server.shard_sum("ssd_io_errors") > 0, "{}", server.admin("stats"));
    let health = server.admin("health");
    assert_eq!(health["ready"], true, "{health}");
    let degraded = health["degraded"].as_array().unwrap();
    assert!(degraded[0].as_str().unwrap().contains("SSD I/O errors"), "{health}");
    c.ping().unwrap();
}

#[cfg(feature = "failpoints")]
const SLOW_LOOKUP_ENV: &str = "ORBITKV_TEST_SLOW_LOOKUP";

/// Runs only as the child process of `a_request_outliving_its_client_ends_before_the_reclaim`
/// (it is ignored otherwise): looks up a chunk that is on the slow disk only, and is killed
/// while it waits.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "helper process for a_request_outliving_its_client_ends_before_the_reclaim"]
fn slow_lookup_process() {
    let env = std::env::var(SLOW_LOOKUP_ENV).expect("run by its test");
    let (socket, ns) = env.split_once(' ').expect("SOCKET NAMESPACE");
    let mut c = Client::connect(orbitkv_client::ClientOptions::with_socket(socket)).unwrap();
    c.register_namespace(&namespace(16)).unwrap();
    let key = chain(ns.parse().unwrap(), 41, 200)[1];
    let answer = c.lookup_leased(&[key]);
    unreachable!("killed while its lookup waits on the disk, but it answered: {answer:?}");
}

/// A client killed while its lookup waits on a slow disk: the lookup runs to its end, counted
/// in `orphaned_requests`; the session is listed as closing until then and reclaimed after it,
/// with the lease the lookup took; the server goes on serving that chunk.
#[cfg(feature = "failpoints")]
#[test]
fn a_request_outliving_its_client_ends_before_the_reclaim() {
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (server, ns, cold) = on_a_slow_disk(dir.path());
    assert_eq!(server.shard_sum("orphaned_requests"), 0);
    let stderr_path = dir.path().join("child.stderr");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "slow_lookup_process", "--nocapture", "--test-threads", "1"])
        .env(SLOW_LOOKUP_ENV, format!("{} {ns}", server.socket.display()))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    // The child starts (a test binary, slow on a loaded machine), connects and looks up; if it
    // ends first, what it said is the failure.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while server.shard_sum("ssd_hits") < 1 {
        let said = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child ended ({status}) before its lookup reached the disk:\n{}", said());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the child's lookup did not reach the disk in 60 s: {}\nchild:\n{}",
            server.admin("stats"),
            said()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
    child.wait().unwrap();
    // The session closes at once (its bootstrap socket ends) with the lookup still waiting.
    server.wait_for("the session to close", |s| s.shard_sum("orphaned_requests") == 1);
    let sessions = server.admin("sessions");
    let listed = sessions["sessions"].as_array().unwrap();
    assert!(
        listed.len() == 1 && listed[0]["closing"] == true,
        "the session is reclaimed only after its lookup: {sessions}"
    );
    server.wait_for("the reclaim", |s| {
        s.admin("stats")["sessions"] == 0 && s.shard_sum("leases") == 0
    });
    assert_eq!(server.admin("sessions")["sessions"].as_array().unwrap().len(), 0);
    // Nothing lost: the chunk is served with its bytes.
    let mut c = server.client("after");
    c.register_namespace(&namespace(16)).unwrap();
    let leases = c.lookup_leased(&cold[1..2]).unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(c.chunk(&leases[0]).unwrap(), &value_for(&cold[1], LEN)[..]);
    c.release(&leases).unwrap();
    assert_eq!(server.shard_sum("orphaned_requests"), 1);
}

/// `--model-quota quiet:ssd-guarantee=2MiB`: a noisy model cycling the SSD log twice leaves
/// the quiet model 2 MiB of its records (rewritten at the head before their regions' reclaim,
/// counted), byte-exact, and they are what a restart finds.
#[test]
fn an_ssd_guarantee_keeps_a_quiet_models_chunks_through_reclaim() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut args = ssd_args_with(dir.path(), 1);
    args.extend(["--model-quota".to_string(), "quiet:ssd-guarantee=2MiB".to_string()]);
    let mut server = TestServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut c = server.client("two-models");
    let quiet_ns = orbitkv_client::NamespaceDescriptor { model: "quiet".into(), ..namespace(16) };
    let quiet = chain(c.register_namespace(&quiet_ns).unwrap().id, 1, 120); // 120 x 20 KiB
    let noisy = chain(c.register_namespace(&namespace(16)).unwrap().id, 2, 2400); // 48 MiB
                                                                                  // Each read once at once (reuse evidence for SSD admission). While reclaim waits for the
                                                                                  // quiet model's records to be rewritten, demotions wait too and DRAM evicts instead: a
                                                                                  // chunk just put may be gone already.
    for k in quiet.iter().chain(&noisy) {
        let out = c.put(&[(*k, &value_for(k, LEN))]).unwrap();
        assert_eq!(out, vec![orbitkv_client::PutOutcome::Stored]);
        c.lookup(std::slice::from_ref(k)).unwrap();
    }
    // 2 MiB of 20 KiB records (header and payload): at least 103 of them.
    let (found, _) = read_all(&mut c, &quiet);
    assert!((103..=120).contains(&found), "{found} quiet chunks left: {}", server.admin("stats"));
    assert!(server.shard_sum("ssd_relocated") >= 103, "{}", server.admin("stats"));
    assert!(server.shard_sum("ssd_reclaimed") > 1000, "the noisy model's records went");
    let audit = server.try_admin_request(&serde_json::json!({"cmd": "audit"})).unwrap();
    assert_eq!(audit["ok"], true, "{audit}");
    drop(c);
    assert!(server.stop().success());
    server.spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut c = server.client("after");
    c.register_namespace(&quiet_ns).unwrap();
    let (found, from_ssd) = read_all(&mut c, &quiet);
    assert!(found >= 103 && from_ssd == found, "{found} found, {from_ssd} from SSD");
}
