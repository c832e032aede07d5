//! The sockets: the bootstrap and admin sockets claimed and bound, the metrics listener and
//! the cluster joined before anything is built, the listeners started.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Settings;
use crate::control::startup::Startup;
use crate::control::{admin, bootstrap};
use crate::error::StartError;
use crate::metrics;
use crate::placement;

/// How long the start waits for the first attempt to join the cluster.
const CLUSTER_JOIN_WAIT: Duration = Duration::from_secs(5);

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

/// Makes the socket's directory and refuses when a live server answers on the socket, before
/// anything else (iceoryx2 state) is touched.
pub(super) fn claim_socket(socket: &Path) -> Result<(), StartError> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(StartError::io("creating", dir))?;
    }
    if UnixStream::connect(socket).is_ok() {
        return Err(StartError::AlreadyServing(socket.to_owned()));
    }
    Ok(())
}

/// Removes SSD files of shards this run does not have (an earlier run with more shards), so
/// that the directory never holds more than the configured cap.
pub(super) fn remove_orphan_shard_files(dir: &Path, shards: usize) -> Result<(), StartError> {
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

/// Binds the bootstrap and admin sockets and starts the threads that accept on them and on
/// the metrics listener.
pub(super) fn start_listeners(
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

/// What starts before the server: the metrics listener, bound (an address in use stops the
/// server at once), and in cluster mode the membership (a node id held by a live member
/// stops the start; an etcd that does not answer does not: the server serves locally and
/// keeps trying).
#[allow(clippy::type_complexity)]
pub(super) fn outside_links(
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
