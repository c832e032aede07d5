//! `orbitkv-perf dma`: GPU save/load of engine KV pages through the copy engine, against one
//! contiguous copy of the same bytes measured in the same run.
//!
//! A stand-in engine allocates the layout's tensors on the GPU and fills them with seeded
//! random bytes. Save gathers every block (in a shuffled block order, into shuffled arena
//! slots unless `--slots in-order`, one chunk per slot) into the CUDA-registered arena; load scatters them back. Before
//! each measured series the destination is scribbled over, after it every byte is compared.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use orbitkv_gpu::dma::{
    plan::Piece, ChecksumTicket, ChunkHasher, CopyEngine, CopyJob, DeviceBuffer, Direction,
    EngineMemory, JobShape, SaveSums, Strategy, Transfer, BATCHED_FROM, JOB_BYTES,
    SUMMED_UNFINISHED,
};
use orbitkv_gpu::{DeviceInfo, HostRegistration, LayoutGeometry, Probe};
use orbitkv_proto::{KvLayoutKind, KvLayoutSpec};
use orbitkv_shards::{Arena, ArenaSlice, PAGE_SIZE};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use crate::args::{DmaArgs, DtypeArg, LayoutArg, SlotOrderArg, StrategyArg};
use crate::dma_interference::{EngineSide, InterferenceResult, MatmulLoop, Windows};
use crate::dma_server::median;
use crate::error::Error;
use crate::progress;
use crate::report::Report;

/// One strategy's series in one direction.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct StrategyResult {
    /// `auto`, `staged` or `batched`.
    pub strategy: &'static str,
    /// Whether the staging kernel was used.
    pub staged: bool,
    /// Whether the staged copies went in block form (block ids and the part table, as the
    /// server plans them) rather than a descriptor per piece (`--pieces`); not known for the
    /// server's rows (the server decides).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks: Option<bool>,
    /// Median GB/s (10^9 bytes/s) over the timed iterations.
    pub gbps: f64,
    /// Best iteration.
    pub best_gbps: f64,
    /// Median / the direction's ceiling.
    pub ratio: f64,
    /// Staging batches per operation (0 when batched).
    pub batches: usize,
    /// Bytes that differed after the series (0 = byte-exact).
    pub mismatched_bytes: u64,
    /// With `--timeline` and a staged strategy: one more operation's batches on the GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
}

/// Where one staged operation spent its time (`--timeline`), from CUDA timing events around
/// each batch's kernel and host-side copy. Times in microseconds from the first batch's start.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Timeline {
    /// Wall time of the operation on the host, from the submit call to the event's completion.
    pub host_total_us: f64,
    /// Time the host spent in the submit call (planning, descriptor tables, enqueueing,
    /// waiting for a staging half).
    pub host_submit_us: f64,
    /// From the first batch's start to the last copy's or kernel's end.
    pub gpu_total_us: f64,
    /// When the first copy started.
    pub first_copy_start_us: f64,
    /// Sum of the batches' copy times.
    pub copy_busy_us: f64,
    /// Bytes over the copy busy time, GB/s: the copy alone, without its gaps.
    pub copy_gbps: f64,
    /// Sum of the idle time of the copy stream between consecutive copies.
    pub copy_gaps_us: f64,
    /// The longest of those gaps.
    pub copy_gap_max_us: f64,
    /// Mean and longest kernel time per batch.
    pub kernel_mean_us: f64,
    /// The longest kernel.
    pub kernel_max_us: f64,
    /// Every batch.
    pub batches: Vec<orbitkv_gpu::dma::BatchSpan>,
}

impl Timeline {
    fn summarize(
        spans: Vec<orbitkv_gpu::dma::BatchSpan>,
        host_submit_us: f64,
        host_total_us: f64,
    ) -> Self {
        let t = orbitkv_gpu::dma::SpanTotals::of(&spans);
        Self {
            host_total_us,
            host_submit_us,
            gpu_total_us: t.span_us,
            first_copy_start_us: t.first_copy_start_us,
            copy_busy_us: t.copy_busy_us,
            copy_gbps: t.copy_gbps(),
            copy_gaps_us: t.copy_gaps_us,
            copy_gap_max_us: t.copy_gap_max_us,
            kernel_mean_us: if t.batches == 0 { 0.0 } else { t.kernel_busy_us / t.batches as f64 },
            kernel_max_us: t.kernel_max_us,
            batches: spans,
        }
    }
}

