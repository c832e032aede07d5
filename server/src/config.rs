//! Server configuration: one serde struct, loadable from TOML, overridden by flags, validated.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use orbitkv_proto::{default_socket_path, parse_duration, parse_size};
use serde::{Deserialize, Serialize};

/// A configuration that cannot be used; the message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config file is not valid TOML for this struct.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value is out of range or combinations conflict.
    #[error("invalid {flag}: {reason}")]
    Invalid {
        /// The flag (as on the command line).
        flag: &'static str,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { flag, reason: reason.into() }
}

/// Everything `orbitkv-server` can be told. Sizes and durations are human strings.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case", default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Bootstrap Unix socket. Default: `$ORBITKV_SOCKET`, else `/run/orbitkv/orbitkv.sock`
    /// for root, else `/tmp/orbitkv-<uid>/orbitkv.sock`.
    pub socket: Option<PathBuf>,
    /// Shard executors (one pinned core each). Default: 0 = one per CPU minus one (left for
    /// the engines, control and DMA threads), at least 1.
    pub shards: usize,
    /// DRAM arena size, split evenly over shards. Default: `1GiB`.
    pub dram: String,
    /// Lock the arena in memory (best effort; failure is a warning). Default: true.
    pub lock_arena: bool,
    /// Pin each shard to its own core (best effort; failure is a warning). Default: true.
    pub pin: bool,
    /// Uids allowed to open sessions (the server's own uid and root are always allowed).
    /// Default: empty.
    pub allow_uid: Vec<u32>,
    /// Most concurrent sessions. Default: 256.
    pub max_sessions: usize,
    /// Most leases one session may hold. Default: 65536.
    pub max_leases_per_session: u64,
    /// Most uncommitted reservations one session may hold. Default: 16384.
    pub max_reservations_per_session: u64,
    /// Most keys in one request. Default: 4096.
    pub max_keys_per_request: u32,
    /// Largest chunk any namespace may declare. Default: `256MiB`.
    pub max_chunk_size: String,
    /// Most namespaces registered at once. Default: 1024.
    pub max_namespaces: usize,
    /// Requests a session may have in flight (iceoryx2 active requests). Default: 8.
    pub max_inflight_per_session: usize,
    /// Capacity of each shard-to-shard queue. Default: 1024.
    pub mesh_queue_depth: usize,
    /// How long a shard keeps spinning after its last piece of work when cores are spare
    /// (requests arriving within it are seen at once; `0` sleeps right away). Default: `2ms`.
    pub spin_window: String,
    /// Longest nap of a shard idle past its spin window while a task or SSD operation is in
    /// flight (with nothing in flight it sleeps on its doorbell instead). Default: `500us`.
    pub idle_poll_max: String,
    /// How long SIGTERM waits for in-flight work before exiting anyway. Default: `10s`.
    pub drain_timeout: String,
    /// Directory of the SSD tier's per-shard files (must exist). Default: none (DRAM only).
    pub ssd_dir: Option<PathBuf>,
    /// SSD tier capacity over all shards; the files never exceed it. Default: `0` (off).
    pub ssd: String,
    /// SSD region size: the unit of reclaim. Default: `64MiB`.
    pub ssd_region_size: String,
    /// io_uring depth of each shard's SSD ring. Default: 64.
    pub ssd_queue_depth: u32,
    /// Fault injection for tests and drills: every SSD I/O waits this long in the kernel
    /// before it starts (a slow disk). Default: `0` (none).
    pub ssd_inject_latency: String,
    /// Fault injection for tests and drills: every N-th SSD I/O fails. Default: 0 (none).
    pub ssd_inject_errors_every: u64,
    /// Use CUDA: `auto` (when a device exists), `off`, or `required` (refuse to start without
    /// one). Default: `auto`.
    pub gpu: orbitkv_gpu::GpuMode,
    /// GPU staging buffer of each DMA thread on each device (pages are gathered into it
    /// before crossing the bus). Default: `256MiB` (four parts of one 64 MiB job each: enough
    /// to keep the copies going while the gathers wait for SMs behind an engine's kernels;
    /// two threads per device hold 512 MiB of its memory, from their first copy on).
    pub gpu_staging: String,
    /// Equal parts of the GPU staging buffer (2-8), used in turn: a save's gathers may run up
    /// to this many batches less one ahead of its copies (a load's copies ahead of its
    /// scatters). Default: as many parts as the staging holds jobs (`gpu_job`), 2 to 8 (4 with
    /// the defaults, 2 with `--gpu-staging 64MiB`).
    pub gpu_staging_depth: Option<usize>,
    /// Bytes of chunks in one GPU copy job: a save or load is split into jobs of at most this
    /// many bytes (whole chunks, at least one), each committed (or released) as soon as its
    /// copy lands while the DMA thread works on the next. Default: `64MiB`.
    pub gpu_job: String,
    /// GPU copy jobs each shard may have queued for each DMA thread. Default: 64.
    pub gpu_queue_depth: usize,
    /// Engine ranks registered for GPU save/load at once. Default: 256.
    pub max_gpu_registrations: usize,
    /// Where a GPU save's chunk checksums are computed: `fused` (on the GPU: the save's
    /// gather sums the rows as it copies, a fold follows once its gathers are seen done; one
    /// chunk per 32 checked again on its shard), `gpu` (on the GPU by row-sum kernels of
    /// their own beside the copy), `tables` (as `gpu`, always by the table-driven row sums:
    /// to compare), `verify` (as `gpu`, every chunk checked again on its shard: for
    /// testing), or `cpu` (on the shards). Default: `fused`.
    pub gpu_checksums: String,
    /// Percent of GPU save jobs (0-90) whose checksums the shards compute from the arena
    /// instead of the GPU: host cores taking SM time off the engine. Default: 0.
    pub gpu_shard_checksums: u32,
    /// How GPU saves and loads cross the bus: `auto` (staged through the gather/scatter kernel
    /// for pages under 1 MiB, copy engines alone above, except saves whose gather sums their
    /// checksums, `--gpu-checksums fused`, which go staged whatever their pages), `staged` or
    /// `batched` (copy engines only: no SM time, so no time-slicing against an engine
    /// computing in another process, at a lower rate for small pages), or `direct` (an experiment that lost on a PCIe host:
    /// the kernel alone copies through the arena's device mapping, SMs busy for the whole
    /// copy). Default: `auto`.
    pub gpu_copy: String,
    /// A diagnostic: timing events around every staged batch of GPU saves and loads, summed
    /// in `stats` (`gpu_transfers.timeline.save` and `.load`): the copies' own rate, the
    /// copy streams' idle gaps and the kernels' time. Default: false.
    pub gpu_timeline: bool,
    /// What lets a GPU staging part take its next batch: `host` (the DMA thread has seen
    /// the part's last copy (save) or scatter (load) finish) or `gpu` (a stream waits for it
    /// on the GPU, the DMA thread planning ahead). Default: `host`.
    pub gpu_staging_gate: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            socket: None,
            shards: 0,
            dram: "1GiB".into(),
            lock_arena: true,
            pin: true,
            allow_uid: Vec::new(),
            max_sessions: 256,
            max_leases_per_session: 65536,
            max_reservations_per_session: 16384,
            max_keys_per_request: 4096,
            max_chunk_size: "256MiB".into(),
            max_namespaces: 1024,
            max_inflight_per_session: 8,
            mesh_queue_depth: 1024,
            spin_window: "2ms".into(),
            idle_poll_max: "500us".into(),
            drain_timeout: "10s".into(),
            ssd_dir: None,
            ssd: "0".into(),
            ssd_region_size: "64MiB".into(),
            ssd_queue_depth: 64,
            ssd_inject_latency: "0".into(),
            ssd_inject_errors_every: 0,
            gpu: orbitkv_gpu::GpuMode::Auto,
            gpu_staging: "256MiB".into(),
            gpu_staging_depth: None,
            gpu_job: format!("{}MiB", orbitkv_gpu::dma::JOB_BYTES >> 20),
            gpu_queue_depth: 64,
            gpu_checksums: "fused".into(),
            gpu_shard_checksums: 0,
            gpu_copy: "auto".into(),
            gpu_timeline: false,
            gpu_staging_gate: "host".into(),
            max_gpu_registrations: 256,
        }
    }
}

