//! The shards, the GPU service and peering, started.

use std::sync::Arc;
use std::time::Duration;

use glommio::channels::channel_mesh::MeshBuilder;
use orbitkv_shards::{Arena, ShardConfig, ShardCore};
use orbitkv_ssd::store::SsdConfig;

use super::arena::io_memory_per_ring;
use crate::config::Settings;
use crate::control::peering;
use crate::control::shared::Shared;
use crate::error::StartError;
use crate::shard::executor;
use crate::shard::executor::{IdlePolicy, ShardContext};
use crate::shard::ipc::IpcNames;
use crate::shard::messages::ControlMsg;
use crate::{gpu, placement};

/// Inventory changes a shard logs between two drains by the peer thread (every 50 ms); more
/// and the peer thread reads the shard's whole inventory instead.
const INVENTORY_LOG: usize = 65_536;

/// In cluster mode, peering (inventory, grants, peer reads) once the shards run. A build
/// without a Transfer Engine stays a member only, and says so.
pub(super) fn start_peering(
    settings: &Settings,
    shared: &Arc<Shared>,
    arena: &Arc<Arena>,
) -> Result<(), StartError> {
    let Some(cluster) = shared.cluster.get() else { return Ok(()) };
    let cfg = orbitkv_peer::PeeringConfig {
        node: Arc::new(peering::Node(Arc::clone(shared))),
        arena: (arena.base_ptr() as u64, arena.len()),
        catalog_max_per_peer: settings.config.peer_catalog_entries,
        max_grants_per_peer: settings.config.peer_max_grants,
        spin_window: settings.config.peer_spin_window.duration(),
    };
    match cluster.start_peering(cfg) {
        Ok(queue) => {
            let _ = shared.peer_fetches.set(queue);
            tracing::info!(segment = %cluster.te_segment(), "cluster: peering started");
            Ok(())
        }
        Err(e @ orbitkv_peer::PeeringError::NoTransferEngine) => {
            tracing::warn!("cluster: {e}");
            Ok(())
        }
        Err(e) => Err(StartError::Peering(e)),
    }
}

/// `--gpu` applied to the devices found (logged).
pub(super) fn resolve_gpu(settings: &Settings) -> Result<Option<orbitkv_gpu::Probe>, StartError> {
    let gpu = orbitkv_gpu::resolve(settings.config.gpu)?;
    match &gpu {
        None => tracing::info!("GPU off (--gpu off)"),
        Some(orbitkv_gpu::Probe::Absent { reason }) => {
            tracing::info!(%reason, "no CUDA device: serving DRAM/SSD only (--gpu auto)")
        }
        Some(orbitkv_gpu::Probe::Present { devices }) => {
            for d in devices {
                tracing::info!(ordinal = d.ordinal, name = %d.name, uuid = %d.uuid, "CUDA device");
            }
        }
    }
    Ok(gpu)
}

/// Starts the DMA thread pair of every device and hands the service to the shards.
pub(super) fn start_gpu_service(
    settings: &Settings,
    shared: &Arc<Shared>,
    devices: &[orbitkv_gpu::DeviceInfo],
    host: &Arc<orbitkv_gpu::HostRegistration>,
) -> Result<(), StartError> {
    let limits = gpu::GpuLimits {
        queue_depth: settings.config.gpu_queue_depth,
        max_registrations: settings.config.max_gpu_registrations,
        staging_bytes: settings.gpu_staging_bytes as usize,
        staging_depth: settings.gpu_staging_depth,
        checksums: settings.config.gpu_checksums,
        copy: settings.config.gpu_copy,
        timeline: settings.config.gpu_timeline,
    };
    let shards = settings.shards;
    let service = gpu::GpuService::new(devices.to_vec(), Arc::clone(host), shards, limits)?;
    let nodes: Vec<Option<u32>> = devices.iter().map(|d| d.numa_node).collect();
    let cores = placement::dma_cores(
        settings.config.pin,
        &placement::allowed_cpus(),
        shards,
        &nodes,
        &placement::cpu_node,
    );
    service.start(Arc::clone(&shared.doorbells), &cores)?;
    tracing::info!(
        devices = devices.len(),
        staging = settings.gpu_staging_bytes,
        staging_depth = settings.gpu_staging_depth,
        job = settings.gpu_job_bytes,
        "GPU save/load ready (gpu-d2h-D, gpu-h2d-D per device D)"
    );
    let _ = shared.gpu_service.set(service);
    Ok(())
}

/// Starts every shard's executor on its slice of the arena and waits until each serves (or
/// says why not); the executors' handles, and whether they are pinned.
pub(super) fn start_shards(
    settings: &Settings,
    shared: &Arc<Shared>,
    arena: &Arc<Arena>,
    controls: Vec<crossbeam_channel::Receiver<ControlMsg>>,
    ipc: &IpcNames,
    (cpus, cores): (&[usize], Option<Vec<usize>>),
) -> Result<(Vec<glommio::ExecutorJoinHandle<()>>, bool), StartError> {
    let shards = settings.shards;
    // With a core to spare for clients, shards poll briefly after work; when every core runs a
    // shard, polling would starve the clients, so shards sleep on their doorbells at once.
    let idle = if shards < cpus.len() { IdlePolicy::Poll } else { IdlePolicy::Sleep };
    tracing::info!(?idle, shards, cpus = cpus.len(), "idle policy");
    let depth = settings.config.mesh_queue_depth;
    let req_mesh = (shards > 1).then(|| MeshBuilder::full(shards, depth));
    let rep_mesh = (shards > 1).then(|| MeshBuilder::full(shards, depth));
    let io_memory = io_memory_per_ring(shards);
    let (ready_tx, ready_rx) = crossbeam_channel::bounded(shards);
    let mut handles = Vec::new();
    for (id, (slice, control)) in arena.split(shards).into_iter().zip(controls).enumerate() {
        let mut core = ShardCore::new(
            ShardConfig {
                id,
                max_chunk_bytes: settings.max_chunk_bytes,
                max_namespaces: settings.config.max_namespaces,
                quota: settings.quota,
                model_quotas: settings.model_quotas.clone(),
            },
            slice,
        );
        if settings.cluster.is_some() {
            core.enable_inventory(INVENTORY_LOG);
        }
        let ctx = ShardContext {
            id,
            shards,
            cpu: cores.as_ref().map(|c| c[id]),
            io_memory,
            core,
            control,
            req_mesh: req_mesh.clone(),
            rep_mesh: rep_mesh.clone(),
            shared: Arc::clone(shared),
            ipc: ipc.clone(),
            ready: ready_tx.clone(),
            idle,
            ssd: settings.ssd.as_ref().map(|s| SsdConfig {
                dir: s.dir.clone(),
                shard_id: id as u32,
                shard_count: shards as u32,
                capacity_bytes: s.per_shard_bytes,
                region_bytes: s.region_bytes,
                ring_depth: s.queue_depth,
                inject_delay: s.inject_latency,
                inject_errors_every: s.inject_errors_every,
                inject_no_space_every: s.inject_no_space_every,
            }),
        };
        handles.push(executor::spawn(ctx)?);
    }
    for _ in 0..shards {
        match ready_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(StartError::ShardTimeout),
        }
    }
    Ok((handles, cores.is_some()))
}