/// One direction.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DirectionResult {
    /// `save` (GPU -> arena) or `load` (arena -> GPU).
    pub direction: Direction,
    /// Contiguous copy of the same byte count, median GB/s (measured before and after the
    /// strategies; the better median of the two).
    pub ceiling_gbps: f64,
    /// The strategies.
    pub strategies: Vec<StrategyResult>,
}

/// The result of `dma`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DmaReport {
    /// The GPU.
    pub device: String,
    /// Its UUID.
    pub device_uuid: String,
    /// Layout name.
    pub layout: &'static str,
    /// The layout's shape.
    pub layers: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element.
    pub elem_bytes: u32,
    /// Blocks moved per operation.
    pub blocks: u64,
    /// Blocks per chunk.
    pub blocks_per_chunk: u64,
    /// Bytes of one page (one block's slice of one layer's K or V).
    pub page_bytes: u64,
    /// Contiguous pieces per operation.
    pub pieces: usize,
    /// Bytes per operation.
    pub bytes: u64,
    /// GPU staging bytes.
    pub staging_bytes: u64,
    /// Arena slot placement: `shuffled` or `in-order`.
    pub slots: &'static str,
    /// Series submitted job by job, as the server does (`--server-jobs`).
    pub server_jobs: bool,
    /// Timed iterations per series.
    pub iterations: u32,
    /// Milliseconds to register the arena with CUDA.
    pub register_ms: f64,
    /// Save, then load.
    pub results: Vec<DirectionResult>,
    /// Sum of mismatched bytes over every series.
    pub mismatched_bytes: u64,
    /// With `--socket`: the run through the server (its rows in `results` are `server`).
    pub server: Option<crate::dma_server::ServedResult>,
    /// With `--interference`: the slowdown of a concurrent matmul loop beside each strategy.
    pub interference: Option<crate::dma_interference::InterferenceResult>,
    /// Chunk checksums on the GPU (local runs): checked against the CPU, and their cost.
    pub checksums: Option<ChecksumResult>,
    /// With `--engine-copies`: the engine-side path (no CUDA IPC) through the server.
    pub engine_copies: Option<crate::dma_engine_copies::EngineCopiesResult>,
    /// With `--duplex` in a local run: a save beside a load in this process, each way.
    pub duplex: Option<LocalDuplex>,
}

/// A save of the first half of the chunks on one copy engine while the second half loads on
/// another (as the server's two DMA threads run them), against both contiguous copies at once.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct LocalDuplex {
    /// Median GB/s of both contiguous copies at once (plain `cuMemcpy*Async`, one per way).
    pub ceiling_gbps: f64,
    /// Rows: `contiguous-batch-call` (each way's contiguous copy as a one-entry
    /// `cuMemcpyBatchAsync`, which the staged and batched copies use), then each strategy.
    pub rows: Vec<DuplexRow>,
}

/// One way of running the duplex.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DuplexRow {
    /// How both halves were copied.
    pub strategy: &'static str,
    /// Median GB/s of both together.
    pub gbps: f64,
    /// That against the duplex ceiling.
    pub ratio: f64,
    /// Median GB/s of the save half alone and of the load half alone, timed beside each other
    /// (each from the shared start to its own end).
    pub save_gbps: f64,
    /// See `save_gbps`.
    pub load_gbps: f64,
    /// Wrong bytes after the series (saved slots and loaded tensors checked); None for the
    /// contiguous row, whose copies move the ceiling region, not the chunks.
    pub mismatched_bytes: Option<u64>,
}

/// The GPU checksum kernels in a local run: every chunk's checksum against
/// `orbitkv_proto::chunk_checksum` of its expected bytes, their speed alone, and a save with
/// them running beside it (as the server's saves do).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ChecksumResult {
    /// How they were computed (`--checksum-form`).
    pub form: crate::args::ChecksumForm,
    /// Chunks checksummed (0 when the chunks are too short for the kernels, or with
    /// `gather-only`).
    pub chunks: usize,
    /// Chunks whose GPU checksum differed from the CPU's (added to `mismatched_bytes` too,
    /// one per chunk).
    pub mismatches: u64,
    /// Median GB/s of checksumming every chunk, nothing else running (0 for the fused form,
    /// whose sums come with the save's copy).
    pub gbps_alone: f64,
    /// Median GB/s of a save (`auto`) with the checksums computed beside it.
    pub save_gbps_with_checksums: f64,
    /// That against the save ceiling.
    pub save_ratio_with_checksums: f64,
    /// With `--timeline`: one more save with checksums beside it, batch by batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// Fused forms: wrong bytes in the saved slots after their saves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatched_bytes: Option<u64>,
}

