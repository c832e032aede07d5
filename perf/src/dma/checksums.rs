//! The GPU chunk checksums of a local `dma` run (`--checksum-form`): every chunk's checksum
//! checked against the CPU's, their speed alone, and saves with them computed beside the copy
//! (`gpu`) or summed by the gather (the fused forms), job by job as the server's DMA thread
//! runs them.

use std::time::Instant;

use orbitkv_gpu::dma::{
    ChecksumTicket, ChunkHasher, Direction, SaveSums, Strategy, Transfer, SUMMED_UNFINISHED,
};
use orbitkv_gpu::LayoutGeometry;

use super::bench::Bench;
use super::report::{ChecksumResult, Timeline};
use super::{dma, gbps, median, ratio};
use crate::error::Error;

impl Bench {
    /// One save (`auto`) with the chunks' checksums computed beside it, job by job (`jobs`:
    /// chunk ranges); GB/s.
    pub(super) fn save_with_checksums(
        &mut self,
        hasher: &mut ChunkHasher,
        jobs: &[std::ops::Range<usize>],
    ) -> Result<f64, Error> {
        // As the server's DMA thread does: job by job, each job's checksums beside the next
        // jobs' copies.
        let t = Instant::now();
        let mut transfers = Vec::with_capacity(jobs.len());
        for r in jobs {
            let sums = SaveSums::Kernels(&mut *hasher);
            transfers.push(self.submit_range(Direction::Save, Strategy::Auto, r.clone(), sums)?);
        }
        for t in transfers {
            t.finish().map_err(dma)?;
        }
        Ok(gbps(self.bytes, t.elapsed().as_secs_f64()))
    }

    /// Starts the checksums of every chunk, without copies, job by job (`jobs`: chunk
    /// ranges); none where the kernels do not apply.
    fn submit_checksums(
        &self,
        hasher: &mut ChunkHasher,
        jobs: &[std::ops::Range<usize>],
    ) -> Result<Vec<ChecksumTicket>, Error> {
        let mut tickets = Vec::with_capacity(jobs.len());
        for r in jobs {
            let chunks = &self.job_chunks[r.clone()];
            match hasher.checksums(&self.memory, chunks, self.chunk_len).map_err(dma)? {
                Some(t) => tickets.push(t),
                None => return Ok(Vec::new()),
            }
        }
        Ok(tickets)
    }

    /// `fused` (the default, as the server's `--gpu-checksums fused`) where the fused form
    /// does not apply to this run's saves (not staged in block form, parts not a multiple of
    /// 1 KiB, its kernels missing): `gpu`, as the server does then; the rows and the JSON name
    /// the form measured.
    pub(super) fn settle_checksum_form(&mut self, hasher: &ChunkHasher) -> Result<(), Error> {
        use crate::args::ChecksumForm;
        if self.checksum_form != ChecksumForm::Fused || self.chunks.is_empty() {
            return Ok(());
        }
        let first = self.job_chunks()[0].clone();
        let job = self.memory.block_job(0, &self.job_chunks[first]).map_err(dma)?;
        let summed = hasher.summed_applies(&job);
        let blocks = self.engine.blocks_for(Strategy::Auto, &job, summed);
        if !blocks || !summed {
            self.checksum_form = ChecksumForm::Gpu;
        }
        Ok(())
    }

    /// `None` when the kernels do not load on this driver (said on stderr).
    pub(super) fn checksums(&mut self, save_ceiling: f64) -> Result<Option<ChecksumResult>, Error> {
        let mut hasher = match ChunkHasher::new(self.engine.context()) {
            Ok(h) => h,
            Err(e) => {
                eprintln!(
                    "orbitkv-perf: note: GPU checksum kernels not loaded ({e}); not measured"
                );
                return Ok(None);
            }
        };
        self.settle_checksum_form(&hasher)?;
        let jobs = self.job_chunks();
        use crate::args::ChecksumForm;
        if self.checksum_form != ChecksumForm::Gpu {
            return self.fused_checksums(&mut hasher, &jobs, save_ceiling).map(Some);
        }
        let mut got = Vec::new();
        for t in self.submit_checksums(&mut hasher, &jobs)? {
            got.extend(t.take().map_err(dma)?);
        }
        if got.is_empty() {
            return Ok(Some(ChecksumResult {
                form: self.checksum_form,
                chunks: 0,
                mismatches: 0,
                gbps_alone: 0.0,
                save_gbps_with_checksums: 0.0,
                save_ratio_with_checksums: 0.0,
                timeline: None,
                mismatched_bytes: None,
            }));
        }
        if got.len() != self.chunks.len() {
            return Err(Error::Gpu(format!(
                "GPU checksums for {} chunks, the run has {}",
                got.len(),
                self.chunks.len()
            )));
        }
        let mismatches = self.wrong_checksums(&got);
        let mut alone = Vec::new();
        let mut with = Vec::new();
        for _ in 0..self.iterations {
            let t = Instant::now();
            for k in self.submit_checksums(&mut hasher, &jobs)? {
                k.take().map_err(dma)?;
            }
            alone.push(gbps(self.bytes, t.elapsed().as_secs_f64()));
            with.push(self.save_with_checksums(&mut hasher, &jobs)?);
        }
        let save = median(with);
        let timeline = if self.timeline {
            self.engine.record_timeline();
            let t = Instant::now();
            self.save_with_checksums(&mut hasher, &jobs)?;
            let total = t.elapsed().as_secs_f64() * 1e6;
            let spans = self.engine.take_timeline().map_err(dma)?;
            // The host's submit time is not separable here (copies and checksums alternate):
            // both host fields are the whole operation. No spans when `auto` went batched.
            (!spans.is_empty()).then(|| Timeline::summarize(spans, total, total))
        } else {
            None
        };
        Ok(Some(ChecksumResult {
            form: self.checksum_form,
            chunks: got.len(),
            mismatches,
            gbps_alone: median(alone),
            save_gbps_with_checksums: save,
            save_ratio_with_checksums: ratio(save, save_ceiling),
            timeline,
            mismatched_bytes: None,
        }))
    }

