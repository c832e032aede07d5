//! What a run through the server adds to the `dma` report ([`ServedResult`]): its series'
//! rates, failures and checks, the server's counters over them, the duplex, and the ceiling's
//! windows around each timed request.

use serde::Serialize;

/// What the server run adds to the report.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct ServedResult {
    /// Median GB/s of a save of every chunk (request to answer, commit included).
    pub save_gbps: f64,
    /// Median GB/s of a load of every chunk.
    pub load_gbps: f64,
    /// Chunks whose save outcome was not `Done` (over all iterations, and the saves beside
    /// `--interference`'s matmul loop).
    pub save_failures: u64,
    /// Chunks whose load outcome was not `Done` (likewise).
    pub load_failures: u64,
    /// Mismatched bytes in the chunks read back through the arena after the last save.
    pub save_mismatched_bytes: u64,
    /// Mismatched bytes in the tensors after the last timed load, and after the last load
    /// beside `--interference`'s matmul loop.
    pub load_mismatched_bytes: u64,
    /// This rank of its tensor-parallel group (`--tp-rank`, `--tp-world-size`).
    pub tp_rank: u32,
    /// Ranks in the group.
    pub tp_world_size: u32,
    /// Chunks saved per series.
    pub chunks: usize,
    /// With `--barrier` and more than one rank: the group prefix (chunks every rank has)
    /// once every rank finished its saves; a complete group has all `chunks`.
    pub group_prefix_chunks: Option<usize>,
    /// Its per-rank counts, in rank order.
    pub group_prefix_per_rank: Option<Vec<usize>>,
    /// With `--duplex`: saves and loads at the same time.
    pub duplex: Option<DuplexResult>,
    /// The timed saves' bytes over the time the server's save thread had copies on the GPU
    /// (`gpu_transfers.save_busy_s` in its stats), GB/s: against `save_gbps`, what the
    /// requests cost around the copies. None when the stats do not say (an older server).
    /// Meaningful when this process is the server's only GPU client (a group's ranks share
    /// the busy time).
    pub save_busy_gbps: Option<f64>,
    /// The same for the timed loads.
    pub load_busy_gbps: Option<f64>,
    /// Mean microseconds per timed save from its start on the server to its first job handed
    /// to the DMA thread (`gpu_transfers.save_lead_s` / `save_requests`); None when the stats
    /// do not say.
    pub save_lead_us: Option<f64>,
    /// Mean microseconds per timed save from its last copy completing to its answer.
    pub save_tail_us: Option<f64>,
    /// The same two for the timed loads.
    pub load_lead_us: Option<f64>,
    /// See `load_lead_us`.
    pub load_tail_us: Option<f64>,
    /// Mean microseconds per timed save that the server's DMA thread, idle, took to take up
    /// the save's first job once queued (`gpu_transfers.save_pickup_s` / `save_requests`):
    /// its wake-up. None when the stats do not say.
    pub save_pickup_us: Option<f64>,
    /// The same for the timed loads.
    pub load_pickup_us: Option<f64>,
    /// With a server run with `--gpu-timeline`: what the timed saves' staged batches did on
    /// the GPU (None otherwise).
    pub save_timeline: Option<GpuTimeline>,
    /// The same for the timed loads.
    pub load_timeline: Option<GpuTimeline>,
    /// Host-side copies per job of the timed saves (`gpu_transfers.save_host_runs` /
    /// `save_jobs`): about one per shard holding the job's chunks when each shard gave them
    /// adjacent arena slots, up to one per chunk when none did; None when the stats do not say.
    pub save_runs_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_runs_per_job: Option<f64>,
    /// Mean microseconds the server's save thread spent handing each job of the timed saves
    /// to the GPU (planning, enqueueing, starting its checksums: `save_submit_s` / jobs);
    /// None when the stats do not say.
    pub save_submit_us_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_submit_us_per_job: Option<f64>,
    /// Of `save_submit_us_per_job`, the save thread's own CPU time (`save_submit_cpu_s` /
    /// jobs): against the jobs' copy time, whether the host side keeps up; None when the
    /// stats do not say.
    pub save_submit_cpu_us_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_submit_cpu_us_per_job: Option<f64>,
    /// Of `save_submit_us_per_job`, the time the save thread waited for earlier jobs to free
    /// staging, tables or checksum slots (`save_submit_wait_s` / jobs; CUDA spins, so the CPU
    /// time includes it): the rest is planning and enqueueing. None when the stats do not say.
    pub save_submit_wait_us_per_job: Option<f64>,
    /// The same for the timed loads.
    pub load_submit_wait_us_per_job: Option<f64>,
    /// The rest of `save_submit_us_per_job`, step by step; None when the stats do not say.
    pub save_submit_parts: Option<SubmitParts>,
    /// The same for the timed loads (no checksum tables).
    pub load_submit_parts: Option<SubmitParts>,
    /// Mean microseconds a job of the timed saves waited, its copy landed, for its GPU
    /// checksums (`save_checksum_wait_s` / jobs); None when the stats do not say.
    pub save_checksum_wait_us_per_job: Option<f64>,
    /// With `--interference`: the same server counters over the saves and loads beside the
    /// matmul loop (where the GPU checksums compete with the engine's kernels for SMs).
    pub beside_matmul: Option<BesideMatmul>,
    /// Contiguous copies of the series' bytes (the ceiling's copy) in this process just before
    /// the first timed save and just after each, GB/s. Empty for a rank of a group
    /// (`--barrier`): its copies would share the links with the other ranks' saves.
    pub save_ceiling_windows_gbps: Vec<f64>,
    /// Each timed save's GB/s over the mean of the two windows around it.
    pub save_bracketed_ratios: Vec<f64>,
    /// Their median (None without windows): the save ratio free of the bus's drift between
    /// the run's ceiling measurements and the saves.
    pub save_ratio_bracketed: Option<f64>,
    /// The same three for the timed loads.
    pub load_ceiling_windows_gbps: Vec<f64>,
    /// See `save_bracketed_ratios`.
    pub load_bracketed_ratios: Vec<f64>,
    /// See `save_ratio_bracketed`.
    pub load_ratio_bracketed: Option<f64>,
}