impl Report for DmaReport {
    fn write_table(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(
            out,
            "{} ({}), {} layout, {} layers x {} tokens x {} heads x {} dim x {} B: {} blocks, page {} B, {} pieces, {:.1} MiB per op",
            self.device,
            self.device_uuid,
            self.layout,
            self.layers,
            self.block_tokens,
            self.kv_heads,
            self.head_dim,
            self.elem_bytes,
            self.blocks,
            self.page_bytes,
            self.pieces,
            self.bytes as f64 / (1u64 << 20) as f64
        )?;
        write_local(out, &self.results)?;
        if let Some(c) = &self.checksums {
            writeln!(
                out,
                "GPU checksums ({:?}): {} chunks, {} wrong, {:.1} GB/s alone; save beside them {:.2} GB/s ({:.3})",
                c.form, c.chunks, c.mismatches, c.gbps_alone, c.save_gbps_with_checksums, c.save_ratio_with_checksums
            )?;
            if let Some(t) = &c.timeline {
                writeln!(
                    out,
                    "  timeline: copies at {:.2} GB/s while copying, gaps {:.0} us, kernel {:.0} us mean",
                    t.copy_gbps, t.copy_gaps_us, t.kernel_mean_us
                )?;
            }
        }
        if let Some(s) = &self.server {
            write_server(out, s)?;
        }
        if let Some(c) = &self.engine_copies {
            writeln!(
                out,
                "engine copies (no IPC): save {:.2} GB/s ({:.3}, checksums by the {}), load \
                 {:.2} GB/s ({:.3}), failures {}, mismatched bytes {}, mapping registered in \
                 {:.0} ms",
                c.save_gbps,
                c.save_ratio,
                c.checksums,
                c.load_gbps,
                c.load_ratio,
                c.failures,
                c.mismatched_bytes,
                c.register_ms
            )?;
        }
        if let Some(d) = &self.duplex {
            writeln!(out, "duplex (save beside load, local): ceiling {:.2} GB/s", d.ceiling_gbps)?;
            for r in &d.rows {
                writeln!(
                    out,
                    "  {:<22} {:>7.2} GB/s ({:.3})  save {:.2}  load {:.2}  mismatched {}",
                    r.strategy,
                    r.gbps,
                    r.ratio,
                    r.save_gbps,
                    r.load_gbps,
                    r.mismatched_bytes.map_or("-".to_string(), |m| m.to_string())
                )?;
            }
        }
        if let Some(i) = &self.interference {
            write_interference(out, i)?;
        }
        Ok(())
    }

    fn passed(&self) -> bool {
        self.mismatched_bytes == 0
            && self.server.as_ref().is_none_or(|s| {
                s.save_failures == 0
                    && s.load_failures == 0
                    && s.group_prefix_chunks.is_none_or(|g| g == s.chunks)
                    && s.duplex.as_ref().is_none_or(|d| d.failures == 0 && d.mismatched_bytes == 0)
            })
            && self.checksums.as_ref().is_none_or(|c| c.mismatches == 0)
            && self
                .engine_copies
                .as_ref()
                .is_none_or(|c| c.failures == 0 && c.mismatched_bytes == 0)
            && self
                .duplex
                .as_ref()
                .is_none_or(|d| d.rows.iter().all(|r| r.mismatched_bytes.unwrap_or(0) == 0))
    }
}

/// The matmul loop beside the copies: alone, then each row against the windows around it.
fn write_interference(out: &mut dyn std::io::Write, i: &InterferenceResult) -> std::io::Result<()> {
    writeln!(
        out,
        "matmul loop alone: {:.1}/s first, {:.1}/s last, {} windows {:.1}% apart at \
         most; {} round(s), each measurement against the windows alone around it",
        i.matmul_per_s_alone,
        i.matmul_per_s_alone_after,
        i.solo_per_s.len(),
        100.0 * i.solo_spread,
        i.rounds
    )?;
    writeln!(
        out,
        "{:<6} {:<14} {:>10} {:>9} {:>17} {:>10}",
        "dir", "beside", "matmul/s", "slower", "rounds' range", "copy GB/s"
    )?;
    for r in &i.rows {
        writeln!(
            out,
            "{:<6} {:<14} {:>10.1} {:>8.2}% {:>7.2}% - {:>5.2}% {:>10.2}",
            r.direction,
            r.strategy,
            r.matmul_per_s,
            100.0 * r.slowdown,
            100.0 * r.slowdown_min,
            100.0 * r.slowdown_max,
            r.copy_gbps
        )?;
    }
    Ok(())
}

