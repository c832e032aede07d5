//! Server configuration: every option defined once, in [`ServerConfig`], which is both the
//! command line (clap) and the TOML file (serde, kebab-case keys). Flags override the file;
//! [`ServerConfig::validate`] checks ranges and combinations and names the flag at fault.

mod cluster;
mod modes;
mod values;

use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches, Parser};
use orbitkv_proto::default_socket_path;
use orbitkv_shards::NamespaceQuota;
use serde::{Deserialize, Serialize};

pub use cluster::ClusterConfig;
pub use modes::{default_staging_depth, GpuMode, Strategy, TeTransport, JOB_BYTES, STAGING_DEPTHS};
pub use values::{ByteSize, ModelQuota, Span};

/// Where a GPU save's chunk checksums are computed (`--gpu-checksums`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum ChecksumPlace {
    /// On the GPU beside the copy; a job's first chunk checked again on its shard, one
    /// chunk per 32 (`transfer::SpotChecks`). A block-form save's rows are summed by a warp
    /// per unit of the block gather's walk, with no tables, where the layout allows (parts a
    /// multiple of 1 KiB), by the table-driven kernel otherwise.
    Gpu,
    /// As `Gpu`; every chunk checked again on its shard.
    Verify,
    /// On the shards, from the bytes in the arena.
    Cpu,
    /// As `Gpu`, the rows summed by the save's gather itself where the layout allows (parts
    /// a multiple of 1 KiB), each job's fold queued once the DMA thread sees its gathers
    /// done (the default).
    Fused,
}

impl ChecksumPlace {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Verify => "verify",
            Self::Cpu => "cpu",
            Self::Fused => "fused",
        }
    }
}

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

