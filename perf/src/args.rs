//! The command line: `serve`, `idle`, `wake`, `ssd`, `dma`, `checksum`, `peer`, `soak` and
//! `arena`.

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
    /// The round trip of the first request after a pause, per pause length (what an engine
    /// whose requests come a few milliseconds apart waits for a shard to wake).
    Wake(WakeArgs),
    /// The SSD tier's I/O path alone: O_DIRECT reads or writes between arena slots and a file
    /// through the shard's io_uring ring (`SsdRing`), compared with fio run on the same file
    /// with the same parameters in the same run (when fio is on PATH).
    Ssd(SsdArgs),
    /// GPU save/load of engine KV pages: gathers blocks of a KV layout from GPU memory into a
    /// CUDA-registered arena and scatters them back, compared with one contiguous copy of the
    /// same bytes in the same run (the PCIe ceiling). Every byte is verified both ways.
    /// Exits 2 on a machine without CUDA.
    Dma(DmaArgs),
    /// How fast this host's cores compute chunk checksums (xxh3-64, what the shards compute
    /// when they checksum commits themselves, `--gpu-checksums cpu`), with one to several
    /// threads at once, compared with a single-thread memcpy measured in the same run.
    Checksum(ChecksumArgs),
    /// Cluster peer reads: chunks put on one Manager (the owner) and looked up on another of
    /// the same cluster (the requester), which reads them with Mooncake Transfer Engine;
    /// compared with raw Transfer Engine reads of the same bytes, in the same batches, over
    /// loopback TCP in the same run. Both Managers on this host; needs `--te-library` or a
    /// build with the `te-python` feature (exits 2 without).
    Peer(PeerArgs),
    /// Many client processes against one server for a set time: random client SIGKILLs,
    /// mixed value sizes, a working set beyond DRAM and SSD, evictions, drains and audits from
    /// the admin socket meanwhile; then every client is killed and the server must come to
    /// rest (no session, lease or reservation left, every shard's full scan consistent, RSS
    /// growth bounded). Every byte read is verified. Exit 1 when any of that fails.
    Soak(SoakArgs),
    /// How fast a server starts with a large arena: for each size and shard count, a private
    /// orbitkv-server (the binary next to this one) is started and its start steps read back
    /// (populating the arena, each shard's slice on its core at once; registering it with
    /// CUDA where a GPU is used), compared with one thread `memset`ting the same bytes of
    /// fresh memory in the same run: the limit is bytes / (shards x that rate).
    Arena(ArenaArgs),
    /// One client process of `soak` (started by it).
    #[command(hide = true)]
    SoakClient(SoakClientArgs),
}

/// Flags of `orbitkv-perf arena`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ArenaArgs {
    /// Arena sizes to start with (default: 1GiB,2GiB).
    #[arg(long, value_name = "SIZES", value_parser = size, value_delimiter = ',',
          default_value = "1GiB,2GiB")]
    pub sizes: Vec<u64>,
    /// Shard counts to start with (default: 1,2).
    #[arg(long, value_name = "N,...", value_delimiter = ',', default_value = "1,2")]
    pub shards: Vec<usize>,
    /// The server's `--hugepages` (default: off: 4 KiB pages).
    #[arg(long, value_name = "auto|on|off", default_value = "off")]
    pub hugepages: String,
    /// The server's `--arena-memfds` (default: one).
    #[arg(long, value_name = "one|per-shard", default_value = "one")]
    pub arena_memfds: String,
    /// The server's `--gpu` (default: off; `auto` to time the arena's CUDA registration too).
    #[arg(long, value_name = "auto|required|off", default_value = "off")]
    pub gpu: String,
    /// Do not lock the arena in memory (the server's `--no-lock-arena`).
    #[arg(long)]
    pub no_lock_arena: bool,
    /// Starts of each size and shard count (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeat: usize,
    /// After each start, also populate (and lock, unless --no-lock-arena) the same bytes in
    /// one memfd, by as many threads as shards on the shards' cores, at once: what the
    /// server's memfd per shard gains (4 KiB pages unless the host's shared-memory THP
    /// applies).
    #[arg(long)]
    pub one_memfd: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `orbitkv-perf soak`.
