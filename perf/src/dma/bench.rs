//! The harness every `dma` series measures with ([`Bench`]): the stand-in engine's tensors
//! filled with seeded random bytes, the arena registered with CUDA, the chunks' slots, a copy
//! engine and the region of the contiguous ceiling copy; its timed series, the scribbling
//! before them and the checks of every byte after.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;
use orbitkv_gpu::dma::{
    plan::Piece, CopyEngine, CopyJob, DeviceBuffer, Direction, EngineMemory, JobShape, SaveSums,
    Strategy, Transfer, BATCHED_FROM, JOB_BYTES,
};
use orbitkv_gpu::{HostRegistration, LayoutGeometry};
use orbitkv_proto::KvLayoutSpec;
use orbitkv_shards::{Arena, ArenaSlice, PAGE_SIZE};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::matmul_loop::EngineSide;
use super::report::{StrategyResult, Timeline};
use super::{dma, gbps, median};
use crate::args::{DmaArgs, SlotOrderArg};
use crate::error::Error;

/// Seeded bytes, 8 at a time (xorshift64*).
fn fill_random(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for w in out.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
}

fn count_mismatch(got: &[u8], want: &[u8]) -> u64 {
    got.iter().zip(want).filter(|(a, b)| a != b).count() as u64
}

pub(super) struct Bench {
    pub(super) engine: CopyEngine,
    pub(super) memory: Arc<EngineMemory>,
    /// The arena's registration with CUDA (what copies name their host side by).
    pub(super) host: Arc<HostRegistration>,
    arena_slice: ArenaSlice,
    pub(super) contiguous: Arc<DeviceBuffer>,
    /// Every chunk's pieces, planned once (their count and typical length describe the run).
    pub(super) pieces: Vec<Piece>,
    /// Pieces planned by the copy engine for a job ([`CopyEngine::start`]), reused.
    plan: Vec<Piece>,
    /// (slot offset in the slice, block ids) per chunk.
    pub(super) chunks: Vec<(u64, Vec<u64>)>,
    /// The same with offsets from the registration's start (what copy jobs name).
    pub(super) job_chunks: Vec<(u64, Vec<u64>)>,
    pub(super) chunk_len: u64,
    pub(super) bytes: u64,
    /// Offset of the ceiling region in the arena slice.
    pub(super) ceiling_at: u64,
    /// Offset of the slice from the registration's start.
    pub(super) slice_at: u64,
    pub(super) originals: Vec<Vec<u8>>,
    pub(super) iterations: u32,
    pub(super) timeline: bool,
    /// Series submit job by job (`--server-jobs`).
    server_jobs: bool,
    /// How the checksums row computes them (`--checksum-form`).
    pub(super) checksum_form: crate::args::ChecksumForm,
}

impl Bench {
    /// Times `iterations` runs of `op` (the transfers of one operation, waited for) after one
    /// warm-up; returns GB/s per run.
    fn time(
        &mut self,
        mut op: impl FnMut(&mut Self) -> Result<Vec<Transfer>, Error>,
    ) -> Result<Vec<f64>, Error> {
        finish_all(op(self)?)?;
        let mut out = Vec::new();
        for _ in 0..self.iterations {
            let t = Instant::now();
            finish_all(op(self)?)?;
            out.push(gbps(self.bytes, t.elapsed().as_secs_f64()));
        }
        Ok(out)
    }

    pub(super) fn ceiling(&mut self, direction: Direction) -> Result<f64, Error> {
        let runs = self.time(|b| b.contiguous(direction).map(|t| vec![t]))?;
        Ok(median(runs))
    }

    /// The contiguous copy of the operation's bytes between the bench's buffer and the
    /// arena's ceiling region.
    fn contiguous(&mut self, direction: Direction) -> Result<Transfer, Error> {
        let at = self.slice_at + self.ceiling_at;
        let buffer = (&self.contiguous, 0);
        self.engine.start_contiguous(direction, buffer, &self.host, at, self.bytes).map_err(dma)
    }

