//! The server's admin socket (`<socket>.admin`): one JSON line out, one JSON line back.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::error::Error;

/// Longest wait for an admin answer (stats asks every shard).
const TIMEOUT: Duration = Duration::from_secs(10);
/// Longest answer accepted.
const MAX_ANSWER: u64 = 16 << 20;

/// The admin socket of the server whose bootstrap socket is `socket`.
pub(crate) fn path(socket: &Path) -> PathBuf {
    orbitkv_proto::admin_socket_path(socket)
}

/// Sends `{"cmd": cmd}` and returns the answer, which must say `"ok": true`.
pub(crate) fn request(socket: &Path, cmd: &str) -> Result<Value, Error> {
    request_json(socket, &json!({ "cmd": cmd }))
}

/// Sends `request` (`{"cmd": ..., ...}`) and returns the answer, which must say `"ok": true`.
pub(crate) fn request_json(socket: &Path, request: &Value) -> Result<Value, Error> {
    let cmd = request["cmd"].as_str().unwrap_or("?");
    let path = path(socket);
    let fail = |reason: String| Error::Admin { path: path.clone(), reason };
    let io = |what: &str, e: std::io::Error| fail(format!("{what}: {e}"));
    let stream = UnixStream::connect(&path).map_err(|e| io("cannot connect", e))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
        .map_err(|e| io("cannot set timeouts", e))?;
    let mut line = request.to_string();
    line.push('\n');
    (&stream).write_all(line.as_bytes()).map_err(|e| io("cannot send", e))?;
    let mut answer = String::new();
    BufReader::new((&stream).take(MAX_ANSWER))
        .read_line(&mut answer)
        .map_err(|e| io(&format!("no answer to {cmd}"), e))?;
    let v: Value = serde_json::from_str(&answer)
        .map_err(|e| fail(format!("answer to {cmd} is not JSON ({e}): {answer:?}")))?;
    if v.get("ok") != Some(&Value::Bool(true)) {
        return Err(fail(format!("{cmd} failed: {v}")));
    }
    Ok(v)
}

/// What the benchmark needs to know about the server, from `stats`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ServerFacts {
    /// The server's process id.
    pub pid: u32,
    /// Shard count.
    pub shards: usize,
    /// DRAM arena bytes.
    pub arena_bytes: u64,
    /// Evictions so far, summed over the shards that answered.
    pub evictions: u64,
}

/// The CPUs the server's shards are pinned to (none when they run unpinned).
pub(crate) fn shard_cores(socket: &Path) -> Result<Vec<usize>, Error> {
    let v = request(socket, "stats")?;
    Ok(v.get("shards")
        .and_then(Value::as_array)
        .map(|shards| {
            shards
                .iter()
                .filter_map(|s| s.get("core").and_then(Value::as_u64))
                .map(|c| c as usize)
                .collect()
        })
        .unwrap_or_default())
}

/// Reads [`ServerFacts`] from `stats`.
pub(crate) fn facts(socket: &Path) -> Result<ServerFacts, Error> {
    let v = request(socket, "stats")?;
    parse_facts(&v).map_err(|reason| Error::Admin { path: path(socket), reason })
}

fn parse_facts(v: &Value) -> Result<ServerFacts, String> {
    let field = |name: &str| {
        v.get(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("stats has no numeric {name:?}: {v}"))
    };
    let shards = v
        .get("shards")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("stats has no \"shards\" list: {v}"))?;
    let evictions = shards.iter().filter_map(|s| s.get("evictions").and_then(Value::as_u64)).sum();
    Ok(ServerFacts {
        pid: u32::try_from(field("pid")?).map_err(|_| "stats pid is out of range".to_string())?,
        shards: shards.len(),
        arena_bytes: field("arena_bytes")?,
        evictions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_sum_evictions_over_answering_shards() {
        let v = json!({"ok": true, "pid": 42, "arena_bytes": 1024,
            "shards": [{"id": 0, "evictions": 3}, {"id": 1, "answering": false},
                       {"id": 2, "evictions": 4}]});
        assert_eq!(
            parse_facts(&v).unwrap(),
            ServerFacts { pid: 42, shards: 3, arena_bytes: 1024, evictions: 7 }
        );
        assert!(parse_facts(&json!({"ok": true})).is_err());
    }
}
