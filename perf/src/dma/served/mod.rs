//! `orbitkv-perf dma --socket`: this process acts as an engine rank. It shares its KV tensors
//! with the server by CUDA IPC, has the server save every chunk and load it back through its
//! DMA threads, and checks every byte on both sides: the chunks through the mapped arena, the
//! tensors by reading them back.
//!
//! [`run_served`] is the `dma` run with `--socket`: the ceilings before and after, these
//! series ([`run`]), the engine-side copies (`--engine-copies`) and the `server` rows. The
//! parts: [`engine`] (the stand-in engine as the server sees it, and the checks of its
//! bytes), [`counters`] (the server's counters around each request), [`interference`] and
//! [`gathered`] (`--interference` through the server), [`result`] (what the run adds to the
//! report).

mod counters;
pub(super) mod engine;
mod gathered;
mod interference;
mod result;

pub(crate) use result::ServedResult;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use orbitkv_client::{ChunkKey, Client, ClientOptions, GpuTensor, NamespaceDescriptor};
use orbitkv_gpu::dma::{Direction, Transfer, BATCHED_FROM};
use orbitkv_gpu::{DeviceInfo, LayoutGeometry};

use super::bench::Bench;
use super::interference::InterferenceResult;
use super::matmul_loop::EngineSide;
use super::report::{DirectionResult, StrategyResult};
use super::{dma, gbps, median, ratio, Measured};
use crate::args::DmaArgs;
use crate::barrier::Barrier;
use crate::error::Error;
use counters::{busy_gbps, Counters, Sums};
use engine::{
    chunk_keys, client_err, descriptor, not_done, saved_mismatches, tensor_mismatches, Engine,
};
use interference::served_interference;
use result::{BesideMatmul, DuplexResult};

/// The run through the server (`--socket`): the ceilings, the served series (and the
/// engine-side copies with `--engine-copies`), the ceilings again, and the `server` rows.
pub(super) fn run_served(
    a: &DmaArgs,
    bench: &mut Bench,
    ctx: &Arc<CudaContext>,
    info: &DeviceInfo,
    barrier: Option<&crate::barrier::Barrier>,
) -> Result<Measured, Error> {
    // The group's ranks measure their ceilings together: the links they share are part
    // of what they can reach together.
    if let Some(b) = barrier {
        b.wait("ceiling")?;
    }
    let save_ceiling = bench.ceiling(Direction::Save)?;
    let load_ceiling = bench.ceiling(Direction::Load)?;
    let duplex_ceiling = if a.duplex { Some(bench.duplex_ceiling(ctx, a)?) } else { None };
    let shape = a.interference.then(|| bench.engine_side_shape(a));
    let engine = Engine {
        memory: &bench.memory,
        originals: &bench.originals,
        chunks: bench.chunks.iter().map(|(_, b)| b.clone()).collect(),
        chunk_len: bench.chunk_len,
        device_uuid: &info.uuid,
    };
    // The ceiling's copy around each timed save and load, alone on the links only when
    // this process is the server's one engine rank.
    let (buffer, host) = (&bench.contiguous, &bench.host);
    let (at, len) = (bench.slice_at + bench.ceiling_at, bench.bytes);
    let copies = &mut bench.engine;
    let mut copy = |d: Direction| -> Result<f64, Error> {
        let t = Instant::now();
        let copy = copies.start_contiguous(d, (buffer, 0), host, at, len);
        copy.and_then(Transfer::finish).map_err(dma)?;
        Ok(gbps(len, t.elapsed().as_secs_f64()))
    };
    let ceiling: Option<CeilingCopy<'_>> = if barrier.is_none() { Some(&mut copy) } else { None };
    let (mut served, interference) = run(a, &engine, barrier, duplex_ceiling, shape, ceiling)?;
    let mut engine_copies = None;
    if a.engine_copies {
        engine_copies = Some(super::engine_copies::run(
            a,
            &engine,
            &mut bench.engine,
            (save_ceiling, load_ceiling),
        )?);
    }
    // The ceilings again after the series, the better of the two counting (as in the
    // local series): a ceiling measured while something else briefly used the bus made
    // ratios over 1 (a load ceiling of 44 GB/s against 55 in the rest of a run).
    if let Some(b) = barrier {
        b.wait("ceiling-after")?;
    }
    let save_ceiling = save_ceiling.max(bench.ceiling(Direction::Save)?);
    let load_ceiling = load_ceiling.max(bench.ceiling(Direction::Load)?);
    if let Some(c) = &mut engine_copies {
        c.save_ratio = ratio(c.save_gbps, save_ceiling);
        c.load_ratio = ratio(c.load_gbps, load_ceiling);
    }
    if let Some(d) = &mut served.duplex {
        d.ceiling_gbps = d.ceiling_gbps.max(bench.duplex_ceiling(ctx, a)?);
        d.ratio = ratio(d.gbps, d.ceiling_gbps);
    }
    let results = served_rows(bench, &served, save_ceiling, load_ceiling);
    let mismatched = served.save_mismatched_bytes + served.load_mismatched_bytes;
    Ok(Measured {
        results,
        mismatched,
        server: Some(served),
        interference,
        engine_copies,
        ..Measured::default()
    })
}

