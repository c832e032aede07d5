//! `orbitkv._native`: the `orbitkv-client` library for Python. The `orbitkv` package wraps it
//! (buffer handling, engine integrations); use that, not this module directly.

mod admin;
mod arena;
mod client;
mod errors;
mod hashing;
mod raw;
mod types;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Logs of the client library (reconnects, backoff) go to stderr, filtered by ORBITKV_LOG
    // (default: warnings). An engine that set up its own subscriber keeps it.
    let filter = tracing_subscriber::EnvFilter::try_from_env("ORBITKV_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    errors::register(m)?;
    m.add_class::<client::NativeClient>()?;
    m.add_class::<types::ChunkKey>()?;
    m.add_class::<types::NamespaceDescriptor>()?;
    m.add_class::<types::Hit>()?;
    m.add_class::<types::Lease>()?;
    m.add_class::<types::Reserved>()?;
    m.add_class::<types::GpuRegistration>()?;
    m.add_class::<types::Transfer>()?;
    m.add_class::<types::KvLayout>()?;
    m.add_class::<arena::ArenaMapping>()?;
    m.add_function(wrap_pyfunction!(hashing::prefix_digests, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::chunk_digest, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::chunk_checksum, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(admin::admin_request, m)?)?;
    m.add("OUTCOMES", pyo3::types::PyTuple::new(m.py(), types::outcome_names())?)?;
    m.add("PREFIX_SEED", pyo3::types::PyBytes::new(m.py(), &orbitkv_client::PREFIX_SEED))?;
    // The workspace's version: the same as `orbitkv-server --version` of this release.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// The socket a client connects to when given none: `$ORBITKV_SOCKET`, else
/// `/run/orbitkv/orbitkv.sock` for root, else `/tmp/orbitkv-<uid>/orbitkv.sock` (the server's
/// default too).
#[pyfunction]
fn default_socket_path() -> std::path::PathBuf {
    orbitkv_client::ClientOptions::default().socket
}
