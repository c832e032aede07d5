//! `orbitkv-perf dma --socket --engine-copies`: the engine-side path, without CUDA IPC. This
//! process registers its own mapping of the arena with CUDA and moves the pages with its own
//! copy engine: a save reserves slots, copies into them and commits (the shards checksum the
//! bytes), job by job with each commit beside the next copy; a load leases the chunks, copies
//! out of them and releases. Every byte is checked on
//! both sides, as in the IPC series.

use std::time::Instant;

use cudarc::driver::CudaEvent;
use orbitkv_client::{Client, ClientOptions, Reserved};
use orbitkv_gpu::dma::plan::Piece;
use orbitkv_gpu::dma::{ChecksumTicket, ChunkHasher, CopyEngine, Direction, Strategy, JOB_BYTES};
use serde::Serialize;

use crate::args::DmaArgs;
use crate::dma::ratio;
use crate::dma_server::{
    chunk_keys, client_err, descriptor, median, not_done, saved_mismatches, tensor_mismatches,
    Engine,
};
use crate::error::Error;

/// What the engine-side series adds to the report.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct EngineCopiesResult {
    /// Milliseconds to register this process's mapping of the arena with CUDA.
    pub register_ms: f64,
    /// Median GB/s of a save: reserve, copy, commit (the shards checksum every chunk).
    pub save_gbps: f64,
    /// Against the save ceiling of the run.
    pub save_ratio: f64,
    /// Median GB/s of a load: leased lookup, copy, release.
    pub load_gbps: f64,
    /// Against the load ceiling of the run.
    pub load_ratio: f64,
    /// Where the saved chunks' checksums were computed: `engine` (this process's GPU, passed
    /// with `commit_checked`) or `shards` (the checksum kernels did not load here).
    pub checksums: &'static str,
    /// Chunks not reserved, committed, found or released as asked (over all runs).
    pub failures: u64,
    /// Mismatched bytes after the last runs: the saved chunks through the arena, every tensor.
    pub mismatched_bytes: u64,
}