/// Everything an operator can tell `orbitkv-server`, as flags (`--max-sessions 64`) and as
/// keys of the TOML file (`max-sessions = 64`). Each doc comment ends with the default, which
/// `--help` also prints; `--print-config` prints the effective values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(rename_all = "kebab-case", default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Bootstrap Unix socket. Default: $ORBITKV_SOCKET, else /run/orbitkv/orbitkv.sock for
    /// root, else /tmp/orbitkv-<uid>/orbitkv.sock.
    #[arg(long, value_name = "PATH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// Metrics listener (TCP address): Prometheus text at /metrics, liveness at /healthz,
    /// readiness at /readyz. Default: none (off).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Cluster mode: etcd endpoints, comma-separated (`http://10.0.0.5:2379,...`). Without
    /// it the server is standalone. Default: none.
    #[arg(long, value_name = "URLS", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub etcd: Vec<String>,
    /// Cluster mode: the cluster's name (letters, digits, `.`, `_`, `-`; at most 64).
    /// Default: orbitkv.
    #[arg(long, value_name = "NAME", default_value = "orbitkv", hide_default_value = true)]
    pub cluster: String,
    /// Cluster mode: this node's id, unique in the cluster (letters, digits, `.`, `_`, `-`; at
    /// most 64). Default: the host name.
    #[arg(long, value_name = "ID")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// Cluster mode: the address peers reach this node at (required with --etcd).
    /// Default: none.
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<std::net::SocketAddr>,
    /// Cluster mode: the TTL of this node's member key in etcd: a node that stops leaves the
    /// membership at most this long after (1s-300s). Default: 10s.
    #[arg(long, value_name = "DUR", default_value = "10s", hide_default_value = true)]
    pub cluster_lease_ttl: Span,
    /// Cluster mode: catalog entries kept per peer (each an estimated 150 bytes here); a peer
    /// holding more is covered partially. Default: 262144.
    #[arg(long, value_name = "N", default_value_t = 262_144, hide_default_value = true)]
    pub peer_catalog_entries: usize,
    /// Cluster mode: grants (chunks pinned here for a peer's read) one peer may hold at once;
    /// more are refused until it releases some. Default: 4096.
    #[arg(long, value_name = "N", default_value_t = 4096, hide_default_value = true)]
    pub peer_max_grants: usize,
    /// Cluster mode: how long the peer thread keeps polling after a grant it served or a read
    /// it did, when it has two cores or more (its own and TE's); 0 parks at once; at most
    /// 100ms. Default: 20ms.
    #[arg(long, value_name = "DUR", default_value = "20ms", hide_default_value = true)]
    pub peer_spin_window: Span,
    /// Cluster mode: the shared library of a Mooncake Transfer Engine build that exports TE's
    /// C API (`libtransfer_engine.so`; a path, or a name the loader searches for), used to
    /// move peer bytes. Default: none (builds with `te-python` use the wheel's engine; others
    /// join the cluster without peer reads).
    #[arg(long, value_name = "PATH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub te_library: Option<PathBuf>,
    /// Cluster mode with `--te-library`: the engine's transports: auto (TE's choice from the
    /// host's devices: RDMA over the RDMA devices it finds, TCP on a host without any) or tcp.
    /// Default: auto.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = TeTransport::Auto,
          hide_default_value = true, hide_possible_values = true)]
    pub te_transport: TeTransport,
    /// Shard executors, one pinned core each; 0 = one per CPU minus one (left for the
    /// engines, control and DMA threads), at least 1. Default: 0.
    #[arg(long, value_name = "N", default_value_t = 0, hide_default_value = true)]
    pub shards: usize,
    /// DRAM arena size, split evenly over the shards. Default: 1GiB.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", hide_default_value = true)]
    pub dram: ByteSize,
    /// Lock the arena in memory (best effort: a refusal is a warning); the flag
    /// `--no-lock-arena` turns it off. Default: true.
    #[arg(long = "no-lock-arena", action = ArgAction::SetFalse)]
    pub lock_arena: bool,
    /// Hugetlb pages for the arena: auto (when enough are reserved, 1GiB ones first, else
    /// 4KiB pages, said at info), on (as auto, a warning when too few are reserved), or off
    /// (4KiB pages, with transparent huge pages where the host's shmem setting allows).
    /// Default: auto.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = HugePages::Auto,
          hide_default_value = true, hide_possible_values = true)]
    pub hugepages: HugePages,
    /// How many memfds the arena is made of: per-shard (each shard's slice its own file,
    /// mapped one after another as one range, so that the shards' page faults at start do not
    /// contend on one file's locks; one with more than 128 shards), or one (every shard's
    /// slice in one file). Default: per-shard.
    #[arg(long, value_name = "LAYOUT", value_enum, default_value_t = ArenaMemfds::PerShard,
          hide_default_value = true, hide_possible_values = true)]
    pub arena_memfds: ArenaMemfds,
    /// Pin each shard to its own core, the last of the allowed CPUs (engines pin from the
    /// first; best effort: a refusal is a warning); the flag `--no-pin` turns it off.
    /// Default: true.
    #[arg(long = "no-pin", action = ArgAction::SetFalse)]
    pub pin: bool,
    /// Uids allowed to open sessions besides the server's own and root (the flag repeats;
    /// flags add to the file's list). Default: none.
    #[arg(long, value_name = "UID")]
    pub allow_uid: Vec<u32>,
    /// Gids whose processes (their effective group, as the kernel reports the peer) may open
    /// sessions (the flag repeats; flags add to the file's list). Default: none.
    #[arg(long, value_name = "GID")]
    pub allow_gid: Vec<u32>,
    /// Uids allowed the admin commands that change state (drain, resume, evict) besides the
    /// server's own and root; everyone allowed a session may read health, stats, sessions and
    /// peers (the flag repeats; flags add to the file's list). Default: none.
    #[arg(long, value_name = "UID")]
    pub admin_uid: Vec<u32>,
    /// Models whose namespaces every allowed uid may register and use (shared between
    /// tenants); any other namespace belongs to the first uid that registers it in this run,
    /// and another uid's registration is refused (the flag repeats; flags add to the file's
    /// list). Default: none.
    #[arg(long, value_name = "MODEL")]
    pub shared_model: Vec<String>,
    /// Group of the bootstrap and admin sockets (a name or a gid); both are mode 0660, so
    /// only the server's uid, root and this group's members can connect at all. Default: the
    /// server's group.
    #[arg(long, value_name = "GROUP")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_group: Option<String>,
    /// Most concurrent sessions. Default: 256.
    #[arg(long, value_name = "N", default_value_t = 256, hide_default_value = true)]
    pub max_sessions: usize,
    /// Most leases one session may hold. Default: 65536.
    #[arg(long, value_name = "N", default_value_t = 65536, hide_default_value = true)]
    pub max_leases_per_session: u64,
    /// Most uncommitted reservations one session may hold. Default: 16384.
    #[arg(long, value_name = "N", default_value_t = 16384, hide_default_value = true)]
    pub max_reservations_per_session: u64,
    /// Most keys in one request (at most 65536). Default: 4096.
    #[arg(long, value_name = "N", default_value_t = 4096, hide_default_value = true)]
    pub max_keys_per_request: u32,
    /// Largest chunk any namespace may declare. Default: 256MiB.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", hide_default_value = true)]
    pub max_chunk_size: ByteSize,
    /// Most DRAM one namespace may hold (its share on each shard; 0: no limit). A write past
    /// it evicts the namespace's own chunks first and is refused with `QuotaExceeded` when
    /// they cannot make room. Default: 0.
    #[arg(long, value_name = "SIZE", default_value = "0", hide_default_value = true)]
    pub namespace_dram_limit: ByteSize,
    /// DRAM of each namespace that eviction for room leaves alone (its share on each shard;
    /// 0: none): other namespaces' writes cannot push one below it. Default: 0.
    #[arg(long, value_name = "SIZE", default_value = "0", hide_default_value = true)]
    pub namespace_dram_guarantee: ByteSize,
    /// Most SSD one namespace's records may take (its share on each shard; 0: no limit): a
    /// namespace at it has its DRAM victims dropped instead of written to SSD. Default: 0.
    #[arg(long, value_name = "SIZE", default_value = "0", hide_default_value = true)]
    pub namespace_ssd_limit: ByteSize,
    /// SSD of each namespace that region reclaim keeps (its share on each shard; 0: none;
    /// at most half of --ssd): records of a namespace below it are rewritten at the log's
    /// head instead of dropped with their region. Default: 0.
    #[arg(long, value_name = "SIZE", default_value = "0", hide_default_value = true)]
    pub namespace_ssd_guarantee: ByteSize,
    /// Quota of one model's namespaces, replacing the --namespace-* values it names:
    /// MODEL:KEY=SIZE[,KEY=SIZE...], keys dram-limit, dram-guarantee, ssd-limit,
    /// ssd-guarantee (the flag repeats; flags add to the file's list). Default: none.
    #[arg(long, value_name = "MODEL:KEY=SIZE,...")]
    pub model_quota: Vec<ModelQuota>,
    /// Most namespaces registered at once. Default: 1024.
    #[arg(long, value_name = "N", default_value_t = 1024, hide_default_value = true)]
    pub max_namespaces: usize,
    /// Requests a session may have in flight (at most 64). Default: 8.
    #[arg(long, value_name = "N", default_value_t = 8, hide_default_value = true)]
    pub max_inflight_per_session: usize,
    /// Capacity of each shard-to-shard queue. Default: 1024.
    #[arg(long, value_name = "N", default_value_t = 1024, hide_default_value = true)]
    pub mesh_queue_depth: usize,
    /// How long a shard keeps spinning after its last piece of work when cores are spare
    /// (requests arriving within it are seen at once; 0 sleeps right away; at most 100ms).
    /// Default: 2ms.
    #[arg(long, value_name = "DUR", default_value = "2ms", hide_default_value = true)]
    pub spin_window: Span,
    /// Longest nap of a shard idle past its spin window while a task or SSD operation is in
    /// flight (with nothing in flight it sleeps on its doorbell instead; at most 100ms).
    /// Default: 500us.
    #[arg(long, value_name = "DUR", default_value = "500us", hide_default_value = true)]
    pub idle_poll_max: Span,
    /// How long SIGTERM waits for in-flight work before exiting anyway. Default: 10s.
    #[arg(long, value_name = "DUR", default_value = "10s", hide_default_value = true)]
    pub drain_timeout: Span,
    /// Directory of the SSD tier's per-shard files (must exist). Default: none (DRAM only).
    #[arg(long, value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd_dir: Option<PathBuf>,
    /// SSD tier capacity over all shards; the files never exceed it (0: no SSD tier).
    /// Default: 0.
    #[arg(long, value_name = "SIZE", default_value = "0", hide_default_value = true)]
    pub ssd: ByteSize,
    /// SSD region size: the unit of reclaim (a multiple of 4KiB, at least 64KiB). Default:
    /// 64MiB.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", hide_default_value = true)]
    pub ssd_region_size: ByteSize,
    /// io_uring depth of each shard's SSD ring (1-4096). Default: 64.
    #[arg(long, value_name = "N", default_value_t = 64, hide_default_value = true)]
    pub ssd_queue_depth: u32,
    /// Use CUDA: auto (when a device exists), off, or required (refuse to start without
    /// one). Default: auto.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = GpuMode::Auto,
          hide_default_value = true, hide_possible_values = true)]
    pub gpu: GpuMode,
    /// GPU staging buffer of each DMA thread on each device, all its parts (1MiB-4GiB):
    /// pages are gathered into it before crossing the bus. Two threads per device hold twice
    /// this of its memory, from their first copy on. Default: 256MiB.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", hide_default_value = true)]
    pub gpu_staging: ByteSize,
    /// Equal parts of the GPU staging buffer (2-8), used in turn: a save's gathers may run
    /// up to this many batches less one ahead of its copies (a load's copies ahead of its
    /// scatters). Default: as many parts as the staging holds jobs (gpu-job), 2 to 8 (4 with
    /// the defaults).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_staging_depth: Option<usize>,
    /// Bytes of chunks in one GPU copy job (1MiB-4GiB): a save or load is split into jobs of
    /// whole chunks (at least one), each committed or released as soon as its copy lands.
    /// Default: 64MiB.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", hide_default_value = true)]
    pub gpu_job: ByteSize,
    /// GPU copy jobs each shard may have queued for each DMA thread (1-4096). Default: 64.
    #[arg(long, value_name = "N", default_value_t = 64, hide_default_value = true)]
    pub gpu_queue_depth: usize,
    /// Engine ranks registered for GPU save/load at once (1-65536). Default: 256.
    #[arg(long, value_name = "N", default_value_t = 256, hide_default_value = true)]
    pub max_gpu_registrations: usize,
    /// Where a GPU save's chunk checksums are computed: fused (the save's gather sums the
    /// rows as it copies, a fold follows; one chunk per 32 checked again on its shard), gpu
    /// (row-sum kernels of their own beside the copy), verify (as gpu, every chunk checked
    /// again on its shard), or cpu (on the shards). Default: fused.
    #[arg(long, value_name = "WHERE", value_enum, default_value_t = ChecksumPlace::Fused,
          hide_default_value = true, hide_possible_values = true)]
    pub gpu_checksums: ChecksumPlace,
    /// How GPU saves and loads cross the bus: auto (the gather/scatter kernel through the
    /// staging for pages under 1MiB, copy engines alone above, except saves whose gather sums
    /// their checksums), staged (always the kernel), or batched (copy engines only: no SM
    /// time taken from an engine computing on the GPU, at a lower rate for small pages).
    /// Default: auto.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = Strategy::Auto,
          hide_default_value = true, hide_possible_values = true)]
    pub gpu_copy: Strategy,
    /// A diagnostic: timing events around every staged batch of GPU saves and loads, summed
    /// in `stats` (`gpu_transfers.timeline`): the copies' own rate, the copy streams' idle
    /// gaps and the kernels' time. Default: false.
    #[arg(long)]
    pub gpu_timeline: bool,
}

