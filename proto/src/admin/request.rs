//! The admin socket's requests: one line, a JSON object whose `"cmd"` string names the command
//! (`{"cmd":"health"}`, ..., `{"cmd":"evict","namespace":ID}` or `{"cmd":"evict","all":true}`).
//! Members a command does not read are ignored.

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

/// One admin request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", try_from = "Value")]
pub enum AdminRequest {
    /// Readiness, and what is impaired ([`HealthReply`](crate::admin::HealthReply)).
    Health,
    /// The server's state and every shard's counters (a JSON object,
    /// [`StatsReply`](crate::admin::StatsReply) reads part of it).
    Stats,
    /// Stop admitting sessions and writes ([`StateReply`](crate::admin::StateReply)).
    Drain,
    /// Admit them again ([`StateReply`](crate::admin::StateReply)).
    Resume,
    /// The open sessions ([`SessionsReply`](crate::admin::SessionsReply)).
    Sessions,
    /// Cluster membership and the peers ([`PeersReply`](crate::admin::PeersReply)).
    Peers,
    /// Every shard's full scan of its bookkeeping ([`AuditReply`](crate::admin::AuditReply)).
    Audit,
    /// Remove chunks from every tier ([`EvictReply`](crate::admin::EvictReply)).
    Evict(EvictTarget),
}

impl AdminRequest {
    /// The request read from one line, with the server's messages for what is not a request.
    pub fn parse(line: &str) -> Result<Self, AdminRequestError> {
        AdminRequestLine::parse(line)?.request()
    }

    /// Its `"cmd"`.
    pub fn cmd(&self) -> &'static str {
        match self {
            Self::Health => "health",
            Self::Stats => "stats",
            Self::Drain => "drain",
            Self::Resume => "resume",
            Self::Sessions => "sessions",
            Self::Peers => "peers",
            Self::Audit => "audit",
            Self::Evict(_) => "evict",
        }
    }
}

impl TryFrom<Value> for AdminRequest {
    type Error = AdminRequestError;

    fn try_from(v: Value) -> Result<Self, AdminRequestError> {
        AdminRequestLine::from_value(v)?.request()
    }
}

/// What an `evict` removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictTarget {
    /// One namespace's chunks (`"namespace": ID`).
    Namespace(u64),
    /// Every chunk (`"all": true`).
    All,
}

impl EvictTarget {
    /// The target an `evict` request object names.
    pub fn of(request: &Value) -> Result<Self, EvictTargetError> {
        match (request.get("namespace"), request.get("all")) {
            (Some(n), None) => {
                n.as_u64().map(Self::Namespace).ok_or(EvictTargetError::BadNamespace)
            }
            (None, Some(Value::Bool(true))) => Ok(Self::All),
            (None, Some(_)) => Err(EvictTargetError::AllNotTrue),
            (Some(_), Some(_)) => Err(EvictTargetError::Both),
            (None, None) => Err(EvictTargetError::Neither),
        }
    }

    /// The namespace, None for every chunk.
    pub fn namespace(self) -> Option<u64> {
        match self {
            Self::Namespace(id) => Some(id),
            Self::All => None,
        }
    }
}

impl Serialize for EvictTarget {
    /// `{"namespace": ID}` or `{"all": true}` (the members beside `"cmd"`).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        match self {
            Self::Namespace(id) => m.serialize_entry("namespace", id)?,
            Self::All => m.serialize_entry("all", &true)?,
        }
        m.end()
    }
}

/// A request line read as far as its command. The server decides who may run the command
/// (and whether it can run while the server starts) before it reads the rest, so that a
/// refusal does not depend on the rest.
#[derive(Clone, Debug, PartialEq)]
pub struct AdminRequestLine {
    cmd: String,
    object: Value,
}

impl AdminRequestLine {
    /// One line: a JSON object with a `"cmd"` string.
    pub fn parse(line: &str) -> Result<Self, AdminRequestError> {
        Self::from_value(serde_json::from_str(line).map_err(AdminRequestError::NotJson)?)
    }

    fn from_value(object: Value) -> Result<Self, AdminRequestError> {
        match object.get("cmd").and_then(Value::as_str) {
            Some(cmd) => Ok(Self { cmd: cmd.to_owned(), object }),
            None => Err(AdminRequestError::NoCommand),
        }
    }

    /// Its `"cmd"`, as sent (it may name no command).
    pub fn cmd(&self) -> &str {
        &self.cmd
    }

    /// The request: an unknown command, or an `evict` without a proper target, is an error.
    pub fn request(&self) -> Result<AdminRequest, AdminRequestError> {
        Ok(match self.cmd.as_str() {
            "health" => AdminRequest::Health,
            "stats" => AdminRequest::Stats,
            "drain" => AdminRequest::Drain,
            "resume" => AdminRequest::Resume,
            "sessions" => AdminRequest::Sessions,
            "peers" => AdminRequest::Peers,
            "audit" => AdminRequest::Audit,
            "evict" => AdminRequest::Evict(EvictTarget::of(&self.object)?),
            other => return Err(AdminRequestError::UnknownCommand(other.to_owned())),
        })
    }
}

