//! Which cores the Manager's threads take.
//!
//! The Manager shares its host with the engines it serves, and engines that pin their threads
//! start at the first core: vLLM's CPU worker binds its OpenMP threads from CPU 0 up and leaves
//! the last cores of its NUMA node to other processes (`VLLM_CPU_NUM_OF_RESERVED_CPU`, one more
//! with a KV connector), and `taskset`/cgroup layouts give a host's first cores to the workload.
//! A shard that polls on a core an engine also pins is starved by it (its requests wait for the
//! engine's time slices, saves time out, loads fail), so the Manager places from the other end:
//! the shards take the last of the CPUs it may run on, the GPU DMA threads the ones below them,
//! and the peer threads every core that is not a shard's. The start log says which cores each
//! took and why; `ctl stats` gives each shard's core.

/// CPUs this process may run on (its affinity mask, which `taskset` and cgroups narrow), in
/// ascending order.
pub(crate) fn allowed_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
        Ok(set) => {
            (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect()
        }
        Err(_) => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// The core of each shard, or `None` for all when they run unpinned (pinning off, or more
/// shards than allowed CPUs). Shards take the last `shards` of `cpus`, in order, so that
/// engines pinned from the first core do not starve them.
pub(crate) fn shard_cores(pin: bool, cpus: &[usize], shards: usize) -> Option<Vec<usize>> {
    if !pin {
        tracing::info!(shards, "shards run unpinned (--no-pin)");
        return None;
    }
    if shards > cpus.len() {
        tracing::warn!(shards, cpus = cpus.len(), "more shards than CPUs: shards run unpinned");
        return None;
    }
    let cores = cpus[cpus.len() - shards..].to_vec();
    tracing::info!(
        ?cores,
        allowed = %cpu_list(cpus),
        "shards pinned to the last of the allowed CPUs (engines pin their threads from the \
         first core: vLLM's CPU worker does; --no-pin or a narrower affinity, e.g. taskset, \
         to place them otherwise)"
    );
    Some(cores)
}

/// The allowed cores below the shards' own, highest first: where the helper threads go.
fn below_shards(cpus: &[usize], shards: usize) -> impl Iterator<Item = usize> + '_ {
    cpus[..cpus.len().saturating_sub(shards)].iter().rev().copied()
}

/// Cores for the GPU DMA threads (a save and a load thread per device, in that order): the
/// allowed cores just below the shards' own, when pinning is on and there are enough of them;
/// otherwise none, and the threads run unpinned beside the shards (said in the log).
pub(crate) fn dma_cores(pin: bool, cpus: &[usize], shards: usize, devices: usize) -> Vec<usize> {
    if !pin {
        return Vec::new();
    }
    let wanted = shards + 2 * devices;
    if wanted > cpus.len() {
        tracing::info!(
            shards,
            dma_threads = 2 * devices,
            cpus = cpus.len(),
            "GPU DMA threads run unpinned: fewer cores than shards and DMA threads"
        );
        return Vec::new();
    }
    let mut cores: Vec<usize> = below_shards(cpus, shards).take(2 * devices).collect();
    cores.reverse();
    tracing::info!(?cores, "GPU DMA threads pinned, one core each, below the shards' cores");
    cores
}

/// Cores for the peer thread and the Transfer Engine's threads: every allowed core that is not
/// a pinned shard's (shared with GPU DMA threads pinned there), so that they never take a
/// spinning shard's core; none (they run anywhere) when pinning is off or no core is left
/// (said in the log).
pub(crate) fn peer_cores(pin: bool, cpus: &[usize], shards: usize) -> Vec<usize> {
    if !pin || shards >= cpus.len() {
        tracing::info!(shards, cpus = cpus.len(), "peer threads run unpinned beside the shards");
        return Vec::new();
    }
    let mut cores: Vec<usize> = below_shards(cpus, shards).collect();
    cores.reverse();
    tracing::info!(?cores, "peer threads on the cores that are not the shards'");
    cores
}

/// `0-3,8,10-11`: a CPU list as the kernel writes one.
fn cpu_list(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::{cpu_list, dma_cores, peer_cores, shard_cores};

    #[test]
    fn shards_take_the_last_allowed_cores() {
        // CI's two cores: the one shard keeps off core 0, where engines pin.
        assert_eq!(shard_cores(true, &[0, 1], 1), Some(vec![1]));
        let cpus: Vec<usize> = (0..16).collect();
        assert_eq!(shard_cores(true, &cpus, 15), Some((1..16).collect()));
        assert_eq!(shard_cores(true, &cpus, 2), Some(vec![14, 15]));
        // A narrowed affinity (taskset -c 4-7,12) is respected.
        assert_eq!(shard_cores(true, &[4, 5, 6, 7, 12], 2), Some(vec![7, 12]));
        assert_eq!(shard_cores(true, &[3], 1), Some(vec![3]));
        // More shards than cores, or pinning off: unpinned.
        assert_eq!(shard_cores(true, &[0, 1], 3), None);
        assert_eq!(shard_cores(false, &cpus, 4), None);
    }

    #[test]
    fn peer_threads_take_the_cores_that_are_not_the_shards() {
        let cpus: Vec<usize> = (0..16).collect();
        assert_eq!(peer_cores(true, &cpus, 14), vec![0, 1]);
        assert_eq!(peer_cores(true, &[4, 5, 6, 7], 1), vec![4, 5, 6]);
        // No core left, or pinning off: anywhere.
        assert!(peer_cores(true, &[0, 1], 2).is_empty());
        assert!(peer_cores(false, &cpus, 4).is_empty());
    }

    #[test]
    fn dma_threads_take_the_cores_just_below_the_shards() {
        let cpus: Vec<usize> = (0..16).collect();
        assert_eq!(dma_cores(true, &cpus, 4, 1), vec![10, 11]);
        assert_eq!(dma_cores(true, &cpus, 4, 2), vec![8, 9, 10, 11]);
        // The allowed cores need not start at 0 nor be adjacent.
        assert_eq!(dma_cores(true, &[2, 3, 8, 9, 12], 2, 1), vec![3, 8]);
        assert_eq!(dma_cores(true, &[0, 1, 2], 1, 1), vec![0, 1]);
        // Too few cores (CI's two), or pinning off: the threads run unpinned.
        assert!(dma_cores(true, &[0, 1], 1, 1).is_empty());
        assert!(dma_cores(false, &cpus, 4, 1).is_empty());
    }

    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[5]), "5");
        assert_eq!(cpu_list(&[]), "");
    }
}
