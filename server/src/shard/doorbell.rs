//! Doorbells: how an idle shard sleeps without burning a core and still wakes at once.
//!
//! A shard idle for a while stores 1 in its word of the arena header, checks once more for
//! work, and blocks on its eventfd. Whoever queues work for it (a client sending a request, a
//! shard sending over the mesh, a control thread) first publishes the work, then reads the
//! word and, if set, writes the eventfd. Both sides put a SeqCst fence between their write
//! and their read, so either the sleeper sees the work or the producer sees the sleeper.

use std::future::Future;
use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Waker;
use std::task::{Context, Poll};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use orbitkv_shards::Arena;

/// Consecutive watchdog looks at a shard loop that did not move before it is logged.
const STALL_WARN_AFTER: u32 = 5;

/// Every shard's eventfd plus the in-process mesh message counters.
#[derive(Debug)]
pub struct Doorbells {
    arena: Arc<Arena>,
    fds: Vec<EventFd>,
    mesh_pending: Vec<AtomicU64>,
    /// Each shard loop's last mark: its iteration count shifted left by 8, ORed with where it
    /// was ([`LoopStage`]); read when the shard does not answer.
    beats: Vec<AtomicU64>,
    /// Each shard executor's nudge task, woken from the watchdog thread (see [`watch`]).
    nudge_wakers: Vec<Mutex<Option<Waker>>>,
    /// Nudges sent to each shard.
    nudges: Vec<AtomicU64>,
    /// Per shard: its loop naps on a timer (tasks in flight), and [`Doorbells::ring`] cuts the
    /// nap short by waking the waker in `nap_wakers` (see [`Nap`]).
    napping: Vec<AtomicBool>,
    nap_wakers: Vec<Mutex<Option<Waker>>>,
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
    /// Its loop has ended (shutdown): nothing to watch any more.
    Stopped = 7,
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
            7 => "stopped",
            _ => "not started",
        }
    }
}

impl Doorbells {
    /// One doorbell per shard.
    pub fn new(arena: Arc<Arena>, shards: usize) -> Result<Self, crate::error::StartError> {
        let fds = (0..shards)
            .map(|_| EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| crate::error::StartError::Os {
                what: "creating shard eventfds",
                source: e.into(),
            })?;
        for i in 0..shards {
            arena.doorbell(i).store(0, Ordering::SeqCst);
        }
        Ok(Self {
            arena,
            fds,
            mesh_pending: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            beats: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            nudge_wakers: (0..shards).map(|_| Mutex::new(None)).collect(),
            nudges: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            napping: (0..shards).map(|_| AtomicBool::new(false)).collect(),
            nap_wakers: (0..shards).map(|_| Mutex::new(None)).collect(),
        })
    }