/// The local series: each direction's ceiling and strategies.
fn write_local(out: &mut dyn std::io::Write, results: &[DirectionResult]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<6} {:<9} {:>10} {:>10} {:>7} {:>8} {:>10}",
        "dir", "strategy", "GB/s", "best", "ratio", "batches", "mismatch"
    )?;
    for d in results {
        let dir = if d.direction == Direction::Save { "save" } else { "load" };
        writeln!(
            out,
            "{dir:<6} {:<9} {:>10.2} {:>10} {:>7} {:>8} {:>10}",
            "ceiling", d.ceiling_gbps, "", "1.000", "", ""
        )?;
        for s in &d.strategies {
            let name = if s.strategy == "auto" {
                if s.staged {
                    "auto:stg"
                } else {
                    "auto:bat"
                }
            } else {
                s.strategy
            };
            writeln!(
                out,
                "{dir:<6} {name:<9} {:>10.2} {:>10.2} {:>7.3} {:>8} {:>10}",
                s.gbps, s.best_gbps, s.ratio, s.batches, s.mismatched_bytes
            )?;
            if let Some(t) = &s.timeline {
                writeln!(
                    out,
                    "  timeline: host {:.0} us (submit {:.0}), GPU {:.0} us, first copy at {:.0}, \
                     copies {:.0} us busy at {:.2} GB/s, gaps {:.0} us (max {:.0}), kernel {:.0} us mean ({:.0} max)",
                    t.host_total_us,
                    t.host_submit_us,
                    t.gpu_total_us,
                    t.first_copy_start_us,
                    t.copy_busy_us,
                    t.copy_gbps,
                    t.copy_gaps_us,
                    t.copy_gap_max_us,
                    t.kernel_mean_us,
                    t.kernel_max_us
                )?;
            }
        }
    }
    Ok(())
}

/// The run through a server: its requests, and what its DMA threads did.
fn write_server(
    out: &mut dyn std::io::Write,
    s: &crate::dma_server::ServedResult,
) -> std::io::Result<()> {
    writeln!(
        out,
        "server: rank {}/{}, {} chunks, failures save {} load {}",
        s.tp_rank, s.tp_world_size, s.chunks, s.save_failures, s.load_failures,
    )?;
    if let (Some(save), Some(load)) = (s.save_ratio_bracketed, s.load_ratio_bracketed) {
        let range = |r: &[f64]| {
            let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{lo:.3}-{hi:.3}")
        };
        writeln!(
            out,
            "server against the ceiling's copy just before and after each: saves \
             {save:.3} ({}), loads {load:.3} ({})",
            range(&s.save_bracketed_ratios),
            range(&s.load_bracketed_ratios)
        )?;
    }
    if let (Some(save), Some(load)) = (s.save_busy_gbps, s.load_busy_gbps) {
        writeln!(
            out,
            "server DMA threads busy: saves {save:.2} GB/s, loads {load:.2} GB/s of their busy time"
        )?;
    }
    if let (Some(sl), Some(st), Some(ll), Some(lt)) =
        (s.save_lead_us, s.save_tail_us, s.load_lead_us, s.load_tail_us)
    {
        writeln!(
            out,
            "server requests around their copies: saves {sl:.0} us to the first job, \
             {st:.0} us after the last copy; loads {ll:.0} us, {lt:.0} us"
        )?;
    }
    if let (Some(save), Some(load)) = (s.save_runs_per_job, s.load_runs_per_job) {
        writeln!(
            out,
            "server host-side copies per job: saves {save:.1}, loads {load:.1} (about \
             one per shard when each shard's slots were adjacent)"
        )?;
    }
    write_server_threads(out, s)?;
    if let (Some(g), Some(per_rank)) = (s.group_prefix_chunks, &s.group_prefix_per_rank) {
        writeln!(out, "group prefix after every rank saved: {g} (per rank {per_rank:?})")?;
    }
    if let Some(d) = &s.duplex {
        writeln!(
            out,
            "duplex: save {:.1} MiB beside load {:.1} MiB: {:.2} GB/s of {:.2} both ways ({:.3}), \
             failures {}, mismatched bytes {}",
            d.save_bytes as f64 / (1u64 << 20) as f64,
            d.load_bytes as f64 / (1u64 << 20) as f64,
            d.gbps,
            d.ceiling_gbps,
            d.ratio,
            d.failures,
            d.mismatched_bytes
        )?;
    }
    Ok(())
}

