//! The measured loop of `ssd`: `--qd` operations kept in flight through the shard's
//! [`SsdRing`], each moving one block between its own arena slot and the file, for
//! `--duration`; then the operations still in flight are drained (and counted).

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv_shards::Arena;
use orbitkv_ssd::ring::SsdRing;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::args::SsdMode;
use crate::error::Error;
use crate::stats::Latency;

/// What to run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DriveConfig {
    /// Access pattern.
    pub mode: SsdMode,
    /// Payload bytes per operation (a multiple of 4 KiB).
    pub block: u64,
    /// Operations in flight.
    pub qd: u32,
    /// Bytes of the file the operations stay inside.
    pub file_size: u64,
    /// How long to keep submitting.
    pub duration: Duration,
    /// Seed of random offsets.
    pub seed: u64,
}

impl DriveConfig {
    /// Bytes of the file one operation covers.
    pub fn extent(&self) -> u64 {
        self.block
    }
}

/// What the loop counted.
#[derive(Debug, Default)]
pub(crate) struct DriveResult {
    /// Operations that moved all their bytes.
    pub ops: u64,
    /// Payload bytes of those operations.
    pub payload_bytes: u64,
    /// From the first submission to the last completion.
    pub wall: Duration,
    /// Submission to completion of every successful operation.
    pub latency: Latency,
    /// Operations that failed or moved fewer bytes than asked.
    pub errors: u64,
    /// What the first of those was.
    pub first_error: Option<String>,
}

impl DriveResult {
    fn error(&mut self, what: impl FnOnce() -> String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(what());
        }
    }
}

/// Where operations go: the file as consecutive extents of one operation each (4 KiB- and,
/// for reads, block-aligned), visited in order (wrapping) or at random.
#[derive(Debug)]
pub(crate) struct Offsets {
    extent: u64,
    count: u64,
    next: u64,
    random: Option<SmallRng>,
}

impl Offsets {
    /// Extents of `extent` bytes inside `file_size` bytes (at least one, checked by the
    /// caller).
    pub fn new(file_size: u64, extent: u64, random: bool, seed: u64) -> Self {
        let count = (file_size / extent).max(1);
        Self { extent, count, next: 0, random: random.then(|| SmallRng::seed_from_u64(seed)) }
    }

    /// The file offset of the next operation.
    pub fn next_offset(&mut self) -> u64 {
        let index = match &mut self.random {
            Some(rng) => rng.gen_range(0..self.count),
            None => {
                let i = self.next;
                self.next = (i + 1) % self.count;
                i
            }
        };
        index * self.extent
    }
}

/// An operation in flight.
struct Op {
    slot: u64,
    at: u64,
    submitted: Instant,
}

