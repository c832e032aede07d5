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
/// allowed cores below the shards' own, when pinning is on and there are enough of them;
/// otherwise none, and the threads run unpinned beside the shards (said in the log). A device
/// whose NUMA node is known (`nodes[i]`) takes the highest two such cores on that node, so that
/// its threads and the pinned host memory they allocate (descriptor tables) sit beside its PCIe
/// link; the others take the highest cores left, ascending. `node_of` gives a core's node.
pub(crate) fn dma_cores(
    pin: bool,
    cpus: &[usize],
    shards: usize,
    nodes: &[Option<u32>],
    node_of: &dyn Fn(usize) -> Option<u32>,
) -> Vec<usize> {
    if !pin {
        return Vec::new();
    }
    let threads = 2 * nodes.len();
    if shards + threads > cpus.len() {
        tracing::info!(
            shards,
            dma_threads = threads,
            cpus = cpus.len(),
            "GPU DMA threads run unpinned: fewer cores than shards and DMA threads"
        );
        return Vec::new();
    }
    // Highest first.
    let mut free: Vec<usize> = below_shards(cpus, shards).collect();
    let mut cores: Vec<Option<usize>> = vec![None; threads];
    for (device, node) in nodes.iter().enumerate() {
        let Some(node) = *node else { continue };
        let local: Vec<usize> =
            free.iter().copied().filter(|&c| node_of(c) == Some(node)).take(2).collect();
        if let [high, low] = local[..] {
            (cores[2 * device], cores[2 * device + 1]) = (Some(low), Some(high));
            free.retain(|c| !local.contains(c));
        }
    }
    let left = cores.iter().filter(|c| c.is_none()).count();
    let mut rest: Vec<usize> = free.into_iter().take(left).collect();
    rest.reverse();
    let mut rest = rest.into_iter();
    let cores: Vec<usize> = cores
        .into_iter()
        .map(|c| c.or_else(|| rest.next()).expect("enough cores, checked above"))
        .collect();
    let on: Vec<Option<u32>> = cores.iter().map(|&c| node_of(c)).collect();
    tracing::info!(
        ?cores,
        numa_nodes = ?on,
        devices_numa_nodes = ?nodes,
        "GPU DMA threads pinned, one core each, below the shards' cores (on the device's NUMA \
         node where it is known)"
    );
    cores
}

/// The NUMA node of `cpu`, as sysfs says (`/sys/devices/system/cpu/cpuN/nodeK`); None where
/// it does not (no NUMA support in the kernel).
pub(crate) fn cpu_node(cpu: usize) -> Option<u32> {
    std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{cpu}"))
        .ok()?
        .flatten()
        .find_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
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
    fn a_cpus_node_is_read_from_sysfs_or_unknown() {
        // Every Linux host has cpu0; its node is known where the kernel has NUMA support.
        assert!(super::cpu_node(0).is_none_or(|n| n < 1024));
        assert_eq!(super::cpu_node(1 << 20), None);
    }

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
        let unknown = |_: usize| None;
        let dma = |cpus: &[usize], shards, devices: usize| {
            dma_cores(true, cpus, shards, &vec![None; devices], &unknown)
        };
        assert_eq!(dma(&cpus, 4, 1), vec![10, 11]);
        assert_eq!(dma(&cpus, 4, 2), vec![8, 9, 10, 11]);
        // The allowed cores need not start at 0 nor be adjacent.
        assert_eq!(dma(&[2, 3, 8, 9, 12], 2, 1), vec![3, 8]);
        assert_eq!(dma(&[0, 1, 2], 1, 1), vec![0, 1]);
        // Too few cores (CI's two), or pinning off: the threads run unpinned.
        assert!(dma(&[0, 1], 1, 1).is_empty());
        assert!(dma_cores(false, &cpus, 4, &[None], &unknown).is_empty());
    }

    #[test]
    fn dma_threads_sit_on_their_devices_numa_node() {
        // Two nodes of 8 cores; the shards on the last 4 (node 1).
        let cpus: Vec<usize> = (0..16).collect();
        let node_of = |c: usize| Some((c / 8) as u32);
        assert_eq!(dma_cores(true, &cpus, 4, &[Some(0)], &node_of), vec![6, 7]);
        assert_eq!(dma_cores(true, &cpus, 4, &[Some(1)], &node_of), vec![10, 11]);
        assert_eq!(dma_cores(true, &cpus, 4, &[Some(0), Some(1)], &node_of), vec![6, 7, 10, 11]);
        // A device of unknown node takes the highest cores the others left.
        assert_eq!(dma_cores(true, &cpus, 4, &[None, Some(1)], &node_of), vec![8, 9, 10, 11]);
        assert_eq!(dma_cores(true, &cpus, 4, &[Some(0), None], &node_of), vec![6, 7, 10, 11]);
        // A node with too few free cores: the highest cores below the shards instead.
        assert_eq!(dma_cores(true, &cpus, 4, &[Some(5)], &node_of), vec![10, 11]);
        let one_free_on_node_1 = [0, 1, 2, 3, 11, 12, 13, 14, 15];
        assert_eq!(dma_cores(true, &one_free_on_node_1, 5, &[Some(1)], &node_of), vec![2, 3]);
    }

    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[5]), "5");
        assert_eq!(cpu_list(&[]), "");
    }
}