/// The server's DMA threads per job: handing jobs to the GPU, its own time, waits, the
/// parts of a job's start, beside the matmul, and the GPU timelines.
fn write_server_threads(
    out: &mut dyn std::io::Write,
    s: &crate::dma_server::ServedResult,
) -> std::io::Result<()> {
    if let (Some(save), Some(load)) = (s.save_submit_us_per_job, s.load_submit_us_per_job) {
        let wait = s.save_checksum_wait_us_per_job.unwrap_or(0.0);
        writeln!(
            out,
            "server DMA threads per job: {save:.0} us handing a save to the GPU, {wait:.0} \
             us waiting for its checksums after its copy; {load:.0} us handing a load"
        )?;
    }
    if let (Some(save), Some(load)) = (s.save_submit_cpu_us_per_job, s.load_submit_cpu_us_per_job) {
        writeln!(
            out,
            "server DMA threads' own CPU time per job: {save:.0} us (saves), {load:.0} us \
             (loads)"
        )?;
    }
    if let (Some(save), Some(load)) = (s.save_submit_wait_us_per_job, s.load_submit_wait_us_per_job)
    {
        writeln!(
            out,
            "server DMA threads waiting per job for earlier jobs to free staging, tables \
             or checksum slots: {save:.0} us (saves), {load:.0} us (loads)"
        )?;
    }
    for (way, parts) in [("saves", s.save_submit_parts), ("loads", s.load_submit_parts)] {
        if let Some(p) = parts {
            writeln!(
                out,
                "server DMA thread per job, {way}: pieces {:.0} us, staged batches {:.0} \
                 us, checksum tables {:.0} us, CUDA calls and the rest {:.0} us",
                p.pieces_us, p.stage_us, p.tables_us, p.cuda_us
            )?;
        }
    }
    if let Some(b) = &s.beside_matmul {
        let f = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.0}"));
        writeln!(
            out,
            "server beside the matmul: saves {} GB/s busy, {} us per job handing them to \
             the GPU, {} us waiting for checksums; loads {} GB/s busy, {} us per job; \
             streamed saves {} GB/s busy, loads {}",
            f(b.save_busy_gbps),
            f(b.save_submit_us_per_job),
            f(b.save_checksum_wait_us_per_job),
            f(b.load_busy_gbps),
            f(b.load_submit_us_per_job),
            f(b.stream_save_busy_gbps),
            f(b.stream_load_busy_gbps)
        )?;
    }
    let beside = s.beside_matmul.as_ref();
    for (way, t) in [
        ("saves", s.save_timeline.as_ref()),
        ("loads", s.load_timeline.as_ref()),
        ("saves beside the matmul", beside.and_then(|b| b.save_timeline.as_ref())),
        ("loads beside the matmul", beside.and_then(|b| b.load_timeline.as_ref())),
    ] {
        if let Some(t) = t {
            writeln!(
                out,
                "server GPU timeline, {way}: copies at {:.2} GB/s while copying; per \
                 request {:.0} us on the GPU, copy stream idle {:.0} us, kernels {:.0} us, \
                 busy periods {}",
                t.copy_gbps,
                t.span_us,
                t.copy_gaps_us,
                t.kernel_us,
                t.periods_per_request.map_or("?".into(), |p| format!("{p:.2}"))
            )?;
        }
    }
    Ok(())
}

fn cuda(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Gpu(format!("{op}: {e}"))
}

fn dma(e: orbitkv_gpu::dma::DmaError) -> Error {
    Error::Gpu(e.to_string())
}