/// `orbitkv-server`: the per-host OrbitKV Manager.
#[derive(Parser, Debug, Default)]
#[command(name = "orbitkv-server", version, about)]
pub struct Args {
    /// TOML config file; flags override its values.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Bootstrap Unix socket (default: $ORBITKV_SOCKET, /run/orbitkv/orbitkv.sock for root,
    /// else /tmp/orbitkv-<uid>/orbitkv.sock).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Shard executors, one pinned core each (default: cores minus one, at least 1).
    #[arg(long, value_name = "N")]
    pub shards: Option<usize>,
    /// DRAM arena size (default: 1GiB).
    #[arg(long, value_name = "SIZE")]
    pub dram: Option<String>,
    /// Do not lock the arena in memory.
    #[arg(long)]
    pub no_lock_arena: bool,
    /// Do not pin shards to cores.
    #[arg(long)]
    pub no_pin: bool,
    /// Additional uid allowed to connect (repeatable; own uid and root always are).
    #[arg(long, value_name = "UID")]
    pub allow_uid: Vec<u32>,
    /// Most concurrent sessions (default: 256).
    #[arg(long, value_name = "N")]
    pub max_sessions: Option<usize>,
    /// Most leases per session (default: 65536).
    #[arg(long, value_name = "N")]
    pub max_leases_per_session: Option<u64>,
    /// Most uncommitted reservations per session (default: 16384).
    #[arg(long, value_name = "N")]
    pub max_reservations_per_session: Option<u64>,
    /// Most keys per request (default: 4096).
    #[arg(long, value_name = "N")]
    pub max_keys_per_request: Option<u32>,
    /// Largest chunk a namespace may declare (default: 256MiB).
    #[arg(long, value_name = "SIZE")]
    pub max_chunk_size: Option<String>,
    /// Most namespaces (default: 1024).
    #[arg(long, value_name = "N")]
    pub max_namespaces: Option<usize>,
    /// Requests in flight per session (default: 8).
    #[arg(long, value_name = "N")]
    pub max_inflight_per_session: Option<usize>,
    /// Shard-to-shard queue capacity (default: 1024).
    #[arg(long, value_name = "N")]
    pub mesh_queue_depth: Option<usize>,
    /// Spin this long after the last work before napping, when cores are spare (default: 2ms).
    #[arg(long, value_name = "DUR")]
    pub spin_window: Option<String>,
    /// Longest nap of an idle shard with work in flight (default: 500us; with nothing in
    /// flight it sleeps on its doorbell, woken by the next request).
    #[arg(long, value_name = "DUR")]
    pub idle_poll_max: Option<String>,
    /// SIGTERM drain timeout (default: 10s).
    #[arg(long, value_name = "DUR")]
    pub drain_timeout: Option<String>,
    /// Directory of the SSD tier's per-shard files (must exist; default: none, DRAM only).
    #[arg(long, value_name = "DIR")]
    pub ssd_dir: Option<PathBuf>,
    /// SSD tier capacity over all shards (hard cap; default: 0, off).
    #[arg(long, value_name = "SIZE")]
    pub ssd: Option<String>,
    /// SSD region size, the unit of reclaim (default: 64MiB).
    #[arg(long, value_name = "SIZE")]
    pub ssd_region_size: Option<String>,
    /// io_uring depth of each shard's SSD ring (default: 64).
    #[arg(long, value_name = "N")]
    pub ssd_queue_depth: Option<u32>,
    /// Fault injection: delay every SSD I/O by DUR, as a slow disk would (default: 0).
    #[arg(long, value_name = "DUR")]
    pub ssd_inject_latency: Option<String>,
    /// Fault injection: fail every N-th SSD I/O (default: 0, none).
    #[arg(long, value_name = "N")]
    pub ssd_inject_errors_every: Option<u64>,
    /// Use CUDA: auto (when a device exists), off, or required (default: auto).
    #[arg(long, value_name = "MODE", value_parser = parse_gpu_mode)]
    pub gpu: Option<orbitkv_gpu::GpuMode>,
    /// GPU staging per DMA thread and device (default: 256MiB).
    #[arg(long, value_name = "SIZE")]
    pub gpu_staging: Option<String>,
    /// Parts of the GPU staging buffer, 2-8: batches a save's gathers may run ahead of its
    /// copies, plus one (default: as many as the staging holds jobs, 2 to 8).
    #[arg(long, value_name = "N")]
    pub gpu_staging_depth: Option<usize>,
    /// Bytes of chunks per GPU copy job; saves and loads are split into such jobs (default:
    /// 64MiB).
    #[arg(long, value_name = "SIZE")]
    pub gpu_job: Option<String>,
    /// GPU copy jobs a shard may queue per DMA thread (default: 64).
    #[arg(long, value_name = "N")]
    pub gpu_queue_depth: Option<usize>,
    /// Engine ranks registered for GPU save/load at once (default: 256).
    #[arg(long, value_name = "N")]
    pub max_gpu_registrations: Option<usize>,
    /// Where GPU saves' chunk checksums are computed: fused (on the GPU, the rows summed by
    /// the save's own gather), gpu (on the GPU, by row-sum kernels of their own), tables (gpu,
    /// by the table-driven row sums: to compare), verify (gpu, all rechecked on the shards),
    /// or cpu (default: fused).
    #[arg(long, value_name = "WHERE")]
    pub gpu_checksums: Option<String>,
    /// Percent of GPU save jobs whose checksums the shards compute instead of the GPU, 0-90
    /// (default: 0).
    #[arg(long, value_name = "PERCENT")]
    pub gpu_shard_checksums: Option<u32>,
    /// How GPU copies cross the bus: auto, staged (gather/scatter kernel), batched (copy
    /// engines only, no SM time) or direct (an experiment that lost on a PCIe host: the
    /// kernel alone, through the arena's device mapping) (default: auto).
    #[arg(long, value_name = "HOW")]
    pub gpu_copy: Option<String>,
    /// A diagnostic: time every staged batch of GPU saves and loads on the GPU and sum it in
    /// `stats` (the copies' own rate, the copy streams' idle gaps, the kernels' time).
    #[arg(long)]
    pub gpu_timeline: bool,
    /// What lets a GPU staging part take its next batch: host (the DMA thread has seen its
    /// last copy (save) or scatter (load) finish) or gpu (a stream waits for it on the GPU)
    /// (default: host).
    #[arg(long, value_name = "WHO")]
    pub gpu_staging_gate: Option<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
}