/// Runs the engine-side save and load series with `engine` (this process's copy engine on
/// device `device`) against the ceilings `(save, load)` measured in this run.
pub(crate) fn run(
    a: &DmaArgs,
    e: &Engine<'_>,
    engine: &mut CopyEngine,
    (save_ceiling, load_ceiling): (f64, f64),
) -> Result<EngineCopiesResult, Error> {
    let socket = a.socket.as_ref().expect("engine copies run against a server");
    let layout = *e.memory.layout();
    let mut client = Client::connect(ClientOptions {
        name: "orbitkv-perf-engine-copies".into(),
        request_timeout: std::time::Duration::from_secs(120),
        ..ClientOptions::with_socket(socket)
    })
    .map_err(client_err("connect"))?;
    let per_chunk = e.chunks[0].len() as u32;
    let ns = client
        .register_namespace(&descriptor(a, &layout, per_chunk))
        .map_err(client_err("register namespace"))?;
    let keys = chunk_keys(ns.id, a.seed, e.chunks.len());
    let lens = vec![e.chunk_len; keys.len()];
    let bytes = e.chunk_len * keys.len() as u64;
    let (base, len) = client.arena_range().ok_or_else(|| Error::Gpu("not connected".into()))?;
    let registration = register(a.device, base, len)?;
    let register_ms = registration.elapsed.as_secs_f64() * 1e3;
    // The registration covers this session's mapping only: a reconnect maps the arena anew
    // (and unmaps this one), so every copy checks that the session is still the same.
    let session = client.session_id();
    let same_session = |client: &Client| {
        if client.session_id() == session && client.arena_range() == Some((base, len)) {
            Ok(())
        } else {
            Err(Error::Gpu("the session was reconnected: its arena mapping is new".into()))
        }
    };
    // Start from the engine's own bytes (the earlier series may have left others).
    for (i, t) in e.originals.iter().enumerate() {
        e.memory.write_tensor(i, t).map_err(|x| Error::Gpu(x.to_string()))?;
    }

    let mut failures = 0;
    let mut pieces = Vec::new();
    let mut save_runs = Vec::new();
    // As an engine should save: job by job (JOB_BYTES, as the server's DMA threads do), each
    // job's commit running beside the next job's copy, with checksums computed here on the
    // GPU (`commit_checked`: the shards then read one chunk per job, not every one).
    let group = (JOB_BYTES / e.chunk_len).max(1) as usize;
    // Without the checksum kernels the shards compute them (the report says which).
    let mut hasher = ChunkHasher::new(engine.context()).ok();
    let checksums = if hasher.is_some() { "engine" } else { "shards" };
    for i in 0..=a.iterations {
        client.evict(&keys).map_err(client_err("evict"))?;
        let t = Instant::now();
        let mut in_flight: Option<InFlight> = None;
        let saved = (|| {
            for (kg, cg) in keys.chunks(group).zip(e.chunks.chunks(group)) {
                let reserved =
                    client.reserve(kg, &lens[..kg.len()]).map_err(client_err("reserve"))?;
                pieces.clear();
                let mut slots: Vec<Reserved> = Vec::with_capacity(kg.len());
                for (r, blocks) in reserved.into_iter().zip(cg) {
                    match r {
                        Ok(r) => {
                            let slot = client.slot_mut(&r).map_err(client_err("slot"))?;
                            if (slot.len() as u64) < e.chunk_len {
                                return Err(Error::Gpu(format!(
                                    "a slot of {} bytes for a {}-byte chunk",
                                    slot.len(),
                                    e.chunk_len
                                )));
                            }
                            let host = slot.as_mut_ptr();
                            e.memory
                                .chunk_pieces(blocks, host as u64, &mut pieces)
                                .map_err(|x| Error::Gpu(x.to_string()))?;
                            slots.push(r);
                        }
                        Err(_) => failures += 1,
                    }
                }
                same_session(&client)?;
                let copied = submit(engine, Direction::Save, &pieces)?;
                let sums = match hasher.as_mut().map(|h| checksums_of(h, &pieces, e.chunk_len)) {
                    Some(Ok(ticket)) => ticket,
                    Some(Err(err)) => {
                        // This job's copy is not in flight yet: let it finish before failing.
                        wait(&copied)?;
                        return Err(err);
                    }
                    None => None,
                };
                // The job before is copied by now or soon: commit it while this one copies.
                if let Some(before) = in_flight.replace(InFlight { copied, sums, slots }) {
                    failures += before.commit(&mut client)?;
                }
            }
            if let Some(last) = in_flight.take() {
                failures += last.commit(&mut client)?;
            }
            Ok(())
        })();
        // On a failure, a copy may still be writing its slots: let it finish first.
        if let Some(job) = in_flight.take() {
            wait(&job.copied)?;
        }
        saved?;
        if i > 0 {
            save_runs.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let mut mismatched_bytes = saved_mismatches(&mut client, e, &keys, &e.chunks)?;

    let junk = vec![0x3cu8; e.originals[0].len()];
    for i in 0..e.originals.len() {
        e.memory.write_tensor(i, &junk).map_err(|x| Error::Gpu(x.to_string()))?;
    }
    let mut load_runs = Vec::new();
    for i in 0..=a.iterations {
        let t = Instant::now();
        let leases = client.lookup_leased(&keys).map_err(client_err("lookup"))?;
        failures += (keys.len() - leases.len()) as u64;
        pieces.clear();
        for (lease, blocks) in leases.iter().zip(&e.chunks) {
            let chunk = client.chunk(lease).map_err(client_err("chunk"))?;
            if chunk.len() as u64 != e.chunk_len {
                // Another length: not copied (the engine's blocks keep their junk).
                failures += 1;
                continue;
            }
            e.memory
                .chunk_pieces(blocks, chunk.as_ptr() as u64, &mut pieces)
                .map_err(|x| Error::Gpu(x.to_string()))?;
        }
        let copied = same_session(&client).and_then(|()| copy(engine, Direction::Load, &pieces));
        // Released whether or not the copy worked: it has finished either way.
        failures += not_done(&client.release(&leases).map_err(client_err("release"))?);
        copied?;
        if i > 0 {
            load_runs.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    mismatched_bytes += tensor_mismatches(e)?;
    // Unregistered before the client (and its mapping) goes.
    drop(registration);
    drop(client);
    let (save_gbps, load_gbps) = (median(save_runs), median(load_runs));
    Ok(EngineCopiesResult {
        register_ms,
        save_gbps,
        save_ratio: ratio(save_gbps, save_ceiling),
        load_gbps,
        load_ratio: ratio(load_gbps, load_ceiling),
        checksums,
        failures,
        mismatched_bytes,
    })
}

// The two calls below hand the client's mapping of the arena to CUDA. The mapping belongs to
// the client, which outlives the registration (dropped first in `run`); the pieces name this
// process's tensors and slots it holds reserved or leased until the copy's event completed.
#[allow(unsafe_code)]
fn register(
    device: usize,
    base: *mut u8,
    len: usize,
) -> Result<orbitkv_gpu::HostRegistration, Error> {
    // SAFETY: see above; the client's mapping is page-aligned (mmap) and registered nowhere
    // else in this process.
    unsafe { orbitkv_gpu::register_host_range(device, base, len) }
        .map_err(|e| Error::Gpu(format!("registering the client's arena mapping: {e}")))
}

#[allow(unsafe_code)]
fn submit(
    engine: &mut CopyEngine,
    direction: Direction,
    pieces: &[Piece],
) -> Result<CudaEvent, Error> {
    // SAFETY: see above; the event is awaited before the slots are committed or released.
    let (event, _) = unsafe { engine.submit(direction, pieces, Strategy::Auto) }
        .map_err(|e| Error::Gpu(e.to_string()))?;
    Ok(event)
}

/// A save job whose copy (and checksums) may still run.
struct InFlight {
    copied: CudaEvent,
    sums: Option<ChecksumTicket>,
    slots: Vec<Reserved>,
}

impl InFlight {
    /// Waits for the copy, then commits: with the job's checksums when they were computed
    /// here. Returns the chunks not committed.
    fn commit(self, client: &mut Client) -> Result<u64, Error> {
        wait(&self.copied)?;
        let sums = match self.sums {
            Some(t) => Some(t.take().map_err(|e| Error::Gpu(e.to_string()))?),
            None => None,
        };
        let out = match sums {
            Some(sums) if sums.len() == self.slots.len() => {
                client.commit_checked(&self.slots, &sums).map_err(client_err("commit_checked"))?
            }
            _ => client.commit(&self.slots).map_err(client_err("commit"))?,
        };
        Ok(not_done(&out))
    }
}

#[allow(unsafe_code)]
fn checksums_of(
    hasher: &mut ChunkHasher,
    pieces: &[Piece],
    chunk_len: u64,
) -> Result<Option<ChecksumTicket>, Error> {
    // SAFETY: the pieces name this process's tensors, unchanged until the ticket is taken
    // (before the job's commit).
    unsafe { hasher.submit(pieces, chunk_len) }.map_err(|e| Error::Gpu(e.to_string()))
}

fn wait(event: &CudaEvent) -> Result<(), Error> {
    event.synchronize().map_err(|e| Error::Gpu(format!("cuEventSynchronize: {e}")))
}

fn copy(engine: &mut CopyEngine, direction: Direction, pieces: &[Piece]) -> Result<(), Error> {
    wait(&submit(engine, direction, pieces)?)
}