/// The `server` row of each direction, against the ceilings measured around the series.
fn served_rows(
    bench: &Bench,
    served: &ServedResult,
    save_ceiling: f64,
    load_ceiling: f64,
) -> Vec<DirectionResult> {
    let bytes = bench.bytes;
    let staged = bench.pieces.is_empty() || bytes / (bench.pieces.len() as u64) < BATCHED_FROM;
    let row = |gbps: f64, ceiling: f64, m: u64| StrategyResult {
        strategy: "server",
        staged,
        blocks: None,
        gbps,
        best_gbps: gbps,
        ratio: ratio(gbps, ceiling),
        batches: 0,
        mismatched_bytes: m,
        timeline: None,
    };
    vec![
        DirectionResult {
            direction: Direction::Save,
            ceiling_gbps: save_ceiling,
            strategies: vec![row(served.save_gbps, save_ceiling, served.save_mismatched_bytes)],
        },
        DirectionResult {
            direction: Direction::Load,
            ceiling_gbps: load_ceiling,
            strategies: vec![row(served.load_gbps, load_ceiling, served.load_mismatched_bytes)],
        },
    ]
}

/// One contiguous copy of the series' bytes in the engine's process, the way the ceiling is
/// measured; GB/s.
pub(crate) type CeilingCopy<'a> = &'a mut dyn FnMut(Direction) -> Result<f64, Error>;

/// The windows around a series' timed operations: the first before the first, then one after
/// each.
#[derive(Default)]
struct Brackets {
    windows: Vec<f64>,
    intervals: Vec<(u64, Duration)>,
}

impl Brackets {
    /// Measures a window with `copy`, if there is one (none in a group).
    fn window(&mut self, copy: &mut Option<CeilingCopy<'_>>, d: Direction) -> Result<(), Error> {
        if let Some(copy) = copy.as_mut() {
            self.windows.push(copy(d)?);
        }
        Ok(())
    }

    /// (windows, ratios, their median).
    fn finish(self) -> (Vec<f64>, Vec<f64>, Option<f64>) {
        let ratios = crate::baseline::ratios(&self.windows, &self.intervals);
        let m = crate::stats::median(&ratios);
        (self.windows, ratios, m)
    }
}