    /// Chunks (in the order of `self.chunks`) whose checksum in `got` is not
    /// `orbitkv_proto::chunk_checksum` of their expected bytes.
    fn wrong_checksums(&self, got: &[u64]) -> u64 {
        let layout = *self.memory.layout();
        let mut want = Vec::with_capacity(self.chunk_len as usize);
        let mut mismatches = 0;
        for ((_, blocks), sum) in self.chunks.iter().zip(got) {
            want.clear();
            for &block in blocks {
                for s in layout.block_segments(block) {
                    let t = &self.originals[s.tensor as usize];
                    want.extend_from_slice(&t[s.offset as usize..(s.offset + s.len) as usize]);
                }
            }
            mismatches += u64::from(orbitkv_proto::chunk_checksum(&want) != *sum);
        }
        mismatches
    }

    /// The checksums row in a fused form (`--checksum-form fused|fused-host|gather-only`):
    /// saves whose gather sums the rows, job by job as the server's DMA thread submits them,
    /// the fold after each job's gathers (not with `gather-only`); the saved bytes and the
    /// checksums checked after the first.
    fn fused_checksums(
        &mut self,
        hasher: &mut ChunkHasher,
        jobs: &[std::ops::Range<usize>],
        save_ceiling: f64,
    ) -> Result<ChecksumResult, Error> {
        self.scribble(Direction::Save)?;
        let (_, got) = self.save_fused(hasher, jobs)?;
        let mismatched_bytes = self.verify(Direction::Save)?;
        if got.len() != self.chunks.len() {
            return Err(Error::Gpu(format!(
                "fused GPU checksums for {} chunks, the run has {}",
                got.len(),
                self.chunks.len()
            )));
        }
        let mismatches = self.wrong_checksums(&got);
        let mut with = Vec::new();
        for _ in 0..self.iterations {
            with.push(self.save_fused(hasher, jobs)?.0);
        }
        let save = median(with);
        let timeline = if self.timeline {
            self.engine.record_timeline();
            let t = Instant::now();
            self.save_fused(hasher, jobs)?;
            let total = t.elapsed().as_secs_f64() * 1e6;
            let spans = self.engine.take_timeline().map_err(dma)?;
            (!spans.is_empty()).then(|| Timeline::summarize(spans, total, total))
        } else {
            None
        };
        Ok(ChecksumResult {
            form: self.checksum_form,
            chunks: got.len(),
            mismatches,
            gbps_alone: 0.0,
            save_gbps_with_checksums: save,
            save_ratio_with_checksums: ratio(save, save_ceiling),
            timeline,
            mismatched_bytes: Some(mismatched_bytes),
        })
    }

    /// One save in the fused form, job by job (`jobs`: chunk ranges), as the server's DMA
    /// thread runs it: each job's gather sums its rows, and its fold is queued once the thread
    /// has seen its gathers done (waiting for the oldest when every checksum slot is held).
    /// GB/s, and the checksums in chunk order.
    pub(super) fn save_fused(
        &mut self,
        hasher: &mut ChunkHasher,
        jobs: &[std::ops::Range<usize>],
    ) -> Result<(f64, Vec<u64>), Error> {
        let t = Instant::now();
        let mut transfers: Vec<Transfer> = Vec::with_capacity(jobs.len());
        for r in jobs {
            // Each begun save holds a checksum slot until its fold is queued.
            fold_seen(hasher, &mut transfers, SUMMED_UNFINISHED - 1)?;
            let sums = SaveSums::Fused(&mut *hasher);
            transfers.push(self.submit_range(Direction::Save, Strategy::Auto, r.clone(), sums)?);
            // Those whose gathers are done already.
            fold_seen(hasher, &mut transfers, usize::MAX)?;
        }
        fold_seen(hasher, &mut transfers, 0)?;
        let mut sums = Vec::with_capacity(self.chunks.len());
        for t in transfers {
            sums.extend(t.finish().map_err(dma)?.unwrap_or_default());
        }
        Ok((gbps(self.bytes, t.elapsed().as_secs_f64()), sums))
    }
}

/// Queues the folds of fused saves among `transfers` (oldest first) whose gathers have
/// finished, and more, each waited for, until at most `keep` are left unfolded.
fn fold_seen(
    hasher: &mut ChunkHasher,
    transfers: &mut [Transfer],
    keep: usize,
) -> Result<(), Error> {
    let mut unfolded = transfers.iter().filter(|t| t.held_slot(hasher).is_some()).count();
    for t in transfers.iter_mut() {
        if t.held_slot(hasher).is_none() {
            continue;
        }
        if !t.fold(hasher, unfolded > keep).map_err(dma)? {
            break;
        }
        unfolded -= 1;
    }
    Ok(())
}
