//! The local `dma` run (no `--socket`): each strategy's series each way in this process
//! between its ceilings, the GPU checksums, with `--duplex` a save beside a load on two copy
//! engines, and with `--interference` the matmul loop beside the copies.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;
use orbitkv_gpu::dma::{
    ChunkHasher, CopyEngine, CopyJob, Direction, SaveSums, Strategy, Transfer, BATCHED_FROM,
};

use super::bench::{staging_depth, Bench};
use super::interference::{InterferenceResult, Windows};
use super::matmul_loop::MatmulLoop;
use super::report::{DirectionResult, DuplexRow, LocalDuplex};
use super::{dma, gbps, median, ratio, strategies_of, Measured};
use crate::args::DmaArgs;
use crate::error::Error;

/// The local run: each strategy's series each way between its ceilings, the checksums, and
/// with `--duplex` and `--interference` their series.
pub(super) fn run_local(
    a: &DmaArgs,
    bench: &mut Bench,
    ctx: &Arc<CudaContext>,
) -> Result<Measured, Error> {
    let mut m = Measured::default();
    let strategies = strategies_of(a);
    // Save first: the load series then starts from arena slots that hold the right bytes.
    for direction in [Direction::Save, Direction::Load] {
        let before = bench.ceiling(direction)?;
        let mut rows = Vec::new();
        for &(name, s) in &strategies {
            rows.push(bench.series(direction, name, s)?);
        }
        let after = bench.ceiling(direction)?;
        let ceiling = before.max(after);
        for r in &mut rows {
            r.ratio = ratio(r.gbps, ceiling);
            m.mismatched += r.mismatched_bytes;
        }
        m.results.push(DirectionResult { direction, ceiling_gbps: ceiling, strategies: rows });
    }
    let save_ceiling = m.results[0].ceiling_gbps;
    m.checksums = bench.checksums(save_ceiling)?;
    m.mismatched += m.checksums.as_ref().map_or(0, |c| c.mismatches);
    if a.duplex {
        let ceiling = bench.duplex_ceiling(ctx, a)?;
        let mut other = CopyEngine::new(ctx, a.staging as usize, staging_depth(a), BATCHED_FROM)
            .map_err(dma)?;
        let d = bench.local_duplex(&mut other, ceiling, &strategies)?;
        m.mismatched += d.rows.iter().filter_map(|r| r.mismatched_bytes).sum::<u64>();
        m.duplex = Some(d);
    }
    if a.interference {
        m.interference = Some(bench.interference(a, &strategies)?);
        // The loads under the matmul rewrote the tensors: check them once more.
        m.mismatched += bench.verify(Direction::Load)?;
    }
    Ok(m)
}

