//! The server while it starts. Its sockets (bootstrap, admin, metrics) are bound before the
//! arena is populated, and answer from then on: not ready, what is being done and how far it
//! got (`populating the arena: 42% ...`); an engine's hello gets `Welcome::Starting` (connect
//! again in a moment: no session, nothing held). Once the shards run, [`Startup::serve`] hands
//! the listeners the server. The steps' durations stay here for `stats` and the metrics.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use orbitkv_proto::admin::{HealthReply, ServerState, StartingProgress};
use orbitkv_proto::format_bytes;
use orbitkv_shards::Arena;
use serde_json::{json, Value};

use crate::config::Settings;
use crate::control::access::Access;
use crate::control::shared::Shared;

/// What a starting server is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Faulting in (and locking) the arena, each shard's slice on its core.
    Populating = 0,
    /// Registering the arena with CUDA (pinning it for DMA).
    RegisteringCuda = 1,
    /// Starting the shard executors (and reading the SSD tier's records).
    StartingShards = 2,
    /// Serving.
    Serving = 3,
}

impl Phase {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Populating,
            1 => Self::RegisteringCuda,
            2 => Self::StartingShards,
            _ => Self::Serving,
        }
    }

    /// Its name in `health` and `stats` (`starting.phase`) and the step names of durations.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Populating => "populate_arena",
            Self::RegisteringCuda => "register_cuda",
            Self::StartingShards => "start_shards",
            Self::Serving => "serving",
        }
    }
}

/// The start's progress, shared by the listeners (which answer from it until the server runs)
/// and the thread that starts the server.
#[derive(Debug)]
pub(crate) struct Startup {
    /// The arena's size (what populating it covers).
    arena_bytes: u64,
    /// Arena bytes populated so far.
    pub populated: AtomicU64,
    phase: AtomicU8,
    /// When the process started.
    began: Instant,
    /// When the current phase began.
    phase_began: Mutex<Instant>,
    /// Each finished step and its seconds, in order.
    steps: Mutex<Vec<(&'static str, f64)>>,
    /// Who may connect (and read `health`) while there is no server yet.
    pub access: Access,
    /// Hellos answered `Starting`.
    pub told_to_wait: AtomicU64,
    /// Sessions refused (uid, version) before the server ran; added to its count.
    pub refused: AtomicU64,
    server: OnceLock<(Arc<Shared>, Arc<Arena>)>,
    /// Seconds from the process's start to serving.
    served_after: OnceLock<f64>,
}

impl Startup {
    /// A start of `arena_bytes`, begun at `began`, populating first.
    pub fn new(settings: &Settings, arena_bytes: u64, began: Instant) -> Self {
        Self {
            arena_bytes,
            populated: AtomicU64::new(0),
            phase: AtomicU8::new(Phase::Populating as u8),
            began,
            phase_began: Mutex::new(Instant::now()),
            steps: Mutex::new(Vec::new()),
            access: Access::new(&settings.config, nix::unistd::getuid().as_raw()),
            told_to_wait: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            server: OnceLock::new(),
            served_after: OnceLock::new(),
        }
    }