/// Runs the loop on `file` (opened O_DIRECT, `path` for messages).
pub(crate) fn drive(file: &File, path: &Path, cfg: &DriveConfig) -> Result<DriveResult, Error> {
    let io = |op: &'static str| move |source| Error::Io { op, path: path.to_owned(), source };
    let writes = cfg.mode.writes();
    let extent = cfg.extent();
    let mut offsets = Offsets::new(cfg.file_size, extent, cfg.mode.random(), cfg.seed);
    let buffers = cfg.block * u64::from(cfg.qd);
    let arena = Arc::new(Arena::create(buffers, false).map_err(|e| {
        Error::Setup(format!("cannot map {buffers} bytes of arena for the I/O buffers: {e}"))
    })?);
    let slice = arena.split(1).pop().expect("splitting an arena in one gives one slice");
    if writes {
        // Arbitrary bytes rather than the arena's zeroes, in case the device compresses.
        let mut rng = SmallRng::seed_from_u64(cfg.seed);
        let mut bytes = vec![0u8; cfg.block as usize];
        for slot in 0..u64::from(cfg.qd) {
            rng.fill_bytes(&mut bytes);
            slice.write(slot * cfg.block, &bytes);
        }
    }
    let mut ring = SsdRing::new(cfg.qd).map_err(io("creating an io_uring for"))?;
    let mut free: Vec<u64> = (0..u64::from(cfg.qd)).rev().collect();
    let mut inflight: HashMap<u64, Op> = HashMap::with_capacity(cfg.qd as usize);
    let mut r = DriveResult::default();
    let start = Instant::now();
    let end = start + cfg.duration;
    let mut last = start;
    loop {
        if Instant::now() < end {
            while let Some(slot) = free.pop() {
                let at = offsets.next_offset();
                let submitted = Instant::now();
                let from = slot * cfg.block;
                let id = if writes {
                    ring.write_from_slot(file, at, &slice, from, cfg.block)
                } else {
                    ring.read_into_slot(file, at, &slice, from, cfg.block)
                };
                // A ring that refuses a submission with room left is broken: stop the run
                // (dropping the ring waits for what is in flight).
                let id = id.map_err(io("submitting I/O to"))?;
                inflight.insert(id, Op { slot, at, submitted });
            }
        }
        if inflight.is_empty() {
            break;
        }
        let done = ring.wait().map_err(io("waiting for I/O on"))?;
        let now = Instant::now();
        last = now;
        for c in done {
            let Some(op) = inflight.remove(&c.id) else { continue };
            free.push(op.slot);
            match c.result {
                Ok(n) if n == extent => {
                    r.ops += 1;
                    r.payload_bytes += cfg.block;
                    r.latency.record(now - op.submitted);
                }
                Ok(n) => r.error(|| format!("moved {n} of {extent} bytes at offset {}", op.at)),
                Err(e) => r.error(|| format!("at offset {}: {e}", op.at)),
            }
        }
    }
    r.wall = last - start;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_offsets_walk_the_file_and_wrap() {
        let mut o = Offsets::new(10 * 4096 + 100, 4096 * 3, false, 1);
        let got: Vec<u64> = (0..4).map(|_| o.next_offset()).collect();
        assert_eq!(got, [0, 12288, 24576, 0]);
    }

    #[test]
    fn random_offsets_are_aligned_inside_and_seeded() {
        let extent = 64 << 10;
        let file = (100 << 20) + 5;
        let mut a = Offsets::new(file, extent, true, 9);
        let mut b = Offsets::new(file, extent, true, 9);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let at = a.next_offset();
            assert_eq!(at, b.next_offset());
            assert_eq!(at % extent, 0);
            assert!(at + extent <= file);
            seen.insert(at);
        }
        assert!(seen.len() > 1000, "{} distinct offsets", seen.len());
    }

    #[test]
    fn writes_cover_a_header_block_more_than_reads() {
        let cfg = DriveConfig {
            mode: SsdMode::RandWrite,
            block: 1 << 20,
            qd: 4,
            file_size: 1 << 30,
            duration: Duration::from_secs(1),
            seed: 1,
        };
        assert_eq!(cfg.extent(), 1 << 20);
    }

    #[test]
    fn reads_and_writes_move_whole_blocks_through_the_ring() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let f = crate::ssd::file::prepare(dir.path(), 4 << 20).unwrap();
        for mode in [SsdMode::Read, SsdMode::Write, SsdMode::RandRead, SsdMode::RandWrite] {
            let cfg = DriveConfig {
                mode,
                block: 64 << 10,
                qd: 4,
                file_size: 4 << 20,
                duration: Duration::from_millis(50),
                seed: 3,
            };
            let r = drive(&f.direct, &f.path, &cfg).unwrap();
            assert!(r.ops > 0, "{mode:?}");
            assert_eq!(r.errors, 0, "{mode:?}: {:?}", r.first_error);
            assert_eq!(r.latency.count(), r.ops);
            assert_eq!(r.payload_bytes, r.ops * cfg.block);
        }
    }
}
