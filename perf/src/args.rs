//! The command line: `serve` and `idle`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// `orbitkv-perf`: OrbitKV benchmarks. Every reader verifies the bytes it reads.
#[derive(Parser, Debug)]
#[command(name = "orbitkv-perf", version, about)]
pub(crate) struct Cli {
    /// The benchmark to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// End to end through the client library: a read-through cache workload (lookup with
    /// lease, copy, release; put on miss, or with `--verify-only` no put at all), optionally
    /// followed by batched lookups; compared with a single-thread memcpy measured in the same
    /// run.
    Serve(ServeArgs),
    /// The CPU use of an idle server, as percent of one core.
    Idle(IdleArgs),
}

/// How keys are picked.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyDist {
    /// Every key equally likely.
    Uniform,
    /// Zipf over key ranks (key 0 hottest), exponent `--zipf-theta`.
    Zipf,
}

impl KeyDist {
    /// Stable name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyDist::Uniform => "uniform",
            KeyDist::Zipf => "zipf",
        }
    }
}

/// Flags of `orbitkv-perf serve`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ServeArgs {
    /// Bootstrap socket of the server to measure (default: $ORBITKV_SOCKET, else
    /// /run/orbitkv/orbitkv.sock for root, else /tmp/orbitkv-<uid>/orbitkv.sock).
    #[arg(long, value_name = "PATH", conflicts_with = "embedded")]
    pub socket: Option<PathBuf>,
    /// Start a private orbitkv-server (the binary next to this one) on a temporary socket,
    /// and stop it at the end.
    #[arg(long)]
    pub embedded: bool,
    /// DRAM arena of the embedded server (default: 1GiB).
    #[arg(long, value_name = "SIZE", value_parser = size, requires = "embedded")]
    pub embedded_dram: Option<u64>,
    /// Shards of the embedded server; 0 = the server's default (default: 0).
    #[arg(long, value_name = "N", requires = "embedded")]
    pub embedded_shards: Option<usize>,
    /// Do not lock the embedded server's arena in memory.
    #[arg(long, requires = "embedded")]
    pub no_lock_arena: bool,
    /// Benchmark clients: one thread and one session each (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub clients: usize,
    /// Length of the main phase, and of the lookup phase if any (default: 10s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "10s")]
    pub duration: Duration,
    /// Bytes of every value (default: 1MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "1MiB")]
    pub value_size: u64,
    /// Bytes of all keys together; keys = working set / value size (default: 4GiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "4GiB")]
    pub working_set: u64,
    /// Seed of keys, values and key choice; values written under one seed are re-derivable
    /// from it (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Key popularity (default: uniform).
    #[arg(long, value_enum, default_value_t = KeyDist::Uniform)]
    pub keys: KeyDist,
    /// Zipf exponent for `--keys zipf` (default: 0.99).
    #[arg(long, value_name = "F", default_value_t = 0.99)]
    pub zipf_theta: f64,
    /// Keys per batched lookup in a second phase; 0 skips that phase (default: 0).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lookup_batch: usize,
    /// Write nothing: every operation is a get of a main key, a hit is verified byte for byte
    /// against the value derived from `--seed` and `--value-size`, a miss is only counted.
    /// Checks what an earlier run with the same `--seed`, `--value-size` and `--working-set`
    /// left in a server (so not with `--embedded`, which starts empty, nor with
    /// `--lookup-batch`, whose setup writes) (default: off).
    #[arg(long, conflicts_with_all = ["embedded", "lookup_batch"])]
    pub verify_only: bool,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `orbitkv-perf idle`.
#[derive(Args, Debug, Clone)]
pub(crate) struct IdleArgs {
    /// Bootstrap socket of the server (its admin socket is `<PATH>.admin`) (default: as for
    /// `serve`).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// How long to sample (default: 10s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "10s")]
    pub duration: Duration,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The socket to use when none is given: the one every OrbitKV tool defaults to.
pub(crate) fn socket_or_default(socket: &Option<PathBuf>) -> PathBuf {
    socket
        .clone()
        .unwrap_or_else(|| orbitkv_proto::default_socket_path(nix::unistd::getuid().as_raw()))
}

fn size(s: &str) -> Result<u64, String> {
    orbitkv_proto::parse_size(s).map_err(|e| e.to_string())
}

fn duration(s: &str) -> Result<Duration, String> {
    orbitkv_proto::parse_duration(s).map_err(|e| e.to_string())
}