#[derive(Args, Debug, Clone)]
pub(crate) struct SoakArgs {
    /// Bootstrap socket of a running server to soak (default: start a private one, the binary
    /// next to this one, with `--dram`, `--ssd` and `--shards`).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// DRAM arena of the private server (default: 64MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "64MiB")]
    pub dram: u64,
    /// SSD tier of the private server, in its temporary directory (default: 128MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "128MiB")]
    pub ssd: u64,
    /// SSD region size of the private server (default: 4MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "4MiB")]
    pub ssd_region_size: u64,
    /// Shards of the private server; 0 = the server's default (default: 0).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub shards: usize,
    /// How long the clients run (default: 60s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "60s")]
    pub duration: Duration,
    /// Client processes at once (default: 4).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub clients: usize,
    /// Keys of the shared key space; each has a fixed size from `--value-sizes` (default:
    /// 8000: about 900 MiB with the default sizes).
    #[arg(long, value_name = "N", default_value_t = 8000)]
    pub keys: u64,
    /// Value sizes, comma-separated (default: 4KiB,64KiB,256KiB).
    #[arg(long, value_name = "SIZES", value_parser = size, value_delimiter = ',',
          default_value = "4KiB,64KiB,256KiB")]
    pub value_sizes: Vec<u64>,
    /// A random client is killed with SIGKILL (and another started) this often; 0s = never
    /// (default: 2s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "2s")]
    pub kill_every: Duration,
    /// An admin action at random (evict the namespace, drain for 200 ms and resume, audit)
    /// this often; 0s = never (default: 3s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "3s")]
    pub admin_every: Duration,
    /// Seed of the kills, the admin actions and the clients' seeds (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `orbitkv-perf soak-client`.
#[derive(Args, Debug, Clone)]
pub(crate) struct SoakClientArgs {
    /// Bootstrap socket of the server.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Seed of this client's choices.
    #[arg(long, value_name = "N")]
    pub seed: u64,
    /// Keys of the shared key space.
    #[arg(long, value_name = "N")]
    pub keys: u64,
    /// Value sizes, comma-separated.
    #[arg(long, value_name = "SIZES", value_parser = size, value_delimiter = ',')]
    pub value_sizes: Vec<u64>,
}

/// Engine KV layouts (see `orbitkv_gpu::KvLayoutKind`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayoutArg {
    /// vLLM FlashAttention per layer, `[2, blocks, block_tokens, heads, dim]`.
    #[value(name = "flash-nhd")]
    FlashNhd,
    /// vLLM FlashAttention per layer, `[2, blocks, heads, block_tokens, dim]`.
    #[value(name = "flash-hnd")]
    FlashHnd,
    /// vLLM cross-layer, `[blocks, layers, 2, block_tokens, heads, dim]`.
    #[value(name = "cross-layer")]
    CrossLayer,
    /// MLA per layer, `[blocks, block_tokens, head_dim]` (kv-heads must be 1).
    #[value(name = "mla")]
    Mla,
    /// SGLang K and V per layer, `[tokens, heads, dim]` (block-tokens must be 1).
    #[value(name = "sglang")]
    Sglang,
    /// vLLM paged per layer (vLLM >= 0.32), `[blocks, block_tokens x heads x 2 x dim]`.
    #[value(name = "paged")]
    Paged,
}

/// Element types.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DtypeArg {
    /// bfloat16 (2 bytes).
    Bf16,
    /// float16 (2 bytes).
    Fp16,
    /// float8 (1 byte).
    Fp8,
}

/// Copy strategies to measure.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StrategyArg {
    /// What the server would pick for this page size.
    Auto,
    /// Gather/scatter kernel through a staging buffer.
    Staged,
    /// cuMemcpyBatchAsync per page.
    Batched,
    /// Each of the above.
    All,
}

