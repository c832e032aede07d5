//! The matmul loop of `orbitkv-perf dma --interference`: the engine's own GPU work, stood in
//! for by a bf16 matrix multiplication loop in a Python process with PyTorch (cuBLAS on tensor
//! cores, what an inference engine runs), on the same device. It reports its progress on
//! stdout. PyTorch is on every host that runs an engine; without it `--interference` fails
//! saying so.
//!
//! The same process can also move pages itself, as an engine does with the engine-side gather
//! (docs/operations.md): its own gather kernel (`index_select`) into a staging batch on one
//! stream and a copy-engine copy to pinned host memory on another, four batches in flight, or the
//! reverse for a load. Those kernels share the engine's CUDA context instead of time-slicing
//! against it. Commands on its stdin (`save`, `load`, `idle`) start and stop them; it reports
//! `copy <op> <seconds> <bytes>` lines as batches complete (bytes since that op's command).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::interference::Windows;
use crate::error::Error;

/// The matmul loop (`matmul_loop.py`, which says what it does), run as `python3 -c`.
const MATMUL_LOOP: &str = include_str!("matmul_loop.py");

/// How long each window of the measurement lasts.
pub(crate) const WINDOW: Duration = Duration::from_secs(3);

/// How long the engine-side copies may take to report their first batch after a command.
const ENGINE_START: Duration = Duration::from_secs(30);

/// Engine-side copies in the matmul process: the shape of what it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EngineSide {
    /// Bytes of one page (one gathered row; even: the rows are bf16).
    pub page_bytes: u64,
    /// Bytes of one staging batch.
    pub batch_bytes: u64,
    /// Bytes of the page pool gathered from (and of the pinned host buffer).
    pub pool_bytes: u64,
    /// Staging batches in flight.
    pub depth: u32,
}

/// The engine-side staging of the matmul loop, shared by CUDA IPC (for the `engine-gather`
/// rows: the server copies from it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SharedStaging {
    /// `cudaIpcMemHandle_t` of the allocation holding it.
    pub handle: [u8; 64],
    /// Its offset in that allocation, and its bytes.
    pub offset: u64,
    pub len: u64,
}

/// A served op's batch handed over by the matmul loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Handoff {
    /// `staged J K`: slot J holds gathered batch K, to be saved.
    Staged(usize),
    /// `scattered J`: slot J's loaded batch is scattered; the slot is free.
    Scattered(usize),
}

/// Parses a `staging HEX OFFSET BYTES` line.
fn shared_staging(line: &str) -> Option<SharedStaging> {
    let mut w = line.split_whitespace();
    if w.next()? != "staging" {
        return None;
    }
    let hex = w.next()?;
    let (offset, len) = (w.next()?.parse().ok()?, w.next()?.parse().ok()?);
    if hex.len() != 128 || w.next().is_some() {
        return None;
    }
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(SharedStaging { handle, offset, len })
}

/// Parses a `staged J K` or `scattered J` line.
fn handoff(line: &str) -> Option<Handoff> {
    let w: Vec<&str> = line.split_whitespace().collect();
    match w.as_slice() {
        ["staged", j, k] => {
            k.parse::<u64>().ok()?;
            Some(Handoff::Staged(j.parse().ok()?))
        }
        ["scattered", j] => Some(Handoff::Scattered(j.parse().ok()?)),
        _ => None,
    }
}

/// The running matmul loop.
pub(crate) struct MatmulLoop {
    child: Child,
    /// Its staging, or why it did not share it.
    staging: Result<SharedStaging, String>,
    /// The served ops' hand-overs, in arrival order.
    handoffs: std::sync::mpsc::Receiver<Handoff>,
    /// (python seconds, products) per line, in arrival order.
    lines: Arc<Mutex<Vec<(f64, u64)>>>,
    /// (op, python seconds, bytes moved since the op's command) per `copy` line of the
    /// engine-side copies, in arrival order.
    copies: Arc<Mutex<Vec<(String, f64, u64)>>>,
}

