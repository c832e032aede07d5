//! GPU requests on a session's home shard: register and unregister an engine rank's tensors,
//! save engine blocks into new chunks, load chunks back into engine blocks.
//!
//! Save reserves the chunks' slots, has `gpu-d2h` copy into them, then commits (or aborts on a
//! copy failure). Load leases the present prefix, has `gpu-h2d` copy out of it, then releases.
//! The request holds its slots until the copy's CUDA event has completed, and a closing
//! session waits for its requests in flight, so no slot is reused under a running copy.

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use orbitkv_gpu::dma::{Direction, EngineMemory};
use orbitkv_gpu::LayoutGeometry;
use orbitkv_proto::{
    ChunkKey, ChunkOutcome, ErrorCode, GpuTensor, Hit, KvLayoutSpec, Reservation, Response, SlotRef,
};
use orbitkv_shards::{SessionId, ShardOp};

use crate::gpu::{off_shard, RequestPhases};
use crate::requests::fanout::{commit_given, lookup, per_slot, reserve, Check, OnWrongChecksum};
use crate::shard::context::Exec;

fn no_gpu() -> Response {
    Response::error(
        ErrorCode::Unavailable,
        "this server has no GPU in use (no CUDA device, --gpu off, or the arena could not be \
         registered; see the server log)",
    )
}

/// `RegisterGpu`. Opening the IPC handles takes the driver milliseconds: it runs off the
/// shard, which keeps serving meanwhile.
pub(crate) async fn register(
    exec: &Rc<Exec>,
    session: SessionId,
    device_uuid: String,
    layout: KvLayoutSpec,
    tensors: Vec<GpuTensor>,
) -> Response {
    let Some(gpu) = exec.shared.gpu_service.get() else { return no_gpu() };
    let (svc, uuid) = (Arc::clone(gpu), device_uuid.clone());
    let result = off_shard_awaited(move || svc.register(session, &uuid, &layout, &tensors))
        .await
        .unwrap_or_else(|| {
            Err((
                ErrorCode::Internal,
                "the IPC handles could not be opened off the shard (see the server log)".into(),
            ))
        });
    match result {
        Ok((registration, generation)) => {
            tracing::info!(session, registration, generation, device_uuid, "GPU registration");
            Response::GpuRegistered { registration, generation }
        }
        Err((code, message)) => Response::Error { code, message },
    }
}

/// Runs `f` off the shard (driver work that takes milliseconds) while the shard keeps
/// serving, and returns its result; None if no thread could run it (it was then dropped on
/// the shard) or it panicked.
async fn off_shard_awaited<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    off_shard(move || {
        let _ = tx.send(f());
    });
    loop {
        match rx.try_recv() {
            Ok(r) => return Some(r),
            Err(crossbeam_channel::TryRecvError::Empty) => {
                glommio::timer::sleep(Duration::from_micros(100)).await
            }
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
        }
    }
}

/// `UnregisterGpu`: answered once no copy uses the engine's memory any more and the server's
/// import of it is closed (when no other registration of the same allocation holds it), so
/// that the engine may free it as soon as the answer arrives: freeing exported memory before
/// the importer closes its handle is undefined in CUDA.
pub(crate) async fn unregister(
    exec: &Rc<Exec>,
    session: SessionId,
    registration: u64,
    generation: u64,
) -> Response {
    let Some(gpu) = exec.shared.gpu_service.get() else { return no_gpu() };
    let memory = match gpu.unregister(session, registration, generation) {
        Ok(m) => m,
        Err((code, message)) => return Response::Error { code, message },
    };
    // Copies in flight hold the memory; the mapping closes when the last of them lets go.
    while Arc::strong_count(&memory) > 1 {
        glommio::timer::sleep(Duration::from_micros(50)).await;
    }
    // Closing the mapping is driver work: off the shard, awaited before the answer.
    off_shard_awaited(move || drop(memory)).await;
    Response::GpuUnregistered
}

