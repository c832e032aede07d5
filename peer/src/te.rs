//! Mooncake Transfer Engine (TE), driven through the `mooncake-transfer-engine-non-cuda`
//! wheel's Python API by an embedded interpreter (feature `te-python`): the route a machine
//! without a TE build of its own (CI) can run. One engine per process serves its registered
//! memory to peers and reads or writes theirs; over TCP here (`P2PHANDSHAKE`: peers find each
//! other by `host:rpc_port`, no metadata server); this route uses TCP only.
//!
//! Limits of the wheel, measured: TCP queues at most 1024 transfers per peer (batches are cut
//! to that), its listening ports bind every interface with no authentication (firewall them on
//! hosts), and registering memory holds the interpreter's lock.

use pyo3::prelude::*;
use pyo3::types::PyList;

/// Transfers per batch call: TE's TCP transport queues at most 1024 per peer.
const MAX_BATCH: usize = 1024;

/// Bytes [`TransferEngine::read_streaming`] reads per call.
const PIECE_BYTES: u64 = 4 << 20;

/// Why a TE call failed.
#[derive(Debug, thiserror::Error)]
pub enum TeError {
    /// The wheel could not be imported or the engine not made (Python's error text).
    #[error("Mooncake Transfer Engine: {0}")]
    Python(String),
    /// A call returned an error code.
    #[error("Mooncake Transfer Engine: {what} returned {code}")]
    Failed {
        /// The call.
        what: &'static str,
        /// Its return code.
        code: i64,
    },
}

fn py_err(e: PyErr) -> TeError {
    TeError::Python(e.to_string())
}

/// One Transfer Engine.
#[derive(Debug)]
pub struct TransferEngine {
    engine: Py<PyAny>,
    segment: String,
}

impl TransferEngine {
    /// Starts an engine reachable at `host` (its RPC port is chosen by TE) with `protocol`
    /// (`tcp`, or `rdma` on hosts with RDMA devices).
    pub fn new(host: &str, protocol: &str) -> Result<Self, TeError> {
        Python::attach(|py| {
            let module = py.import("mooncake.engine").map_err(py_err)?;
            let engine =
                module.getattr("TransferEngine").and_then(|c| c.call0()).map_err(py_err)?;
            let code: i64 = engine
                .call_method1("initialize", (host, "P2PHANDSHAKE", protocol, ""))
                .and_then(|r| r.extract())
                .map_err(py_err)?;
            if code != 0 {
                return Err(TeError::Failed { what: "initialize", code });
            }
            let port: u16 =
                engine.call_method0("get_rpc_port").and_then(|r| r.extract()).map_err(py_err)?;
            Ok(Self { engine: engine.unbind(), segment: format!("{host}:{port}") })
        })
    }

    /// The name peers use for this engine's memory (`host:rpc_port`).
    pub fn segment(&self) -> &str {
        &self.segment
    }

    /// Registers `len` bytes at `addr` (for example the arena) for peers to read and write.
    /// The memory must stay mapped until it is unregistered or the engine is dropped.
    pub fn register(&self, addr: u64, len: u64) -> Result<(), TeError> {
        self.call("register_memory", |e| e.call_method1("register_memory", (addr, len)))
    }

    /// Unregisters what [`TransferEngine::register`] registered at `addr`.
    pub fn unregister(&self, addr: u64) -> Result<(), TeError> {
        self.call("unregister_memory", |e| e.call_method1("unregister_memory", (addr,)))
    }

    /// Reads `len` bytes at `remote` in `peer`'s registered memory into `local` (registered
    /// here), waiting for the transfer.
    pub fn read(&self, peer: &str, local: u64, remote: u64, len: u64) -> Result<(), TeError> {
        self.call("transfer_sync_read", |e| {
            e.call_method1("transfer_sync_read", (peer, local, remote, len))
        })
    }

    /// Writes `len` bytes at `local` (registered here) to `remote` in `peer`'s memory.
    pub fn write(&self, peer: &str, local: u64, remote: u64, len: u64) -> Result<(), TeError> {
        self.call("transfer_sync_write", |e| {
            e.call_method1("transfer_sync_write", (peer, local, remote, len))
        })
    }

    /// Reads many ranges of `peer`'s memory, `(local, remote, len)` each, in batches TE's
    /// queues take, waiting for all.
    pub fn read_many(&self, peer: &str, ranges: &[(u64, u64, u64)]) -> Result<(), TeError> {
        for batch in ranges.chunks(MAX_BATCH) {
            self.call("batch_transfer_sync_read", |e| {
                let py = e.py();
                let local = PyList::new(py, batch.iter().map(|r| r.0))?;
                let remote = PyList::new(py, batch.iter().map(|r| r.1))?;
                let lens = PyList::new(py, batch.iter().map(|r| r.2))?;
                e.call_method1("batch_transfer_sync_read", (peer, local, remote, lens))
            })?;
        }
        Ok(())
    }

    /// Reads `(local, remote, len)` ranges of `peer` one call per piece of about
    /// [`PIECE_BYTES`] (what the wheel's synchronous calls allow), calling `landed(n)` after
    /// each piece: the first `n` ranges have landed (`ranges.len()` last on success). On an
    /// error the ranges from the last `n` on may hold anything.
    pub fn read_streaming(
        &self,
        peer: &str,
        ranges: &[(u64, u64, u64)],
        landed: &mut dyn FnMut(usize),
    ) -> Result<(), TeError> {
        let mut at = 0;
        while at < ranges.len() {
            let (mut end, mut bytes) = (at, 0);
            while end < ranges.len() && (end == at || bytes < PIECE_BYTES) {
                bytes += ranges[end].2;
                end += 1;
            }
            self.read_many(peer, &ranges[at..end])?;
            landed(end);
            at = end;
        }
        Ok(())
    }

    /// Calls the engine; an integer result other than 0 is an error.
    fn call(
        &self,
        what: &'static str,
        f: impl for<'a> FnOnce(&'a Bound<'a, PyAny>) -> PyResult<Bound<'a, PyAny>>,
    ) -> Result<(), TeError> {
        Python::attach(|py| {
            let engine = self.engine.bind(py);
            let code: i64 = f(engine).and_then(|r| r.extract()).map_err(py_err)?;
            if code == 0 {
                Ok(())
            } else {
                Err(TeError::Failed { what, code })
            }
        })
    }
}