    /// The eventfd of `shard`, to pass to clients homed there.
    pub fn fd(&self, shard: usize) -> BorrowedFd<'_> {
        self.fds[shard].as_fd()
    }

    /// Call after queueing work for `shard`: wakes it if it sleeps, or ends its nap.
    pub fn ring(&self, shard: usize) {
        fence(Ordering::SeqCst);
        if self.arena.doorbell(shard).load(Ordering::SeqCst) != 0 {
            let _ = self.fds[shard].write(1);
        }
        // A plain load first: most rings find no nap, and need not write the shared flag.
        let napping = &self.napping[shard];
        if napping.load(Ordering::SeqCst) && napping.swap(false, Ordering::SeqCst) {
            // Woken by reference: the waker is dropped on the shard's thread (by its `Nap`).
            if let Some(w) = &*self.nap_wakers[shard].lock().expect("nap lock is never poisoned") {
                w.wake_by_ref();
            }
        }
    }

    /// A nap of `shard`'s loop that [`Doorbells::ring`] ends early; `pending` says whether
    /// work came before the nap could be armed.
    pub fn nap<'a, F: Fn() -> bool>(&'a self, shard: usize, pending: F) -> Nap<'a, F> {
        Nap { bells: self, shard, pending, armed: false }
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

    /// Stores the waker of `shard`'s nudge task (called by that task each time it is polled).
    pub fn arm_nudge(&self, shard: usize, waker: &Waker) {
        let mut slot = self.nudge_wakers[shard].lock().expect("nudge lock is never poisoned");
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }

    /// Forgets `shard`'s nudge task; its executor calls this before it stops, so that the
    /// waker is dropped on its own thread.
    pub fn disarm_nudge(&self, shard: usize) {
        self.nudge_wakers[shard].lock().expect("nudge lock is never poisoned").take();
    }

    /// Nudges sent to `shard` so far.
    pub fn nudges(&self, shard: usize) -> u64 {
        self.nudges[shard].load(Ordering::Relaxed)
    }

    /// Wakes the nudge task of each shard whose loop has not moved since `last` was taken
    /// and is not blocked on its doorbell; updates `last`.
    fn nudge_stalled(&self, last: &mut [(u64, u32)]) -> Look {
        let mut look = Look { nudged: 0, all_asleep: true };
        for (shard, (seen, streak)) in last.iter_mut().enumerate() {
            let beat = self.beats[shard].load(Ordering::Relaxed);
            let stage = beat as u8;
            // A stopped loop stands still for good, and needs no more looks than a sleeping one.
            let resting = stage == LoopStage::Sleeping as u8 || stage == LoopStage::Stopped as u8;
            look.all_asleep &= resting;
            let stalled = beat == *seen && stage != 0 && !resting && *seen != u64::MAX;
            *seen = beat;
            if !stalled {
                *streak = 0;
                continue;
            }
            *streak += 1;
            if *streak == STALL_WARN_AFTER {
                tracing::warn!(
                    shard,
                    stage = LoopStage::name(stage),
                    iteration = beat >> 8,
                    nudges = self.nudges(shard),
                    "shard loop stood still through {STALL_WARN_AFTER} watchdog looks (its core \
                     busy elsewhere, or its executor parked with work queued); nudging it"
                );
            }
            let waker =
                self.nudge_wakers[shard].lock().expect("nudge lock is never poisoned").clone();
            if let Some(w) = waker {
                w.wake();
                self.nudges[shard].fetch_add(1, Ordering::Relaxed);
                look.nudged += 1;
            }
        }
        look
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

/// Ends when the shard's doorbell is rung after it was first polled (race it against the
/// nap's timer): a control message (a peer read that landed, a grant to take) is then taken
/// at once rather than when the timer fires. Work queued before the nap was armed ends it at
/// once too (`pending`).
pub struct Nap<'a, F: Fn() -> bool> {
    bells: &'a Doorbells,
    shard: usize,
    pending: F,
    armed: bool,
}

impl<F: Fn() -> bool + Unpin> Future for Nap<'_, F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let flag = &this.bells.napping[this.shard];
        if this.armed {
            return if flag.load(Ordering::SeqCst) { Poll::Pending } else { Poll::Ready(()) };
        }
        *this.bells.nap_wakers[this.shard].lock().expect("nap lock is never poisoned") =
            Some(cx.waker().clone());
        flag.store(true, Ordering::SeqCst);
        this.armed = true;
        if (this.pending)() {
            flag.store(false, Ordering::SeqCst);
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl<F: Fn() -> bool> Drop for Nap<'_, F> {
    fn drop(&mut self) {
        self.bells.napping[self.shard].store(false, Ordering::SeqCst);
        self.bells.nap_wakers[self.shard].lock().expect("nap lock is never poisoned").take();
    }
}

/// What one watchdog look found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Look {
    /// Shards nudged.
    nudged: usize,
    /// Every shard was asleep on its doorbell.
    all_asleep: bool,
}