/// Flags of `orbitkv-perf dma`.
#[derive(Args, Debug, Clone)]
pub(crate) struct DmaArgs {
    /// KV layout of the stand-in engine.
    #[arg(long, value_enum, default_value = "flash-nhd")]
    pub layout: LayoutArg,
    /// Attention layers (default: 32).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub layers: u32,
    /// Tokens per block (default: 16; 1 for sglang).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_tokens: u32,
    /// KV heads (default: 8; 1 for mla).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub kv_heads: u32,
    /// Elements per head, or the latent width for mla (default: 128).
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub head_dim: u32,
    /// Element type (default: bf16).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DtypeArg,
    /// Blocks in the engine's cache; all of them are saved and loaded (default: 1024).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub blocks: u64,
    /// Blocks per chunk (arena slot) (default: 1; 16 or more for sglang).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub blocks_per_chunk: u64,
    /// Strategies to measure (default: all).
    #[arg(long, value_enum, default_value = "all")]
    pub strategy: StrategyArg,
    /// Where the chunks' arena slots lie: `shuffled` (no two chunks in a row adjacent: one
    /// host copy per chunk, the worst case) or `in-order` (chunk after chunk, as a fresh
    /// shard allocates them and the server orders a job: host copies merge) (default:
    /// shuffled).
    #[arg(long, value_enum, default_value = "shuffled")]
    pub slots: SlotOrderArg,
    /// GPU staging buffer, all its parts (default: 256MiB, as the server's).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "256MiB")]
    pub staging: u64,
    /// Parts of the staging buffer, used in turn (2-8; as the server's `--gpu-staging-depth`;
    /// through a server, its flag decides) (default: as the server's, as many as the staging
    /// holds its 64 MiB jobs: 4 with the default staging, 2 with 64MiB).
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u8).range(2..=8), conflicts_with = "socket")]
    pub staging_depth: Option<u8>,
    /// Timed repetitions of each measurement (default: 5).
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub iterations: u32,
    /// CUDA device ordinal (default: 0).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub device: usize,
    /// Seed of the block order, slot order and tensor contents (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Save and load through the orbitkv-server on this socket (this process acts as the
    /// engine: it shares its tensors by CUDA IPC, the server's DMA threads copy), instead of
    /// driving a copy engine in this process. The ceiling is still measured here.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// With `--socket`: this process is rank N of a tensor-parallel group; its chunks go to
    /// the rank's own namespace (the descriptor's `tp_rank`) (default: 0).
    #[arg(long, value_name = "N", default_value_t = 0, requires = "socket")]
    pub tp_rank: u32,
    /// With `--socket`: ranks in the group (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "socket")]
    pub tp_world_size: u32,
    /// With `--socket`: a folder the group's ranks share; every rank waits for the others
    /// (there) before its ceiling, save and load series, so the ranks copy at the same time,
    /// and after the saves checks that the group prefix (every rank's chunks) is complete.
    #[arg(long, value_name = "DIR", requires = "socket")]
    pub barrier: Option<PathBuf>,
    /// Also save half of the chunks while loading the other half, both at once (as an engine
    /// does while it prefills some requests and finishes others), against a contiguous copy
    /// each way at the same time: through the server with `--socket`, else on two copy
    /// engines in this process (each strategy, and a one-entry batched copy each way).
    #[arg(long)]
    pub duplex: bool,
    /// With `--socket`: also save and load without CUDA IPC, as an engine in a container
    /// without host IPC would: this process registers its own mapping of the arena with CUDA,
    /// copies into reserved slots and commits, and copies out of leased chunks.
    #[arg(long, requires = "socket")]
    pub engine_copies: bool,
    /// Also measure how much saving and loading slow a concurrent bf16 matmul loop on the same
    /// GPU (a PyTorch process: `python3`, or `$ORBITKV_PYTHON`), 3 s per strategy and
    /// direction, each after 3 s of the loop alone and against the windows alone around it;
    /// last, the engine-side gather: that process gathers this layout's pages into staging
    /// and copies them itself, in its own CUDA context (about a minute and a half per round).
    /// With `--socket`: beside saves (each after an evict) and loads through the server, as
    /// the server runs them (its `--gpu-copy`, `--gpu-checksums`), the same streamed, the
    /// engine-side gather, and the engine-side gather through the server (`engine-gather`:
    /// the server copies the process's staging batches as chunks).
    #[arg(long)]
    pub interference: bool,
    /// With `--interference`: how many times to run the whole sequence of measurements
    /// (each beside a copy, after a window of the loop alone); the table has each row's median
    /// and range over the rounds.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "interference",
          value_parser = clap::value_parser!(u32).range(1..=20))]
    pub interference_rounds: u32,
    /// With `--interference`: staging batches the engine-side copies keep in flight (default: 4).
    #[arg(long, value_name = "N", default_value_t = 4, requires = "interference",
          value_parser = clap::value_parser!(u32).range(2..=64))]
    pub engine_depth: u32,
    /// With `--interference`: bytes of one engine-side staging batch (default: half of
    /// `--staging`).
    #[arg(long, value_name = "SIZE", value_parser = size, requires = "interference")]
    pub engine_batch: Option<u64>,
    /// After each staged series, one more operation with timing events around every staging
    /// batch: where the GPU time went (kernel, copy, the copy stream's idle gaps), in the JSON
    /// and the table. A diagnostic: the events cost a little, so the timed series run without.
    #[arg(long, conflicts_with = "socket")]
    pub timeline: bool,
    /// Submit each series' operation as the server's DMA threads get it: in jobs of at most
    /// 64 MiB of whole chunks, each its own submission, back to back (instead of one
    /// submission of every piece). Tells a cost of the job split from one of the server.
    #[arg(long, conflicts_with = "socket")]
    pub server_jobs: bool,
    /// How the checksums row (and `--interference`'s checksummed save row) computes a save's
    /// GPU checksums, as the server's `--gpu-checksums`: `fused` (the save's gather sums the
    /// rows, each job's fold queued once this thread has seen its gathers done) or `gpu` (row
    /// sums and fold kernels beside the copy: the block row sums, a warp per unit, where they
    /// apply) (default: fused, which measures `gpu` where the fused form does not apply, as
    /// the server does: copy-engine saves, parts not a multiple of 1 KiB).
    #[arg(long, value_enum, default_value = "fused", conflicts_with = "socket")]
    pub checksum_form: ChecksumForm,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// How `dma`'s checksums row computes GPU checksums (`--checksum-form`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum ChecksumForm {
    /// Row sums and fold kernels beside the copy: the block row sums (a warp per unit, no
    /// tables) where they apply.
    Gpu,
    /// The save's gather sums the rows; each job's fold is queued once its gathers are seen
    /// done.
    Fused,
}

