//! The arena: made on the pages the host gives (`--hugepages`), populated, registered with
//! CUDA; and the io_uring memory each shard's rings may lock.

use std::sync::Arc;

use orbitkv_proto::format_bytes;
use orbitkv_shards::Arena;

use crate::config;
use crate::config::Settings;
use crate::error::StartError;

/// io_uring memory per ring so that every executor's three rings fit RLIMIT_MEMLOCK.
pub(super) fn io_memory_per_ring(shards: usize) -> usize {
    const MAX: u64 = 1 << 20;
    const MIN: u64 = 64 << 10;
    let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
        .map(|(soft, _)| soft)
        .unwrap_or(8 << 20);
    let per = (limit / (shards as u64 * 4)).clamp(MIN, MAX);
    (per / 4096 * 4096) as usize
}

/// The arena on the pages `--hugepages` and the host's reservation give: hugetlb pages (1 GiB
/// first, then 2 MiB) where enough are free, else 4 KiB pages, saying why. A hugetlb arena that
/// cannot be made (another process took the pages meanwhile) falls back too. It is made of
/// `files` memfds (`--arena-memfds`).
pub(super) fn create_arena(
    mode: config::HugePages,
    data_bytes: u64,
    files: usize,
) -> Result<Arena, StartError> {
    use orbitkv_shards::PageSize;
    let small =
        || Arena::create_unpopulated(data_bytes, PageSize::Small, files).map_err(StartError::Arena);
    if mode == config::HugePages::Off {
        return small();
    }
    let need = |p: PageSize| p.arena_bytes(data_bytes) / p.bytes();
    let fits =
        [PageSize::Huge1G, PageSize::Huge2M].into_iter().find(|&p| p.free_huge_pages() >= need(p));
    let fallback = |why: String| {
        let flag = mode.as_str();
        if mode == config::HugePages::On {
            tracing::warn!("--hugepages {flag}: {why}; the arena is on 4KiB pages instead");
        } else {
            tracing::info!("--hugepages {flag}: {why}; the arena is on 4KiB pages");
        }
    };
    let Some(pages) = fits else {
        fallback(format!(
            "too few hugetlb pages are free for a {} arena ({} of 2MiB free, {} needed; {} of \
             1GiB free, {} needed): reserve them with the vm.nr_hugepages sysctl or the kernel's \
             hugepages= parameter (docs/operations.md)",
            format_bytes(data_bytes),
            PageSize::Huge2M.free_huge_pages(),
            need(PageSize::Huge2M),
            PageSize::Huge1G.free_huge_pages(),
            need(PageSize::Huge1G),
        ));
        return small();
    };
    match Arena::create_unpopulated(data_bytes, pages, files) {
        Ok(arena) => {
            tracing::info!(
                pages = pages.as_str(),
                count = need(pages),
                "the arena is on hugetlb pages"
            );
            Ok(arena)
        }
        Err(e) => {
            fallback(format!(
                "a hugetlb arena of {} pages could not be made ({e})",
                pages.as_str()
            ));
            small()
        }
    }
}

/// Logs how the arena was populated: each shard's slice (its core, NUMA node, seconds, rate)
/// and the whole, wall clock.
pub(super) fn log_population(parts: &[orbitkv_shards::Populated], seconds: f64) {
    for (shard, p) in parts.iter().enumerate() {
        tracing::info!(
            shard,
            bytes = %format_bytes(p.bytes),
            core = ?p.core,
            numa_node = ?p.node,
            seconds = format!("{:.3}", p.seconds),
            lock_seconds = format!("{:.3}", p.lock_seconds),
            gib_per_s = format!("{:.2}", p.bytes as f64 / (1u64 << 30) as f64 / p.seconds.max(1e-9)),
            locked = p.locked,
            "arena slice populated"
        );
    }
    if parts.iter().all(|p| p.node.is_none()) {
        tracing::info!(
            "the kernel does not say which NUMA node holds the arena (no NUMA support, or \
             get_mempolicy refused): each shard's slice is still placed by first touch from its \
             own core; stats show numa_node null"
        );
    }
    let bytes: u64 = parts.iter().map(|p| p.bytes).sum();
    tracing::info!(
        bytes = %format_bytes(bytes),
        threads = parts.len(),
        seconds = format!("{:.3}", seconds),
        gib_per_s = format!("{:.2}", bytes as f64 / (1u64 << 30) as f64 / seconds.max(1e-9)),
        "arena populated"
    );
}

/// The arena registered with CUDA when a device is in use, each shard's slice by a thread on
/// the core that populated it, all at once; a failure ends the start with `--gpu required`,
/// and otherwise leaves the server serving without GPU (logged).
pub(super) fn register_arena(
    settings: &Settings,
    gpu: Option<&orbitkv_gpu::Probe>,
    arena: &Arc<Arena>,
    population: &[orbitkv_shards::Populated],
) -> Result<Option<Arc<orbitkv_gpu::HostRegistration>>, StartError> {
    let Some(orbitkv_gpu::Probe::Present { devices }) = gpu else { return Ok(None) };
    let first = &devices[0];
    let parts: Vec<orbitkv_gpu::RegisterPart> = population
        .iter()
        .map(|p| orbitkv_gpu::RegisterPart { offset: p.offset, bytes: p.bytes, core: p.core })
        .collect();
    match orbitkv_gpu::register_host_parts(first.ordinal as usize, arena.clone(), &parts) {
        Ok(r) => {
            for (shard, (p, seconds)) in population.iter().zip(&r.part_seconds).enumerate() {
                tracing::info!(
                    shard,
                    bytes = %format_bytes(p.bytes),
                    core = ?p.core,
                    seconds = format!("{seconds:.3}"),
                    "arena slice registered with CUDA"
                );
            }
            tracing::info!(
                uuid = %first.uuid,
                bytes = arena.len(),
                threads = parts.len(),
                ms = r.elapsed.as_millis() as u64,
                "arena registered with CUDA"
            );
            Ok(Some(Arc::new(r)))
        }
        Err(e) if settings.config.gpu == orbitkv_gpu::GpuMode::Required => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, "arena not registered with CUDA: serving without GPU");
            Ok(None)
        }
    }
}