/// Where a DMA thread's time per job went besides waiting, microseconds (the server's
/// `{save,load}_submit_{pieces,stage,tables}_s` over the jobs).
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct SubmitParts {
    /// The chunks' pieces.
    pub pieces_us: f64,
    /// Staged batches and their descriptor tables.
    pub stage_us: f64,
    /// A save's checksum tables.
    pub tables_us: f64,
    /// The rest, not waiting: the CUDA calls that enqueue the job.
    pub cuda_us: f64,
}

/// The server's counters over the saves and loads run beside `--interference`'s matmul loop.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct BesideMatmul {
    /// The saves' bytes over the save thread's busy time, GB/s.
    pub save_busy_gbps: Option<f64>,
    /// Mean microseconds per save job handing it to the GPU.
    pub save_submit_us_per_job: Option<f64>,
    /// Mean microseconds per save job between its copy landing and its checksums being ready.
    pub save_checksum_wait_us_per_job: Option<f64>,
    /// The loads' bytes over the load thread's busy time, GB/s.
    pub load_busy_gbps: Option<f64>,
    /// Mean microseconds per load job handing it to the GPU.
    pub load_submit_us_per_job: Option<f64>,
    /// With the server's `--gpu-timeline`: the saves' batches beside the matmul (whether they
    /// lose their rate there by slower copies or by the copy stream waiting for gathers).
    pub save_timeline: Option<GpuTimeline>,
    /// The same for the loads (waiting for uploads, or scatters waiting for SMs).
    pub load_timeline: Option<GpuTimeline>,
    /// The streamed saves' bytes (`server-stream` rows: requests back to back, two in
    /// flight) over the save thread's busy time, GB/s.
    pub stream_save_busy_gbps: Option<f64>,
    /// The same for the streamed loads.
    pub stream_load_busy_gbps: Option<f64>,
}

/// The server's `--gpu-timeline` sums over the timed runs of one direction, per request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct GpuTimeline {
    /// The batches' bytes over the time their host-side copies ran, GB/s: the copies' own
    /// rate, their stream's idle gaps left out.
    pub copy_gbps: f64,
    /// Microseconds per request from the first batch's start to the last copy or kernel.
    pub span_us: f64,
    /// Microseconds per request the copy stream stood idle between consecutive copies.
    pub copy_gaps_us: f64,
    /// Microseconds per request the gather or scatter kernels ran.
    pub kernel_us: f64,
    /// The DMA thread's busy periods per request (more than one: it ran out of jobs in the
    /// middle of a request for longer than its spin; None from a server that does not count
    /// them).
    pub periods_per_request: Option<f64>,
    /// Microseconds per request from the first batch's start to the first copy's (a save's
    /// first gather; None from a server that does not report it).
    pub lead_us: Option<f64>,
    /// Microseconds per request from the last copy's end to the last kernel's (a load's last
    /// scatter; None likewise).
    pub tail_us: Option<f64>,
}

/// A save of the first half of the chunks and a load of the second half, sent together.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DuplexResult {
    /// Bytes saved per run.
    pub save_bytes: u64,
    /// Bytes loaded per run.
    pub load_bytes: u64,
    /// Median GB/s of both together (saved + loaded bytes over the time until both answered).
    pub gbps: f64,
    /// A contiguous device-to-host copy of the saved bytes beside a host-to-device copy of the
    /// loaded bytes, GB/s (measured in this process, in the same run).
    pub ceiling_gbps: f64,
    /// gbps / ceiling_gbps.
    pub ratio: f64,
    /// Chunks whose save or load was not `Done` (over all runs).
    pub failures: u64,
    /// Mismatched bytes after the last run: the saved chunks through the arena, every tensor.
    pub mismatched_bytes: u64,
}
