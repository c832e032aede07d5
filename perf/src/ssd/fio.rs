//! The baseline of `ssd`: fio with the same engine (io_uring), O_DIRECT, pattern, block size,
//! queue depth, size, duration and file, run in the same invocation after the measured loop.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::ssd::drive::DriveConfig;

/// Extra time fio gets beyond `--duration` before it is killed (start-up, file checks).
const FIO_GRACE: Duration = Duration::from_secs(60);
/// Bytes of fio's stderr quoted in an error.
const STDERR_TAIL: usize = 1000;

/// What fio measured.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct FioResult {
    /// Throughput, GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// Operations per second.
    pub iops: f64,
    /// Operations completed.
    pub ops: u64,
    /// Median of submission-to-completion latency (fio's `lat`), microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// 99.9th percentile, microseconds.
    pub p999_us: f64,
    /// fio's version string.
    pub version: String,
    /// The command line that ran.
    pub command: String,
}

/// The `fio` executable on PATH, if any.
pub(crate) fn find() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("fio")).find(|p| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// fio's arguments for `cfg` on `file`.
pub(crate) fn args(cfg: &DriveConfig, file: &Path) -> Vec<String> {
    // fio splits --filename at ':' (several files); a literal colon is written '\:'.
    let filename = file.display().to_string().replace(':', "\\:");
    vec![
        "--name=orbitkv-perf-ssd".into(),
        format!("--filename={filename}"),
        "--ioengine=io_uring".into(),
        "--direct=1".into(),
        format!("--rw={}", cfg.mode.as_str()),
        format!("--bs={}", cfg.block),
        format!("--iodepth={}", cfg.qd),
        format!("--size={}", cfg.file_size),
        "--time_based".into(),
        format!("--runtime={}ms", cfg.duration.as_millis().max(1)),
        format!("--randseed={}", cfg.seed),
        // Percentiles of submission-to-completion latency, what `ssd` measures per op.
        "--lat_percentiles=1".into(),
        "--output-format=json".into(),
    ]
}

/// Runs fio at `bin` for `cfg` on `file`; any failure is a message (the run goes on without
/// its baseline).
pub(crate) fn run(bin: &Path, cfg: &DriveConfig, file: &Path) -> Result<FioResult, String> {
    let args = args(cfg, file);
    let command = format!("{} {}", bin.display(), args.join(" "));
    let mut child = Command::new(bin)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + cfg.duration + FIO_GRACE;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("fio did not finish within {:?}", cfg.duration + FIO_GRACE));
            }
            Err(e) => return Err(format!("waiting for fio: {e}")),
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        let start = stderr.len().saturating_sub(STDERR_TAIL);
        let start = (start..stderr.len()).find(|i| stderr.is_char_boundary(*i)).unwrap_or(0);
        return Err(format!("fio exited with {status}: {}", stderr[start..].trim()));
    }
    let mut result = parse(&stdout, cfg.mode.writes())?;
    result.command = command;
    Ok(result)
}

/// Reads fio's JSON report (anything before its first `{` is fio chatter).
pub(crate) fn parse(stdout: &str, writes: bool) -> Result<FioResult, String> {
    let json = stdout.find('{').map(|i| &stdout[i..]).ok_or("fio printed no JSON report")?;
    let v: Value =
        serde_json::from_str(json).map_err(|e| format!("fio's report is not JSON: {e}"))?;
    let job = v.get("jobs").and_then(|j| j.get(0)).ok_or("fio's report has no job")?;
    match job.get("error").and_then(Value::as_i64) {
        Some(0) => {}
        Some(e) => return Err(format!("fio's job failed with error {e}")),
        None => return Err("fio's job has no error field".into()),
    }
    let side = job.get(if writes { "write" } else { "read" }).ok_or("fio's job has no I/O side")?;
    let number = |path: &[&str]| {
        let mut at = side;
        for p in path {
            at = at.get(p).ok_or_else(|| format!("fio's report has no {}", path.join(".")))?;
        }
        at.as_f64().ok_or_else(|| format!("fio's {} is not a number", path.join(".")))
    };
    let us = |q: &str| number(&["lat_ns", "percentile", q]).map(|ns| ns / 1e3);
    Ok(FioResult {
        gbps: number(&["bw_bytes"])? / 1e9,
        iops: number(&["iops"])?,
        ops: number(&["total_ios"])? as u64,
        p50_us: us("50.000000")?,
        p99_us: us("99.000000")?,
        p999_us: us("99.900000")?,
        version: v.get("fio version").and_then(Value::as_str).unwrap_or("?").to_string(),
        command: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::SsdMode;

    fn cfg(mode: SsdMode) -> DriveConfig {
        DriveConfig {
            mode,
            block: 1 << 20,
            qd: 32,
            file_size: 2 << 30,
            duration: Duration::from_secs(10),
            seed: 5,
        }
    }

    #[test]
    fn arguments_carry_the_same_parameters() {
        let a = args(&cfg(SsdMode::RandWrite), Path::new("/tmp/a:b/f.dat"));
        for want in [
            "--filename=/tmp/a\\:b/f.dat",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randwrite",
            "--bs=1048576",
            "--iodepth=32",
            "--size=2147483648",
            "--time_based",
            "--runtime=10000ms",
            "--output-format=json",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing from {a:?}");
        }
    }

    const REPORT: &str = r#"note: a line of chatter
{
  "fio version" : "fio-3.33",
  "jobs" : [ { "jobname" : "orbitkv-perf-ssd", "error" : 0,
      "read" : { "bw_bytes" : 2500000000, "iops" : 2384.2, "total_ios" : 23842,
        "lat_ns" : { "percentile" : { "50.000000" : 12000000, "99.000000" : 30000000,
                                      "99.900000" : 45000000 } } },
      "write" : { "bw_bytes" : 0, "iops" : 0.0, "total_ios" : 0,
        "lat_ns" : { "min" : 0, "max" : 0 } } } ]
}"#;

    #[test]
    fn parses_the_side_that_ran() {
        let r = parse(REPORT, false).unwrap();
        assert_eq!(r.gbps, 2.5);
        assert_eq!(r.iops, 2384.2);
        assert_eq!(r.ops, 23842);
        assert_eq!((r.p50_us, r.p99_us, r.p999_us), (12000.0, 30000.0, 45000.0));
        assert_eq!(r.version, "fio-3.33");
        // The write side has no percentiles: asking for it is an error, not zeros.
        assert!(parse(REPORT, true).unwrap_err().contains("percentile"));
        assert!(parse("no json", false).is_err());
        let failed = REPORT.replace("\"error\" : 0", "\"error\" : 5");
        assert!(parse(&failed, false).unwrap_err().contains("error 5"));
    }
}
