//! `orbitkv-server`: the per-host OrbitKV Manager. The binary's `main` is [`main`]; the
//! library exists for it and for [`fuzzing`], which drives the decoders of outside input that
//! live here (the admin socket's requests, the config file) in process.

#![deny(unsafe_code)]
// The stats reply is one json! object of many keys.
#![recursion_limit = "256"]

pub use orbitkv_config as config;
mod control;
mod deadline;
mod error;
mod gpu;
mod metrics;
mod placement;
mod requests;
mod shard;

pub mod fuzzing;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::channels::channel_mesh::MeshBuilder;
use orbitkv_proto::{admin_socket_path, format_bytes};
use orbitkv_shards::{Arena, ShardConfig, ShardCore};
use orbitkv_ssd::store::SsdConfig;

use crate::config::Settings;
use crate::control::shared::{ServeState, Shared};
use crate::control::startup::{Phase, Startup};
use crate::control::{admin, bootstrap, peering, shared};
use crate::error::StartError;
use crate::shard::executor::{IdlePolicy, ShardContext};
use crate::shard::ipc::IpcNames;
use crate::shard::messages::ControlMsg;
use crate::shard::{doorbell, executor, ipc};

/// How often the watchdog looks for a shard executor that parked with work queued.
const WATCHDOG_PERIOD: Duration = Duration::from_millis(10);
/// How often it looks while every shard sleeps on its doorbell (an idle server).
const WATCHDOG_ASLEEP_PERIOD: Duration = Duration::from_millis(100);

/// The server: parses the command line, runs until SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ORBITKV_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    iceoryx2::prelude::set_log_level_from_env_or(iceoryx2::prelude::LogLevel::Warn);
    // Test builds: the failpoints named in FAILPOINTS, for the process's life.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let (config, print_config) = match config::from_command_line(std::env::args_os()) {
        Ok(c) => c,
        // Usage errors, --help and --version: clap prints them and picks the exit code.
        Err(config::CommandLineError::Flags(e)) => e.exit(),
        Err(e) => return fail(&e.to_string()),
    };
    if print_config {
        print!("{}", toml::to_string(&config).expect("the config struct serializes to TOML"));
        return ExitCode::SUCCESS;
    }
    let settings = match config.validate() {
        Ok(s) => s,
        Err(e) => return fail(&e.to_string()),
    };
    #[cfg(feature = "te-python")]
    if !settings.config.etcd.is_empty() && settings.config.te_library.is_none() {
        wheel_waits_for_every_transfer();
    }
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e.to_string()),
    }
}

/// The wheel's engine (the `te-python` route) gives up on a batch after `MC_TRANSFER_TIMEOUT`
/// seconds (30 unless set) while its transfers may still run: under an owner that is paused,
/// not dead, a read given up so could land after its slots were freed. As on the C route, a
/// batch is waited for until TE has ended every transfer of it (completed or failed): the
/// wheel reads the variable when its engine is made, so it is set here to the largest value
/// it takes (about 68 years), replacing any other.
#[cfg(feature = "te-python")]
fn wheel_waits_for_every_transfer() {
    const FOREVER: &str = "2147483647";
    let was = std::env::var("MC_TRANSFER_TIMEOUT").ok();
    if was.as_deref() != Some(FOREVER) {
        if let Some(was) = was {
            tracing::info!(
                was = %was,
                "MC_TRANSFER_TIMEOUT replaced: peer reads wait until the Transfer Engine ends them"
            );
        }
        // Called from `main` before the server starts any thread: nothing reads the
        // environment meanwhile.
        std::env::set_var("MC_TRANSFER_TIMEOUT", FOREVER);
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("orbitkv-server: error: {message}");
    ExitCode::from(2)
}

/// Binds a Unix socket at `path`, refusing if a live server answers there and replacing a
/// stale socket file left by a crash.
fn bind(path: &Path, mode: u32, gid: Option<u32>) -> Result<UnixListener, StartError> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(StartError::AlreadyServing(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(StartError::io("removing stale socket", path))?;
    }
    let listener = UnixListener::bind(path).map_err(StartError::io("binding", path))?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(StartError::io("setting the group (--socket-group) of", path))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(StartError::io("setting permissions of", path))?;
    Ok(listener)
}

/// Removes SSD files of shards this run does not have (an earlier run with more shards), so
/// that the directory never holds more than the configured cap.
fn remove_orphan_shard_files(dir: &Path, shards: usize) -> Result<(), StartError> {
    let entries = std::fs::read_dir(dir).map_err(StartError::io("reading --ssd-dir", dir))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("shard-"))
            .and_then(|n| n.strip_suffix(".okv"))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if id >= shards {
            tracing::warn!(path = %entry.path().display(), shards, "removing the SSD file of a shard this run does not have");
            std::fs::remove_file(entry.path()).map_err(StartError::io("removing", entry.path()))?;
        }
    }
    Ok(())
}

/// io_uring memory per ring so that every executor's three rings fit RLIMIT_MEMLOCK.
fn io_memory_per_ring(shards: usize) -> usize {
    const MAX: u64 = 1 << 20;
    const MIN: u64 = 64 << 10;
    let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
        .map(|(soft, _)| soft)
        .unwrap_or(8 << 20);
    let per = (limit / (shards as u64 * 4)).clamp(MIN, MAX);
    (per / 4096 * 4096) as usize
}