/// Whether the arena is on hugetlb pages (`--hugepages`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum HugePages {
    /// When enough are reserved (1 GiB pages first); else 4 KiB pages, said at info.
    Auto,
    /// As `Auto`, a warning when too few are reserved.
    On,
    /// 4 KiB pages (THP advice).
    Off,
}

/// How many memfds the arena is made of (`--arena-memfds`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum ArenaMemfds {
    /// One memfd for every shard's slice.
    One,
    /// A memfd per shard (one with more than `MAX_ARENA_FILES` shards).
    PerShard,
}

impl ArenaMemfds {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::One => "one",
            Self::PerShard => "per-shard",
        }
    }

    /// The memfds of an arena of `shards` shards.
    pub fn files(self, shards: usize) -> usize {
        match self {
            Self::PerShard if shards <= orbitkv_proto::MAX_ARENA_FILES => shards,
            _ => 1,
        }
    }
}

impl HugePages {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

impl Default for ServerConfig {
    /// The defaults: what an empty command line gives (one definition, in the clap
    /// attributes above).
    fn default() -> Self {
        Args::try_parse_from(["orbitkv-server"]).expect("an empty command line parses").server
    }
}

/// `orbitkv-server`: the per-host OrbitKV Manager.
#[derive(Parser, Debug)]
#[command(name = "orbitkv-server", version, about)]
pub struct Args {
    /// TOML config file (keys as the flags, without the dashes in front); flags override its
    /// values.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// The options.
    #[command(flatten)]
    pub server: ServerConfig,
}

/// The configuration the command line `argv` asks for: the file named by `--config` (when
/// given), with every flag given on the command line in place of the file's value (`allow-uid`
/// adds to the file's list), and whether `--print-config` was given.
pub fn from_command_line<I, T>(argv: I) -> Result<(ServerConfig, bool), CommandLineError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Args::command().try_get_matches_from(argv)?;
    let args = Args::from_arg_matches(&matches)?;
    let Some(path) = &args.config else { return Ok((args.server, args.print_config)) };
    let text = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::Read { path: path.clone(), source })?;
    let config = merge(&text, &args.server, &matches)
        .map_err(|e| ConfigError::Parse { path: path.clone(), message: e.to_string() })?;
    Ok((config, args.print_config))
}