/// Runs the save/load series through the server; with `interference` (`--interference`: the
/// engine-side copies' shape), also the matmul loop's slowdown beside them.
pub(crate) fn run(
    a: &DmaArgs,
    e: &Engine<'_>,
    barrier: Option<&Barrier>,
    duplex_ceiling: Option<f64>,
    interference: Option<EngineSide>,
    mut ceiling: Option<CeilingCopy<'_>>,
) -> Result<(ServedResult, Option<InterferenceResult>), Error> {
    let meet = |phase: &str| barrier.map_or(Ok(()), |b| b.wait(phase));
    let socket = a.socket.as_ref().expect("server mode has a socket");
    let Session { mut client, descriptor, ns, reg } = Session::open(a, e, socket)?;
    // Every rank of a group stores the same prompt's chunks, under its own namespace.
    let keys = chunk_keys(ns, a.seed, e.chunks.len());
    let blocks: Vec<u64> = e.chunks.iter().flatten().copied().collect();
    let bytes = e.chunk_len * keys.len() as u64;
    let mut requests = Requests { client: &mut client, reg: &reg, keys: &keys, blocks: &blocks };

    meet("save")?;
    let mut save = requests.timed(a, socket, Direction::Save, bytes, &mut ceiling)?;
    meet("saved")?;
    // No rank evicts again before the "load" meeting: the group prefix is complete now.
    let group = if barrier.is_some() && a.tp_world_size > 1 {
        Some(group_prefix(a, e, requests.client, &descriptor)?)
    } else {
        None
    };
    // Every chunk, read through the mapped arena.
    save.mismatched_bytes = saved_mismatches(requests.client, e, &keys, &e.chunks)?;

    let junk = vec![0x5au8; e.originals[0].len()];
    for i in 0..e.originals.len() {
        e.memory.write_tensor(i, &junk).map_err(|x| Error::Gpu(x.to_string()))?;
    }
    meet("load")?;
    let mut load = requests.timed(a, socket, Direction::Load, bytes, &mut ceiling)?;
    load.mismatched_bytes = tensor_mismatches(e)?;

    let interference = match interference {
        Some(shape) => {
            // Each rank's matmul loop beside its own copies, all ranks at once.
            meet("interference")?;
            let (result, failed, counters) =
                served_interference(a, e, requests.client, &reg, (&keys, &blocks), shape)?;
            save.failures += failed.0;
            load.failures += failed.1;
            load.mismatched_bytes += tensor_mismatches(e)?;
            Some((result, counters))
        }
        None => None,
    };
    let (interference, beside_matmul) = match interference {
        Some((result, counters)) => (Some(result), Some(counters)),
        None => (None, None),
    };
    let duplex = match duplex_ceiling {
        Some(ceiling) => Some(duplex(a, e, requests.client, &reg, (&keys, &blocks), ceiling)?),
        None => None,
    };

    // The checks below evict and re-register: after every rank's timed loads.
    meet("loaded")?;
    client.unregister_gpu(&reg).map_err(client_err("unregister_gpu"))?;
    let extras = ServedExtras { group, duplex, beside_matmul };
    let served = served_result(a, (save, load), bytes, keys.len(), extras);
    Ok((served, interference))
}

/// What [`run`] holds with the server: its client, the namespace's descriptor and id, and
/// the registration of this process's tensors.
struct Session {
    client: Client,
    descriptor: NamespaceDescriptor,
    ns: u64,
    reg: orbitkv_client::GpuRegistration,
}

impl Session {
    /// Connects to the server on `socket`, registers the run's namespace (checking that it
    /// holds the layout's chunks) and shares the engine's tensors with the server.
    fn open(a: &DmaArgs, e: &Engine<'_>, socket: &std::path::Path) -> Result<Self, Error> {
        let layout = *e.memory.layout();
        let mut client = Client::connect(ClientOptions {
            name: "orbitkv-perf-dma".into(),
            request_timeout: Duration::from_secs(120),
            ..ClientOptions::with_socket(socket)
        })
        .map_err(client_err("connect"))?;
        let per_chunk = e.chunks[0].len() as u32;
        let descriptor = descriptor(a, &layout, per_chunk);
        let ns =
            client.register_namespace(&descriptor).map_err(client_err("register namespace"))?;
        if ns.max_chunk_bytes < e.chunk_len {
            return Err(Error::Gpu(format!(
                "namespace holds {} bytes per chunk, the layout needs {}",
                ns.max_chunk_bytes, e.chunk_len
            )));
        }
        let exports = e.memory.exports().map_err(|x| Error::Gpu(x.to_string()))?;
        let tensors: Vec<GpuTensor> = exports
            .iter()
            .map(|x| GpuTensor { handle: x.handle, offset: x.offset, len: x.len })
            .collect();
        let reg = client
            .register_gpu(e.device_uuid, layout, &tensors)
            .map_err(client_err("register_gpu"))?;
        Ok(Self { client, descriptor, ns: ns.id, reg })
    }
}