fn layout_of(a: &DmaArgs) -> Result<(KvLayoutSpec, &'static str), Error> {
    let (layout, name) = match a.layout {
        LayoutArg::FlashNhd => (KvLayoutKind::FlashAttnNhd, "flash-nhd"),
        LayoutArg::FlashHnd => (KvLayoutKind::FlashAttnHnd, "flash-hnd"),
        LayoutArg::CrossLayer => (KvLayoutKind::CrossLayer, "cross-layer"),
        LayoutArg::Mla => (KvLayoutKind::MlaPerLayer, "mla"),
        LayoutArg::Sglang => (KvLayoutKind::SglangPerLayer, "sglang"),
        LayoutArg::Paged => (KvLayoutKind::Paged, "paged"),
    };
    let elem_bytes = match a.dtype {
        DtypeArg::Bf16 | DtypeArg::Fp16 => 2,
        DtypeArg::Fp8 => 1,
    };
    let desc = KvLayoutSpec {
        kind: layout,
        num_layers: a.layers,
        num_blocks: a.blocks,
        block_size: a.block_tokens,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        elem_bytes,
    };
    desc.validate().map_err(|e| {
        let flag = match e.field {
            "num_layers" => "--layers",
            "num_blocks" => "--blocks",
            "block_size" => "--block-tokens",
            "kv_heads" => "--kv-heads",
            "head_dim" => "--head-dim",
            _ => "--dtype",
        };
        Error::InvalidArgument { flag, reason: e.to_string() }
    })?;
    Ok((desc, name))
}

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

fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

struct Bench {
    engine: CopyEngine,
    memory: Arc<EngineMemory>,
    /// The arena's registration with CUDA (what copies name their host side by).
    host: Arc<HostRegistration>,
    arena_slice: ArenaSlice,
    contiguous: Arc<DeviceBuffer>,
    /// Every chunk's pieces, planned once (their count and typical length describe the run).
    pieces: Vec<Piece>,
    /// Pieces planned by the copy engine for a job ([`CopyEngine::start`]), reused.
    plan: Vec<Piece>,
    /// (slot offset in the slice, block ids) per chunk.
    chunks: Vec<(u64, Vec<u64>)>,
    /// The same with offsets from the registration's start (what copy jobs name).
    job_chunks: Vec<(u64, Vec<u64>)>,
    chunk_len: u64,
    bytes: u64,
    /// Offset of the ceiling region in the arena slice.
    ceiling_at: u64,
    /// Offset of the slice from the registration's start.
    slice_at: u64,
    originals: Vec<Vec<u8>>,
    iterations: u32,
    timeline: bool,
    /// Series submit job by job (`--server-jobs`).
    server_jobs: bool,
    /// How the checksums row computes them (`--checksum-form`).
    checksum_form: crate::args::ChecksumForm,
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

