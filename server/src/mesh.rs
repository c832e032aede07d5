//! Shard-to-shard queues: one bounded lock-free ring per ordered pair of shards, one mesh for
//! requests and one for replies (a reply never waits behind a request, so two shards cannot
//! deadlock on each other). Each ring has one producer (the sending shard) and one consumer
//! (the receiving shard), and the receiver's loop polls its rings directly: a message costs a
//! push and a pop, no wake-up of a task on either side. A sleeping shard is woken by its
//! doorbell, rung by the sender.

use crossbeam_queue::ArrayQueue;

/// The rings between `n` shards.
pub struct Mesh<T> {
    n: usize,
    rings: Vec<ArrayQueue<T>>,
}

impl<T> std::fmt::Debug for Mesh<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh").field("shards", &self.n).finish_non_exhaustive()
    }
}

impl<T> Mesh<T> {
    /// Rings of `depth` messages between every two of `n` shards.
    pub fn new(n: usize, depth: usize) -> Self {
        Self { n, rings: (0..n * n).map(|_| ArrayQueue::new(depth.max(1))).collect() }
    }

    fn ring(&self, from: usize, to: usize) -> &ArrayQueue<T> {
        assert!(from < self.n && to < self.n && from != to, "a ring joins two shards");
        &self.rings[from * self.n + to]
    }

    /// Queues `msg` from `from` to `to`; gives it back when the ring is full.
    pub fn push(&self, from: usize, to: usize, msg: T) -> Result<(), T> {
        self.ring(from, to).push(msg)
    }

    /// Takes the oldest message from `from` to `to`.
    pub fn pop(&self, from: usize, to: usize) -> Option<T> {
        self.ring(from, to).pop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_are_per_ordered_pair_fifo_and_bounded() {
        let m = Mesh::new(3, 2);
        m.push(0, 1, 'a').unwrap();
        m.push(0, 1, 'b').unwrap();
        assert_eq!(m.push(0, 1, 'c'), Err('c'));
        m.push(1, 0, 'x').unwrap();
        assert_eq!(m.pop(2, 1), None);
        assert_eq!(m.pop(0, 1), Some('a'));
        assert_eq!(m.pop(1, 0), Some('x'));
        assert_eq!(m.pop(0, 1), Some('b'));
        assert_eq!(m.pop(0, 1), None);
    }
}