/// Checks the block list against the keys and the registered layout: `n` blocks per key,
/// every id in range. Returns (blocks per chunk, chunk bytes).
fn shape(layout: &KvLayoutSpec, keys: usize, blocks: &[u64]) -> Result<(usize, u64), Response> {
    let bad = |m: String| Err(Response::error(ErrorCode::InvalidArgument, m));
    if blocks.is_empty() || !blocks.len().is_multiple_of(keys) {
        return bad(format!(
            "blocks: {} block ids for {keys} keys; give the same number (at least one) per key",
            blocks.len()
        ));
    }
    if let Some((i, b)) = blocks.iter().enumerate().find(|(_, &b)| b >= layout.num_blocks) {
        return bad(format!(
            "blocks[{i}]: {b} is out of range (the engine registered {} blocks)",
            layout.num_blocks
        ));
    }
    let per_chunk = blocks.len() / keys;
    match layout.block_bytes().checked_mul(per_chunk as u64) {
        Some(len) => Ok((per_chunk, len)),
        None => bad(format!(
            "blocks: {per_chunk} blocks per key of {} bytes each make a chunk larger than 2^64 \
             bytes",
            layout.block_bytes()
        )),
    }
}

fn blocks_of(blocks: &[u64], per_chunk: usize, i: usize) -> Vec<u64> {
    blocks[i * per_chunk..(i + 1) * per_chunk].to_vec()
}

/// A save or load that passed its checks.
struct Transfer {
    device: usize,
    memory: Arc<EngineMemory>,
    per_chunk: usize,
    chunk_len: u64,
}

/// Finds the registration and checks the blocks; the error is the whole answer (an empty
/// key list answers no outcomes). A transfer that passes wakes its DMA thread now, so that the
/// thread's wake-up overlaps the first job's reservations or lookups on the shards.
fn prepare(
    exec: &Rc<Exec>,
    session: SessionId,
    direction: Direction,
    (registration, generation): (u64, u64),
    (keys, blocks): (&[ChunkKey], &[u64]),
) -> Result<Transfer, Response> {
    let Some(gpu) = exec.shared.gpu_service.get() else { return Err(no_gpu()) };
    let (device, memory) = gpu
        .lookup(session, registration, generation)
        .map_err(|(code, message)| Response::Error { code, message })?;
    if keys.is_empty() {
        return Err(Response::Outcomes { outcomes: Vec::new() });
    }
    let (per_chunk, chunk_len) = shape(memory.layout(), keys.len(), blocks)?;
    gpu.expect(direction, device);
    Ok(Transfer { device, memory, per_chunk, chunk_len })
}

/// `Save`.
pub(crate) async fn save(
    exec: &Rc<Exec>,
    session: SessionId,
    registration: u64,
    generation: u64,
    keys: Vec<ChunkKey>,
    blocks: Vec<u64>,
) -> Response {
    let started = Instant::now();
    let transfer =
        match prepare(exec, session, Direction::Save, (registration, generation), (&keys, &blocks))
        {
            Ok(t) => Rc::new(t),
            Err(answer) => return answer,
        };
    let phases = Rc::new(RequestPhases::new(started));
    let mut outcomes = vec![ChunkOutcome::Done; keys.len()];
    // Groups of chunks go to the DMA thread one after another; each group is committed (its
    // checksums computed on the owning shards) as soon as its copy completes, while the copy
    // engine works on the next groups. Each group's slots are reserved just before it goes:
    // the first copy waits for its own group's reservations only, and the later groups are
    // reserved while the copy engine moves the ones before (reserving a whole 2 GiB save of
    // 512 KiB chunks first kept the engine idle for about a millisecond).
    let group = (exec.shared.settings.gpu_job_bytes / transfer.chunk_len).max(1) as usize;
    let jobs = keys.len().div_ceil(group);
    let blocks = Rc::new(blocks);
    let mut tasks = Vec::new();
    let mut checks = SaveChecks::default();
    for (g, group_keys) in keys.chunks(group).enumerate() {
        let mut part =
            reserve_group(exec, session, group_keys, g * group, transfer.chunk_len, &mut outcomes)
                .await;
        if part.is_empty() {
            continue;
        }
        let check = checks.job(part.len(), g + 1 == jobs);
        // In arena order within the job: slots a shard allocated one after another then sit
        // side by side in the staging buffer too, and their host copies merge into one (a
        // copy per chunk under a megabyte costs the device-to-host engine a few percent).
        // Every chunk keeps its index, slot and checksum together, so order does not matter
        // otherwise.
        part.sort_by_key(|&(_, _, off)| off);
        let (exec, transfer, blocks) = (Rc::clone(exec), Rc::clone(&transfer), Rc::clone(&blocks));
        let phases = Rc::clone(&phases);
        tasks.push(glommio::spawn_local(async move {
            let chunks = part
                .iter()
                .map(|&(i, _, off)| (off, blocks_of(&blocks, transfer.per_chunk, i)))
                .collect();
            phases.submitted(Instant::now());
            let copied = exec
                .gpu_run(
                    Direction::Save,
                    transfer.device,
                    Arc::clone(&transfer.memory),
                    (chunks, transfer.chunk_len),
                )
                .await;
            phases.copied(Instant::now());
            let refs: Vec<SlotRef> = part.iter().map(|r| r.1).collect();
            let results =
                finish_save_job(&exec, (session, registration), &refs, copied, check).await;
            part.iter().map(|r| r.0).zip(results).collect::<Vec<_>>()
        }));
    }
    for t in tasks {
        for (i, o) in t.await {
            outcomes[i] = o;
        }
    }
    if let Some(gpu) = exec.shared.gpu_service.get() {
        phases.finish(&gpu.counters, Direction::Save, Instant::now());
    }
    Response::Outcomes { outcomes }
}

