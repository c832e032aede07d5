//! The start and the stop: sockets claimed, the arena made and populated, shards, the GPU
//! service and peering started, the listeners handed the server; then, on SIGTERM or SIGINT,
//! drained and stopped (`run`).

mod arena;
mod services;
mod sockets;

use self::arena::{create_arena, log_population, register_arena};
use self::services::{resolve_gpu, start_gpu_service, start_peering, start_shards};
use self::sockets::{claim_socket, outside_links, remove_orphan_shard_files, start_listeners};

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv_proto::{admin_socket_path, format_bytes};
use orbitkv_shards::Arena;

use crate::config::Settings;
use crate::control::shared;
use crate::control::shared::{ServeState, Shared};
use crate::control::startup::{Phase, Startup};
use crate::error::StartError;
use crate::placement;
use crate::shard::ipc::IpcNames;
use crate::shard::messages::ControlMsg;
use crate::shard::{doorbell, ipc};

/// How often the watchdog looks for a shard executor that parked with work queued.
const WATCHDOG_PERIOD: Duration = Duration::from_millis(10);

/// How often it looks while every shard sleeps on its doorbell (an idle server).
const WATCHDOG_ASLEEP_PERIOD: Duration = Duration::from_millis(100);

/// How long the shutdown waits for the member key's removal.
const CLUSTER_LEAVE_WAIT: Duration = Duration::from_secs(2);

/// The shards run on io_uring (glommio: a ring per executor and the probe of its operations,
/// Linux 5.8 or newer). Checked before anything starts, so that a kernel without it, or a
/// sysctl or seccomp profile refusing it, stops the start with one error naming it.
fn check_io_uring() -> Result<(), StartError> {
    let ring = io_uring::IoUring::new(2).map_err(StartError::NoIoUring)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(StartError::NoIoUring)
}

pub(crate) fn run(settings: Settings) -> Result<(), StartError> {
    let started = Instant::now();
    check_io_uring()?;
    let socket = settings.socket.clone();
    let admin = admin_socket_path(&socket);
    claim_socket(&socket)?;
    let (metrics_listener, cluster) = outside_links(&settings)?;
    let gpu = resolve_gpu(&settings)?;
    let files = settings.config.arena_memfds.files(settings.shards);
    let arena = create_arena(settings.config.hugepages, settings.dram_bytes, files)?;
    tracing::info!(
        memfds = arena.fds().len(),
        layout = settings.config.arena_memfds.as_str(),
        "the arena's memfds (--arena-memfds)"
    );
    // The sockets answer from here on: not ready, and how far the start got, until it serves.
    let startup = Arc::new(Startup::new(&settings, arena.len(), started));
    let running = start_listeners((&socket, &admin), metrics_listener, &settings, &startup)
        .and_then(|()| start(settings, arena, gpu, cluster, &startup));
    let (shared, handles, ipc) = match running {
        Ok(r) => r,
        Err(e) => {
            // Nothing serves behind the sockets: remove them before saying why.
            let _ = std::fs::remove_file(&socket);
            let _ = std::fs::remove_file(&admin);
            return Err(e);
        }
    };
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .map_err(|source| StartError::Os { what: "installing signal handlers", source })?;
    let signal = signals.forever().next().unwrap_or(signal_hook::consts::SIGTERM);
    tracing::info!(signal, "shutting down: draining");
    drain(&shared.settings, &shared);
    shut_down(&shared, (&socket, &admin), handles, &ipc);
    Ok(())
}

/// A started server: its shared state, the shard executors' handles, its iceoryx2 names.
type Running = (Arc<Shared>, Vec<glommio::ExecutorJoinHandle<()>>, IpcNames);