/// The requests of a series through the server: every chunk's key, saved from (or loaded
/// into) its blocks of the registered tensors.
struct Requests<'a> {
    client: &'a mut Client,
    reg: &'a orbitkv_client::GpuRegistration,
    keys: &'a [ChunkKey],
    blocks: &'a [u64],
}

/// One direction's series through the server: each timed request's GB/s, the chunks not
/// done, the server's counters over the timed requests, the ceiling's windows around them,
/// and the bytes found wrong after it.
#[derive(Default)]
struct ServedSeries {
    runs: Vec<f64>,
    failures: u64,
    sums: Sums,
    brackets: Brackets,
    mismatched_bytes: u64,
}

impl Requests<'_> {
    /// One untimed request of every chunk, then `--iterations` timed ones (a save each after
    /// an evict of every chunk), the ceiling's window before the first timed and after each;
    /// `bytes` the bytes of one request. The series' `mismatched_bytes` are the caller's.
    fn timed(
        &mut self,
        a: &DmaArgs,
        socket: &std::path::Path,
        direction: Direction,
        bytes: u64,
        ceiling: &mut Option<CeilingCopy<'_>>,
    ) -> Result<ServedSeries, Error> {
        let gbps = |t: Instant| bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        let way = match direction {
            Direction::Save => "save",
            Direction::Load => "load",
        };
        let mut s = ServedSeries::default();
        for i in 0..=a.iterations {
            if direction == Direction::Save {
                self.client.evict(self.keys).map_err(client_err("evict"))?;
            }
            if i == 1 {
                s.brackets.window(ceiling, direction)?;
            }
            let before = Counters::read(socket, way);
            let t = Instant::now();
            let o = match direction {
                Direction::Save => self.client.save(self.reg, self.keys, self.blocks),
                Direction::Load => self.client.load(self.reg, self.keys, self.blocks),
            }
            .map_err(client_err(way))?;
            if i > 0 {
                s.brackets.intervals.push((bytes, t.elapsed()));
                s.runs.push(gbps(t));
                s.sums.add(before, Counters::read_after(socket, way, &before));
                s.brackets.window(ceiling, direction)?;
            }
            s.failures += not_done(&o);
        }
        Ok(s)
    }
}

/// The group prefix once every rank has saved: each rank's chunks under its own namespace
/// (`descriptor` with the rank's `tp_rank`), looked up as a group.
fn group_prefix(
    a: &DmaArgs,
    e: &Engine<'_>,
    client: &mut Client,
    descriptor: &NamespaceDescriptor,
) -> Result<orbitkv_client::GroupPrefix, Error> {
    let mut ranks = Vec::with_capacity(a.tp_world_size as usize);
    for r in 0..a.tp_world_size {
        let d = NamespaceDescriptor { tp_rank: r, ..descriptor.clone() };
        let id = client.register_namespace(&d).map_err(client_err("register namespace"))?.id;
        ranks.push(chunk_keys(id, a.seed, e.chunks.len()));
    }
    let views: Vec<&[ChunkKey]> = ranks.iter().map(|k| &k[..]).collect();
    client.lookup_group(&views).map_err(client_err("lookup_group"))
}

/// What a server run may add besides its two series: the group prefix (`--barrier`), the
/// duplex (`--duplex`) and the server's counters beside the matmul loop (`--interference`).
struct ServedExtras {
    group: Option<orbitkv_client::GroupPrefix>,
    duplex: Option<DuplexResult>,
    beside_matmul: Option<BesideMatmul>,
}