/// Reserves the slots of one save group, whose first key is the request's `first`-th: the
/// reserved ones as (index in the request, slot, arena offset); a refusal is written into
/// `outcomes`.
async fn reserve_group(
    exec: &Rc<Exec>,
    session: SessionId,
    group_keys: &[ChunkKey],
    first: usize,
    chunk_len: u64,
    outcomes: &mut [ChunkOutcome],
) -> Vec<(usize, SlotRef, u64)> {
    let items: Vec<(ChunkKey, u64)> = group_keys.iter().map(|k| (*k, chunk_len)).collect();
    let mut part = Vec::with_capacity(items.len());
    for (j, s) in reserve(exec, session, &items).await.into_iter().enumerate() {
        let i = first + j;
        match s {
            Reservation::Slot { offset, generation, .. } => {
                part.push((i, SlotRef { key: group_keys[j], generation }, offset))
            }
            Reservation::Failed(code) => outcomes[i] = ChunkOutcome::Failed(code),
        }
    }
    part
}

/// Commits a save job whose copy is over (or aborts its reservations if the copy failed),
/// after settling its spot check; the outcomes of `refs`, in order.
async fn finish_save_job(
    exec: &Rc<Exec>,
    (session, registration): (SessionId, u64),
    refs: &[SlotRef],
    copied: Result<Option<Vec<u64>>, (ErrorCode, String)>,
    check: JobCheck,
) -> Vec<ChunkOutcome> {
    let (check, report) = check.settle().await;
    match copied {
        Ok(Some(sums)) if sums.len() == refs.len() => {
            let (out, verified) = commit_summed(exec, session, refs, sums, check).await;
            if let Some(tx) = report {
                let _ = tx.try_send(verified);
            }
            out
        }
        Ok(sums) => {
            if let Some(s) = sums {
                tracing::error!(
                    got = s.len(),
                    chunks = refs.len(),
                    "GPU checksums for a job of another size; the shards compute them"
                );
            }
            per_slot(exec, refs, |slots| ShardOp::Commit { session, slots }).await
        }
        Err((code, message)) => {
            tracing::warn!(session, registration, %message, "GPU save failed; reservations aborted");
            per_slot(exec, refs, |slots| ShardOp::Abort { session, slots }).await;
            vec![ChunkOutcome::Failed(code); refs.len()]
        }
    }
}

/// A save's spot checks. A job's first GPU checksum is checked on its shard (hashing a chunk
/// there), beside the next jobs' copies: the first job's, then one per `SpotChecks` share of
/// chunks (every job of 64 MiB in chunks of up to 2 MiB). The last job's would instead delay
/// the answer by that hash (0.1-0.4 ms for 0.5-2 MiB chunks, about 1% of a 2 GiB save). So the
/// first job that is not the last says whether its check passed, and the last job, once its
/// copy is done, commits unchecked when it did (normally known by then) and checks its own
/// otherwise.
struct SaveChecks {
    spot: SpotChecks,
    verdict_tx: Option<LocalSender<bool>>,
    verdict_rx: Option<LocalReceiver<bool>>,
}

