//! The exception hierarchy: `OrbitKVError` and one subclass per way a call can fail, each
//! carrying `kind` (a stable name) and, for the server's errors, `code` (its wire code name).

use orbitkv_client::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(_native, OrbitKVError, PyException, "Base of every OrbitKV error.");
create_exception!(
    _native,
    Unavailable,
    OrbitKVError,
    "The server cannot be reached now (not running, starting, or reconnects backing off)."
);
create_exception!(
    _native,
    Disconnected,
    OrbitKVError,
    "The session ended while the call was in flight; the next call reconnects."
);
create_exception!(_native, Timeout, Disconnected, "No answer in time; the session was dropped.");
create_exception!(
    _native,
    Stale,
    OrbitKVError,
    "A lease, reservation or registration of an earlier session (before a reconnect)."
);
create_exception!(
    _native,
    ServerError,
    OrbitKVError,
    "The server refused the request; `code` names why (no_space, busy, lease_limit, ...)."
);
create_exception!(
    _native,
    InvalidArgument,
    OrbitKVError,
    "Arguments that cannot be sent; the message names what is wrong."
);
create_exception!(
    _native,
    ProtocolError,
    OrbitKVError,
    "The server broke the protocol, or shared-memory transport failed."
);

/// The Python exception for a client error, with `kind` and `code` set.
pub(crate) fn to_py(e: Error) -> PyErr {
    let message = e.to_string();
    let kind = e.kind();
    let code = e.code().map(|c| c.as_str());
    let err = match &e {
        Error::Connect { .. } | Error::Unavailable { .. } | Error::Starting { .. } => {
            Unavailable::new_err(message)
        }
        Error::Timeout { .. } => Timeout::new_err(message),
        Error::Disconnected(_) => Disconnected::new_err(message),
        Error::Stale => Stale::new_err(message),
        Error::Refused { .. } | Error::Server { .. } => ServerError::new_err(message),
        Error::InvalidArgument(_) | Error::BufferTooSmall { .. } => {
            InvalidArgument::new_err(message)
        }
        Error::Protocol(_) | Error::Ipc(_) => ProtocolError::new_err(message),
    };
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("kind", kind);
        let _ = value.setattr("code", code);
    });
    err
}

/// An `InvalidArgument` raised by the bindings themselves (kind `invalid_argument`).
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    to_py(Error::InvalidArgument(message.into()))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("OrbitKVError", py.get_type::<OrbitKVError>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("Disconnected", py.get_type::<Disconnected>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("Stale", py.get_type::<Stale>())?;
    m.add("ServerError", py.get_type::<ServerError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    Ok(())
}
