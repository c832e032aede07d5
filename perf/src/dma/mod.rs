//! `orbitkv-perf dma`: GPU save/load of engine KV pages through the copy engine, against one
//! contiguous copy of the same bytes measured in the same run.
//!
//! A stand-in engine allocates the layout's tensors on the GPU and fills them with seeded
//! random bytes. Save gathers every block (in a shuffled block order, into shuffled arena
//! slots unless `--slots in-order`, one chunk per slot) into the CUDA-registered arena; load scatters them back. Before
//! each measured series the destination is scribbled over, after it every byte is compared.
//!
//! This module is the entry point: it checks the flags, opens the device, builds the
//! [`bench::Bench`] every series measures with and runs the series in this process
//! ([`local`]) or through a server (`--socket`: [`served`]). The rest: [`checksums`] (the
//! GPU checksum rows of a local run), [`engine_copies`] (`--engine-copies`), [`interference`]
//! and [`matmul_loop`] (`--interference`), [`report`] (what the run reports).

mod bench;
mod checksums;
mod engine_copies;
mod interference;
mod local;
mod matmul_loop;
mod report;
mod served;

pub(crate) use report::DmaReport;

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use orbitkv_gpu::dma::Strategy;
use orbitkv_gpu::{DeviceInfo, LayoutGeometry, Probe};
use orbitkv_proto::{KvLayoutKind, KvLayoutSpec};

use crate::args::{DmaArgs, DtypeArg, LayoutArg, SlotOrderArg, StrategyArg};
use crate::error::Error;
use crate::progress;
use bench::bench;
use interference::InterferenceResult;
use report::{ChecksumResult, DirectionResult, LocalDuplex};

/// How long a rank waits for the others at a `--barrier` (they allocate and fill their
/// tensors first: seconds for tens of GiB).
const BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

/// What a run's series measured, local or through the server: the rows of the report and the
/// optional sections, with the bytes that differed across all of them.
#[derive(Default)]
struct Measured {
    results: Vec<DirectionResult>,
    mismatched: u64,
    server: Option<served::ServedResult>,
    interference: Option<InterferenceResult>,
    checksums: Option<ChecksumResult>,
    engine_copies: Option<engine_copies::EngineCopiesResult>,
    duplex: Option<LocalDuplex>,
}

/// Runs `dma`.
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
            served::run_served(a, &mut bench, &ctx, &info, barrier.as_ref())
        } else {
            local::run_local(a, &mut bench, &ctx)
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

fn cuda(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Gpu(format!("{op}: {e}"))
}

fn dma(e: orbitkv_gpu::dma::DmaError) -> Error {
    Error::Gpu(e.to_string())
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// `num / den`, or 0 when `den` is not positive (a rate or ceiling that was not measured).
pub(crate) fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