impl Default for SaveChecks {
    fn default() -> Self {
        let (tx, rx) = local_channel::new_bounded::<bool>(1);
        Self { spot: SpotChecks::default(), verdict_tx: Some(tx), verdict_rx: Some(rx) }
    }
}

impl SaveChecks {
    /// The check of the next job, of `chunks` reserved chunks.
    fn job(&mut self, chunks: usize, last: bool) -> JobCheck {
        let report = if last { None } else { self.verdict_tx.take() };
        let verdict = if last && self.verdict_tx.is_none() { self.verdict_rx.take() } else { None };
        let checked = self.spot.job(chunks, report.is_some(), last);
        JobCheck { report, verdict, checked }
    }
}

/// One save job's part in its request's spot checks.
struct JobCheck {
    /// Where this job says whether its check passed (the first job that is not the last).
    report: Option<LocalSender<bool>>,
    /// The first job's verdict (the last job, when an earlier one reports).
    verdict: Option<LocalReceiver<bool>>,
    /// Whether this job checks, when it has no verdict to wait for.
    checked: bool,
}

impl JobCheck {
    /// Once the job's copy is over: what its commit checks, and where it reports the result.
    async fn settle(self) -> (Check, Option<LocalSender<bool>>) {
        let check = match self.verdict {
            Some(rx) if rx.recv().await == Some(true) => Check::Nothing,
            Some(_) => Check::First,
            None if self.checked => Check::First,
            None => Check::Nothing,
        };
        (check, self.report)
    }
}

/// Which jobs of a GPU save check their first chunk's GPU checksum on its shard: hashing a
/// chunk there costs a core about a millisecond per 8 MiB (on the H200 host), and checking every
/// job of 8 MiB chunks hashed an eighth of a save's bytes, its last checks delaying the answer.
/// A job checks when it reports the request's verdict (the first that goes), when it is the
/// last with no verdict to wait for, or when `CHUNKS_PER_CHECK` chunks went unchecked since the
/// last check (counting that job's own).
#[derive(Default)]
struct SpotChecks {
    unchecked: usize,
}

impl SpotChecks {
    /// At most one check per this many chunks a save commits.
    const CHUNKS_PER_CHECK: usize = 32;

    /// Whether the next job, of `chunks` chunks, checks (a last job's verdict, when it has
    /// one, decides instead).
    fn job(&mut self, chunks: usize, reports: bool, last: bool) -> bool {
        let check = reports || last || self.unchecked >= Self::CHUNKS_PER_CHECK;
        self.unchecked = if check { chunks } else { self.unchecked + chunks };
        check
    }
}

/// Commits a save job's slots with the checksums the GPU computed. With `check` (`First`) the
/// first chunk's is checked against the bytes on its shard before the others are committed;
/// if it is wrong the whole job is dropped (`DeviceError`: a miss costs a cache little, a
/// wrong chunk with a matching checksum would not be caught later) and saves' checksums move
/// to the shards. Under `--gpu-checksums verify` every chunk is checked. Also says whether a
/// checksum was checked and found right.
async fn commit_summed(
    exec: &Rc<Exec>,
    session: SessionId,
    refs: &[SlotRef],
    sums: Vec<u64>,
    check: Check,
) -> (Vec<ChunkOutcome>, bool) {
    let gpu = exec.shared.gpu_service.get();
    let all = gpu.map(|g| g.checksum_place()) == Some(crate::config::ChecksumPlace::Verify);
    let check = if all { Check::All } else { check };
    let out = commit_given(exec, session, refs, &sums, check, OnWrongChecksum::AbortRest).await;
    let wrong = ChunkOutcome::Failed(ErrorCode::ChecksumMismatch);
    if check == Check::First && out.first() == Some(&wrong) {
        if let Some(g) = gpu {
            g.distrust_checksums();
        }
        return (vec![ChunkOutcome::Failed(ErrorCode::DeviceError); refs.len()], false);
    }
    // Checked and right: the first chunk was checked and stored.
    let verified = check != Check::Nothing && out.first() == Some(&ChunkOutcome::Done);
    // A checksum the GPU got wrong is the device's error.
    let out = out
        .into_iter()
        .map(|o| if o == wrong { ChunkOutcome::Failed(ErrorCode::DeviceError) } else { o })
        .collect();
    (out, verified)
}

