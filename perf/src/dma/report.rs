//! What `dma` reports: one JSON object ([`DmaReport`]), or a table for people. The local
//! series' rows are here; the sections of a run through the server, of the engine-side copies
//! and of `--interference` are their modules' ([`super::served`], [`super::engine_copies`],
//! [`super::interference`]), and their table lines are written here too.

use orbitkv_gpu::dma::Direction;
use serde::Serialize;

use super::interference::InterferenceResult;
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
    pub(super) fn summarize(
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
    pub server: Option<super::served::ServedResult>,
    /// With `--interference`: the slowdown of a concurrent matmul loop beside each strategy.
    pub interference: Option<super::interference::InterferenceResult>,
    /// Chunk checksums on the GPU (local runs): checked against the CPU, and their cost.
    pub checksums: Option<ChecksumResult>,
    /// With `--engine-copies`: the engine-side path (no CUDA IPC) through the server.
    pub engine_copies: Option<super::engine_copies::EngineCopiesResult>,
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
    s: &super::served::ServedResult,
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
    s: &super::served::ServedResult,
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
