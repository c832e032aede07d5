//! The admin socket's requests as the server reads them: one line, a JSON object with a `"cmd"`
//! string; an `evict`'s target. (The commands and their answers: docs/operations.md.)

use serde_json::Value;

/// A request line that is not a request.
#[derive(Debug, thiserror::Error)]
pub enum AdminRequestError {
    /// Not JSON at all.
    #[error("request is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// JSON without a `"cmd"` string.
    #[error("request has no \"cmd\" string")]
    NoCommand,
}

/// One request line: its command and the whole object.
pub fn parse_admin_request(line: &str) -> Result<(String, Value), AdminRequestError> {
    let v = serde_json::from_str::<Value>(line).map_err(AdminRequestError::NotJson)?;
    match v.get("cmd").and_then(Value::as_str) {
        Some(cmd) => Ok((cmd.to_owned(), v)),
        None => Err(AdminRequestError::NoCommand),
    }
}

/// An `evict` request that names neither a namespace nor everything, or both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EvictTargetError {
    /// `"namespace"` is not an unsigned 64-bit integer.
    #[error("evict: \"namespace\" must be a namespace id (an unsigned 64-bit integer)")]
    BadNamespace,
    /// `"all"` is there but not `true`.
    #[error("evict: \"all\" must be true")]
    AllNotTrue,
    /// Both are there.
    #[error("evict: give \"namespace\" or \"all\", not both")]
    Both,
    /// Neither is there.
    #[error("evict: give \"namespace\": ID or \"all\": true")]
    Neither,
}

/// What an `evict` request names: a namespace, or every chunk (None).
pub fn evict_target(request: &Value) -> Result<Option<u64>, EvictTargetError> {
    match (request.get("namespace"), request.get("all")) {
        (Some(n), None) => n.as_u64().map(Some).ok_or(EvictTargetError::BadNamespace),
        (None, Some(Value::Bool(true))) => Ok(None),
        (None, Some(_)) => Err(EvictTargetError::AllNotTrue),
        (Some(_), Some(_)) => Err(EvictTargetError::Both),
        (None, None) => Err(EvictTargetError::Neither),
    }
}