fn parse_gpu_mode(s: &str) -> Result<orbitkv_gpu::GpuMode, String> {
    orbitkv_gpu::GpuMode::parse(s).ok_or_else(|| format!("{s:?} is not auto, off or required"))
}

/// A validated configuration with parsed sizes and durations.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The source configuration (as printed by `--print-config`).
    pub config: ServerConfig,
    /// Bootstrap socket path.
    pub socket: PathBuf,
    /// Shard count.
    pub shards: usize,
    /// Arena bytes (multiple of 4 KiB * shards).
    pub dram_bytes: u64,
    /// Largest chunk.
    pub max_chunk_bytes: u64,
    /// Spin window after work.
    pub spin_window: Duration,
    /// Idle poll ceiling.
    pub idle_poll_max: Duration,
    /// SIGTERM drain timeout.
    pub drain_timeout: Duration,
    /// The SSD tier, when configured.
    pub ssd: Option<SsdSettings>,
    /// GPU staging bytes per DMA thread and device.
    pub gpu_staging_bytes: u64,
    /// Bytes of chunks per GPU copy job.
    pub gpu_job_bytes: u64,
    /// Parts of the GPU staging (as given, or derived from the staging and job sizes).
    pub gpu_staging_depth: usize,
    /// Where GPU saves' checksums are computed.
    pub gpu_checksums: crate::gpu::ChecksumPlace,
    /// How GPU copies cross the bus.
    pub gpu_copy: orbitkv_gpu::dma::Strategy,
    /// Whether a staging part is reused once the DMA thread has seen it free
    /// (`--gpu-staging-gate host`) rather than behind a stream wait on the GPU.
    pub gpu_staging_gate_host: bool,
}