/// Starts the watchdog thread: every `period` it nudges each shard executor whose loop has
/// not moved and is not asleep on its doorbell; while every shard sleeps on its doorbell it
/// looks every `asleep_period` instead (an idle server then wakes the thread rarely). It ends
/// when the doorbells are dropped.
///
/// Why: glommio 0.9 can park an executor in the kernel while tasks are queued (a round that
/// starts with its preemption flag raised runs nothing, and the park that follows waits for
/// an event that never comes, all timers having fired). A wake from another thread writes
/// the executor's eventfd, so the park returns and the queued tasks run. A nudge to a shard
/// that was only busy costs at most one eventfd write and one empty poll.
pub fn watch(
    doorbells: Weak<Doorbells>,
    period: Duration,
    asleep_period: Duration,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("orbitkv-watchdog".into()).spawn(move || {
        let mut last = match doorbells.upgrade() {
            Some(d) => vec![(u64::MAX, 0); d.beats.len()],
            None => return,
        };
        let mut wait = period;
        loop {
            std::thread::sleep(wait);
            match doorbells.upgrade() {
                Some(d) => {
                    let look = d.nudge_stalled(&mut last);
                    wait = if look.all_asleep { asleep_period } else { period };
                }
                None => return,
            }
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn doorbells(shards: usize) -> Doorbells {
        let arena = Arc::new(Arena::create(1 << 20, false).expect("arena"));
        Doorbells::new(arena, shards).expect("doorbells")
    }

    #[test]
    fn a_ring_ends_a_nap_of_that_shard_only() {
        let d = doorbells(2);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let mut nap = std::pin::pin!(d.nap(0, || false));
        assert!(nap.as_mut().poll(&mut cx).is_pending());
        d.ring(1);
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "another shard's ring woke the nap");
        assert!(nap.as_mut().poll(&mut cx).is_pending());
        d.ring(0);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(nap.as_mut().poll(&mut cx).is_ready());
        // Once over, a ring wakes nothing.
        d.ring(0);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);

        // Work queued before the nap was armed ends it at once.
        let mut early = std::pin::pin!(d.nap(1, || true));
        assert!(early.as_mut().poll(&mut cx).is_ready());
        // A nap dropped before it ended leaves nothing armed.
        {
            let mut dropped = std::pin::pin!(d.nap(1, || false));
            assert!(dropped.as_mut().poll(&mut cx).is_pending());
        }
        d.ring(1);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn only_a_shard_whose_loop_stands_still_outside_its_doorbell_is_nudged() {
        let d = doorbells(3);
        let wakes: Vec<Arc<Count>> = (0..3).map(|_| Arc::new(Count(AtomicUsize::new(0)))).collect();
        for (shard, w) in wakes.iter().enumerate() {
            d.arm_nudge(shard, &Waker::from(Arc::clone(w)));
        }
        let mut last = vec![(u64::MAX, 0); 3];
        d.beat(0, 1, LoopStage::Napping);
        d.beat(1, 1, LoopStage::Sleeping);
        // Shard 2 has not started its loop.
        assert_eq!(d.nudge_stalled(&mut last).nudged, 0, "the first look only records the beats");
        d.beat(1, 1, LoopStage::Sleeping);
        assert_eq!(
            d.nudge_stalled(&mut last),
            Look { nudged: 1, all_asleep: false },
            "shard 0 stood still while napping"
        );
        assert_eq!(wakes[0].0.load(Ordering::SeqCst), 1);
        assert_eq!(wakes[1].0.load(Ordering::SeqCst), 0, "a shard asleep on its doorbell is left");
        assert_eq!(wakes[2].0.load(Ordering::SeqCst), 0, "a shard not started is left");
        d.beat(0, 2, LoopStage::Working);
        assert_eq!(d.nudge_stalled(&mut last).nudged, 0, "shard 0 moved on");
        assert_eq!(d.nudge_stalled(&mut last).nudged, 1, "and then stood still again");
        assert_eq!((d.nudges(0), d.nudges(1), d.nudges(2)), (2, 0, 0));
        d.disarm_nudge(0);
        assert_eq!(d.nudge_stalled(&mut last).nudged, 0, "a disarmed shard is not nudged");
        assert_eq!(wakes[0].0.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_stopped_shard_is_neither_nudged_nor_watched_closely() {
        let d = doorbells(2);
        let wake = Arc::new(Count(AtomicUsize::new(0)));
        d.arm_nudge(0, &Waker::from(Arc::clone(&wake)));
        let mut last = vec![(u64::MAX, 0); 2];
        d.beat(0, 9, LoopStage::Stopped);
        d.beat(1, 4, LoopStage::Sleeping);
        for _ in 0..2 * STALL_WARN_AFTER {
            assert_eq!(d.nudge_stalled(&mut last), Look { nudged: 0, all_asleep: true });
        }
        assert_eq!((wake.0.load(Ordering::SeqCst), d.nudges(0)), (0, 0));
        assert_eq!(last[0].1, 0, "no stall streak, so no warning");
        assert_eq!(d.last_beat(0), (9, "stopped"));
    }

    #[test]
    fn a_server_whose_shards_all_sleep_on_their_doorbells_is_seen_asleep() {
        let d = doorbells(2);
        let mut last = vec![(u64::MAX, 0); 2];
        d.beat(0, 7, LoopStage::Sleeping);
        d.beat(1, 3, LoopStage::Napping);
        assert!(!d.nudge_stalled(&mut last).all_asleep, "shard 1 naps");
        d.beat(1, 4, LoopStage::Sleeping);
        assert_eq!(d.nudge_stalled(&mut last), Look { nudged: 0, all_asleep: true });
        d.beat(0, 8, LoopStage::Working);
        assert!(!d.nudge_stalled(&mut last).all_asleep, "shard 0 woke");
    }
}
