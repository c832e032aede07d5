//! `orbitkv-perf dma --interference`: how much the copies slow down the engine's own GPU work.
//!
//! The engine's work is stood in for by a bf16 matrix multiplication loop in a Python process
//! with PyTorch (cuBLAS on tensor cores, what an inference engine runs), on the same device.
//! It reports its progress on stdout; the loop's rate alone is compared with its rate while
//! saves, then loads, run back to back in this process. PyTorch is on every host that runs an
//! engine; without it `--interference` fails saying so.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::Error;

/// The matmul loop: two 8192 x 8192 bf16 matrices, four products per line of output
/// (`<perf_counter seconds> <products so far>`), after a `ready` line.
const MATMUL_LOOP: &str = r#"
import sys, time
import torch
dev = int(sys.argv[1])
torch.cuda.set_device(dev)
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()
print("ready", flush=True)
count = 0
while True:
    for _ in range(4):
        c = a @ b
    torch.cuda.synchronize()
    count += 4
    print(f"{time.perf_counter():.6f} {count}", flush=True)
"#;

/// How long each window of the measurement lasts.
pub(crate) const WINDOW: Duration = Duration::from_secs(3);

/// The interference part of the report: the matmul loop alone, then beside each way of
/// copying (the contiguous ceiling copy first: what any copy of these bytes costs the engine).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct InterferenceResult {
    /// Matrix products per second with no copy running, before the copies.
    pub matmul_per_s_alone: f64,
    /// ... and after them; slowdowns are against the larger of the two.
    pub matmul_per_s_alone_after: f64,
    /// One row per strategy and direction.
    pub rows: Vec<InterferenceRow>,
}

/// The matmul loop beside one way of copying, run back to back for a window.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct InterferenceRow {
    /// `contiguous` (the ceiling copy), `auto`, `staged`, `batched`, or `auto+checksums`
    /// (saves with the GPU checksums beside them, as the server runs them by default).
    pub strategy: &'static str,
    /// `save` or `load`.
    pub direction: &'static str,
    /// Matrix products per second meanwhile.
    pub matmul_per_s: f64,
    /// 1 - matmul_per_s / the better of the two rates alone.
    pub slowdown: f64,
    /// Median GB/s of the copies meanwhile.
    pub copy_gbps: f64,
}

/// The running matmul loop.
pub(crate) struct MatmulLoop {
    child: Child,
    /// (python seconds, products) per line, in arrival order.
    lines: Arc<Mutex<Vec<(f64, u64)>>>,
}

impl MatmulLoop {
    /// Starts the loop on CUDA device `device` and waits until it runs.
    pub(crate) fn start(device: usize) -> Result<Self, Error> {
        let python = std::env::var("ORBITKV_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = Command::new(&python)
            .args(["-c", MATMUL_LOOP, &device.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Gpu(format!("--interference: starting {python}: {e}")))?;
        let stdout = child.stdout.take().expect("piped");
        let mut reader = BufReader::new(stdout);
        let mut first = String::new();
        let ready = reader.read_line(&mut first).is_ok() && first.trim() == "ready";
        if !ready {
            let _ = child.kill();
            let out = child.wait_with_output().ok();
            let err =
                out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default();
            let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
            return Err(Error::Gpu(format!(
                "--interference needs {python} with PyTorch and CUDA (the matmul loop did not start: {tail})"
            )));
        }
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                let mut parts = line.split_whitespace();
                if let (Some(Ok(t)), Some(Ok(n))) =
                    (parts.next().map(str::parse::<f64>), parts.next().map(str::parse::<u64>))
                {
                    sink.lock().unwrap_or_else(|p| p.into_inner()).push((t, n));
                }
            }
        });
        Ok(Self { child, lines })
    }

    /// Lines received so far.
    pub(crate) fn mark(&self) -> usize {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Products per second between two marks (line counts), from the loop's own clock.
    pub(crate) fn rate(&self, from: usize, to: usize) -> f64 {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        let (Some(a), Some(b)) = (lines.get(from), lines.get(to.saturating_sub(1))) else {
            return 0.0;
        };
        if b.0 > a.0 {
            (b.1 - a.1) as f64 / (b.0 - a.0)
        } else {
            0.0
        }
    }

    /// Runs `f` repeatedly for at least `WINDOW`; returns (products per second meanwhile,
    /// what `f` returned each time).
    pub(crate) fn during<T>(
        &self,
        mut f: impl FnMut() -> Result<T, Error>,
    ) -> Result<(f64, Vec<T>), Error> {
        let from = self.mark();
        let start = Instant::now();
        let mut out = Vec::new();
        while start.elapsed() < WINDOW {
            out.push(f()?);
        }
        Ok((self.rate(from, self.mark()), out))
    }

    /// Products per second over `WINDOW` with nothing else running here.
    pub(crate) fn alone(&self) -> f64 {
        let from = self.mark();
        std::thread::sleep(WINDOW);
        self.rate(from, self.mark())
    }
}

impl Drop for MatmulLoop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// A stand-in for `python3`: ignores its arguments, says ready, then one line per 10 ms
    /// whose clock advances 1 s and count 4 per line (so 4 products per second).
    fn fake_python(dir: &std::path::Path, body: &str) -> std::path::PathBuf {
        let path = dir.join("python");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn rates_come_from_the_loop_clock_and_a_missing_torch_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let ok = fake_python(
            dir.path(),
            "echo ready\ni=0\nt=100\nwhile true; do i=$((i+4)); echo \"$t.0 $i\"; t=$((t+1)); sleep 0.01; done",
        );
        std::env::set_var("ORBITKV_PYTHON", &ok);
        let m = MatmulLoop::start(0).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let a = m.mark();
        std::thread::sleep(Duration::from_millis(200));
        let b = m.mark();
        assert!(b > a + 2, "lines arrive: {a} -> {b}");
        assert!((m.rate(a, b) - 4.0).abs() < 1e-9, "{}", m.rate(a, b));
        assert_eq!(m.rate(b, b), 0.0);
        drop(m);

        let bad = fake_python(
            dir.path(),
            "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1",
        );
        std::env::set_var("ORBITKV_PYTHON", &bad);
        let err = MatmulLoop::start(0).err().expect("refused").to_string();
        assert!(err.contains("needs") && err.contains("torch"), "{err}");
        std::env::remove_var("ORBITKV_PYTHON");
    }
}
