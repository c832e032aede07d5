//! The yardstick measured in every run: one thread copying value-sized blocks out of a source
//! too large to stay in cache.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Smallest source buffer: far beyond any last-level cache.
const MIN_SOURCE: usize = 256 << 20;
/// Bytes copied between clock reads.
const CHECK_EVERY: usize = 16 << 20;

/// Single-thread memcpy throughput in GB/s (10^9 bytes/s), copying `block`-byte blocks for
/// about `duration`.
pub(crate) fn memcpy_gbps(block: usize, duration: Duration) -> f64 {
    let block = block.max(1);
    let blocks = MIN_SOURCE.max(block.saturating_mul(4)).div_ceil(block);
    // A non-zero fill makes the kernel back every page (zero pages would all share one frame
    // and sit in cache).
    let src = vec![0xa5u8; blocks * block];
    let mut dst = vec![0x5au8; block];
    let per_check = (CHECK_EVERY / block).max(1);
    let mut next = 0;
    let mut copied = 0u64;
    let start = Instant::now();
    loop {
        for _ in 0..per_check {
            dst.copy_from_slice(&src[next * block..(next + 1) * block]);
            black_box(&mut dst);
            next = (next + 1) % blocks;
        }
        copied += (per_check * block) as u64;
        let elapsed = start.elapsed();
        if elapsed >= duration {
            return copied as f64 / elapsed.as_secs_f64() / 1e9;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn measures_something() {
        let gbps = super::memcpy_gbps(4096, std::time::Duration::from_millis(10));
        assert!(gbps.is_finite() && gbps > 0.0);
    }
}