/// The start behind the bound sockets: populates the arena (each shard's slice on its core),
/// registers it with CUDA, starts the shards, the GPU service and peering, then hands the
/// listeners the server (`startup`'s phases say which step runs).
fn start(
    settings: Settings,
    mut arena: Arena,
    gpu: Option<orbitkv_gpu::Probe>,
    cluster: Option<Arc<orbitkv_peer::Cluster>>,
    startup: &Arc<Startup>,
) -> Result<Running, StartError> {
    let socket = settings.socket.clone();
    let shards = settings.shards;
    let cpus = placement::allowed_cpus();
    let cores = placement::shard_cores(settings.config.pin, &cpus, shards);
    tracing::info!(
        socket = %socket.display(),
        arena = %format_bytes(arena.len()),
        "listening (not ready: populating the arena)"
    );
    // Each shard's slice is populated (and locked) by a thread on the shard's own core, all at
    // once: its pages land on that core's NUMA node, and the time divides by the shards.
    let populating = Instant::now();
    let progress = |bytes: u64| {
        startup.populated.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        // Drills and tests hold the start here (e.g. `arena-populate-step=sleep(500)`).
        fail::fail_point!("arena-populate-step");
    };
    let population =
        arena.populate(shards, cores.as_deref(), settings.config.lock_arena, &progress);
    let populate_seconds = populating.elapsed().as_secs_f64();
    log_population(&population, populate_seconds);
    let arena = Arc::new(arena);
    // With a GPU in use the arena is registered with CUDA now; dropped (unregistered) after
    // the GPU service has stopped, before the arena.
    let with_gpu = matches!(gpu, Some(orbitkv_gpu::Probe::Present { .. }));
    startup.advance(if with_gpu { Phase::RegisteringCuda } else { Phase::StartingShards });
    let registration = register_arena(&settings, gpu.as_ref(), &arena, &population)?;
    if with_gpu {
        startup.advance(Phase::StartingShards);
    }
    let ipc = IpcNames::for_socket(&socket);
    ipc::remove_leftovers(&ipc);
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..shards).map(|_| crossbeam_channel::bounded::<ControlMsg>(1024)).unzip();
    let service_prefix = format!("orbitkv/{}", std::process::id());
    let doorbells = Arc::new(doorbell::Doorbells::new(Arc::clone(&arena), shards)?);
    doorbell::watch(Arc::downgrade(&doorbells), WATCHDOG_PERIOD, WATCHDOG_ASLEEP_PERIOD)
        .map_err(StartError::thread("orbitkv-watchdog"))?;
    let shared = Shared::new(
        settings.clone(),
        txs,
        doorbells,
        gpu,
        shared::StartState {
            locked: arena.locked(),
            populate_seconds,
            parts: population,
            register_seconds: registration
                .as_ref()
                .map(|r| r.part_seconds.clone())
                .unwrap_or_default(),
            pages: arena.pages(),
            memfds: arena.fds().len(),
        },
        ipc.clone(),
        service_prefix,
    )
    .map_err(StartError::thread("orbitkv-ipc-janitor"))?;
    if let Some(c) = cluster {
        let _ = shared.cluster.set(c);
    }
    // GPU save/load needs the arena registered with CUDA.
    if let (Some(orbitkv_gpu::Probe::Present { devices }), Some(host)) =
        (&shared.gpu, &registration)
    {
        start_gpu_service(&settings, &shared, devices, host)?;
    }
    if let Some(ssd) = &settings.ssd {
        remove_orphan_shard_files(&ssd.dir, shards)?;
    }
    let (handles, pinned) = start_shards(&settings, &shared, &arena, rxs, &ipc, (&cpus, cores))?;
    start_peering(&settings, &shared, &arena)?;
    let locked = arena.locked();
    startup.serve(Arc::clone(&shared), arena);
    tracing::info!(
        socket = %socket.display(),
        shards,
        arena = %format_bytes(settings.dram_bytes),
        arena_locked = locked,
        pinned,
        startup_ms = (startup.seconds_to_serve().unwrap_or(0.0) * 1e3) as u64,
        "orbitkv-server serving"
    );
    Ok((shared, handles, ipc))
}

/// After the drain: leaves the cluster, removes the sockets, stops the shards and the GPU
/// service, in that order.
fn shut_down(
    shared: &Shared,
    (socket, admin): (&Path, &Path),
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
    ipc: &IpcNames,
) {
    if let Some(c) = shared.cluster.get() {
        c.leave(CLUSTER_LEAVE_WAIT);
    }
    // Remove the sockets first so no new client finds a dying server.
    let _ = std::fs::remove_file(socket);
    let _ = std::fs::remove_file(admin);
    for shard in 0..shared.shards() {
        shared.send_control(shard, ControlMsg::Stop, Duration::from_secs(5));
    }
    for h in handles {
        let _ = h.join();
    }
    // Copies in flight complete before the arena is unregistered and unmapped.
    if let Some(service) = shared.gpu_service.get() {
        service.shutdown();
    }
    ipc::remove_leftovers(ipc);
    tracing::info!("orbitkv-server stopped");
}

/// Stops admitting writes and waits (up to `--drain-timeout`) for the reservations
/// outstanding to be committed or aborted.
fn drain(settings: &Settings, shared: &Shared) {
    shared.set_state(ServeState::Draining);
    let deadline = Instant::now() + settings.drain_timeout;
    while !shared.drained(Duration::from_secs(1)) {
        if Instant::now() >= deadline {
            tracing::warn!("drain timeout reached with reservations outstanding; exiting anyway");
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
