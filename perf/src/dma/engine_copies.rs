//! `orbitkv-perf dma --socket --engine-copies`: the engine-side path, without CUDA IPC. This
//! process maps the session's arena memfd itself, registers that mapping with CUDA and moves
//! the pages with its own copy engine: a save reserves slots, copies into them and commits (the shards checksum the
//! bytes), job by job with each commit beside the next copy; a load leases the chunks, copies
//! out of them and releases. Every byte is checked on
//! both sides, as in the IPC series.

use std::sync::Arc;
use std::time::Instant;

use orbitkv_client::{ChunkKey, Client, ClientOptions, Reserved};
use orbitkv_gpu::dma::plan::Piece;
use orbitkv_gpu::dma::{
    ChunkHasher, CopyEngine, CopyJob, Direction, SaveSums, Strategy, Transfer, JOB_BYTES,
};
use orbitkv_gpu::HostRegistration;
use serde::Serialize;

use super::served::engine::{
    chunk_keys, client_err, descriptor, not_done, saved_mismatches, tensor_mismatches, Engine,
};
use super::{median, ratio};
use crate::args::DmaArgs;
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
    let bytes = e.chunk_len * keys.len() as u64;
    let host = register(a.device, &mut client)?;
    let register_ms = host.elapsed.as_secs_f64() * 1e3;
    // Start from the engine's own bytes (the earlier series may have left others).
    for (i, t) in e.originals.iter().enumerate() {
        e.memory.write_tensor(i, t).map_err(|x| Error::Gpu(x.to_string()))?;
    }
    // Without the checksum kernels the shards compute them (the report says which).
    let mut hasher = ChunkHasher::new(engine.context()).ok();
    let checksums = if hasher.is_some() { "engine" } else { "shards" };
    let session = client.session_id();
    let mut s = Series { client, e, engine, host, keys, session, pieces: Vec::new(), failures: 0 };
    let mut save_runs = Vec::new();
    for i in 0..=a.iterations {
        s.client.evict(&s.keys).map_err(client_err("evict"))?;
        let t = Instant::now();
        s.save(hasher.as_mut())?;
        if i > 0 {
            save_runs.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let mut mismatched_bytes = saved_mismatches(&mut s.client, e, &s.keys, &e.chunks)?;
    let junk = vec![0x3cu8; e.originals[0].len()];
    for i in 0..e.originals.len() {
        e.memory.write_tensor(i, &junk).map_err(|x| Error::Gpu(x.to_string()))?;
    }
    let mut load_runs = Vec::new();
    for i in 0..=a.iterations {
        let t = Instant::now();
        s.load()?;
        if i > 0 {
            load_runs.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    mismatched_bytes += tensor_mismatches(e)?;
    let failures = s.failures;
    // Unregistered before the client (and the session's arena) goes.
    let Series { client, host, .. } = s;
    drop(host);
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

/// The engine side of the series: its client, its copy engine, its mapping of the arena.
struct Series<'a, 'e> {
    client: Client,
    e: &'a Engine<'e>,
    engine: &'a mut CopyEngine,
    host: Arc<HostRegistration>,
    keys: Vec<ChunkKey>,
    /// The session the mapping is of.
    session: Option<u64>,
    /// Pieces planned for a job, reused.
    pieces: Vec<Piece>,
    /// Chunks not reserved, committed, found or released as asked.
    failures: u64,
}

impl Series<'_, '_> {
    /// The mapping is of this session's arena: a reconnect (to a restarted server) may bring
    /// another, so every copy checks that the session is still the same.
    fn same_session(&self) -> Result<(), Error> {
        if self.client.session_id() == self.session {
            Ok(())
        } else {
            Err(Error::Gpu("the session was reconnected: its arena mapping is new".into()))
        }
    }

    /// Copies `chunks` (arena offsets, block ids) one way and returns the transfer.
    fn start(
        &mut self,
        direction: Direction,
        chunks: &[(u64, Vec<u64>)],
        sums: SaveSums<'_>,
    ) -> Result<Transfer, Error> {
        self.same_session()?;
        let job = CopyJob {
            direction,
            memory: self.e.memory,
            host: &self.host,
            chunks,
            chunk_len: self.e.chunk_len,
        };
        self.engine
            .start(&job, Strategy::Auto, sums, &mut self.pieces)
            .map_err(|x| Error::Gpu(x.to_string()))
    }

    /// One save, as an engine should save: job by job (JOB_BYTES, as the server's DMA threads
    /// do), each job's commit running beside the next job's copy, with checksums computed
    /// here on the GPU where `hasher` is (`commit_checked`: the shards then read one chunk per
    /// job, not every one).
    fn save(&mut self, mut hasher: Option<&mut ChunkHasher>) -> Result<(), Error> {
        let e = self.e;
        let group = (JOB_BYTES / e.chunk_len).max(1) as usize;
        let keys = self.keys.clone();
        let mut in_flight: Option<InFlight> = None;
        let saved = (|| {
            for (kg, cg) in keys.chunks(group).zip(e.chunks.chunks(group)) {
                let lens = vec![e.chunk_len; kg.len()];
                let reserved = self.client.reserve(kg, &lens).map_err(client_err("reserve"))?;
                let mut chunks = Vec::with_capacity(kg.len());
                let mut slots: Vec<Reserved> = Vec::with_capacity(kg.len());
                for (r, blocks) in reserved.into_iter().zip(cg) {
                    match r {
                        Ok(r) if r.len < e.chunk_len => {
                            return Err(Error::Gpu(format!(
                                "a slot of {} bytes for a {}-byte chunk",
                                r.len, e.chunk_len
                            )));
                        }
                        Ok(r) => {
                            chunks.push((r.offset, blocks.clone()));
                            slots.push(r);
                        }
                        Err(_) => self.failures += 1,
                    }
                }
                let sums = hasher.as_deref_mut().map_or(SaveSums::Off, SaveSums::Kernels);
                let transfer = self.start(Direction::Save, &chunks, sums)?;
                // The job before is copied by now or soon: commit it while this one copies.
                if let Some(before) = in_flight.replace(InFlight { transfer, slots }) {
                    self.failures += before.commit(&mut self.client)?;
                }
            }
            if let Some(last) = in_flight.take() {
                self.failures += last.commit(&mut self.client)?;
            }
            Ok(())
        })();
        // On a failure, a copy may still be writing its slots: dropping it waits for it.
        drop(in_flight);
        saved
    }

    /// One load: a leased lookup of every key, one copy of the chunks found into the
    /// engine's blocks, the release.
    fn load(&mut self) -> Result<(), Error> {
        let e = self.e;
        let leases = self.client.lookup_leased(&self.keys).map_err(client_err("lookup"))?;
        self.failures += (self.keys.len() - leases.len()) as u64;
        let mut chunks = Vec::with_capacity(leases.len());
        for (lease, blocks) in leases.iter().zip(&e.chunks) {
            if lease.hit.len != e.chunk_len {
                // Another length: not copied (the engine's blocks keep their junk).
                self.failures += 1;
                continue;
            }
            chunks.push((lease.hit.offset, blocks.clone()));
        }
        let copied = self
            .start(Direction::Load, &chunks, SaveSums::Off)
            .and_then(|t| t.finish().map(drop).map_err(|x| Error::Gpu(x.to_string())));
        // Released whether or not the copy worked: it has finished either way.
        let released = self.client.release(&leases).map_err(client_err("release"))?;
        self.failures += not_done(&released);
        copied
    }
}

/// This process's own mapping of the session's arena (`Client::map_arena`), registered with
/// CUDA on `device`.
fn register(device: usize, client: &mut Client) -> Result<Arc<HostRegistration>, Error> {
    let arena = client.map_arena().map_err(client_err("map the arena"))?;
    orbitkv_gpu::register_host(device, Arc::new(arena))
        .map(Arc::new)
        .map_err(|e| Error::Gpu(format!("registering the arena mapping: {e}")))
}

/// A save job whose copy (and checksums) may still run; dropping it waits for them.
struct InFlight {
    transfer: Transfer,
    slots: Vec<Reserved>,
}

impl InFlight {
    /// Waits for the copy, then commits: with the job's checksums when they were computed
    /// here. Returns the chunks not committed.
    fn commit(self, client: &mut Client) -> Result<u64, Error> {
        let sums = self.transfer.finish().map_err(|e| Error::Gpu(e.to_string()))?;
        let out = match sums {
            Some(sums) if sums.len() == self.slots.len() => {
                client.commit_checked(&self.slots, &sums).map_err(client_err("commit_checked"))?
            }
            _ => client.commit(&self.slots).map_err(client_err("commit"))?,
        };
        Ok(not_done(&out))
    }
}