/// The report of a server run from its `(save, load)` series (of `bytes` and `chunks` each)
/// and `extras`.
fn served_result(
    a: &DmaArgs,
    (save, load): (ServedSeries, ServedSeries),
    bytes: u64,
    chunks: usize,
    extras: ServedExtras,
) -> ServedResult {
    let ServedExtras { group, duplex, beside_matmul } = extras;
    let (save_sums, load_sums) = (&save.sums, &load.sums);
    let (save_ceiling_windows_gbps, save_bracketed_ratios, save_ratio_bracketed) =
        save.brackets.finish();
    let (load_ceiling_windows_gbps, load_bracketed_ratios, load_ratio_bracketed) =
        load.brackets.finish();
    ServedResult {
        save_gbps: median(save.runs),
        load_gbps: median(load.runs),
        save_failures: save.failures,
        load_failures: load.failures,
        save_mismatched_bytes: save.mismatched_bytes,
        load_mismatched_bytes: load.mismatched_bytes,
        tp_rank: a.tp_rank,
        tp_world_size: a.tp_world_size,
        chunks,
        group_prefix_chunks: group.as_ref().map(|g| g.chunks),
        group_prefix_per_rank: group.map(|g| g.per_rank),
        duplex,
        // All timed runs' bytes over all their busy time (None if a reading was missing).
        save_busy_gbps: busy_gbps(bytes * u64::from(a.iterations), save_sums.busy_s),
        load_busy_gbps: busy_gbps(bytes * u64::from(a.iterations), load_sums.busy_s),
        save_lead_us: save_sums.per_request_us(save_sums.lead_s),
        save_tail_us: save_sums.per_request_us(save_sums.tail_s),
        load_lead_us: load_sums.per_request_us(load_sums.lead_s),
        load_tail_us: load_sums.per_request_us(load_sums.tail_s),
        save_pickup_us: save_sums.per_request_us(save_sums.pickup_s),
        load_pickup_us: load_sums.per_request_us(load_sums.pickup_s),
        save_timeline: save_sums.timeline(),
        load_timeline: load_sums.timeline(),
        save_runs_per_job: save_sums.runs_per_job(),
        load_runs_per_job: load_sums.runs_per_job(),
        save_submit_us_per_job: save_sums.per_job(save_sums.submit_s * 1e6),
        load_submit_us_per_job: load_sums.per_job(load_sums.submit_s * 1e6),
        save_submit_cpu_us_per_job: save_sums.per_job(save_sums.submit_cpu_s * 1e6),
        load_submit_cpu_us_per_job: load_sums.per_job(load_sums.submit_cpu_s * 1e6),
        save_submit_wait_us_per_job: save_sums.per_job(save_sums.submit_wait_s * 1e6),
        load_submit_wait_us_per_job: load_sums.per_job(load_sums.submit_wait_s * 1e6),
        save_submit_parts: save_sums.submit_parts(),
        load_submit_parts: load_sums.submit_parts(),
        save_checksum_wait_us_per_job: save_sums.per_job(save_sums.checksum_wait_s * 1e6),
        beside_matmul,
        save_ceiling_windows_gbps,
        save_bracketed_ratios,
        save_ratio_bracketed,
        load_ceiling_windows_gbps,
        load_bracketed_ratios,
        load_ratio_bracketed,
    }
}

