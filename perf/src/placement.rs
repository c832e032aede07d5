//! Where the benchmark's threads run: on CPUs that no shard of the server is pinned to, when
//! there are any. A client thread that lands on a shard's core competes with that shard
//! (which spins after work), and the two halve each other: a run would measure the
//! scheduler's placement instead of OrbitKV.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// CPUs this process may use that no shard is pinned to, in order.
pub(crate) fn free_cpus(shard_cores: &[usize]) -> Vec<usize> {
    let Ok(allowed) = sched_getaffinity(Pid::from_raw(0)) else { return Vec::new() };
    (0..CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false) && !shard_cores.contains(&c))
        .collect()
}

/// Pins the calling thread to `cpus` (any of them); false when that is not possible.
pub(crate) fn pin_current_thread(cpus: &[usize]) -> bool {
    if cpus.is_empty() {
        return false;
    }
    let mut set = CpuSet::new();
    for &c in cpus {
        if set.set(c).is_err() {
            return false;
        }
    }
    sched_setaffinity(Pid::from_raw(0), &set).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_cores_are_left_out() {
        let all = free_cpus(&[]);
        assert!(!all.is_empty(), "this process may run somewhere");
        let without_first = free_cpus(&all[..1]);
        assert_eq!(without_first.len(), all.len() - 1);
        assert!(!without_first.contains(&all[0]));
    }
}