/// Validated SSD tier settings.
#[derive(Clone, Debug)]
pub struct SsdSettings {
    /// Directory of the per-shard files.
    pub dir: PathBuf,
    /// Capacity of each shard's file.
    pub per_shard_bytes: u64,
    /// Region size.
    pub region_bytes: u64,
    /// Ring depth.
    pub queue_depth: u32,
    /// Injected latency per I/O.
    pub inject_latency: Duration,
    /// Every n-th I/O fails (0: none).
    pub inject_errors_every: u64,
}

impl ServerConfig {
    fn validate_ssd(&self, shards: usize) -> Result<Option<SsdSettings>, ConfigError> {
        let total = parse_size(&self.ssd).map_err(|e| invalid("--ssd", e.to_string()))?;
        let Some(dir) = &self.ssd_dir else {
            if total > 0 {
                return Err(invalid("--ssd", "needs --ssd-dir"));
            }
            return Ok(None);
        };
        if total == 0 {
            return Err(invalid("--ssd-dir", "needs --ssd SIZE (the tier's capacity)"));
        }
        if !dir.is_dir() {
            return Err(invalid(
                "--ssd-dir",
                format!("{} is not an existing directory", dir.display()),
            ));
        }
        let region_bytes = parse_size(&self.ssd_region_size)
            .map_err(|e| invalid("--ssd-region-size", e.to_string()))?;
        if region_bytes < 64 << 10 || !region_bytes.is_multiple_of(orbitkv_shards::PAGE_SIZE) {
            return Err(invalid(
                "--ssd-region-size",
                "must be a multiple of 4 KiB, at least 64 KiB",
            ));
        }
        let per_shard_bytes = total / shards as u64;
        if per_shard_bytes < 2 * region_bytes + orbitkv_shards::PAGE_SIZE {
            return Err(invalid(
                "--ssd",
                format!(
                    "{total} bytes give each of {shards} shards less than two regions of \
                     --ssd-region-size {region_bytes} bytes"
                ),
            ));
        }
        if self.ssd_queue_depth == 0 || self.ssd_queue_depth > 4096 {
            return Err(invalid("--ssd-queue-depth", "must be between 1 and 4096"));
        }
        let inject_latency = parse_duration(&self.ssd_inject_latency)
            .map_err(|e| invalid("--ssd-inject-latency", e.to_string()))?;
        Ok(Some(SsdSettings {
            dir: dir.clone(),
            per_shard_bytes,
            region_bytes,
            queue_depth: self.ssd_queue_depth,
            inject_latency,
            inject_errors_every: self.ssd_inject_errors_every,
        }))
    }

