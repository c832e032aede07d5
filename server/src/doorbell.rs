//! Doorbells: how an idle shard sleeps without burning a core and still wakes at once.
//!
//! A shard idle for a while stores 1 in its word of the arena header, checks once more for
//! work, and blocks on its eventfd. Whoever queues work for it (a client sending a request, a
//! shard sending over the mesh, a control thread) first publishes the work, then reads the
//! word and, if set, writes the eventfd. Both sides put a SeqCst fence between their write
//! and their read, so either the sleeper sees the work or the producer sees the sleeper.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use orbitkv_shards::Arena;

/// Every shard's eventfd plus the in-process mesh message counters.
#[derive(Debug)]
pub struct Doorbells {
    arena: Arc<Arena>,
    fds: Vec<EventFd>,
    mesh_pending: Vec<AtomicU64>,
    /// Each shard loop's last mark: its iteration count shifted left by 8, ORed with where it
    /// was ([`LoopStage`]); read when the shard does not answer.
    beats: Vec<AtomicU64>,
}

/// Where a shard's loop was last (see [`Doorbells::beat`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LoopStage {
    /// Taking work (control messages, requests, completions, SSD, maintenance).
    Working = 1,
    /// Yielding to its tasks after work.
    YieldAfterWork = 2,
    /// Yielding to its tasks while spinning idle.
    YieldSpinning = 3,
    /// Blocked on its doorbell, sleeping.
    Sleeping = 4,
    /// Yielding to its tasks after a sleep.
    YieldAfterSleep = 5,
    /// Napping on a glommio timer.
    Napping = 6,
}

impl LoopStage {
    /// The stage's name, for stats.
    pub fn name(raw: u8) -> &'static str {
        match raw {
            1 => "working",
            2 => "yield-after-work",
            3 => "yield-spinning",
            4 => "sleeping",
            5 => "yield-after-sleep",
            6 => "napping",
            _ => "not started",
        }
    }
}

impl Doorbells {
    /// One doorbell per shard.
    pub fn new(arena: Arc<Arena>, shards: usize) -> Result<Self, String> {
        let fds = (0..shards)
            .map(|_| EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("creating shard eventfds: {e}"))?;
        for i in 0..shards {
            arena.doorbell(i).store(0, Ordering::SeqCst);
        }
        Ok(Self {
            arena,
            fds,
            mesh_pending: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            beats: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// The eventfd of `shard`, to pass to clients homed there.
    pub fn fd(&self, shard: usize) -> BorrowedFd<'_> {
        self.fds[shard].as_fd()
    }

    /// Call after queueing work for `shard`: wakes it if it sleeps.
    pub fn ring(&self, shard: usize) {
        fence(Ordering::SeqCst);
        if self.arena.doorbell(shard).load(Ordering::SeqCst) != 0 {
            let _ = self.fds[shard].write(1);
        }
    }

    /// Call before sending a mesh message to `shard`.
    pub fn mesh_sending(&self, shard: usize) {
        self.mesh_pending[shard].fetch_add(1, Ordering::SeqCst);
    }

    /// Call when `shard` took a mesh message out.
    pub fn mesh_received(&self, shard: usize) {
        self.mesh_pending[shard].fetch_sub(1, Ordering::SeqCst);
    }

    /// Records where `shard`'s loop is, in its `iteration`.
    pub fn beat(&self, shard: usize, iteration: u64, stage: LoopStage) {
        self.beats[shard].store(iteration << 8 | stage as u64, Ordering::Relaxed);
    }

    /// `shard`'s last mark: its loop iteration and stage name.
    pub fn last_beat(&self, shard: usize) -> (u64, &'static str) {
        let b = self.beats[shard].load(Ordering::Relaxed);
        (b >> 8, LoopStage::name(b as u8))
    }

    /// Mesh messages queued for `shard` and not yet taken out.
    pub fn mesh_pending(&self, shard: usize) -> u64 {
        self.mesh_pending[shard].load(Ordering::SeqCst)
    }

    /// Sleeps until rung or `timeout`, unless `has_work` finds work after the doorbell word is
    /// set. Returns true when woken by a ring (or when work was already there).
    pub fn sleep(&self, shard: usize, timeout: Duration, has_work: impl Fn() -> bool) -> bool {
        let word = self.arena.doorbell(shard);
        word.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let woken = if has_work() {
            true
        } else {
            let mut fds = [PollFd::new(self.fds[shard].as_fd(), PollFlags::POLLIN)];
            let ms = PollTimeout::try_from(timeout.as_millis().min(60_000) as i32)
                .unwrap_or(PollTimeout::MAX);
            matches!(poll(&mut fds, ms), Ok(n) if n > 0)
        };
        word.store(0, Ordering::SeqCst);
        // Reset the counter (non-blocking: EAGAIN when nobody rang).
        let _ = self.fds[shard].read();
        woken
    }
}