/// Saves the first half of the chunks while loading the second half (all of them present
/// when it starts): before each run the first half is evicted and the second half's blocks
/// are scribbled over on the GPU; after the last, every byte is checked on both sides.
fn duplex(
    a: &DmaArgs,
    e: &Engine<'_>,
    client: &mut Client,
    reg: &orbitkv_client::GpuRegistration,
    (keys, blocks): (&[ChunkKey], &[u64]),
    ceiling_gbps: f64,
) -> Result<DuplexResult, Error> {
    let layout = *e.memory.layout();
    let per_chunk = e.chunks[0].len();
    let half = keys.len() / 2;
    if half == 0 {
        return Err(Error::InvalidArgument {
            flag: "--duplex",
            reason: "needs at least two chunks".into(),
        });
    }
    let (save_keys, load_keys) = keys.split_at(half);
    let (save_blocks, load_blocks) = blocks.split_at(half * per_chunk);
    // The tensors with the loaded half's blocks scribbled over (the saved half's blocks keep
    // their bytes: they are what the save reads).
    let mut scribbled: Vec<Vec<u8>> = e.originals.to_vec();
    for &block in load_blocks {
        for s in layout.block_segments(block) {
            scribbled[s.tensor as usize][s.offset as usize..(s.offset + s.len) as usize].fill(0xa7);
        }
    }
    let (save_bytes, load_bytes) =
        (e.chunk_len * save_keys.len() as u64, e.chunk_len * load_keys.len() as u64);
    let mut runs = Vec::new();
    let mut failures = 0;
    for i in 0..=a.iterations {
        client.evict(save_keys).map_err(client_err("evict"))?;
        for (t, bytes) in scribbled.iter().enumerate() {
            e.memory.write_tensor(t, bytes).map_err(|x| Error::Gpu(x.to_string()))?;
        }
        let t = Instant::now();
        let saving =
            client.start_save(reg, save_keys, save_blocks).map_err(client_err("start_save"))?;
        let loading = match client.start_load(reg, load_keys, load_blocks) {
            Ok(l) => l,
            Err(e) => {
                // The save is under way: let it finish before the tensors are touched again.
                let _ = client.wait_transfer(&saving);
                return Err(client_err("start_load")(e));
            }
        };
        // Both are waited for before either error counts: neither may still be running.
        let saved = client.wait_transfer(&saving);
        let loaded = client.wait_transfer(&loading);
        let saved = saved.map_err(client_err("save"))?;
        let loaded = loaded.map_err(client_err("load"))?;
        if i > 0 {
            runs.push((save_bytes + load_bytes) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        failures += not_done(&saved) + not_done(&loaded);
    }
    let mismatched_bytes =
        saved_mismatches(client, e, save_keys, &e.chunks[..half])? + tensor_mismatches(e)?;
    let gbps = median(runs);
    Ok(DuplexResult {
        save_bytes,
        load_bytes,
        gbps,
        ceiling_gbps,
        ratio: if ceiling_gbps > 0.0 { gbps / ceiling_gbps } else { 0.0 },
        failures,
        mismatched_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::{Brackets, CeilingCopy, Direction};
    use std::time::Duration;

    #[test]
    fn each_timed_operation_against_the_ceiling_copies_around_it() {
        // Windows of 50, 60 and 40 GB/s around two 1 GB operations of 25 and 20 ms (40 and 50
        // GB/s): 40 / 55 and 50 / 50.
        let mut readings = vec![40.0, 60.0, 50.0];
        let mut asked = Vec::new();
        let mut copy = |d: Direction| {
            asked.push(d);
            Ok(readings.pop().expect("three windows"))
        };
        let mut b = Brackets::default();
        let mut ceiling: Option<CeilingCopy<'_>> = Some(&mut copy);
        b.window(&mut ceiling, Direction::Load).unwrap();
        for ms in [25, 20] {
            b.intervals.push((1_000_000_000, Duration::from_millis(ms)));
            b.window(&mut ceiling, Direction::Load).unwrap();
        }
        let (windows, ratios, median) = b.finish();
        assert_eq!(windows, [50.0, 60.0, 40.0]);
        assert_eq!(asked, [Direction::Load; 3]);
        assert!((ratios[0] - 40.0 / 55.0).abs() < 1e-9 && (ratios[1] - 1.0).abs() < 1e-9);
        assert!((median.unwrap() - (40.0 / 55.0 + 1.0) / 2.0).abs() < 1e-9, "{median:?}");
        // Without a copy (a rank of a group): no windows, no ratios.
        let mut b = Brackets::default();
        b.window(&mut None, Direction::Save).unwrap();
        b.intervals.push((1, Duration::from_millis(1)));
        assert_eq!(b.finish(), (vec![], vec![], None));
        // A copy that fails fails the series, naming why.
        let mut failing = |_: Direction| Err(crate::error::Error::Gpu("copy refused".into()));
        let e = Brackets::default().window(&mut Some(&mut failing), Direction::Save).unwrap_err();
        assert!(e.to_string().contains("copy refused"), "{e}");
    }
}