    pub(super) fn scribble(&self, direction: Direction) -> Result<(), Error> {
        match direction {
            Direction::Save => {
                let junk = vec![0xeeu8; self.chunk_len as usize];
                for (slot, _) in &self.chunks {
                    self.arena_slice.write(*slot, &junk);
                }
            }
            Direction::Load => {
                let junk = vec![0x11u8; self.originals[0].len()];
                for i in 0..self.originals.len() {
                    self.memory.write_tensor(i, &junk).map_err(dma)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn verify(&self, direction: Direction) -> Result<u64, Error> {
        let layout = *self.memory.layout();
        let mut bad = 0;
        match direction {
            Direction::Save => {
                let mut want = Vec::with_capacity(self.chunk_len as usize);
                for (slot, blocks) in &self.chunks {
                    want.clear();
                    for &block in blocks {
                        for s in layout.block_segments(block) {
                            let t = &self.originals[s.tensor as usize];
                            want.extend_from_slice(
                                &t[s.offset as usize..(s.offset + s.len) as usize],
                            );
                        }
                    }
                    bad += count_mismatch(self.arena_slice.bytes(*slot, self.chunk_len), &want);
                }
            }
            Direction::Load => {
                let mut got = vec![0u8; self.originals[0].len()];
                for (i, want) in self.originals.iter().enumerate() {
                    self.memory.read_tensor(i, &mut got).map_err(dma)?;
                    bad += count_mismatch(&got, want);
                }
            }
        }
        Ok(bad)
    }

    /// One timed operation with strategy `strategy`; GB/s.
    pub(super) fn once(&mut self, direction: Direction, strategy: Strategy) -> Result<f64, Error> {
        let t = Instant::now();
        let all = 0..self.chunks.len();
        self.submit_range(direction, strategy, all, SaveSums::Off)?.finish().map_err(dma)?;
        Ok(gbps(self.bytes, t.elapsed().as_secs_f64()))
    }

    /// Starts the chunks `chunks` as one job, as the server's DMA thread would (block form
    /// where it applies), with a save's checksums as `sums` asks.
    pub(super) fn submit_range(
        &mut self,
        direction: Direction,
        strategy: Strategy,
        chunks: std::ops::Range<usize>,
        sums: SaveSums<'_>,
    ) -> Result<Transfer, Error> {
        let job = CopyJob {
            direction,
            memory: &self.memory,
            host: &self.host,
            chunks: &self.job_chunks[chunks],
            chunk_len: self.chunk_len,
        };
        self.engine.start(&job, strategy, sums, &mut self.plan).map_err(dma)
    }

    /// Chunk ranges of the server's jobs: at most 64 MiB of whole chunks each.
    pub(super) fn job_chunks(&self) -> Vec<std::ops::Range<usize>> {
        let per_job = (JOB_BYTES / self.chunk_len).max(1) as usize;
        (0..self.chunks.len())
            .step_by(per_job)
            .map(|c| c..(c + per_job).min(self.chunks.len()))
            .collect()
    }

    /// The shape of the engine-side copies of `--interference`: pages of this layout's
    /// typical piece length, as many as the run moves; unless `--engine-batch` says, batches
    /// of the staging part's size cut down to whole chunks (so that the server can copy them
    /// as chunks: the `engine-gather` rows).
    pub(super) fn engine_side_shape(&self, a: &DmaArgs) -> EngineSide {
        let sample = &self.pieces[..self.pieces.len().min(1024)];
        let mean = sample.iter().map(|p| p.len).sum::<u64>() / (sample.len() as u64).max(1);
        let part = self.engine.staging_part() as u64;
        let whole = match part / self.chunk_len.max(1) {
            0 => part,
            n => n * self.chunk_len,
        };
        EngineSide {
            page_bytes: (mean / 2).max(1) * 2,
            batch_bytes: a.engine_batch.unwrap_or(whole),
            pool_bytes: self.bytes,
            depth: a.engine_depth,
        }
    }

    /// The first half of the chunks' bytes copied device-to-host while the second half's go
    /// host-to-device, each contiguous, on two copy engines at once (what a save beside a load
    /// can reach); median GB/s of both together.
    pub(super) fn duplex_ceiling(
        &mut self,
        ctx: &Arc<CudaContext>,
        a: &DmaArgs,
    ) -> Result<f64, Error> {
        let mut other = CopyEngine::new(ctx, a.staging as usize, staging_depth(a), BATCHED_FROM)
            .map_err(dma)?;
        let half = self.chunk_len * (self.chunks.len() as u64 / 2);
        let rest = self.bytes - half;
        let at = self.slice_at + self.ceiling_at;
        let mut runs = Vec::new();
        for i in 0..=self.iterations {
            let t = Instant::now();
            // The two copies use disjoint halves of the buffer and of the ceiling region.
            let save = self.engine.start_contiguous(
                Direction::Save,
                (&self.contiguous, 0),
                &self.host,
                at,
                half,
            );
            let load = other.start_contiguous(
                Direction::Load,
                (&self.contiguous, half),
                &self.host,
                at + half,
                rest,
            );
            let (save, load) = (save.map_err(dma)?, load.map_err(dma)?);
            finish_all(vec![save, load])?;
            if i > 0 {
                runs.push(gbps(self.bytes, t.elapsed().as_secs_f64()));
            }
        }
        Ok(median(runs))
    }

    /// One contiguous copy of the operation's bytes (the ceiling's copy); GB/s.
    pub(super) fn contiguous_once(&mut self, direction: Direction) -> Result<f64, Error> {
        let t = Instant::now();
        self.contiguous(direction)?.finish().map_err(dma)?;
        Ok(gbps(self.bytes, t.elapsed().as_secs_f64()))
    }

    /// Starts one whole operation: every chunk in one job, or with `--server-jobs` job by
    /// job; the transfers and the sum of their shapes.
    fn submit_jobs(
        &mut self,
        direction: Direction,
        strategy: Strategy,
    ) -> Result<(Vec<Transfer>, JobShape), Error> {
        let jobs = if self.server_jobs {
            self.job_chunks()
        } else {
            std::iter::once(0..self.chunks.len()).collect()
        };
        let mut transfers = Vec::with_capacity(jobs.len());
        let mut whole = JobShape::default();
        for r in jobs {
            let t = self.submit_range(direction, strategy, r, SaveSums::Off)?;
            let s = t.shape();
            whole.bytes += s.bytes;
            whole.pieces += s.pieces;
            whole.batches += s.batches;
            whole.staged = s.staged;
            whole.blocks = s.blocks;
            transfers.push(t);
        }
        Ok((transfers, whole))
    }

    pub(super) fn series(
        &mut self,
        direction: Direction,
        name: &'static str,
        strategy: Strategy,
    ) -> Result<StrategyResult, Error> {
        self.scribble(direction)?;
        let mut shape = None;
        let runs = self.time(|b| {
            let (transfers, s) = b.submit_jobs(direction, strategy)?;
            shape = Some(s);
            Ok(transfers)
        })?;
        let shape = shape.expect("at least the warm-up ran");
        let timeline = if self.timeline && shape.staged {
            self.engine.record_timeline();
            let t = Instant::now();
            let r = self.submit_jobs(direction, strategy);
            let submitted = t.elapsed();
            finish_all(r?.0)?;
            let total = t.elapsed();
            let spans = self.engine.take_timeline().map_err(dma)?;
            Some(Timeline::summarize(
                spans,
                submitted.as_secs_f64() * 1e6,
                total.as_secs_f64() * 1e6,
            ))
        } else {
            None
        };
        let mismatched_bytes = self.verify(direction)?;
        let best = runs.iter().copied().fold(0.0, f64::max);
        Ok(StrategyResult {
            strategy: name,
            staged: shape.staged,
            blocks: Some(shape.blocks),
            gbps: median(runs),
            best_gbps: best,
            ratio: 0.0,
            batches: shape.batches,
            mismatched_bytes,
            timeline,
        })
    }
}

/// Waits for every transfer (in order; each one's failure reported after all have
/// finished, dropping the rest waits for them).
fn finish_all(transfers: Vec<Transfer>) -> Result<(), Error> {
    for t in transfers {
        t.finish().map_err(dma)?;
    }
    Ok(())
}

/// `--staging-depth`, or where not given the server's rule for its default 64 MiB jobs
/// (`--gpu-job`): as many parts as the staging holds such jobs, 2 to 8.
pub(super) fn staging_depth(a: &DmaArgs) -> usize {
    a.staging_depth.map_or_else(|| CopyEngine::default_depth(a.staging, 64 << 20), usize::from)
}

/// The stand-in engine (its tensors filled with seeded bytes), the arena registered with
/// CUDA, the chunks' slots and a copy engine: everything a run measures with; and how long
/// registering the arena took (ms).
pub(super) fn bench(
    a: &DmaArgs,
    ctx: &Arc<CudaContext>,
    layout: KvLayoutSpec,
) -> Result<(Bench, f64), Error> {
    let memory = Arc::new(EngineMemory::allocate(ctx, layout).map_err(dma)?);
    let tensor_bytes = layout.tensor_bytes().expect("validated") as usize;
    let mut originals = Vec::with_capacity(layout.tensor_count() as usize);
    for i in 0..layout.tensor_count() as usize {
        let mut t = vec![0u8; tensor_bytes];
        fill_random(a.seed.wrapping_mul(1_000_003).wrapping_add(i as u64), &mut t);
        memory.write_tensor(i, &t).map_err(dma)?;
        originals.push(t);
    }
    let nchunks = a.blocks / a.blocks_per_chunk;
    let chunk_len = layout.block_bytes() * a.blocks_per_chunk;
    let slot_len = chunk_len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    // Chunk slots, then a separate region for the contiguous ceiling copies (which must not
    // overwrite what a save just stored).
    let ceiling_at = slot_len * nchunks;
    let ceiling_len = (chunk_len * nchunks).div_ceil(PAGE_SIZE) * PAGE_SIZE;
    let arena = Arc::new(
        Arena::create(ceiling_at + ceiling_len, true)
            .map_err(|e| Error::Gpu(format!("arena: {e}")))?,
    );
    let registration = Arc::new(
        orbitkv_gpu::register_host(a.device, arena.clone())
            .map_err(|e| Error::Gpu(e.to_string()))?,
    );
    let register_ms = registration.elapsed.as_secs_f64() * 1e3;
    let arena_slice = arena.split(1).pop().expect("one slice");
    let slice_at = arena_slice.offset();
    let mut rng = SmallRng::seed_from_u64(a.seed);
    let mut blocks: Vec<u64> = (0..a.blocks).collect();
    blocks.shuffle(&mut rng);
    let mut slots: Vec<u64> = (0..nchunks).map(|i| i * slot_len).collect();
    if a.slots == SlotOrderArg::Shuffled {
        slots.shuffle(&mut rng);
    }
    let mut pieces = Vec::new();
    let mut chunks = Vec::with_capacity(nchunks as usize);
    for (i, slot) in slots.iter().enumerate() {
        let ids =
            blocks[i * a.blocks_per_chunk as usize..(i + 1) * a.blocks_per_chunk as usize].to_vec();
        // Planned once to describe the run (how many pieces, how long); jobs plan their own.
        memory.chunk_pieces(&ids, slice_at + slot, &mut pieces).map_err(dma)?;
        chunks.push((*slot, ids));
    }
    let job_chunks = chunks.iter().map(|(slot, ids)| (slice_at + slot, ids.clone())).collect();
    let bytes = chunk_len * nchunks;
    let engine =
        CopyEngine::new(ctx, a.staging as usize, staging_depth(a), BATCHED_FROM).map_err(dma)?;
    let contiguous = Arc::new(DeviceBuffer::new(ctx, bytes as usize).map_err(dma)?);
    let bench = Bench {
        engine,
        memory,
        host: registration,
        arena_slice,
        contiguous,
        pieces,
        plan: Vec::new(),
        chunks,
        job_chunks,
        chunk_len,
        bytes,
        ceiling_at,
        slice_at,
        originals,
        iterations: a.iterations,
        timeline: a.timeline,
        server_jobs: a.server_jobs,
        checksum_form: a.checksum_form,
    };
    Ok((bench, register_ms))
}