    /// Loads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        toml::from_str(&text)
            .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })
    }

    /// Applies command-line overrides.
    pub fn apply_args(&mut self, a: &Args) {
        if let Some(v) = &a.socket {
            self.socket = Some(v.clone());
        }
        if let Some(v) = &a.ssd_dir {
            self.ssd_dir = Some(v.clone());
        }
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = &a.$f { self.$f = v.clone(); } )* };
        }
        set!(
            shards,
            dram,
            max_sessions,
            max_leases_per_session,
            max_reservations_per_session,
            max_keys_per_request,
            max_chunk_size,
            max_namespaces,
            max_inflight_per_session,
            mesh_queue_depth,
            spin_window,
            idle_poll_max,
            drain_timeout,
            ssd,
            ssd_region_size,
            ssd_queue_depth,
            ssd_inject_latency,
            ssd_inject_errors_every,
            gpu,
            gpu_staging,
            gpu_job,
            gpu_queue_depth,
            max_gpu_registrations,
            gpu_checksums,
            gpu_shard_checksums,
            gpu_copy,
            gpu_staging_gate
        );
        if let Some(d) = a.gpu_staging_depth {
            self.gpu_staging_depth = Some(d);
        }
        if a.no_lock_arena {
            self.lock_arena = false;
        }
        if a.gpu_timeline {
            self.gpu_timeline = true;
        }
        if a.no_pin {
            self.pin = false;
        }
        self.allow_uid.extend(a.allow_uid.iter().copied());
    }

    /// Checks every value; the error names the flag.
    pub fn validate(&self) -> Result<Settings, ConfigError> {
        let socket = self
            .socket
            .clone()
            .unwrap_or_else(|| default_socket_path(nix::unistd::getuid().as_raw()));
        if socket.as_os_str().len() > 100 {
            return Err(invalid(
                "--socket",
                format!(
                    "{} is longer than a Unix socket path may be (100 bytes)",
                    socket.display()
                ),
            ));
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        // One CPU is left to the engines (and the control and DMA threads): with it, shards
        // poll briefly after work and answer in microseconds; with none spare they must sleep
        // on their doorbells and every request pays a wake-up (docs/performance.md).
        let shards = if self.shards == 0 { cpus.saturating_sub(1).max(1) } else { self.shards };
        if shards > 256 {
            return Err(invalid("--shards", format!("{shards} is more than 256")));
        }
        let dram = parse_size(&self.dram).map_err(|e| invalid("--dram", e.to_string()))?;
        let page = orbitkv_shards::PAGE_SIZE;
        let per_shard = dram / shards as u64 / page * page;
        if per_shard < 16 * page {
            return Err(invalid(
                "--dram",
                format!("{dram} bytes gives each of {shards} shards less than 64 KiB"),
            ));
        }
        let max_chunk = parse_size(&self.max_chunk_size)
            .map_err(|e| invalid("--max-chunk-size", e.to_string()))?;
        if max_chunk == 0 {
            return Err(invalid("--max-chunk-size", "must be positive"));
        }
        for (flag, v) in [
            ("--max-sessions", self.max_sessions as u64),
            ("--max-leases-per-session", self.max_leases_per_session),
            ("--max-reservations-per-session", self.max_reservations_per_session),
            ("--max-keys-per-request", self.max_keys_per_request as u64),
            ("--max-namespaces", self.max_namespaces as u64),
            ("--max-inflight-per-session", self.max_inflight_per_session as u64),
            ("--mesh-queue-depth", self.mesh_queue_depth as u64),
        ] {
            if v == 0 {
                return Err(invalid(flag, "must be at least 1"));
            }
        }
        if self.max_keys_per_request > 65536 {
            return Err(invalid("--max-keys-per-request", "must be at most 65536"));
        }
        if self.max_inflight_per_session > 64 {
            return Err(invalid("--max-inflight-per-session", "must be at most 64"));
        }
        let idle_poll_max = parse_duration(&self.idle_poll_max)
            .map_err(|e| invalid("--idle-poll-max", e.to_string()))?;
        if idle_poll_max > Duration::from_millis(100) {
            return Err(invalid("--idle-poll-max", "must be at most 100ms"));
        }
        let spin_window = parse_duration(&self.spin_window)
            .map_err(|e| invalid("--spin-window", e.to_string()))?;
        if spin_window > Duration::from_millis(100) {
            return Err(invalid("--spin-window", "must be at most 100ms"));
        }
        let drain_timeout = parse_duration(&self.drain_timeout)
            .map_err(|e| invalid("--drain-timeout", e.to_string()))?;
        let ssd = self.validate_ssd(shards)?;
        let gpu_staging_bytes =
            parse_size(&self.gpu_staging).map_err(|e| invalid("--gpu-staging", e.to_string()))?;
        if !(1 << 20..=4 << 30).contains(&gpu_staging_bytes) {
            return Err(invalid("--gpu-staging", "must be between 1MiB and 4GiB"));
        }
        let gpu_job_bytes =
            parse_size(&self.gpu_job).map_err(|e| invalid("--gpu-job", e.to_string()))?;
        if !(1 << 20..=4 << 30).contains(&gpu_job_bytes) {
            return Err(invalid("--gpu-job", "must be between 1MiB and 4GiB"));
        }
        let depths = orbitkv_gpu::dma::CopyEngine::DEPTHS;
        let gpu_staging_depth = match self.gpu_staging_depth {
            Some(d) if !depths.contains(&d) => {
                return Err(invalid(
                    "--gpu-staging-depth",
                    format!("must be between {} and {}", depths.start(), depths.end()),
                ))
            }
            Some(d) => d,
            None => orbitkv_gpu::dma::CopyEngine::default_depth(gpu_staging_bytes, gpu_job_bytes),
        };
        let gpu_checksums =
            crate::gpu::ChecksumPlace::parse(&self.gpu_checksums).ok_or_else(|| {
                invalid(
                    "--gpu-checksums",
                    format!(
                        "{:?} is not one of fused, gpu, tables, verify, cpu",
                        self.gpu_checksums
                    ),
                )
            })?;
        if self.gpu_shard_checksums > 90 {
            return Err(invalid("--gpu-shard-checksums", "must be a percent from 0 to 90"));
        }
        let gpu_copy = orbitkv_gpu::dma::Strategy::parse(&self.gpu_copy).ok_or_else(|| {
            invalid(
                "--gpu-copy",
                format!("{:?} is not one of auto, staged, batched, direct", self.gpu_copy),
            )
        })?;
        let gpu_staging_gate_host = match self.gpu_staging_gate.as_str() {
            "host" => true,
            "gpu" => false,
            other => {
                return Err(invalid(
                    "--gpu-staging-gate",
                    format!("{other:?} is not one of host, gpu"),
                ))
            }
        };
        for (flag, v, max) in [
            ("--gpu-queue-depth", self.gpu_queue_depth, 4096),
            ("--max-gpu-registrations", self.max_gpu_registrations, 65536),
        ] {
            if v == 0 || v > max {
                return Err(invalid(flag, format!("must be between 1 and {max}")));
            }
        }
        Ok(Settings {
            ssd,
            config: self.clone(),
            socket,
            shards,
            dram_bytes: per_shard * shards as u64,
            max_chunk_bytes: max_chunk,
            spin_window,
            idle_poll_max,
            drain_timeout,
            gpu_staging_bytes,
            gpu_job_bytes,
            gpu_staging_depth,
            gpu_checksums,
            gpu_copy,
            gpu_staging_gate_host,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        let s = ServerConfig::default().validate().unwrap();
        assert!(s.shards >= 1);
        assert_eq!(s.max_chunk_bytes, 256 << 20);
    }

    #[test]
    fn errors_name_the_flag() {
        let bad = |c: ServerConfig| c.validate().unwrap_err().to_string();
        assert!(bad(ServerConfig { dram: "lots".into(), ..Default::default() }).contains("--dram"));
        assert!(bad(ServerConfig { dram: "4KiB".into(), ..Default::default() }).contains("--dram"));
        assert!(
            bad(ServerConfig { max_sessions: 0, ..Default::default() }).contains("--max-sessions")
        );
        assert!(bad(ServerConfig { idle_poll_max: "1s".into(), ..Default::default() })
            .contains("--idle-poll-max"));
        assert!(bad(ServerConfig { spin_window: "1s".into(), ..Default::default() })
            .contains("--spin-window"));
        assert!(bad(ServerConfig { gpu_staging: "4KiB".into(), ..Default::default() })
            .contains("--gpu-staging"));
        for depth in [0, 1, 9] {
            let e = bad(ServerConfig { gpu_staging_depth: Some(depth), ..Default::default() });
            assert!(e.contains("--gpu-staging-depth") && e.contains("between 2 and 8"), "{e}");
        }
        let depth = |staging: &str, depth: Option<usize>| {
            let c = ServerConfig {
                gpu_staging: staging.into(),
                gpu_staging_depth: depth,
                ..Default::default()
            };
            c.validate().unwrap().gpu_staging_depth
        };
        assert_eq!(depth("64MiB", Some(8)), 8);
        // Unset: as many parts as the staging holds 64 MiB jobs, 2 to 8.
        assert_eq!(depth("64MiB", None), 2);
        assert_eq!(depth("16MiB", None), 2);
        assert_eq!(depth("256MiB", None), 4);
        assert_eq!(depth("200MiB", None), 3);
        assert_eq!(depth("4GiB", None), 8);
        // The defaults: 256 MiB in four parts of one job each.
        let d = ServerConfig::default().validate().unwrap();
        assert_eq!((d.gpu_staging_bytes, d.gpu_staging_depth), (256 << 20, 4));
        assert_eq!(depth("256MiB", Some(2)), 2);
        for job in ["4KiB", "8GiB", "lots"] {
            let e = bad(ServerConfig { gpu_job: job.into(), ..Default::default() });
            assert!(e.contains("--gpu-job"), "{job}: {e}");
        }
        assert!(bad(ServerConfig { gpu_checksums: "gpu2".into(), ..Default::default() })
            .contains("--gpu-checksums"));
        assert!(bad(ServerConfig { gpu_shard_checksums: 91, ..Default::default() })
            .contains("--gpu-shard-checksums"));
        assert!(bad(ServerConfig { gpu_checksums: "rows".into(), ..Default::default() })
            .contains("--gpu-checksums"));
        let e = bad(ServerConfig { gpu_staging_gate: "cpu".into(), ..Default::default() });
        assert!(e.contains("--gpu-staging-gate") && e.contains("\"cpu\""), "{e}");
        assert!(bad(ServerConfig { gpu_copy: "fast".into(), ..Default::default() })
            .contains("--gpu-copy"));
        assert!(bad(ServerConfig { gpu_queue_depth: 0, ..Default::default() })
            .contains("--gpu-queue-depth"));
        assert!(bad(ServerConfig { max_gpu_registrations: 0, ..Default::default() })
            .contains("--max-gpu-registrations"));
        assert!(bad(ServerConfig { spin_window: "fast".into(), ..Default::default() })
            .contains("--spin-window"));
        assert!(bad(ServerConfig { shards: 1000, ..Default::default() }).contains("--shards"));
    }

    #[test]
    fn toml_round_trip_and_flag_override() {
        let text = "dram = \"64MiB\"\nshards = 2\nallow-uid = [1000]\n";
        let mut c: ServerConfig = toml::from_str(text).unwrap();
        assert_eq!(c.dram, "64MiB");
        let args = Args { dram: Some("128MiB".into()), allow_uid: vec![7], ..Default::default() };
        c.apply_args(&args);
        assert_eq!(c.dram, "128MiB");
        assert_eq!(c.allow_uid, vec![1000, 7]);
        assert_eq!(c.shards, 2);
        assert!(toml::from_str::<ServerConfig>("bogus = 1").is_err());
        // The timeline diagnostic: off by default, on from the file or the flag.
        assert!(!c.gpu_timeline);
        assert!(toml::from_str::<ServerConfig>("gpu-timeline = true").unwrap().gpu_timeline);
        c.apply_args(&Args { gpu_timeline: true, ..Default::default() });
        assert!(c.gpu_timeline);
        // The staging gate: the host's by default, the GPU's from the file or the flag.
        assert!(c.validate().unwrap().gpu_staging_gate_host);
        let f: ServerConfig = toml::from_str("gpu-staging-gate = \"gpu\"").unwrap();
        assert!(!f.validate().unwrap().gpu_staging_gate_host);
        c.apply_args(&Args { gpu_staging_gate: Some("gpu".into()), ..Default::default() });
        assert!(!c.validate().unwrap().gpu_staging_gate_host);
        // The staging depth: unset unless given, from the file or the flag.
        assert_eq!(c.gpu_staging_depth, None);
        let f: ServerConfig = toml::from_str("gpu-staging-depth = 3").unwrap();
        assert_eq!(f.gpu_staging_depth, Some(3));
        c.apply_args(&Args { gpu_staging_depth: Some(4), ..Default::default() });
        assert_eq!(c.gpu_staging_depth, Some(4));
    }

    #[test]
    fn the_shipped_config_file_parses_and_states_the_gpu_defaults() {
        let c: ServerConfig = toml::from_str(include_str!("../../deploy/orbitkv.toml"))
            .expect("deploy/orbitkv.toml: a key the server no longer knows?");
        c.validate().expect("deploy/orbitkv.toml validates");
        let d = ServerConfig::default();
        assert_eq!(c.gpu_staging, d.gpu_staging);
        assert_eq!(c.gpu_staging_depth, d.gpu_staging_depth);
        assert_eq!(c.gpu_job, d.gpu_job);
        assert_eq!(c.gpu_queue_depth, d.gpu_queue_depth);
        assert_eq!(c.gpu_checksums, d.gpu_checksums);
        assert_eq!(c.gpu_shard_checksums, d.gpu_shard_checksums);
        assert_eq!(c.gpu_copy, d.gpu_copy);
        assert_eq!(c.gpu_timeline, d.gpu_timeline);
        assert_eq!(c.gpu_staging_gate, d.gpu_staging_gate);
    }
}
