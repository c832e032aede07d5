//! Reconnect pacing: after a failed connect, calls fail fast with [`Error::Unavailable`] until
//! the next attempt is due, and the wait between attempts grows (capped exponential, with
//! jitter so that the engines of a host do not all knock at once when their Manager returns).
//! The first attempt after a session is lost is made at once.

use std::time::{Duration, Instant};

use crate::Error;

/// When the next connect may be tried, and why the last one failed.
#[derive(Debug, Default)]
pub(crate) struct Reconnect {
    /// Connect attempts that failed in a row (0: the next one goes at once).
    failures: u32,
    /// No attempt before this.
    next_attempt: Option<Instant>,
    /// The last attempt's error, repeated by the calls refused until the next one.
    last_error: String,
    /// Connect attempts made, successful or not (for tests and counters).
    pub(crate) attempts: u64,
    /// The server said it is starting at the last attempt (said once in the log).
    waiting: bool,
}

impl Reconnect {
    /// `Ok` when an attempt may be made now; otherwise the fail-fast error.
    pub(crate) fn check(&self, socket: &std::path::Path) -> Result<(), Error> {
        match self.next_attempt {
            Some(at) if Instant::now() < at => Err(Error::Unavailable {
                socket: socket.to_owned(),
                retry_in: at.saturating_duration_since(Instant::now()),
                cause: self.last_error.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Records the outcome of an attempt: success resets the pacing, a failure pushes the
    /// next attempt out by `min(initial * 2^(failures-1), max)`, less up to a fifth (jitter).
    /// A server that says it is starting is no failure: the next attempt is when it said.
    pub(crate) fn record(&mut self, outcome: Result<(), &Error>, initial: Duration, max: Duration) {
        self.attempts += 1;
        match outcome {
            Ok(()) => {
                self.failures = 0;
                self.next_attempt = None;
                self.last_error.clear();
                self.waiting = false;
            }
            Err(e @ Error::Starting { retry_in, message }) => {
                self.failures = 0;
                self.next_attempt = Some(Instant::now() + *retry_in);
                self.last_error = e.to_string();
                if !self.waiting {
                    tracing::info!(%message, "orbitkv-server is starting; connecting once it serves");
                }
                self.waiting = true;
            }
            Err(e) => {
                self.waiting = false;
                self.failures = self.failures.saturating_add(1);
                let delay = delay(self.failures, initial, max);
                self.next_attempt = Some(Instant::now() + delay);
                self.last_error = e.to_string();
                if self.failures == 1 {
                    tracing::warn!(error = %e, "orbitkv-server unreachable; retrying with backoff");
                }
            }
        }
    }

    /// Connect attempts that failed in a row.
    #[cfg(test)]
    fn failures(&self) -> u32 {
        self.failures
    }
}

/// The wait after the `failures`-th failure in a row: `initial` doubled per earlier failure,
/// at most `max`, less a jitter of up to a fifth of it.
fn delay(failures: u32, initial: Duration, max: Duration) -> Duration {
    let doubled = initial.saturating_mul(1u32 << failures.saturating_sub(1).min(20));
    let capped = doubled.min(max);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // A fifth of the wait, scaled by a pseudo-random fraction (the clock's nanoseconds).
    let jitter = capped / 5 * (nanos % 1024) / 1024;
    capped - jitter
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_up_to_its_cap_with_at_most_a_fifth_off() {
        let (initial, max) = (Duration::from_millis(50), Duration::from_secs(2));
        let mut last = Duration::ZERO;
        for failures in 1..40 {
            let d = delay(failures, initial, max);
            let full = initial.saturating_mul(1 << (failures - 1).min(20)).min(max);
            assert!(d <= full && d >= full - full / 5, "{failures}: {d:?} against {full:?}");
            assert!(d + full / 5 >= last, "never much shorter than the wait before");
            last = d;
        }
        assert!(delay(39, initial, max) <= max);
    }

    #[test]
    fn a_failure_makes_calls_fail_fast_and_a_success_clears_it() {
        let mut r = Reconnect::default();
        let socket = std::path::Path::new("/nonexistent/orbitkv.sock");
        assert!(r.check(socket).is_ok(), "the first attempt goes at once");
        let err = Error::Disconnected("gone".into());
        r.record(Err(&err), Duration::from_secs(60), Duration::from_secs(60));
        let refused = r.check(socket).unwrap_err();
        assert!(
            matches!(&refused, Error::Unavailable { cause, retry_in, .. }
                if cause.contains("gone") && *retry_in <= Duration::from_secs(60)),
            "{refused}"
        );
        assert_eq!(refused.kind(), "unavailable");
        assert_eq!(r.failures(), 1);
        r.record(Ok(()), Duration::from_secs(60), Duration::from_secs(60));
        assert!(r.check(socket).is_ok());
        assert_eq!((r.failures(), r.attempts), (0, 2));
    }

    #[test]
    fn a_starting_server_is_tried_again_when_it_said_and_counts_no_failure() {
        let mut r = Reconnect::default();
        let socket = std::path::Path::new("/nonexistent/orbitkv.sock");
        let (initial, max) = (Duration::from_millis(1), Duration::from_millis(1));
        r.record(Err(&Error::Disconnected("gone".into())), initial, max);
        let starting = Error::Starting {
            message: "populating the arena: 42%".into(),
            retry_in: Duration::from_secs(60),
        };
        r.record(Err(&starting), initial, max);
        assert_eq!(r.failures(), 0, "a starting server resets the backoff");
        let refused = r.check(socket).unwrap_err();
        assert!(
            matches!(&refused, Error::Unavailable { cause, retry_in, .. }
                if cause.contains("42%") && *retry_in > Duration::from_secs(59)),
            "{refused}"
        );
        assert!(refused.is_unavailable() && starting.is_unavailable());
        assert_eq!(starting.kind(), "starting");
    }
}
