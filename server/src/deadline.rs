//! A reader with one deadline for a whole message, so that a peer dripping one byte at a time
//! cannot hold a control-plane thread longer than the deadline.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Reads from `stream` until `deadline`; every read waits at most the time left.
#[derive(Debug)]
pub struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl<'a> DeadlineReader<'a> {
    /// A reader that gives up `budget` from now.
    pub fn new(stream: &'a UnixStream, budget: Duration) -> Self {
        Self { stream, deadline: Instant::now() + budget }
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}
