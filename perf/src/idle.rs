//! `orbitkv-perf idle`: how much CPU a quiet server burns (adaptive polling should make it
//! close to nothing).

use std::io::Write;
use std::path::PathBuf;

use nix::unistd::{sysconf, SysconfVar};
use serde::Serialize;

use crate::admin;
use crate::args::{socket_or_default, IdleArgs};
use crate::error::Error;

/// The result of `idle`.
#[derive(Debug, Serialize)]
pub(crate) struct IdleReport {
    /// Server CPU time (user + system) over the window, as percent of one core.
    pub cpu_percent: f64,
    /// Length of the window.
    pub duration_s: f64,
}

impl crate::report::Report for IdleReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "idle server CPU: {:.2}% of one core over {:.1} s",
            self.cpu_percent, self.duration_s
        )
    }

    fn passed(&self) -> bool {
        true
    }
}

/// Samples the server's CPU time around a sleep of `--duration`.
pub(crate) fn run(a: &IdleArgs) -> Result<IdleReport, Error> {
    let socket = socket_or_default(&a.socket);
    let pid = admin::facts(&socket)?.pid;
    let ticks_per_s = match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => return Err(Error::Setup("sysconf(CLK_TCK) gave no clock tick rate".into())),
    };
    let before = cpu_ticks(pid)?;
    let started = std::time::Instant::now();
    std::thread::sleep(a.duration);
    let after = cpu_ticks(pid)?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_s = after.saturating_sub(before) as f64 / ticks_per_s;
    Ok(IdleReport { cpu_percent: 100.0 * cpu_s / elapsed, duration_s: elapsed })
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64, Error> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        op: "reading",
        path: path.clone(),
        source,
    })?;
    parse_cpu_ticks(&text).ok_or_else(|| {
        Error::Setup(format!("{} is not in the expected format: {text:?}", path.display()))
    })
}

/// utime (field 14) + stime (field 15) of a `/proc/<pid>/stat` line. The command name (field
/// 2) is parenthesised and may hold spaces and parentheses, so fields are counted from the last
/// `)`.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace().skip(11); // field 3 is the first here
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_utime_and_stime_after_odd_command_names() {
        let line = "1234 (a b) c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 40 0 0 20 0 9 0 \
                    100 1000 10 18446744073709551615";
        assert_eq!(parse_cpu_ticks(line), Some(290));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn reads_this_process() {
        assert!(cpu_ticks(std::process::id()).is_ok());
    }
}
