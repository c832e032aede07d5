//! Awaiting an answer that comes within a few milliseconds without parking the runtime's
//! thread.
//!
//! The peer thread's runtime parks in the kernel when it has nothing to run; under a
//! hypervisor the wake-up that follows an answer costs 50-200 us, a good part of a grant round
//! trip. While a grant is awaited the runtime is kept polling instead (its task yields, so the
//! I/O driver is polled without blocking and the other tasks run), for a bounded time.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long [`hot`] keeps the runtime polling before it parks as usual.
pub(crate) const HOT_FOR: Duration = Duration::from_millis(2);

/// Awaits `f`, keeping this runtime's thread polling for up to `spin_for`, then waiting as
/// usual.
pub(crate) async fn hot<F: Future>(f: F, spin_for: Duration) -> F::Output {
    let until = Instant::now() + spin_for;
    tokio::pin!(f);
    while Instant::now() < until {
        tokio::select! {
            biased;
            out = &mut f => return out,
            () = tokio::task::yield_now() => {}
        }
    }
    f.await
}

/// Keeps a runtime polling for a window after activity, as a shard does after work: the next
/// request or fetch, when it comes within the window, finds the thread awake. Each
/// [`Warm::touch`] moves the end of the window; one task (started by the first touch after a
/// window ended) yields until then, so the runtime polls its I/O driver without blocking.
#[derive(Clone, Debug)]
pub(crate) struct Warm(Arc<WarmState>);

#[derive(Debug)]
struct WarmState {
    window: Duration,
    base: Instant,
    /// End of the window, in nanoseconds after `base`.
    until: AtomicU64,
    /// Whether the polling task runs.
    polling: AtomicBool,
}

impl Warm {
    /// A window of `window` (zero: never poll).
    pub(crate) fn new(window: Duration) -> Self {
        Self(Arc::new(WarmState {
            window,
            base: Instant::now(),
            until: AtomicU64::new(0),
            polling: AtomicBool::new(false),
        }))
    }

    /// Activity now: the runtime (this one: call it from a task) polls until `window` after it.
    pub(crate) fn touch(&self) {
        let s = &self.0;
        if s.window.is_zero() {
            return;
        }
        s.until.fetch_max(s.now() + s.window.as_nanos() as u64, Ordering::AcqRel);
        if !s.polling.swap(true, Ordering::AcqRel) {
            tokio::spawn(Arc::clone(s).poll());
        }
    }

    /// Whether this runtime polls after activity (its window is not zero).
    pub(crate) fn polls(&self) -> bool {
        !self.0.window.is_zero()
    }

    /// Whether the polling task runs (for tests).
    #[cfg(test)]
    fn polling(&self) -> bool {
        self.0.polling.load(Ordering::Acquire)
    }
}

impl WarmState {
    fn now(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    async fn poll(self: Arc<Self>) {
        loop {
            if self.now() >= self.until.load(Ordering::Acquire) {
                self.polling.store(false, Ordering::Release);
                // A touch between the check and the store saw the task running and left the
                // window to it: take it back unless another task was started since.
                if self.now() >= self.until.load(Ordering::Acquire)
                    || self.polling.swap(true, Ordering::AcqRel)
                {
                    return;
                }
            }
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn the_answer_is_returned_whether_it_comes_within_the_window_or_after_it() {
        let rt = runtime();
        assert_eq!(rt.block_on(hot(async { 7 }, HOT_FOR)), 7);
        // An answer from another task of the runtime (it runs while this one yields).
        let (tx, rx) = tokio::sync::oneshot::channel();
        let answered = rt.block_on(async {
            tokio::spawn(async move { tx.send(8).unwrap() });
            hot(rx, HOT_FOR).await
        });
        assert_eq!(answered, Ok(8));
        // An answer after the window: awaited as usual.
        let late = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            9
        };
        assert_eq!(rt.block_on(hot(late, Duration::from_millis(1))), 9);
    }

    #[test]
    fn warm_polls_for_its_window_after_each_touch_then_stops() {
        let rt = runtime();
        rt.block_on(async {
            let never = Warm::new(Duration::ZERO);
            never.touch();
            assert!(!never.polls() && !never.polling());
            let warm = Warm::new(Duration::from_millis(30));
            assert!(warm.polls());
            warm.touch();
            assert!(warm.polling());
            // Other tasks run while it polls; a touch moves the window's end.
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move { tx.send(()).unwrap() });
            rx.await.unwrap();
            let end = warm.0.until.load(Ordering::Acquire);
            tokio::time::sleep(Duration::from_millis(1)).await;
            warm.touch();
            assert!(warm.0.until.load(Ordering::Acquire) > end);
            assert!(warm.polling());
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(!warm.polling(), "over after the window");
            warm.touch();
            assert!(warm.polling(), "a touch after the window starts it again");
        });
    }
}
