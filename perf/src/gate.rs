//! A start line for benchmark threads: every client finishes its setup and waits; the
//! coordinator sees all setups (and their failures), then starts everyone together or calls
//! the run off.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::Error;

#[derive(Default)]
struct State {
    arrived: usize,
    failures: Vec<Error>,
    /// `Some(Some(end))`: go until `end`; `Some(None)`: the run is off.
    decision: Option<Option<Instant>>,
}

/// One start line for a fixed number of clients.
pub(crate) struct Gate {
    parties: usize,
    state: Mutex<State>,
    changed: Condvar,
}

impl Gate {
    /// A gate for `parties` clients.
    pub fn new(parties: usize) -> Self {
        Self { parties, state: Mutex::new(State::default()), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking client cannot leave the counters half-updated, so poison is harmless.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A client reports its setup and waits for the start: `Some(end)` to run until `end`,
    /// `None` when the run is off.
    pub fn arrive(&self, setup: Result<(), Error>) -> Option<Instant> {
        let mut s = self.lock();
        s.arrived += 1;
        if let Err(e) = setup {
            s.failures.push(e);
        }
        self.changed.notify_all();
        loop {
            if let Some(decision) = s.decision {
                return decision;
            }
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until every client arrived and returns their setup failures. Returns early, with
    /// an error, when `gone()` says a client thread ended without arriving.
    pub fn wait_arrivals(&self, gone: impl Fn() -> bool) -> Result<Vec<Error>, Error> {
        let mut s = self.lock();
        while s.arrived < self.parties {
            if gone() {
                return Err(Error::Setup(
                    "a benchmark client thread ended during setup (it panicked)".into(),
                ));
            }
            s = self
                .changed
                .wait_timeout(s, Duration::from_millis(100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(std::mem::take(&mut s.failures))
    }

    /// Starts everyone until `end`, or (with `None`) calls the run off.
    pub fn open(&self, end: Option<Instant>) {
        self.lock().decision = Some(end);
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn everyone_starts_after_all_arrive_and_failures_are_reported() {
        let gate = Arc::new(Gate::new(3));
        let threads: Vec<_> = (0..3)
            .map(|i| {
                let gate = gate.clone();
                std::thread::spawn(move || {
                    let setup = if i == 1 { Err(Error::Setup("no".into())) } else { Ok(()) };
                    gate.arrive(setup)
                })
            })
            .collect();
        let failures = gate.wait_arrivals(|| false).unwrap();
        assert_eq!(failures.len(), 1);
        let end = Instant::now();
        gate.open(Some(end));
        for t in threads {
            assert_eq!(t.join().unwrap(), Some(end));
        }
    }
}