/// Arena slot placement of `dma`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotOrderArg {
    /// A random permutation of the slots.
    Shuffled,
    /// Chunk i in slot i.
    InOrder,
}

/// The access pattern of `ssd` (fio's `--rw` of the same name).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SsdMode {
    /// Sequential reads.
    #[value(name = "read")]
    Read,
    /// Sequential writes.
    #[value(name = "write")]
    Write,
    /// Reads at random block-aligned offsets.
    #[value(name = "randread")]
    RandRead,
    /// Writes at random aligned offsets.
    #[value(name = "randwrite")]
    RandWrite,
}

impl SsdMode {
    /// Stable name for reports, and fio's `--rw` value.
    pub fn as_str(self) -> &'static str {
        match self {
            SsdMode::Read => "read",
            SsdMode::Write => "write",
            SsdMode::RandRead => "randread",
            SsdMode::RandWrite => "randwrite",
        }
    }

    /// True for the write modes.
    pub fn writes(self) -> bool {
        matches!(self, SsdMode::Write | SsdMode::RandWrite)
    }

    /// True for the random modes.
    pub fn random(self) -> bool {
        matches!(self, SsdMode::RandRead | SsdMode::RandWrite)
    }
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
    /// A further flag for the embedded server, passed as given; repeat for several (e.g.
    /// `--embedded-server-arg=--hugepages --embedded-server-arg=on`).
    #[arg(long, value_name = "ARG", requires = "embedded", allow_hyphen_values = true)]
    pub embedded_server_arg: Vec<String>,
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
    /// Keys per get: a run of consecutive keys from the picked one (wrapping), as an engine
    /// loads a prompt's chunks: looked up and leased in one request, the present prefix copied
    /// out and released in one deferred request, the missing rest put in one request. A get's
    /// latency and GB/s are per batch (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub get_batch: usize,
    /// Also measure the memcpy yardstick inside the main phase, on each client's own thread:
    /// a 0.5 s window first, then one between two gets whenever this long has passed, and a
    /// last one at the end; each interval's get GB/s is compared with the mean of the two
    /// windows around it (`ratio_get_vs_memcpy_bracketed`: the median over the intervals).
    /// For machines whose memory bandwidth drifts during a run. The windows take time from
    /// the gets (default: off).
    #[arg(long, value_name = "DUR", value_parser = duration)]
    pub baseline_every: Option<Duration>,
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

