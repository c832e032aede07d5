//! The server's admin socket from Python, through the one admin client (`orbitkv_proto::admin::
//! AdminClient`): a request object out, the answer back as it came.

use std::path::PathBuf;
use std::time::Duration;

use orbitkv_proto::admin::{AdminClient, AdminError};
use pyo3::prelude::*;

use orbitkv_client::Error;

use crate::errors::{invalid, to_py};

/// Sends `request` (a JSON object's text, `{"cmd": ...}`) to the admin socket of the server
/// whose bootstrap socket is `socket` (default: the client's) and returns the answer's JSON
/// text, whatever its `"ok"` says; waits at most `timeout` seconds.
#[pyfunction]
#[pyo3(signature = (request, socket = None, timeout = 10.0))]
pub(crate) fn admin_request(
    py: Python<'_>,
    request: &str,
    socket: Option<PathBuf>,
    timeout: f64,
) -> PyResult<String> {
    let request: serde_json::Value = serde_json::from_str(request)
        .map_err(|e| invalid(format!("an admin request is a JSON object: {e}")))?;
    if !request.is_object() {
        return Err(invalid("an admin request is a JSON object with a \"cmd\""));
    }
    if !timeout.is_finite() || timeout <= 0.0 || timeout > 86_400.0 {
        return Err(invalid(format!("timeout = {timeout}: seconds, above 0 and at most a day")));
    }
    let socket = socket.unwrap_or_else(|| orbitkv_client::ClientOptions::default().socket);
    let client = AdminClient::new(orbitkv_proto::admin_socket_path(&socket))
        .with_timeout(Duration::from_secs_f64(timeout));
    let answer = py.detach(|| client.send(&request)).map_err(|e| match e {
        AdminError::Unreachable { path, source } => to_py(Error::Connect { socket: path, source }),
        e @ AdminError::Io { .. } => to_py(Error::Disconnected(e.to_string())),
        other => to_py(Error::Protocol(other.to_string())),
    })?;
    Ok(answer.to_string())
}