/// Inventory changes a shard logs between two drains by the peer thread (every 50 ms); more
/// and the peer thread reads the shard's whole inventory instead.
const INVENTORY_LOG: usize = 65_536;
/// How long the start waits for the first attempt to join the cluster.
const CLUSTER_JOIN_WAIT: Duration = Duration::from_secs(5);
/// How long the shutdown waits for the member key's removal.
const CLUSTER_LEAVE_WAIT: Duration = Duration::from_secs(2);

/// The arena on the pages `--hugepages` and the host's reservation give: hugetlb pages (1 GiB
/// first, then 2 MiB) where enough are free, else 4 KiB pages, saying why. A hugetlb arena that
/// cannot be made (another process took the pages meanwhile) falls back too. It is made of
/// `files` memfds (`--arena-memfds`).
fn create_arena(
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
fn log_population(parts: &[orbitkv_shards::Populated], seconds: f64) {
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

/// The shards run on io_uring (glommio: a ring per executor and the probe of its operations,
/// Linux 5.8 or newer). Checked before anything starts, so that a kernel without it, or a
/// sysctl or seccomp profile refusing it, stops the start with one error naming it.
fn check_io_uring() -> Result<(), StartError> {
    let ring = io_uring::IoUring::new(2).map_err(StartError::NoIoUring)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(StartError::NoIoUring)
}

fn run(settings: Settings) -> Result<(), StartError> {
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

/// In cluster mode, peering (inventory, grants, peer reads) once the shards run. A build
/// without a Transfer Engine stays a member only, and says so.
fn start_peering(
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

/// Makes the socket's directory and refuses when a live server answers on the socket, before
/// anything else (iceoryx2 state) is touched.
fn claim_socket(socket: &Path) -> Result<(), StartError> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(StartError::io("creating", dir))?;
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(StartError::AlreadyServing(socket.to_owned()));
    }
    Ok(())
}

/// `--gpu` applied to the devices found (logged).
fn resolve_gpu(settings: &Settings) -> Result<Option<orbitkv_gpu::Probe>, StartError> {
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

/// The arena registered with CUDA when a device is in use, each shard's slice by a thread on
/// the core that populated it, all at once; a failure ends the start with `--gpu required`,
/// and otherwise leaves the server serving without GPU (logged).
fn register_arena(
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

/// Starts the DMA thread pair of every device and hands the service to the shards.
fn start_gpu_service(
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
fn start_shards(
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

/// What starts before the server: the metrics listener, bound (an address in use stops the
/// server at once), and in cluster mode the membership (a node id held by a live member
/// stops the start; an etcd that does not answer does not: the server serves locally and
/// keeps trying).
#[allow(clippy::type_complexity)]
fn outside_links(
    settings: &Settings,
) -> Result<(Option<std::net::TcpListener>, Option<Arc<orbitkv_peer::Cluster>>), StartError> {
    let metrics_listener = settings
        .config
        .metrics_addr
        .map(|addr| {
            metrics::http::bind(addr).map_err(|source| StartError::Metrics { addr, source })
        })
        .transpose()?;
    let cluster = match &settings.cluster {
        Some(cfg) => {
            let cpus = placement::peer_cores(
                settings.config.pin,
                &placement::allowed_cpus(),
                settings.shards,
            );
            let cfg = orbitkv_peer::ClusterConfig { cpus, ..cfg.clone() };
            Some(orbitkv_peer::Cluster::start(cfg, CLUSTER_JOIN_WAIT)?)
        }
        None => None,
    };
    Ok((metrics_listener, cluster))
}

/// Binds the bootstrap and admin sockets and starts the threads that accept on them and on
/// the metrics listener.
fn start_listeners(
    (socket, admin): (&Path, &Path),
    metrics_listener: Option<std::net::TcpListener>,
    settings: &Settings,
    startup: &Arc<Startup>,
) -> Result<(), StartError> {
    // Only the server's uid, root and the socket group reach the allow lists at all.
    let gid = settings.socket_gid;
    let listener = bind(socket, 0o660, gid)?;
    let admin_listener = bind(admin, 0o660, gid)?;
    let s = Arc::clone(startup);
    let limit = settings.config.max_sessions + bootstrap::HANDSHAKE_HEADROOM;
    std::thread::Builder::new()
        .name("orbitkv-accept".into())
        .spawn(move || bootstrap::serve(listener, s, limit))
        .map_err(StartError::thread("orbitkv-accept"))?;
    let s = Arc::clone(startup);
    std::thread::Builder::new()
        .name("orbitkv-admin".into())
        .spawn(move || admin::serve(admin_listener, s))
        .map_err(StartError::thread("orbitkv-admin"))?;
    if let Some(listener) = metrics_listener {
        let addr = listener.local_addr().map_err(|source| StartError::Os {
            what: "reading the metrics listener's address",
            source,
        })?;
        let s = Arc::clone(startup);
        std::thread::Builder::new()
            .name("orbitkv-metrics".into())
            .spawn(move || metrics::http::serve(listener, s))
            .map_err(StartError::thread("orbitkv-metrics"))?;
        tracing::info!(%addr, "metrics on http://{addr}/metrics (and /healthz, /readyz)");
    }
    Ok(())
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