impl MatmulLoop {
    /// Starts the loop on CUDA device `device` and waits until it runs; with `engine`, ready
    /// to run engine-side copies of that shape on command ([`MatmulLoop::engine_side`]).
    pub(crate) fn start(device: usize, engine: Option<EngineSide>) -> Result<Self, Error> {
        let python = std::env::var("ORBITKV_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut args = vec!["-c".to_string(), MATMUL_LOOP.to_string(), device.to_string()];
        if let Some(e) = engine {
            args.extend(
                [e.page_bytes, e.batch_bytes, e.pool_bytes, u64::from(e.depth)]
                    .map(|v| v.to_string()),
            );
        }
        let mut child = Command::new(&python)
            .args(&args)
            .stdin(if engine.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::Gpu(format!("--interference: starting {python}: {e}")))?;
        let stdout = child.stdout.take().expect("piped");
        let mut reader = BufReader::new(stdout);
        let mut first = String::new();
        // The staging's handle (or why not) comes before `ready`.
        let mut staging = Err("it runs no engine-side copies".to_string());
        let mut ready = false;
        for _ in 0..2 {
            first.clear();
            if reader.read_line(&mut first).is_err() {
                break;
            }
            if first.trim() == "ready" {
                ready = true;
                break;
            }
            if !first.starts_with("staging") {
                break;
            }
            staging = shared_staging(&first).ok_or_else(|| first.trim().to_string());
        }
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
        let copies = Arc::new(Mutex::new(Vec::new()));
        let (sink, copy_sink) = (Arc::clone(&lines), Arc::clone(&copies));
        let (handed, handoffs) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in reader.lines().map_while(Result::ok) {
                if let Some(h) = handoff(&line) {
                    let _ = handed.send(h);
                    continue;
                }
                let mut parts = line.split_whitespace().peekable();
                let op = if parts.peek() == Some(&"copy") {
                    parts.next();
                    parts.next()
                } else {
                    None
                };
                let (Some(Ok(t)), Some(Ok(n))) =
                    (parts.next().map(str::parse::<f64>), parts.next().map(str::parse::<u64>))
                else {
                    continue;
                };
                match op {
                    Some(op) => copy_sink.lock().unwrap_or_else(|p| p.into_inner()).push((
                        op.to_string(),
                        t,
                        n,
                    )),
                    None => sink.lock().unwrap_or_else(|p| p.into_inner()).push((t, n)),
                }
            }
        });
        Ok(Self { child, staging, handoffs, lines, copies })
    }

    /// The staging the loop shared, or why not (no engine-side copies, or PyTorch could not
    /// share it: its line).
    pub(crate) fn staging(&self) -> Result<SharedStaging, String> {
        self.staging.clone()
    }

    /// The next hand-over of a served op, waiting up to `wait`.
    pub(crate) fn handoff(&self, wait: Duration) -> Option<Handoff> {
        self.handoffs.recv_timeout(wait).ok()
    }

    /// Drops hand-overs left from an earlier op.
    pub(crate) fn forget_handoffs(&self) {
        while self.handoffs.try_recv().is_ok() {}
    }

    /// Whether the loop's process has ended.
    pub(crate) fn ended(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }

    /// Runs the engine-side copies (`save` or `load`) for `WINDOW`, after their first batch
    /// has landed; returns (products per second meanwhile, GB/s the copies moved).
    pub(crate) fn engine_side(&mut self, op: &str) -> Result<(f64, f64), Error> {
        // The last line of this op's copies at or after `from` (a late line of the op before
        // may still arrive after the command: its byte count is another op's).
        let last = |m: &Self, from: usize| {
            let copies = m.copies.lock().unwrap_or_else(|p| p.into_inner());
            copies.iter().skip(from).rev().find(|c| c.0 == op).map(|c| (c.1, c.2))
        };
        let from = self.copies.lock().unwrap_or_else(|p| p.into_inner()).len();
        self.command(op)?;
        let deadline = Instant::now() + ENGINE_START;
        while last(self, from).is_none() {
            if Instant::now() >= deadline || self.child.try_wait().ok().flatten().is_some() {
                let _ = self.command("idle");
                return Err(Error::Gpu(format!(
                    "--interference: the engine-side {op} copies reported nothing within {} s",
                    ENGINE_START.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let (m0, a) = (self.mark(), last(self, from));
        std::thread::sleep(WINDOW);
        let (m1, b) = (self.mark(), last(self, from));
        self.command("idle")?;
        let gbps = match (a, b) {
            (Some(a), Some(b)) if b.0 > a.0 && b.1 > a.1 => (b.1 - a.1) as f64 / (b.0 - a.0) / 1e9,
            _ => 0.0,
        };
        Ok((self.rate(m0, m1), gbps))
    }

    /// The engine-side copies, saves then loads, the matmul's own process gathering and
    /// copying (nothing else runs meanwhile), each after a window alone: rows `engine-side`.
    pub(crate) fn engine_side_rows(&mut self, windows: &mut Windows) -> Result<(), Error> {
        for op in ["save", "load"] {
            windows.measure(self, "engine-side", op, |m| m.engine_side(op))?;
        }
        Ok(())
    }

    /// Sends one command line to the engine-side copies.
    pub(crate) fn command(&mut self, op: &str) -> Result<(), Error> {
        let stdin = self.child.stdin.as_mut().ok_or_else(|| {
            Error::Gpu("--interference: the matmul loop runs no engine-side copies".into())
        })?;
        writeln!(stdin, "{op}")
            .and_then(|()| stdin.flush())
            .map_err(|e| Error::Gpu(format!("--interference: engine-side {op}: {e}")))
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

    /// The tests point `ORBITKV_PYTHON` (process-wide) at their stand-ins one at a time.
    static PYTHON: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A stand-in loop's body: says ready, then one line per 10 ms whose clock advances 1 s
    /// and count 4 per line (so 4 products per second).
    const FOUR_PER_SECOND: &str = "echo ready\ni=0\nt=100\nwhile true; do i=$((i+4)); \
                                   echo \"$t.0 $i\"; t=$((t+1)); sleep 0.01; done";

    /// A stand-in for `python3` running `body`, whatever its arguments.
    fn fake_python(dir: &std::path::Path, body: &str) -> std::path::PathBuf {
        let path = dir.join("python");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// A stand-in for PyTorch, enough for the matmul loop's script to run on a CPU: every
    /// tensor and stream is one object that does nothing, a product takes 2 ms, and the
    /// staging shares a handle of 64 bytes 0xab at offset 512, as PyTorch 2 does (after its
    /// version byte 2 and kind 'c').
    const FAKE_TORCH: &str = r#"
import time
class T:
    shape = (1 << 20, 1 << 20)
    def __getattr__(self, name): return T()
    def __call__(self, *a, **k): return T()
    def __getitem__(self, i): return T()
    def __matmul__(self, o): return T()
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def numel(self): return 4096
    def element_size(self): return 8
    def synchronize(self): time.sleep(0.002)
    def untyped_storage(self):
        s = T()
        s._share_cuda_ = lambda: (0, b"\x02c" + b"\xab" * 64, 1 << 20, 512)
        return s
bfloat16, int64 = "bf16", "i64"
cuda = T()
def randn(*a, **k): return T()
def empty(*a, **k): return T()
def randperm(n, **k): return T()
def index_select(*a, **k): return T()
"#;

    /// The engine-side shape the stand-in runs.
    const SHAPE: EngineSide =
        EngineSide { page_bytes: 2048, batch_bytes: 4 << 20, pool_bytes: 64 << 20, depth: 3 };

    /// Points `ORBITKV_PYTHON` at python3 with `torch` as the stand-in for PyTorch (None,
    /// said, without python3).
    fn with_fake_torch(dir: &std::path::Path, torch: &str) -> Option<()> {
        let Ok(python) = which_python() else {
            println!("skipped: no python3 here");
            return None;
        };
        std::fs::write(dir.join("torch.py"), torch).unwrap();
        let wrapper = fake_python(
            dir,
            &format!("PYTHONPATH={} exec {} \"$@\"", dir.display(), python.display()),
        );
        std::env::set_var("ORBITKV_PYTHON", &wrapper);
        Some(())
    }

    #[test]
    fn a_handle_other_than_cuda_mallocs_is_not_shared() {
        let _one = PYTHON.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        // An expandable segment's: kind 'e', not a cudaIpcMemHandle_t.
        let torch = FAKE_TORCH.replace(r#"b"\x02c" + b"\xab" * 64"#, r#"b"\x02e" + b"\xab" * 40"#);
        assert_ne!(torch, FAKE_TORCH);
        if with_fake_torch(dir.path(), &torch).is_none() {
            return;
        }
        let m = MatmulLoop::start(0, Some(SHAPE));
        std::env::remove_var("ORBITKV_PYTHON");
        let why = m.unwrap().staging().expect_err("no staging shared");
        assert!(why.contains("an IPC handle of 42 bytes"), "{why}");
    }

    #[test]
    fn the_served_ops_hand_batches_over_both_ways() {
        let _one = PYTHON.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        if with_fake_torch(dir.path(), FAKE_TORCH).is_none() {
            return;
        }
        let mut m = MatmulLoop::start(0, Some(SHAPE)).unwrap();
        let plain = MatmulLoop::start(0, None).unwrap().staging();
        assert!(plain.is_err_and(|why| why.contains("no engine-side copies")));
        std::env::remove_var("ORBITKV_PYTHON");
        let st = m.staging().expect("the staging is shared");
        assert_eq!((st.handle, st.offset, st.len), ([0xab; 64], 512, 4096 * 8));
        let next = |m: &MatmulLoop| m.handoff(Duration::from_secs(10)).expect("a hand-over");
        // Saves: every slot is gathered once, then each only once it is handed back.
        m.command("save-server").unwrap();
        for j in 0..3 {
            assert_eq!(next(&m), Handoff::Staged(j));
        }
        assert_eq!(m.handoff(Duration::from_millis(200)), None, "waits for a free slot");
        m.command("free 1").unwrap();
        assert_eq!(m.handoff(Duration::from_millis(200)), None, "slots are taken in turn");
        m.command("free 0").unwrap();
        assert_eq!(next(&m), Handoff::Staged(0));
        assert_eq!(next(&m), Handoff::Staged(1));
        m.command("idle").unwrap();
        assert_eq!(m.handoff(Duration::from_millis(200)), None);
        // Loads: a slot is scattered once loaded, in turn; a stop leaves nothing behind.
        m.forget_handoffs();
        m.command("load-server").unwrap();
        assert_eq!(m.handoff(Duration::from_millis(200)), None, "nothing loaded yet");
        m.command("loaded 0 7").unwrap();
        assert_eq!(next(&m), Handoff::Scattered(0));
        m.command("loaded 2 8").unwrap();
        m.command("loaded 1 9").unwrap();
        assert_eq!(next(&m), Handoff::Scattered(1));
        assert_eq!(next(&m), Handoff::Scattered(2));
        m.command("idle").unwrap();
        // The loop kept multiplying throughout.
        let from = m.mark();
        std::thread::sleep(Duration::from_millis(300));
        assert!(m.mark() > from, "the matmul loop runs on");
        assert!(!m.ended());
    }

    fn which_python() -> Result<std::path::PathBuf, ()> {
        let out = Command::new("sh").args(["-c", "command -v python3"]).output().map_err(|_| ())?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !path.is_empty() {
            Ok(path.into())
        } else {
            Err(())
        }
    }

    #[test]
    fn staging_and_handoff_lines_are_parsed_strictly() {
        let hex = "0f".repeat(64);
        assert_eq!(
            shared_staging(&format!("staging {hex} 8 1024")),
            Some(SharedStaging { handle: [0x0f; 64], offset: 8, len: 1024 })
        );
        for bad in [
            format!("staging {} 8 1024", "0f".repeat(63)),
            format!("staging {hex} -8 1024"),
            format!("staging {hex} 8"),
            format!("staging {hex} 8 1024 5"),
            format!("staging {}zz 8 1024", "0f".repeat(63)),
            "staging-unshared RuntimeError".to_string(),
        ] {
            assert_eq!(shared_staging(&bad), None, "{bad}");
        }
        assert_eq!(handoff("staged 2 17"), Some(Handoff::Staged(2)));
        assert_eq!(handoff("scattered 3"), Some(Handoff::Scattered(3)));
        for bad in
            ["staged 2", "staged x 1", "scattered", "scattered 1 2", "100.5 4", "copy save 1.0 5"]
        {
            assert_eq!(handoff(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_run_alternates_windows_alone_and_measurements() {
        let _one = PYTHON.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let ok = fake_python(dir.path(), FOUR_PER_SECOND);
        std::env::set_var("ORBITKV_PYTHON", &ok);
        let mut m = MatmulLoop::start(0, None).unwrap();
        let mut w = Windows::default();
        let mut calls = 0;
        w.measure(&mut m, "contiguous", "save", |_| {
            calls += 1;
            Ok((3.0, 55.0))
        })
        .unwrap();
        w.end_round();
        let err = w.measure(&mut m, "auto", "load", |_| Err(Error::Gpu("no copy".into())));
        assert!(err.is_err());
        let r = w.finish(&m);
        drop(m);
        std::env::remove_var("ORBITKV_PYTHON");
        assert_eq!(calls, 1);
        // A window alone before each measurement (the failed one's too) and one at the end.
        assert_eq!(r.solo_per_s.len(), 3);
        assert!(r.solo_per_s.iter().all(|x| (x - 4.0).abs() < 1e-9), "{:?}", r.solo_per_s);
        assert_eq!(r.rounds, 1);
        assert_eq!(r.rows.len(), 1);
        assert!((r.rows[0].slowdown - 0.25).abs() < 1e-9, "{:?}", r.rows[0]);
        assert_eq!(r.rows[0].copy_gbps, 55.0);
    }

    #[test]
    fn rates_come_from_the_loop_clock_and_a_missing_torch_is_named() {
        let _one = PYTHON.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let ok = fake_python(dir.path(), FOUR_PER_SECOND);
        std::env::set_var("ORBITKV_PYTHON", &ok);
        let m = MatmulLoop::start(0, None).unwrap();
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
        let err = MatmulLoop::start(0, None).err().expect("refused").to_string();
        assert!(err.contains("needs") && err.contains("torch"), "{err}");
        std::env::remove_var("ORBITKV_PYTHON");
    }

    #[test]
    fn engine_side_copies_run_on_command_and_report_their_rate() {
        let _one = PYTHON.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // Four products and, while a command runs, 2 GB per second of its clock; its
        // arguments are kept to be checked.
        let ok = fake_python(
            dir.path(),
            &format!(
                "shift 2; echo \"$@\" > {d}/args\necho idle > {d}/op\nexec 3<&0\necho ready\n\
                 (while read -r op; do echo \"$op\" > {d}/op; done; echo gone > {d}/op) 0<&3 &\n\
                 i=0; t=100; moved=0; last=none; lastmoved=0\n\
                 while true; do i=$((i+4)); echo \"$t.0 $i\"; op=$(cat {d}/op)\n\
                 if [ \"$op\" = save ] || [ \"$op\" = load ]; then \
                 if [ \"$op\" != \"$last\" ] && [ \"$last\" != none ]; then \
                 echo \"copy $last $t.0 $lastmoved\"; sleep 0.2; fi\n\
                 moved=$((moved+2000000000)); echo \"copy $op $t.0 $moved\"; \
                 last=$op; lastmoved=$moved; else moved=0; fi\n\
                 t=$((t+1)); sleep 0.01; done"
            ),
        );
        std::env::set_var("ORBITKV_PYTHON", &ok);
        let shape =
            EngineSide { page_bytes: 2048, batch_bytes: 32 << 20, pool_bytes: 1 << 30, depth: 4 };
        let mut m = MatmulLoop::start(3, Some(shape)).unwrap();
        let (rate, gbps) = m.engine_side("save").unwrap();
        assert!((rate - 4.0).abs() < 1e-9, "{rate}");
        assert!((gbps - 2.0).abs() < 1e-9, "{gbps}");
        let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
        assert_eq!(args.trim(), "3 2048 33554432 1073741824 4");
        std::thread::sleep(Duration::from_millis(50));
        let op = std::fs::read_to_string(dir.path().join("op")).unwrap();
        assert_eq!(op.trim(), "idle", "the copies are stopped after their window");
        // The next op's rate is its own, though a late line of the save comes after the
        // command (with the save's larger byte count).
        let (rate, gbps) = m.engine_side("load").unwrap();
        assert!((rate - 4.0).abs() < 1e-9, "{rate}");
        assert!((gbps - 2.0).abs() < 1e-9, "{gbps}");
        drop(m);

        // A loop without engine-side copies, or one that dies, is an error naming the cause.
        let mut plain = MatmulLoop::start(0, None).unwrap();
        let err = plain.engine_side("save").expect_err("refused").to_string();
        assert!(err.contains("no engine-side copies"), "{err}");
        drop(plain);
        let dies = fake_python(dir.path(), "echo ready\nread -r op\nexit 3");
        std::env::set_var("ORBITKV_PYTHON", &dies);
        let mut m = MatmulLoop::start(0, Some(shape)).unwrap();
        let err = m.engine_side("load").expect_err("refused").to_string();
        assert!(err.contains("engine-side load") && err.contains("reported nothing"), "{err}");
        std::env::remove_var("ORBITKV_PYTHON");
    }
}