impl Bench {
    /// The matmul loop beside back-to-back copies, each measurement after a window of the
    /// loop alone (and one more at the end): the contiguous ceiling copy, then each strategy,
    /// saves then loads; then saves with GPU checksums, and the engine-side copies; all of it
    /// `--interference-rounds` times.
    fn interference(
        &mut self,
        a: &DmaArgs,
        strategies: &[(&'static str, Strategy)],
    ) -> Result<InterferenceResult, Error> {
        let mut matmul = MatmulLoop::start(a.device, Some(self.engine_side_shape(a)))?;
        let mut windows = Windows::default();
        // Loaded once: a failure to load them leaves the row out, as it would every round.
        let mut hasher = ChunkHasher::new(self.engine.context()).ok();
        if let Some(h) = hasher.as_ref() {
            self.settle_checksum_form(h)?;
        }
        let jobs = self.job_chunks();
        for _ in 0..a.interference_rounds {
            let ways = std::iter::once(("contiguous", None))
                .chain(strategies.iter().map(|&(name, s)| (name, Some(s))));
            for (name, strategy) in ways {
                for direction in [Direction::Save, Direction::Load] {
                    let way = if direction == Direction::Save { "save" } else { "load" };
                    windows.measure(&mut matmul, name, way, |m| {
                        let (rate, runs) = m.during(|| match strategy {
                            None => self.contiguous_once(direction),
                            Some(s) => self.once(direction, s),
                        })?;
                        Ok((rate, median(runs)))
                    })?;
                }
            }
            // Saves as the server runs them: checksums summed by the gather (by default, where
            // that applies) or on the GPU beside the copy (`--checksum-form`).
            if let Some(hasher) = hasher.as_mut() {
                let row = match self.checksum_form {
                    crate::args::ChecksumForm::Gpu => "auto+checksums",
                    crate::args::ChecksumForm::Fused => "auto+fused",
                };
                windows.measure(&mut matmul, row, "save", |m| {
                    let (rate, runs) = m.during(|| match self.checksum_form {
                        crate::args::ChecksumForm::Gpu => self.save_with_checksums(hasher, &jobs),
                        crate::args::ChecksumForm::Fused => {
                            self.save_fused(hasher, &jobs).map(|r| r.0)
                        }
                    })?;
                    Ok((rate, median(runs)))
                })?;
            }
            matmul.engine_side_rows(&mut windows)?;
            windows.end_round();
        }
        Ok(windows.finish(&matmul))
    }

    /// A save of the first half of the chunks (on `other`) beside a load of the second half
    /// (on the bench's engine), each way in `strategies`, after one plain contiguous copy each
    /// way at once (the ceiling) and one one-entry batched copy each way at once.
    fn local_duplex(
        &mut self,
        other: &mut CopyEngine,
        ceiling_gbps: f64,
        strategies: &[(&'static str, Strategy)],
    ) -> Result<LocalDuplex, Error> {
        let nchunks = self.chunks.len();
        let half = self.chunk_len * (nchunks as u64 / 2);
        // The halves as the server's DMA threads get them.
        let (save_chunks, load_chunks) = self.job_chunks.split_at(nchunks / 2);
        let job = |direction, chunks| CopyJob {
            direction,
            memory: &self.memory,
            host: &self.host,
            chunks,
            chunk_len: self.chunk_len,
        };
        let (save_job, load_job) =
            (job(Direction::Save, save_chunks), job(Direction::Load, load_chunks));
        let mut rows = Vec::new();
        for &(name, strategy) in strategies {
            let (mut both, mut saves, mut loads) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..=self.iterations {
                // Each way from its own thread, as the server's two DMA threads: starting a
                // staged job waits for its staging parts, so one thread would start the load
                // only once the save was nearly through.
                let t = Instant::now();
                let engine = &mut self.engine;
                let (save_s, load_s) = std::thread::scope(|scope| {
                    let save = scope.spawn(|| -> Result<f64, Error> {
                        let mut plan = Vec::new();
                        let copy = other.start(&save_job, strategy, SaveSums::Off, &mut plan);
                        copy.and_then(Transfer::finish).map_err(dma)?;
                        Ok(t.elapsed().as_secs_f64())
                    });
                    let load = (|| -> Result<f64, Error> {
                        let mut plan = Vec::new();
                        let copy = engine.start(&load_job, strategy, SaveSums::Off, &mut plan);
                        copy.and_then(Transfer::finish).map_err(dma)?;
                        Ok(t.elapsed().as_secs_f64())
                    })();
                    let save = save.join().expect("the save thread does not panic");
                    (save, load)
                });
                let (save_s, load_s) = (save_s?, load_s?);
                let total = t.elapsed().as_secs_f64();
                if i > 0 {
                    both.push(gbps(self.bytes, total));
                    saves.push(gbps(half, save_s.min(total)));
                    loads.push(gbps(self.bytes - half, load_s.min(total)));
                }
            }
            // The series rewrote half the slots and half the blocks with the bytes they held.
            let mismatched_bytes =
                Some(self.verify(Direction::Save)? + self.verify(Direction::Load)?);
            let g = median(both);
            rows.push(DuplexRow {
                strategy: name,
                gbps: g,
                ratio: ratio(g, ceiling_gbps),
                save_gbps: median(saves),
                load_gbps: median(loads),
                mismatched_bytes,
            });
        }
        Ok(LocalDuplex { ceiling_gbps, rows })
    }
}