/// `Load`.
pub(crate) async fn load(
    exec: &Rc<Exec>,
    session: SessionId,
    registration: u64,
    generation: u64,
    keys: Vec<ChunkKey>,
    blocks: Vec<u64>,
) -> Response {
    let started = Instant::now();
    let transfer =
        match prepare(exec, session, Direction::Load, (registration, generation), (&keys, &blocks))
        {
            Ok(t) => Rc::new(t),
            Err(answer) => return answer,
        };
    let phases = Rc::new(RequestPhases::new(started));
    let mut outcomes = vec![ChunkOutcome::Failed(ErrorCode::NotFound); keys.len()];
    // Jobs of at most `--gpu-job` bytes, queued one after another: the DMA thread plans one while the
    // copy engine moves the one before. Each job's chunks are looked up (and leased) just
    // before it goes, so the first copy waits for its own lookup only and the later lookups
    // run beside the copies. The prefix ends at the first miss: hits after it in its group are
    // released unread, and later groups are not looked up (their chunks answer `NotFound`, as
    // chunks past the prefix do). A job's leases are released as soon as its copy has
    // completed; every lease is released before the answer.
    let group = (exec.shared.settings.gpu_job_bytes / transfer.chunk_len).max(1) as usize;
    let mut tasks = Vec::new();
    let mut unread = Vec::new();
    for (g, group_keys) in keys.chunks(group).enumerate() {
        let hits: Vec<Option<Hit>> = lookup(exec, session, group_keys, true).await;
        let job = LoadJob::sort(&transfer, &blocks, (g * group, group_keys), &hits, &mut outcomes);
        unread.extend(job.unread);
        if !job.chunks.is_empty() {
            let (exec, transfer, phases) =
                (Rc::clone(exec), Rc::clone(&transfer), Rc::clone(&phases));
            let (ids, chunks) = (job.ids, job.chunks);
            tasks.push(glommio::spawn_local(async move {
                phases.submitted(Instant::now());
                let copied = exec
                    .gpu_run(
                        Direction::Load,
                        transfer.device,
                        Arc::clone(&transfer.memory),
                        (chunks, transfer.chunk_len),
                    )
                    .await;
                phases.copied(Instant::now());
                let o = match copied {
                    Ok(_) => ChunkOutcome::Done,
                    Err((code, message)) => {
                        tracing::warn!(session, registration, %message, "GPU load failed");
                        ChunkOutcome::Failed(code)
                    }
                };
                // The copy is over (completed or failed: the DMA thread answers only once its
                // event has completed), so the slots may go.
                let slots: Vec<SlotRef> = ids.iter().map(|&(_, s)| s).collect();
                per_slot(&exec, &slots, |slots| ShardOp::Release { session, slots }).await;
                (ids, o)
            }));
        }
        if job.missed {
            break;
        }
    }
    for t in tasks {
        let (ids, o) = t.await;
        for (i, _) in ids {
            outcomes[i] = o;
        }
    }
    if !unread.is_empty() {
        per_slot(exec, &unread, |slots| ShardOp::Release { session, slots }).await;
    }
    if let Some(gpu) = exec.shared.gpu_service.get() {
        phases.finish(&gpu.counters, Direction::Load, Instant::now());
    }
    Response::Outcomes { outcomes }
}

/// One load group's leased hits, sorted into the job that copies them and the leases released
/// unread.
struct LoadJob {
    /// The copied chunks, in arena order, as (index in the request, slot).
    ids: Vec<(usize, SlotRef)>,
    /// The same chunks as (arena offset, engine blocks), the DMA thread's job.
    chunks: Vec<(u64, Vec<u64>)>,
    /// Hits past the group's first miss, or of another length, released unread.
    unread: Vec<SlotRef>,
    /// Whether the group has a miss (the prefix ends in it).
    missed: bool,
}