    fn ceiling(&mut self, direction: Direction) -> Result<f64, Error> {
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

    fn scribble(&self, direction: Direction) -> Result<(), Error> {
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

    fn verify(&self, direction: Direction) -> Result<u64, Error> {
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
    fn once(&mut self, direction: Direction, strategy: Strategy) -> Result<f64, Error> {
        let t = Instant::now();
        let all = 0..self.chunks.len();
        self.submit_range(direction, strategy, all, SaveSums::Off)?.finish().map_err(dma)?;
        Ok(gbps(self.bytes, t.elapsed().as_secs_f64()))
    }

    /// Starts the chunks `chunks` as one job, as the server's DMA thread would (block form
    /// where it applies), with a save's checksums as `sums` asks.
    fn submit_range(
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
    fn job_chunks(&self) -> Vec<std::ops::Range<usize>> {
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
    fn engine_side_shape(&self, a: &DmaArgs) -> EngineSide {
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

    /// One save (`auto`) with the chunks' checksums computed beside it, job by job (`jobs`:
    /// chunk ranges); GB/s.
    fn save_with_checksums(
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

    /// The first half of the chunks' bytes copied device-to-host while the second half's go
    /// host-to-device, each contiguous, on two copy engines at once (what a save beside a load
    /// can reach); median GB/s of both together.
    fn duplex_ceiling(&mut self, ctx: &Arc<CudaContext>, a: &DmaArgs) -> Result<f64, Error> {
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

    /// One contiguous copy of the operation's bytes (the ceiling's copy); GB/s.
    fn contiguous_once(&mut self, direction: Direction) -> Result<f64, Error> {
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
    fn settle_checksum_form(&mut self, hasher: &ChunkHasher) -> Result<(), Error> {
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
    fn checksums(&mut self, save_ceiling: f64) -> Result<Option<ChecksumResult>, Error> {
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
    fn save_fused(
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

    fn series(
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

/// How long a rank waits for the others at a `--barrier` (they allocate and fill their
/// tensors first: seconds for tens of GiB).
const BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

/// `num / den`, or 0 when `den` is not positive (a rate or ceiling that was not measured).
/// `--staging-depth`, or where not given the server's rule for its default 64 MiB jobs
/// (`--gpu-job`): as many parts as the staging holds such jobs, 2 to 8.
fn staging_depth(a: &DmaArgs) -> usize {
    a.staging_depth.map_or_else(|| CopyEngine::default_depth(a.staging, 64 << 20), usize::from)
}

pub(crate) fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// Runs `dma`.
/// Refuses flags that cannot go together, naming the flag.
fn check_args(a: &DmaArgs) -> Result<(), Error> {
    if a.blocks_per_chunk == 0 || !a.blocks.is_multiple_of(a.blocks_per_chunk) {
        return Err(Error::InvalidArgument {
            flag: "--blocks-per-chunk",
            reason: format!("must divide --blocks {}", a.blocks),
        });
    }
    if a.iterations == 0 {
        return Err(Error::InvalidArgument {
            flag: "--iterations",
            reason: "must be at least 1".into(),
        });
    }
    if a.engine_batch.is_some_and(|b| !(1 << 20..=1 << 30).contains(&b)) {
        return Err(Error::InvalidArgument {
            flag: "--engine-batch",
            reason: "must be between 1MiB and 1GiB".into(),
        });
    }
    if a.tp_world_size == 0 || a.tp_rank >= a.tp_world_size {
        return Err(Error::InvalidArgument {
            flag: "--tp-rank",
            reason: format!(
                "rank {} of a group of {}: ranks are 0 to --tp-world-size - 1",
                a.tp_rank, a.tp_world_size
            ),
        });
    }
    Ok(())
}

/// The stand-in engine (its tensors filled with seeded bytes), the arena registered with
/// CUDA, the chunks' slots and a copy engine: everything a run measures with; and how long
/// registering the arena took (ms).
fn bench(a: &DmaArgs, ctx: &Arc<CudaContext>, layout: KvLayoutSpec) -> Result<(Bench, f64), Error> {
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

/// What a run's series measured, local or through the server: the rows of the report and the
/// optional sections, with the bytes that differed across all of them.
#[derive(Default)]
struct Measured {
    results: Vec<DirectionResult>,
    mismatched: u64,
    server: Option<crate::dma_server::ServedResult>,
    interference: Option<InterferenceResult>,
    checksums: Option<ChecksumResult>,
    engine_copies: Option<crate::dma_engine_copies::EngineCopiesResult>,
    duplex: Option<LocalDuplex>,
}

/// The device `--device` names, and a CUDA context on it.
fn open_device(a: &DmaArgs) -> Result<(DeviceInfo, Arc<CudaContext>), Error> {
    let devices = match orbitkv_gpu::probe() {
        Probe::Absent { reason } => return Err(Error::Gpu(format!("no CUDA device: {reason}"))),
        Probe::Present { devices } => devices,
    };
    let info =
        devices.iter().find(|d| d.ordinal as usize == a.device).cloned().ok_or_else(|| {
            Error::InvalidArgument {
                flag: "--device",
                reason: format!("no device {} ({} found)", a.device, devices.len()),
            }
        })?;
    let ctx: Arc<CudaContext> =
        CudaContext::new(a.device).map_err(cuda("creating the CUDA context"))?;
    Ok((info, ctx))
}

pub(crate) fn run(a: &DmaArgs) -> Result<DmaReport, Error> {
    let (layout, layout_name) = layout_of(a)?;
    check_args(a)?;
    let barrier = a
        .barrier
        .as_deref()
        .map(|dir| crate::barrier::Barrier::new(dir, a.tp_rank, a.tp_world_size, BARRIER_TIMEOUT))
        .transpose()?;
    let (info, ctx) = open_device(a)?;
    let (mut bench, register_ms) = bench(a, &ctx, layout)?;
    // A spinner on a terminal while the series run (not with --json).
    let show = !a.json && std::io::stderr().is_terminal();
    let measured = progress::during(&format!("dma {layout_name}"), None, show, || {
        if a.socket.is_some() {
            run_served(a, &mut bench, &ctx, &info, barrier.as_ref())
        } else {
            run_local(a, &mut bench, &ctx)
        }
    })?;
    let (pieces, bytes) = (bench.pieces.len(), bench.bytes);
    // The copy engines and every transfer are done; the registration goes with the bench.
    drop(bench);
    Ok(DmaReport {
        device: info.name,
        device_uuid: info.uuid,
        layout: layout_name,
        layers: a.layers,
        block_tokens: a.block_tokens,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        elem_bytes: layout.elem_bytes,
        blocks: a.blocks,
        blocks_per_chunk: a.blocks_per_chunk,
        page_bytes: layout.part_len(),
        pieces,
        bytes,
        staging_bytes: a.staging,
        slots: match a.slots {
            SlotOrderArg::Shuffled => "shuffled",
            SlotOrderArg::InOrder => "in-order",
        },
        server_jobs: a.server_jobs,
        iterations: a.iterations,
        register_ms,
        results: measured.results,
        mismatched_bytes: measured.mismatched,
        server: measured.server,
        interference: measured.interference,
        checksums: measured.checksums,
        engine_copies: measured.engine_copies,
        duplex: measured.duplex,
    })
}

/// The run through the server (`--socket`): the ceilings, the served series (and the
/// engine-side copies with `--engine-copies`), the ceilings again, and the `server` rows.
fn run_served(
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
    let engine = crate::dma_server::Engine {
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
    let ceiling: Option<crate::dma_server::CeilingCopy<'_>> =
        if barrier.is_none() { Some(&mut copy) } else { None };
    let (mut served, interference) =
        crate::dma_server::run(a, &engine, barrier, duplex_ceiling, shape, ceiling)?;
    let mut engine_copies = None;
    if a.engine_copies {
        engine_copies = Some(crate::dma_engine_copies::run(
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
    served: &crate::dma_server::ServedResult,
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

/// The strategies `--strategy` names, each with its name in the report.
fn strategies_of(a: &DmaArgs) -> Vec<(&'static str, Strategy)> {
    match a.strategy {
        StrategyArg::Auto => vec![("auto", Strategy::Auto)],
        StrategyArg::Staged => vec![("staged", Strategy::Staged)],
        StrategyArg::Batched => vec![("batched", Strategy::Batched)],
        StrategyArg::All => vec![
            ("auto", Strategy::Auto),
            ("staged", Strategy::Staged),
            ("batched", Strategy::Batched),
        ],
    }
}

/// The local run: each strategy's series each way between its ceilings, the checksums, and
/// with `--duplex` and `--interference` their series.
fn run_local(a: &DmaArgs, bench: &mut Bench, ctx: &Arc<CudaContext>) -> Result<Measured, Error> {
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

#[cfg(test)]
mod tests {
    use super::Timeline;
    use orbitkv_gpu::dma::{BatchSpan, SpanTotals};

    /// The arithmetic is `SpanTotals`' (tested in orbitkv-gpu); this checks what the report
    /// takes from it and adds: the host times and the mean kernel time.
    #[test]
    fn the_timeline_reports_the_span_totals_and_the_host_times() {
        let span = |k: f64, c: f64| BatchSpan {
            bytes: 1_000_000,
            runs: 1,
            kernel_start_us: k,
            kernel_end_us: k + 20.0,
            copy_start_us: c,
            copy_end_us: c + 100.0,
        };
        let spans = vec![span(110.0, 100.0), span(10.0, 0.0), span(230.0, 225.0)];
        let want = SpanTotals::of(&spans);
        let t = Timeline::summarize(spans, 300.0, 400.0);
        assert_eq!(
            (t.gpu_total_us, t.first_copy_start_us, t.copy_busy_us),
            (want.span_us, want.first_copy_start_us, want.copy_busy_us)
        );
        assert_eq!((t.copy_gaps_us, t.copy_gap_max_us), (want.copy_gaps_us, want.copy_gap_max_us));
        assert_eq!((t.copy_gbps, t.kernel_max_us), (want.copy_gbps(), want.kernel_max_us));
        assert_eq!(t.kernel_mean_us, 20.0);
        assert_eq!((t.host_submit_us, t.host_total_us), (300.0, 400.0));
        assert_eq!(t.batches.len(), 3);
        // No batch: no mean to divide by zero for.
        assert_eq!(Timeline::summarize(Vec::new(), 1.0, 2.0).kernel_mean_us, 0.0);
    }
}
