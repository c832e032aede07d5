//! An engine that pins busy threads to the first core (as vLLM's CPU worker binds its OpenMP
//! threads from CPU 0 up) does not starve a Manager started at its default placement: the
//! shards take the last allowed cores, say so at start, and every request is answered.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use orbitkv_client::PutOutcome;
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

/// The CPUs this test process may use.
fn allowed() -> Vec<usize> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect()
}

/// The CPU list each `shard-*` thread of process `pid` may run on, from /proc.
fn shard_thread_cpus(pid: i32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("shard-") {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default();
        out.push((comm.trim().to_string(), cpus));
    }
    out
}

/// Busy threads pinned to `core` until dropped: the engine's OpenMP team.
struct Engine {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Engine {
    fn pinned_to(core: usize, threads: usize) -> Engine {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut set = nix::sched::CpuSet::new();
                    set.set(core).unwrap();
                    // Pid 0: this thread only.
                    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        Engine { stop, threads }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[test]
fn a_manager_at_its_defaults_keeps_off_the_engines_first_core() {
    let cpus = allowed();
    if cpus.len() < 2 {
        eprintln!(
            "skipped: one allowed CPU ({cpus:?}); the shards cannot keep off an engine's core"
        );
        return;
    }
    let first = cpus[0];
    let _engine = Engine::pinned_to(first, 4);
    // Placement at its defaults (shards = cores - 1, pinned); a small arena starts quickly.
    let server = TestServer::start(&["--dram", "64MiB"]);
    let log = server.log();
    assert!(log.contains("shards pinned to the last of the allowed CPUs"), "{log}");

    let stats = server.admin("stats");
    let shards = stats["shards"].as_array().unwrap();
    assert_eq!(shards.len(), cpus.len() - 1);
    let cores: Vec<u64> = shards.iter().map(|s| s["core"].as_u64().expect("pinned")).collect();
    let want: Vec<u64> = cpus[1..].iter().map(|&c| c as u64).collect();
    assert_eq!(cores, want, "the shards take the last allowed cores, in order");
    // What the kernel holds each shard thread to, not only what the server reports.
    // (glommio names its helper thread after the executor: a shard may show twice.)
    let threads = shard_thread_cpus(server.pid());
    let mut names: Vec<&str> = threads.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), shards.len(), "{threads:?}");
    for (name, list) in &threads {
        assert_ne!(list, &first.to_string(), "{name} shares the engine's core {first}");
        assert!(!list.contains('-') && !list.contains(','), "{name} is pinned: {list}");
    }

    // Every request is answered, byte-exact, while the engine keeps its core busy.
    let mut c = server.client("beside-the-engine");
    let ns = c.register_namespace(&namespace(16)).unwrap();
    for round in 0..50u32 {
        let keys = chain(ns.id, round, 8);
        let vals: Vec<Vec<u8>> = keys.iter().map(|k| value_for(k, 48 << 10)).collect();
        let items: Vec<_> = keys.iter().zip(&vals).map(|(k, v)| (*k, v.as_slice())).collect();
        let out = c.put(&items).unwrap();
        assert!(out.iter().all(|o| *o == PutOutcome::Stored), "round {round}: {out:?}");
        let mut bufs = vec![vec![0u8; 64 << 10]; keys.len()];
        let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let lens = c.get_into(&keys, &mut refs).unwrap();
        for (i, len) in lens.iter().enumerate() {
            assert_eq!(&bufs[i][..*len], &vals[i][..], "round {round} chunk {i}");
        }
    }
}