impl LoadJob {
    /// Sorts the `hits` of `group_keys`, whose first is the request's `first`-th; a hit of
    /// another length than the registration's chunk answers `InvalidArgument` in `outcomes`.
    fn sort(
        transfer: &Transfer,
        blocks: &[u64],
        (first, group_keys): (usize, &[ChunkKey]),
        hits: &[Option<Hit>],
        outcomes: &mut [ChunkOutcome],
    ) -> Self {
        let miss = hits.iter().position(Option::is_none);
        let mut copying = Vec::new();
        let mut unread = Vec::new();
        for (j, (key, h)) in group_keys.iter().zip(hits).enumerate() {
            let Some(h) = h else { continue };
            let i = first + j;
            let slot = SlotRef { key: *key, generation: h.generation };
            if miss.is_some_and(|m| j >= m) {
                unread.push(slot);
            } else if h.len != transfer.chunk_len {
                outcomes[i] = ChunkOutcome::Failed(ErrorCode::InvalidArgument);
                unread.push(slot);
            } else {
                copying.push((h.offset, i, slot));
            }
        }
        // In arena order within the job, as for saves (host copies of adjacent slots merge).
        copying.sort_by_key(|&(offset, _, _)| offset);
        let chunks = copying
            .iter()
            .map(|&(offset, i, _)| (offset, blocks_of(blocks, transfer.per_chunk, i)))
            .collect();
        let ids = copying.into_iter().map(|(_, i, slot)| (i, slot)).collect();
        Self { ids, chunks, unread, missed: miss.is_some() }
    }
}

#[cfg(test)]
mod tests {
    use orbitkv_proto::KvLayoutKind;

    use super::*;

    fn layout() -> KvLayoutSpec {
        KvLayoutSpec {
            kind: KvLayoutKind::FlashAttnNhd,
            num_layers: 4,
            num_blocks: 100,
            block_size: 16,
            kv_heads: 2,
            head_dim: 64,
            elem_bytes: 2,
        }
    }

    fn refused(r: Result<(usize, u64), Response>) -> String {
        match r {
            Err(Response::Error { code: ErrorCode::InvalidArgument, message }) => message,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// The jobs of one save that check a chunk, for `jobs` jobs of `chunks` chunks each.
    fn checked_jobs(jobs: usize, chunks: usize) -> Vec<usize> {
        let mut spot = SpotChecks::default();
        (0..jobs).filter(|&g| spot.job(chunks, g == 0 && jobs > 1, g + 1 == jobs)).collect()
    }

    #[test]
    fn saves_check_one_chunk_per_share() {
        // 64 MiB jobs of 2 MiB (or 1 MiB) chunks: every job.
        assert_eq!(checked_jobs(5, 32), vec![0, 1, 2, 3, 4]);
        assert_eq!(checked_jobs(3, 64), vec![0, 1, 2]);
        // Of 8 MiB chunks: one job in four, and the last (whose verdict, when it has one,
        // decides instead).
        assert_eq!(checked_jobs(10, 8), vec![0, 4, 8, 9]);
        // Jobs of one chunk: every 32nd.
        assert_eq!(checked_jobs(70, 1), vec![0, 32, 64, 69]);
        // One job: it checks its own.
        assert_eq!(checked_jobs(1, 8), vec![0]);
    }

    #[test]
    fn blocks_per_key_and_chunk_length() {
        let l = layout();
        assert_eq!(shape(&l, 2, &[0, 1, 2, 3]).unwrap(), (2, 2 * l.block_bytes()));
        assert_eq!(shape(&l, 3, &[5, 6, 7]).unwrap(), (1, l.block_bytes()));
    }

    #[test]
    fn bad_block_lists_name_what_is_wrong() {
        let l = layout();
        assert!(refused(shape(&l, 2, &[0, 1, 2])).starts_with("blocks: 3 block ids for 2 keys"));
        assert!(refused(shape(&l, 2, &[])).starts_with("blocks: 0 block ids"));
        let m = refused(shape(&l, 2, &[0, 100]));
        assert!(m.starts_with("blocks[1]: 100 is out of range"), "{m}");
        assert!(refused(shape(&l, 1, &[u64::MAX])).contains("out of range"));
        // Blocks of 2^45 bytes (a valid layout), 2^19 of them per key: the chunk's length
        // would wrap to 0 (and a division by it panic the shard).
        let big = KvLayoutSpec {
            num_layers: 1 << 4,
            num_blocks: 1,
            block_size: 1 << 20,
            kv_heads: 1 << 10,
            head_dim: 1 << 10,
            elem_bytes: 1,
            ..l
        };
        assert!(big.validate().is_ok());
        let m = refused(shape(&big, 1, &vec![0; 1 << 19]));
        assert!(m.starts_with("blocks: 524288 blocks per key of 35184372088832 bytes"), "{m}");
    }
}