    /// The arena's size.
    pub fn arena_bytes(&self) -> u64 {
        self.arena_bytes
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Acquire))
    }

    /// Ends the current step (its duration recorded and logged) and begins `next`.
    pub fn advance(&self, next: Phase) {
        let now = Instant::now();
        let began = std::mem::replace(
            &mut *self.phase_began.lock().expect("startup lock is never poisoned"),
            now,
        );
        let step = self.phase();
        let seconds = now.duration_since(began).as_secs_f64();
        self.steps.lock().expect("startup lock is never poisoned").push((step.as_str(), seconds));
        tracing::info!(step = step.as_str(), seconds = format!("{seconds:.3}"), "start step done");
        self.phase.store(next as u8, Ordering::Release);
    }

    /// Hands the listeners the running server: from now on they serve it.
    pub fn serve(&self, shared: Arc<Shared>, arena: Arc<Arena>) {
        shared.refused_sessions.fetch_add(self.refused.load(Ordering::Relaxed), Ordering::Relaxed);
        self.advance(Phase::Serving);
        let _ = self.served_after.set(self.began.elapsed().as_secs_f64());
        let _ = self.server.set((shared, arena));
    }

    /// The running server, once it serves.
    pub fn server(&self) -> Option<&(Arc<Shared>, Arc<Arena>)> {
        self.server.get()
    }

    /// Each finished step and its seconds, in order.
    pub fn steps(&self) -> Vec<(&'static str, f64)> {
        self.steps.lock().expect("startup lock is never poisoned").clone()
    }

    /// Seconds from the process's start to serving (None while starting).
    pub fn seconds_to_serve(&self) -> Option<f64> {
        self.served_after.get().copied()
    }

    /// Percent of the arena populated (100 once past populating).
    pub fn percent(&self) -> u32 {
        if self.phase() != Phase::Populating || self.arena_bytes == 0 {
            return 100;
        }
        let done = self.populated.load(Ordering::Relaxed).min(self.arena_bytes);
        (done as u128 * 100 / self.arena_bytes as u128) as u32
    }

    /// What the server is doing, for humans: `populating the arena: 42% (3.4GiB of 8GiB in
    /// 2.1 s)`, `registering the arena with CUDA`, `starting the shards`.
    pub fn message(&self) -> String {
        let in_phase = self.phase_began.lock().expect("startup lock is never poisoned").elapsed();
        match self.phase() {
            Phase::Populating => format!(
                "populating the arena: {}% ({} of {} in {:.1} s)",
                self.percent(),
                format_bytes(self.populated.load(Ordering::Relaxed).min(self.arena_bytes)),
                format_bytes(self.arena_bytes),
                in_phase.as_secs_f64()
            ),
            Phase::RegisteringCuda => format!(
                "registering the {} arena with CUDA ({:.1} s so far)",
                format_bytes(self.arena_bytes),
                in_phase.as_secs_f64()
            ),
            Phase::StartingShards => "starting the shards".to_string(),
            Phase::Serving => "serving".to_string(),
        }
    }

    /// When a client told to wait should try again: the time populating should still take
    /// at the rate so far, between 100 ms and 1 s; 250 ms in the other steps.
    pub fn retry_after(&self) -> Duration {
        const MIN: Duration = Duration::from_millis(100);
        const MAX: Duration = Duration::from_secs(1);
        if self.phase() != Phase::Populating {
            return Duration::from_millis(250);
        }
        let done = self.populated.load(Ordering::Relaxed);
        let elapsed = self.phase_began.lock().expect("startup lock is never poisoned").elapsed();
        if done == 0 {
            return MAX;
        }
        let left = self.arena_bytes.saturating_sub(done) as f64;
        Duration::from_secs_f64(elapsed.as_secs_f64() * left / done as f64).clamp(MIN, MAX)
    }

    /// The `health` answer (and `/readyz`'s body) while starting: not ready, state
    /// `starting`, the reason in words and the progress as numbers.
    pub fn health(&self) -> HealthReply {
        HealthReply {
            ok: true,
            ready: false,
            state: ServerState::Starting,
            reason: self.message(),
            degraded: Vec::new(),
            cluster: None,
            starting: Some(self.progress()),
        }
    }

    /// The progress as numbers: phase, percent, bytes populated of the arena's, seconds.
    pub fn progress(&self) -> StartingProgress {
        StartingProgress {
            phase: self.phase().as_str().to_string(),
            percent: self.percent(),
            populated_bytes: self.populated.load(Ordering::Relaxed).min(self.arena_bytes),
            arena_bytes: self.arena_bytes,
            seconds: self.began.elapsed().as_secs_f64(),
            told_to_wait: self.told_to_wait.load(Ordering::Relaxed),
        }
    }

    /// The start's steps for `stats`: each step's seconds, the total, hellos told to wait.
    pub fn stats_json(&self) -> Value {
        let steps: serde_json::Map<String, Value> =
            self.steps().into_iter().map(|(s, secs)| (s.to_string(), json!(secs))).collect();
        json!({
            "steps_s": steps,
            "total_s": self.seconds_to_serve(),
            "told_to_wait": self.told_to_wait.load(Ordering::Relaxed),
        })
    }
}