/// The gid of `--socket-group`: a group name, or a number.
fn resolve_group(group: &str) -> Result<u32, ConfigError> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(invalid("--socket-group", format!("no group named {group:?}"))),
        Err(e) => Err(invalid("--socket-group", format!("looking up {group:?}: {e}"))),
    }
}

/// Why a command line gives no configuration: clap's own error (printed with usage, or
/// `--help` / `--version`), or the file's.
#[derive(Debug, thiserror::Error)]
pub enum CommandLineError {
    /// A flag clap refused, or help and version.
    #[error(transparent)]
    Flags(#[from] clap::Error),
    /// The config file.
    #[error(transparent)]
    File(#[from] ConfigError),
}

/// Why a config file's text gives no settings.
#[derive(Debug, thiserror::Error)]
pub enum FileTextError {
    /// Not TOML, or not the options' keys and values.
    #[error(transparent)]
    Toml(#[from] toml::de::Error),
    /// The flags given could not be put in place of the file's values.
    #[error(transparent)]
    Flags(#[from] toml::ser::Error),
    /// The command line's defaults could not be read (clap).
    #[error(transparent)]
    CommandLine(#[from] clap::Error),
    /// Options that do not validate; the message names the flag.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
}

/// A config file's TOML `text` alone (no flag given), as `--config` reads it, validated.
pub fn from_file_text(text: &str) -> Result<Settings, FileTextError> {
    let matches = Args::command().try_get_matches_from(["orbitkv-server"])?;
    let args = Args::from_arg_matches(&matches)?;
    let config = merge(text, &args.server, &matches)?;
    Ok(config.validate()?)
}

/// The file's TOML `text` with the options `matches` got from the command line taken from
/// `flags` instead.
fn merge(
    text: &str,
    flags: &ServerConfig,
    matches: &ArgMatches,
) -> Result<ServerConfig, FileTextError> {
    let mut file: toml::Table = toml::from_str(text)?;
    let given = toml::Table::try_from(flags)?;
    for id in matches.ids() {
        if matches.value_source(id.as_str()) != Some(ValueSource::CommandLine) {
            continue;
        }
        let key = id.as_str().replace('_', "-");
        let Some(value) = given.get(&key) else { continue };
        match (file.get_mut(&key), value) {
            (Some(toml::Value::Array(listed)), toml::Value::Array(more)) => {
                listed.extend(more.iter().cloned())
            }
            _ => {
                file.insert(key, value.clone());
            }
        }
    }
    Ok(ServerConfig::deserialize(file)?)
}

/// A validated configuration, with the values the server derives from it.
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
    /// Each shard's share of the `--namespace-*` quota of every namespace.
    pub quota: NamespaceQuota,
    /// Each shard's share of the quotas of `--model-quota`'s models.
    pub model_quotas: Vec<(String, NamespaceQuota)>,
    /// The SSD tier, when configured.
    pub ssd: Option<SsdSettings>,
    /// Cluster mode, when configured.
    pub cluster: Option<ClusterConfig>,
    /// The sockets' group (`--socket-group`), resolved.
    pub socket_gid: Option<u32>,
    /// GPU staging bytes per DMA thread and device.
    pub gpu_staging_bytes: u64,
    /// Bytes of chunks per GPU copy job.
    pub gpu_job_bytes: u64,
    /// Parts of the GPU staging (as given, or derived from the staging and job sizes).
    pub gpu_staging_depth: usize,
}

/// SSD faults injected by failpoints (none in builds without the `failpoints` feature).
#[derive(Clone, Copy, Debug, Default)]
struct SsdFaults {
    /// Latency before every SSD I/O.
    latency: Duration,
    /// Every n-th SSD I/O fails (`EBADF`; 0: none).
    errors_every: u64,
    /// Every n-th SSD write fails with `ENOSPC` (0: none).
    no_space_every: u64,
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
    /// Injected latency per I/O (zero unless built with `failpoints` and asked for).
    pub inject_latency: Duration,
    /// Every n-th I/O fails (0: none; only with `failpoints`).
    pub inject_errors_every: u64,
    /// Every n-th write fails with `ENOSPC` (0: none; only with `failpoints`).
    pub inject_no_space_every: u64,
}

impl ServerConfig {
    /// The SSD fault injection the failpoints ask for, e.g.
    /// `FAILPOINTS="ssd-io-delay=return(50ms);ssd-io-errors-every=return(3)"`
    /// (docs/hardening.md).
    #[cfg(feature = "failpoints")]
    fn ssd_faults(&self) -> Result<SsdFaults, ConfigError> {
        let arg = |name: &str| fail::eval(name, |arg| arg).flatten();
        let latency = match arg("ssd-io-delay") {
            Some(d) => orbitkv_proto::parse_duration(&d)
                .map_err(|e| invalid("FAILPOINTS ssd-io-delay", e.to_string()))?,
            None => Duration::ZERO,
        };
        let count = |name: &str, flag: &'static str| match arg(name) {
            Some(n) => n.parse().map_err(|_| invalid(flag, format!("{n:?} is not a count"))),
            None => Ok(0),
        };
        Ok(SsdFaults {
            latency,
            errors_every: count("ssd-io-errors-every", "FAILPOINTS ssd-io-errors-every")?,
            no_space_every: count("ssd-write-no-space", "FAILPOINTS ssd-write-no-space")?,
        })
    }

    /// No fault injection in builds without `failpoints`.
    #[cfg(not(feature = "failpoints"))]
    fn ssd_faults(&self) -> Result<SsdFaults, ConfigError> {
        Ok(SsdFaults::default())
    }

    fn validate_ssd(&self, shards: usize) -> Result<Option<SsdSettings>, ConfigError> {
        let total = self.ssd.bytes();
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
        let region_bytes = self.ssd_region_size.bytes();
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
        let SsdFaults {
            latency: inject_latency,
            errors_every: inject_errors_every,
            no_space_every,
        } = self.ssd_faults()?;
        Ok(Some(SsdSettings {
            dir: dir.clone(),
            per_shard_bytes,
            region_bytes,
            queue_depth: self.ssd_queue_depth,
            inject_latency,
            inject_errors_every,
            inject_no_space_every: no_space_every,
        }))
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
        let (shards, dram_bytes) = self.validate_shards()?;
        let max_chunk = self.max_chunk_size.bytes();
        if max_chunk == 0 {
            return Err(invalid("--max-chunk-size", "must be positive"));
        }
        self.validate_limits()?;
        let idle_poll_max = self.idle_poll_max.duration();
        if idle_poll_max > Duration::from_millis(100) {
            return Err(invalid("--idle-poll-max", "must be at most 100ms"));
        }
        let spin_window = self.spin_window.duration();
        if spin_window > Duration::from_millis(100) {
            return Err(invalid("--spin-window", "must be at most 100ms"));
        }
        let ssd = self.validate_ssd(shards)?;
        let (quota, model_quotas) = self.validate_quotas(shards)?;
        let (gpu_staging_bytes, gpu_job_bytes, gpu_staging_depth) = self.validate_gpu()?;
        let cluster = self.validate_cluster(shards)?;
        let socket_gid = self.socket_group.as_deref().map(resolve_group).transpose()?;
        Ok(Settings {
            quota,
            model_quotas,
            ssd,
            cluster,
            socket_gid,
            config: self.clone(),
            socket,
            shards,
            dram_bytes,
            max_chunk_bytes: max_chunk,
            spin_window,
            idle_poll_max,
            drain_timeout: self.drain_timeout.duration(),
            gpu_staging_bytes,
            gpu_job_bytes,
            gpu_staging_depth,
        })
    }

    /// Each shard's share of the `--namespace-*` quota, and of each `--model-quota`'s.
    fn validate_quotas(
        &self,
        shards: usize,
    ) -> Result<(NamespaceQuota, Vec<(String, NamespaceQuota)>), ConfigError> {
        let default = [
            self.namespace_dram_limit,
            self.namespace_dram_guarantee,
            self.namespace_ssd_limit,
            self.namespace_ssd_guarantee,
        ];
        let quota = self.quota_share(default, shards).map_err(|(flag, why)| invalid(flag, why))?;
        let mut models: Vec<(String, NamespaceQuota)> = Vec::new();
        for m in &self.model_quota {
            if models.iter().any(|(seen, _)| *seen == m.model) {
                return Err(invalid("--model-quota", format!("model {:?} given twice", m.model)));
            }
            let own = [m.dram_limit, m.dram_guarantee, m.ssd_limit, m.ssd_guarantee];
            let merged = std::array::from_fn(|i| own[i].unwrap_or(default[i]));
            let q = self
                .quota_share(merged, shards)
                .map_err(|(flag, why)| invalid("--model-quota", format!("{m}: {why} ({flag})")))?;
            models.push((m.model.clone(), q));
        }
        Ok((quota, models))
    }

    /// Each shard's share of one quota (DRAM limit and guarantee, SSD limit and guarantee:
    /// DRAM in arena pages rounded up, SSD in bytes), or the flag at fault and why.
    fn quota_share(
        &self,
        [dram_limit, dram_guarantee, ssd_limit, ssd_guarantee]: [ByteSize; 4],
        shards: usize,
    ) -> Result<NamespaceQuota, (&'static str, String)> {
        let share = |b: ByteSize| b.bytes().div_ceil(shards as u64);
        let pages = |b: ByteSize| share(b).div_ceil(orbitkv_shards::PAGE_SIZE);
        let (limit, guarantee) = (dram_limit.bytes(), dram_guarantee.bytes());
        if limit > 0 && guarantee > limit {
            return Err((
                "--namespace-dram-guarantee",
                format!("{guarantee} bytes is more than the DRAM limit ({limit} bytes)"),
            ));
        }
        if guarantee >= self.dram.bytes() && guarantee > 0 {
            return Err((
                "--namespace-dram-guarantee",
                "must be less than --dram (a namespace at its guarantee would leave no room)"
                    .into(),
            ));
        }
        let (limit, guarantee) = (ssd_limit.bytes(), ssd_guarantee.bytes());
        if limit > 0 && guarantee > limit {
            return Err((
                "--namespace-ssd-guarantee",
                format!("{guarantee} bytes is more than the SSD limit ({limit} bytes)"),
            ));
        }
        if guarantee > 0 && self.ssd_dir.is_none() {
            return Err((
                "--namespace-ssd-guarantee",
                "needs an SSD tier (--ssd-dir, --ssd)".into(),
            ));
        }
        if guarantee > self.ssd.bytes() / 2 {
            return Err((
                "--namespace-ssd-guarantee",
                format!(
                    "{guarantee} bytes is more than half of --ssd (reclaim needs room to rewrite \
                     what it keeps)"
                ),
            ));
        }
        Ok(NamespaceQuota {
            dram_limit_pages: pages(dram_limit),
            dram_guarantee_pages: pages(dram_guarantee),
            ssd_limit_bytes: share(ssd_limit),
            ssd_guarantee_bytes: share(ssd_guarantee),
        })
    }

    /// Cluster mode's settings, with `--etcd`; the cluster flags without it are an error.
    fn validate_cluster(&self, shards: usize) -> Result<Option<ClusterConfig>, ConfigError> {
        let name_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        if !name_ok(&self.cluster) {
            return Err(invalid(
                "--cluster",
                format!("{:?}: use 1-64 letters, digits, '.', '_' or '-'", self.cluster),
            ));
        }
        let ttl = self.cluster_lease_ttl.duration();
        if !(Duration::from_secs(1)..=Duration::from_secs(300)).contains(&ttl) {
            return Err(invalid("--cluster-lease-ttl", "must be 1s to 300s"));
        }
        if !(1..=1 << 26).contains(&self.peer_catalog_entries) {
            return Err(invalid("--peer-catalog-entries", "must be 1 to 67108864"));
        }
        if !(1..=1 << 20).contains(&self.peer_max_grants) {
            return Err(invalid("--peer-max-grants", "must be 1 to 1048576"));
        }
        if self.peer_spin_window.duration() > Duration::from_millis(100) {
            return Err(invalid("--peer-spin-window", "must be at most 100ms"));
        }
        if self.etcd.is_empty() {
            for (flag, set) in [
                ("--node-id", self.node_id.is_some()),
                ("--peer-addr", self.peer_addr.is_some()),
                ("--te-library", self.te_library.is_some()),
                ("--te-transport", self.te_transport != TeTransport::default()),
            ] {
                if set {
                    return Err(invalid(flag, "is for cluster mode: give --etcd too"));
                }
            }
            return Ok(None);
        }
        if self.te_library.is_none() && self.te_transport != TeTransport::default() {
            return Err(invalid(
                "--te-transport",
                "chooses the transports of a --te-library engine: give --te-library too (the \
                 wheel's engine moves bytes over TCP)",
            ));
        }
        if let Some(bad) = self.etcd.iter().find(|u| u.starts_with("https://")) {
            return Err(invalid(
                "--etcd",
                format!("{bad:?}: TLS to etcd is not supported; give http://HOST:PORT"),
            ));
        }
        if let Some(bad) = self.etcd.iter().find(|u| !u.starts_with("http://")) {
            return Err(invalid("--etcd", format!("{bad:?}: give endpoints as http://HOST:PORT")));
        }
        let node_id = match &self.node_id {
            Some(id) => id.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
        };
        if !name_ok(&node_id) {
            return Err(invalid(
                "--node-id",
                format!("{node_id:?}: use 1-64 letters, digits, '.', '_' or '-'"),
            ));
        }
        let Some(peer_addr) = self.peer_addr else {
            return Err(invalid(
                "--peer-addr",
                "cluster mode (--etcd) needs the address peers reach this node at",
            ));
        };
        Ok(Some(ClusterConfig {
            etcd: self.etcd.clone(),
            cluster: self.cluster.clone(),
            node_id,
            peer_addr,
            shards,
            lease_ttl: ttl,
            te_library: self.te_library.clone(),
            te_transport: self.te_transport,
            // Given at start, once the shards' cores are known.
            cpus: Vec::new(),
        }))
    }

    /// The shard count (0: one per CPU minus one) and the arena's bytes (whole pages per
    /// shard, at least 64 KiB each).
    fn validate_shards(&self) -> Result<(usize, u64), ConfigError> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        // One CPU is left to the engines (and the control and DMA threads): with it, shards
        // poll briefly after work and answer in microseconds; with none spare they must sleep
        // on their doorbells and every request pays a wake-up (docs/performance.md).
        let shards = if self.shards == 0 { cpus.saturating_sub(1).max(1) } else { self.shards };
        if shards > 256 {
            return Err(invalid("--shards", format!("{shards} is more than 256")));
        }
        let dram = self.dram.bytes();
        let page = orbitkv_shards::PAGE_SIZE;
        let per_shard = dram / shards as u64 / page * page;
        if per_shard < 16 * page {
            return Err(invalid(
                "--dram",
                format!("{dram} bytes gives each of {shards} shards less than 64 KiB"),
            ));
        }
        Ok((shards, per_shard * shards as u64))
    }

    /// The per-session and per-request bounds and the mesh's depth.
    fn validate_limits(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// The GPU staging and job sizes and the staging's parts (as given, or as many as the
    /// staging holds jobs, 2 to 8); the queue and registration bounds.
    fn validate_gpu(&self) -> Result<(u64, u64, usize), ConfigError> {
        let gpu_staging_bytes = self.gpu_staging.bytes();
        if !(1 << 20..=4 << 30).contains(&gpu_staging_bytes) {
            return Err(invalid("--gpu-staging", "must be between 1MiB and 4GiB"));
        }
        let gpu_job_bytes = self.gpu_job.bytes();
        if !(1 << 20..=4 << 30).contains(&gpu_job_bytes) {
            return Err(invalid("--gpu-job", "must be between 1MiB and 4GiB"));
        }
        let depths = STAGING_DEPTHS;
        let gpu_staging_depth = match self.gpu_staging_depth {
            Some(d) if !depths.contains(&d) => {
                return Err(invalid(
                    "--gpu-staging-depth",
                    format!("must be between {} and {}", depths.start(), depths.end()),
                ))
            }
            Some(d) => d,
            None => default_staging_depth(gpu_staging_bytes, gpu_job_bytes),
        };
        for (flag, v, max) in [
            ("--gpu-queue-depth", self.gpu_queue_depth, 4096),
            ("--max-gpu-registrations", self.max_gpu_registrations, 65536),
        ] {
            if v == 0 || v > max {
                return Err(invalid(flag, format!("must be between 1 and {max}")));
            }
        }
        Ok((gpu_staging_bytes, gpu_job_bytes, gpu_staging_depth))
    }
}

#[cfg(test)]
mod tests;