/// A request line that is not a request (the message is the server's answer).
#[derive(Debug, thiserror::Error)]
pub enum AdminRequestError {
    /// Not JSON at all.
    #[error("request is not JSON: {0}")]
    NotJson(serde_json::Error),
    /// JSON without a `"cmd"` string.
    #[error("request has no \"cmd\" string")]
    NoCommand,
    /// A `"cmd"` that names no command.
    #[error("unknown command {0:?}")]
    UnknownCommand(String),
    /// An `evict` that does not say what to evict.
    #[error(transparent)]
    Evict(#[from] EvictTargetError),
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

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: [AdminRequest; 10] = [
        AdminRequest::Health,
        AdminRequest::Stats,
        AdminRequest::Drain,
        AdminRequest::Resume,
        AdminRequest::Sessions,
        AdminRequest::Peers,
        AdminRequest::Audit,
        AdminRequest::Evict(EvictTarget::All),
        AdminRequest::Evict(EvictTarget::Namespace(0)),
        AdminRequest::Evict(EvictTarget::Namespace(u64::MAX)),
    ];

    #[test]
    fn every_request_round_trips_through_its_line() {
        for request in EVERY {
            let line = serde_json::to_string(&request).unwrap();
            assert_eq!(AdminRequest::parse(&line).unwrap(), request, "{line}");
            assert_eq!(serde_json::from_str::<AdminRequest>(&line).unwrap(), request, "{line}");
            assert_eq!(AdminRequestLine::parse(&line).unwrap().cmd(), request.cmd(), "{line}");
        }
    }

    #[test]
    fn requests_are_the_documented_lines() {
        let line = |r: AdminRequest| serde_json::to_value(r).unwrap();
        assert_eq!(line(AdminRequest::Health), serde_json::json!({"cmd": "health"}));
        assert_eq!(line(AdminRequest::Audit), serde_json::json!({"cmd": "audit"}));
        assert_eq!(
            line(AdminRequest::Evict(EvictTarget::Namespace(12))),
            serde_json::json!({"cmd": "evict", "namespace": 12})
        );
        assert_eq!(
            line(AdminRequest::Evict(EvictTarget::All)),
            serde_json::json!({"cmd": "evict", "all": true})
        );
        // Members a command does not read do not matter.
        let extra = r#"{"cmd":"audit","extra":[1,2,{"x":null}],"namespace":"x"}"#;
        assert_eq!(AdminRequest::parse(extra).unwrap(), AdminRequest::Audit);
    }

    #[test]
    fn bad_lines_get_the_servers_messages() {
        let message = |line: &str| AdminRequest::parse(line).unwrap_err().to_string();
        assert!(message("health").starts_with("request is not JSON: "), "{}", message("health"));
        assert!(message("").starts_with("request is not JSON: "));
        for no_cmd in ["{}", "[1]", "5", r#"{"cmd":5}"#, r#"{"command":"health"}"#] {
            assert_eq!(message(no_cmd), "request has no \"cmd\" string", "{no_cmd}");
        }
        assert_eq!(message(r#"{"cmd":"frobnicate"}"#), r#"unknown command "frobnicate""#);
        assert_eq!(message(r#"{"cmd":"Health"}"#), r#"unknown command "Health""#);
        assert_eq!(message(r#"{"cmd":"a\"b"}"#), r#"unknown command "a\"b""#);
        for (line, says) in [
            (r#"{"cmd":"evict"}"#, "evict: give \"namespace\": ID or \"all\": true"),
            (
                r#"{"cmd":"evict","namespace":"x"}"#,
                "evict: \"namespace\" must be a namespace id (an unsigned 64-bit integer)",
            ),
            (
                r#"{"cmd":"evict","namespace":-1}"#,
                "evict: \"namespace\" must be a namespace id (an unsigned 64-bit integer)",
            ),
            (
                r#"{"cmd":"evict","namespace":1.0}"#,
                "evict: \"namespace\" must be a namespace id (an unsigned 64-bit integer)",
            ),
            (
                r#"{"cmd":"evict","namespace":null}"#,
                "evict: \"namespace\" must be a namespace id (an unsigned 64-bit integer)",
            ),
            (r#"{"cmd":"evict","all":false}"#, "evict: \"all\" must be true"),
            (r#"{"cmd":"evict","all":"yes"}"#, "evict: \"all\" must be true"),
            (
                r#"{"cmd":"evict","all":true,"namespace":1}"#,
                "evict: give \"namespace\" or \"all\", not both",
            ),
        ] {
            assert_eq!(message(line), says, "{line}");
        }
        // Deserializing says the same.
        let e = serde_json::from_str::<AdminRequest>(r#"{"cmd":"evict","all":false}"#);
        assert_eq!(e.unwrap_err().to_string(), "evict: \"all\" must be true");
    }

    #[test]
    fn the_command_is_read_before_the_rest() {
        let line = AdminRequestLine::parse(r#"{"cmd":"evict","all":false}"#).unwrap();
        assert_eq!(line.cmd(), "evict");
        assert!(matches!(
            line.request(),
            Err(AdminRequestError::Evict(EvictTargetError::AllNotTrue))
        ));
        let line = AdminRequestLine::parse(r#"{"cmd":"nope"}"#).unwrap();
        assert_eq!(line.cmd(), "nope");
        assert!(matches!(line.request(), Err(AdminRequestError::UnknownCommand(c)) if c == "nope"));
    }
}
