//! The one default socket path shared by server, client, ctl and perf.

use std::path::{Path, PathBuf};

/// Environment variable that overrides the default socket path everywhere.
pub const SOCKET_ENV: &str = "ORBITKV_SOCKET";

/// The socket path used when no `--socket` is given: `$ORBITKV_SOCKET`, else
/// `/run/orbitkv/orbitkv.sock` for root, else `/tmp/orbitkv-<uid>/orbitkv.sock`.
pub fn default_socket_path(uid: u32) -> PathBuf {
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if uid == 0 {
        PathBuf::from("/run/orbitkv/orbitkv.sock")
    } else {
        PathBuf::from(format!("/tmp/orbitkv-{uid}/orbitkv.sock"))
    }
}

/// The admin socket that sits next to a main socket (`<socket>.admin`).
pub fn admin_socket_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".admin");
    PathBuf::from(s)
}
