//! Client of the server's admin socket: one JSON line out, one JSON line back.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::error::CtlError;

/// Talks to `<socket>.admin`.
#[derive(Debug)]
pub struct AdminClient {
    path: PathBuf,
}

impl AdminClient {
    /// A client for the admin socket at `path`.
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    /// Sends `{"cmd": cmd}` and returns the answer; an `"ok": false` answer is an error.
    pub fn call(&self, cmd: &str) -> Result<Value, CtlError> {
        self.request(&serde_json::json!({ "cmd": cmd }))
    }

    /// Sends `request` (an object with a `"cmd"`) and returns the answer; an `"ok": false`
    /// answer is an error.
    pub fn request(&self, request: &Value) -> Result<Value, CtlError> {
        let mut s = UnixStream::connect(&self.path)
            .map_err(|source| CtlError::Unreachable { path: self.path.clone(), source })?;
        let io = |source| CtlError::Io { path: self.path.clone(), source };
        s.set_read_timeout(Some(Duration::from_secs(10))).map_err(io)?;
        s.write_all(format!("{request}\n").as_bytes()).map_err(io)?;
        let mut line = String::new();
        BufReader::new(s.take(16 << 20)).read_line(&mut line).map_err(io)?;
        let v: Value = serde_json::from_str(&line)
            .map_err(|source| CtlError::NotJson { path: self.path.clone(), source })?;
        if v["ok"] != true {
            return Err(CtlError::Server(v["error"].as_str().unwrap_or("unknown error").into()));
        }
        Ok(v)
    }
}
