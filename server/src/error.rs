//! Why the server could not start: each cause a variant an operator's message names.

use std::path::PathBuf;

/// Why `orbitkv-server` could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A file system operation on a path (the socket's directory, a socket, an SSD file).
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done (`creating`, `binding`, ...).
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--metrics-addr` could not be bound (in use, not local, no permission).
    #[error("--metrics-addr {addr}: {source}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Joining the cluster was refused (`--node-id` held, bad `--etcd`).
    #[error(transparent)]
    Cluster(#[from] orbitkv_peer::JoinError),
    /// Cluster peering could not start.
    #[error("cluster: {0}")]
    Peering(orbitkv_peer::PeeringError),
    /// io_uring is missing, or refused by the kernel's settings or a seccomp profile.
    #[error(
        "io_uring is not available ({0}): the shards run on io_uring, which needs Linux 5.8 or \
         newer with io_uring allowed (sysctl kernel.io_uring_disabled = 0; in a container, a \
         seccomp profile that allows io_uring_setup); the server does not start without it"
    )]
    NoIoUring(std::io::Error),
    /// A live server answers on the socket.
    #[error("another server is already serving on {}", .0.display())]
    AlreadyServing(PathBuf),
    /// A thread of the server could not be started.
    #[error("starting the {thread} thread: {source}")]
    Thread {
        /// Its name.
        thread: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The shards' eventfds or the signal handlers.
    #[error("{what}: {source}")]
    Os {
        /// What was being made.
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// CUDA (with `--gpu required`, or a context the GPU service needs).
    #[error(transparent)]
    Gpu(#[from] orbitkv_gpu::GpuError),
    /// The arena.
    #[error("the arena: {0}")]
    Arena(#[from] orbitkv_shards::Error),
    /// A shard's executor could not be started.
    #[error("starting shard {shard}'s executor: {detail}")]
    Executor {
        /// The shard.
        shard: usize,
        /// glommio's error.
        detail: String,
    },
    /// A shard failed while starting.
    #[error(transparent)]
    Shard(#[from] ShardStartError),
    /// A shard did not say it was serving in time.
    #[error("a shard did not start within 30 s")]
    ShardTimeout,
}

impl StartError {
    /// `op` on `path` failed with `source`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { op, path, source }
    }

    /// Starting the thread `thread` failed with `source`.
    pub fn thread(thread: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let thread = thread.into();
        move |source| Self::Thread { thread, source }
    }
}

/// Why a shard could not start serving (sent from its thread to `main`).
#[derive(Debug, thiserror::Error)]
pub enum ShardStartError {
    /// Its iceoryx2 node.
    #[error("shard {shard}: {source}")]
    Ipc {
        /// The shard.
        shard: usize,
        /// What failed.
        source: crate::shard::ipc::IpcError,
    },
    /// Joining the shard-to-shard queues.
    #[error("shard {shard}: joining the {mesh} mesh: {detail}")]
    Mesh {
        /// The shard.
        shard: usize,
        /// Which mesh (`request` or `reply`).
        mesh: &'static str,
        /// glommio's error.
        detail: String,
    },
    /// Opening its SSD file.
    #[error("shard {shard}: SSD tier (--ssd-dir): {source}")]
    Ssd {
        /// The shard.
        shard: usize,
        /// The SSD store's error.
        source: orbitkv_ssd::store::SsdError,
    },
}