/// Flags of `orbitkv-perf checksum`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ChecksumArgs {
    /// Bytes per chunk hashed (default: 2MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "2MiB")]
    pub value_size: u64,
    /// Bytes of the buffer the chunks come from; far larger than the caches, as arena memory
    /// just written by copy engines is cold (default: 1GiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "1GiB")]
    pub working_set: u64,
    /// Thread counts to measure, one after another, comma-separated (1 to 1024 each).
    #[arg(long, value_name = "N,...", value_delimiter = ',', default_value = "1,2,4")]
    pub threads: Vec<usize>,
    /// How long each thread count hashes (default: 2s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "2s")]
    pub duration: Duration,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `orbitkv-perf peer`.
#[derive(Args, Debug, Clone)]
pub(crate) struct PeerArgs {
    /// Bootstrap socket of the owner (the chunks are put there).
    #[arg(long, value_name = "PATH")]
    pub owner: PathBuf,
    /// Bootstrap socket of the requester (the chunks are read there, from the owner).
    #[arg(long, value_name = "PATH")]
    pub requester: PathBuf,
    /// Bytes per chunk, a multiple of 4 KiB (4KiB to 16MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "1MiB")]
    pub chunk_size: u64,
    /// Chunks read in the throughput part (1 to 65536).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub chunks: u32,
    /// Chunks per lookup (and per raw Transfer Engine batch), 1 to 1024.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub batch: u32,
    /// Single-chunk lookups timed for the lookup-to-first-byte latency (0 to 10000).
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub latency_samples: u32,
    /// The raw Transfer Engine baseline through the C API of this TE build's library (give
    /// the Managers' `--te-library`); default: the wheel's engine (builds with `te-python`).
    #[arg(long, value_name = "PATH")]
    pub te_library: Option<PathBuf>,
    /// The transports of the baseline's `--te-library` engines, as the Managers'
    /// `--te-transport`: auto (TE's choice: RDMA over the RDMA devices it finds, else TCP) or
    /// tcp.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = orbitkv_peer::TeTransport::Auto)]
    pub te_transport: orbitkv_peer::TeTransport,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `orbitkv-perf wake`.
#[derive(Args, Debug, Clone)]
pub(crate) struct WakeArgs {
    /// Bootstrap socket of the server (default: as for `serve`).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Pauses before the timed round trips, comma-separated (at most 10s each).
    #[arg(long, value_name = "DUR,...", value_parser = duration, value_delimiter = ',',
        default_value = "0,500us,1500us,3ms,5ms,10ms,15ms,30ms,300ms")]
    pub gaps: Vec<Duration>,
    /// Timed round trips per pause (1 to 100000).
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub samples: u32,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `orbitkv-perf ssd`.
#[derive(Args, Debug, Clone)]
pub(crate) struct SsdArgs {
    /// Directory of the test file `orbitkv-perf-ssd.dat` (created, preallocated and filled on
    /// first use; reused after). It must be on a file system that supports O_DIRECT.
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Bytes of the test file that the run (and fio) use (default: 1GiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "1GiB")]
    pub file_size: u64,
    /// Bytes per operation, a multiple of 4 KiB (default: 1MiB).
    #[arg(long, value_name = "SIZE", value_parser = size, default_value = "1MiB")]
    pub block_size: u64,
    /// Operations in flight (default: 32).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub qd: u32,
    /// Access pattern.
    #[arg(long, value_enum)]
    pub mode: SsdMode,
    /// Length of the run, and of fio's run (default: 10s).
    #[arg(long, value_name = "DUR", value_parser = duration, default_value = "10s")]
    pub duration: Duration,
    /// Seed of the random offsets (default: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Do not run fio even when it is on PATH (default: off).
    #[arg(long)]
    pub no_fio: bool,
    /// Print one JSON object on stdout instead of a table.
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
