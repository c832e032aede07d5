//! Awaiting an answer that comes within a few milliseconds without parking the runtime's
//! thread.
//!
//! The peer thread's runtime parks in the kernel when it has nothing to run; under a
//! hypervisor the wake-up that follows an answer costs 50-200 us, a good part of a grant round
//! trip. While a grant is awaited the runtime is kept polling instead (its task yields, so the
//! I/O driver is polled without blocking and the other tasks run), for a bounded time.

use std::future::Future;
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
}
