//! The Transfer Engine as peering uses it: one per process, through the C API of a TE build
//! the operator names (`--te-library`), else through the wheel's Python API in builds with
//! `te-python`, else none (then peering does not start).

use std::path::Path;
use std::sync::Arc;

use crate::te_c;

/// A Transfer Engine call's failure, from whichever route the engine takes.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Through the C API.
    #[error(transparent)]
    C(#[from] te_c::TeCError),
    /// Through the wheel's Python API.
    #[cfg(feature = "te-python")]
    #[error(transparent)]
    Python(#[from] crate::te::TeError),
}

/// The host's RDMA devices as the kernel lists them (`/sys/class/infiniband`), which TE's
/// topology discovery looks among.
fn rdma_devices() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// Said with a failure to make the engine: its usual cause that TE's own log does not name.
const START_HINT: &str = "TE's log above says why; if it found no free port: TE binds two \
    ports from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (15000-17000 unless set), and those of an \
    engine killed in the last minute or so stay unusable (TCP TIME_WAIT)";

/// This process's Transfer Engine.
#[derive(Clone, Debug)]
pub enum Engine {
    /// Through the C API of a TE build's library.
    C(Arc<te_c::TransferEngine>),
    /// Through the wheel's Python API.
    #[cfg(feature = "te-python")]
    Python(Arc<crate::te::TransferEngine>),
}

impl Engine {
    /// Starts the engine on `host`: from `library` when given, moving bytes with `transport`,
    /// else the wheel's in builds with `te-python` (TCP), else none.
    pub fn start(
        host: &str,
        library: Option<&Path>,
        transport: te_c::TeTransport,
    ) -> Result<Option<Engine>, String> {
        if let Some(library) = library {
            let named = |e: te_c::TeCError| format!("--te-library: {e}");
            let api = te_c::load(library).map_err(named)?;
            let engine = te_c::TransferEngine::new(api, host, transport).map_err(|e| match e {
                te_c::TeCError::Failed { what: "createTransferEngine", .. } => {
                    format!("{}; {START_HINT}", named(e))
                }
                e => named(e),
            })?;
            let devices = rdma_devices();
            tracing::info!(
                library = %library.display(),
                transport = transport.as_str(),
                rdma_devices = ?devices,
                "Transfer Engine started through its C API ({})",
                match (transport, devices.is_empty(), std::env::var_os("MC_FORCE_TCP")) {
                    (te_c::TeTransport::Auto, false, None) => "RDMA over the devices TE discovers",
                    _ => "TCP",
                }
            );
            return Ok(Some(Engine::C(Arc::new(engine))));
        }
        #[cfg(feature = "te-python")]
        {
            crate::te::TransferEngine::new(host, "tcp")
                .map(|e| Some(Engine::Python(Arc::new(e))))
                .map_err(|e| match e {
                    crate::te::TeError::Failed { what: "initialize", .. } => {
                        format!("{e}; {START_HINT}")
                    }
                    e => e.to_string(),
                })
        }
        #[cfg(not(feature = "te-python"))]
        Ok(None)
    }

    /// The name peers use for this engine's memory (`host:rpc_port`).
    pub fn segment(&self) -> &str {
        match self {
            Engine::C(e) => e.segment(),
            #[cfg(feature = "te-python")]
            Engine::Python(e) => e.segment(),
        }
    }

    /// Registers `len` bytes at `addr` for peers to read and as the local side of reads; the
    /// memory must stay mapped while the engine lives.
    pub fn register(&self, addr: u64, len: u64) -> Result<(), EngineError> {
        match self {
            Engine::C(e) => Ok(e.register(addr, len)?),
            #[cfg(feature = "te-python")]
            Engine::Python(e) => Ok(e.register(addr, len)?),
        }
    }

    /// `peer` left the cluster: the C route looks its segment up afresh next time (an engine
    /// back at the same address is another one). The wheel keeps what it knew (its Python API
    /// has no call to drop it); a transfer that fails on that is a miss.
    pub fn forget_segment(&self, peer: &str) {
        match self {
            Engine::C(e) => e.forget_segment(peer),
            #[cfg(feature = "te-python")]
            Engine::Python(_) => {}
        }
    }

    /// Reads `(local, remote, len)` ranges of `peer` in as few calls as the engine takes,
    /// waiting for all.
    pub fn read_many(&self, peer: &str, ranges: &[(u64, u64, u64)]) -> Result<(), EngineError> {
        match self {
            Engine::C(e) => Ok(e.read_many(peer, ranges)?),
            #[cfg(feature = "te-python")]
            Engine::Python(e) => Ok(e.read_many(peer, ranges)?),
        }
    }
}
