//! `orbitkv-perf ssd`: the SSD tier's I/O path (`SsdRing`, O_DIRECT, arena slots as buffers)
//! on one file, against fio on the same file with the same parameters in the same run.

mod drive;
mod file;
mod fio;
mod report;

pub(crate) use report::SsdReport;

use std::io::IsTerminal;

use orbitkv_shards::PAGE_SIZE;

use crate::args::SsdArgs;
use crate::error::{invalid, Error};
use crate::progress;
use crate::report::OpSummary;
use drive::DriveConfig;

/// Most operations in flight.
const MAX_QD: u32 = 4096;
/// Largest block: one I/O moves at most 2 GiB - 4 KiB on Linux, and results are 32-bit.
const MAX_BLOCK: u64 = 1 << 30;
/// Most bytes of I/O buffers (`--qd` x `--block-size`), all mapped and populated up front.
const MAX_BUFFERS: u64 = 4 << 30;

/// Checks the flags; every problem names its flag.
fn check(a: &SsdArgs) -> Result<DriveConfig, Error> {
    if a.block_size == 0 || !a.block_size.is_multiple_of(PAGE_SIZE) {
        return Err(invalid(
            "--block-size",
            format!("{} bytes is not a positive multiple of 4 KiB (O_DIRECT)", a.block_size),
        ));
    }
    if a.block_size > MAX_BLOCK {
        return Err(invalid(
            "--block-size",
            format!("{} bytes is more than the {MAX_BLOCK} one operation may move", a.block_size),
        ));
    }
    if a.qd == 0 || a.qd > MAX_QD {
        return Err(invalid("--qd", format!("{} is not in 1..={MAX_QD}", a.qd)));
    }
    let buffers = a.block_size * u64::from(a.qd);
    if buffers > MAX_BUFFERS {
        return Err(invalid(
            "--qd",
            format!(
                "{} operations of --block-size {} need {buffers} bytes of buffers, more than \
                 {MAX_BUFFERS}",
                a.qd, a.block_size
            ),
        ));
    }
    if a.duration.is_zero() {
        return Err(invalid("--duration", "must be positive"));
    }
    let cfg = DriveConfig {
        mode: a.mode,
        block: a.block_size,
        qd: a.qd,
        file_size: a.file_size,
        duration: a.duration,
        seed: a.seed,
    };
    if a.file_size < cfg.extent() {
        let one = format!("one block of --block-size ({} bytes)", a.block_size);
        return Err(invalid("--file-size", format!("{} bytes is smaller than {one}", a.file_size)));
    }
    Ok(cfg)
}

/// Runs the benchmark, then fio; setup failures are errors, I/O failures are counted.
pub(crate) fn run(a: &SsdArgs) -> Result<SsdReport, Error> {
    let cfg = check(a)?;
    let test_file = file::prepare(&a.dir, a.file_size)?;
    // A bar on a terminal while each part runs (not with --json).
    let show = !a.json && std::io::stderr().is_terminal();
    let r = progress::during("SsdRing", Some(a.duration), show, || {
        drive::drive(&test_file.direct, &test_file.path, &cfg)
    })?;
    drop(test_file.direct);

    let fio_bin = if a.no_fio {
        eprintln!("orbitkv-perf: note: fio skipped (--no-fio); no baseline");
        None
    } else {
        let found = fio::find();
        if found.is_none() {
            eprintln!("orbitkv-perf: note: fio is not on PATH; no baseline (fio: null)");
        }
        found
    };
    let (fio, fio_error) = match fio_bin {
        None => (None, None),
        Some(bin) => match progress::during("fio", Some(a.duration), show, || {
            fio::run(&bin, &cfg, &test_file.path)
        }) {
            Ok(f) => (Some(f), None),
            Err(e) => {
                eprintln!("orbitkv-perf: note: no fio baseline: {e}");
                (None, Some(e))
            }
        },
    };
    if let Some(e) = &r.first_error {
        eprintln!("orbitkv-perf: {} I/O error(s), first: {e}", r.errors);
    }

    let wall = r.wall.as_secs_f64();
    let per_s = |n: u64| if wall > 0.0 { n as f64 / wall } else { 0.0 };
    let gbps = per_s(r.payload_bytes) / 1e9;
    let fio_gbps = fio.as_ref().map(|f| f.gbps);
    let mut notes = Vec::new();
    if fio.is_some() {
        notes.push("fio ran right after SsdRing, on the same file".into());
    }
    Ok(SsdReport {
        file: test_file.path.display().to_string(),
        file_size: a.file_size,
        file_created: test_file.prepared.created,
        fill_s: test_file.prepared.fill_s,
        mode: a.mode.as_str(),
        block_size: a.block_size,
        qd: a.qd,
        duration_s: a.duration.as_secs_f64(),
        seed: a.seed,
        ops: r.ops,
        bytes: r.payload_bytes,
        wall_s: wall,
        gbps,
        iops: per_s(r.ops),
        latency: OpSummary::from(&r.latency),
        errors: r.errors,
        first_error: r.first_error,
        ratio_vs_fio: fio_gbps.filter(|g| *g > 0.0).map(|g| gbps / g),
        fio_gbps,
        fio,
        fio_error,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::SsdMode;
    use std::time::Duration;

    fn args() -> SsdArgs {
        SsdArgs {
            dir: "/tmp".into(),
            file_size: 1 << 20,
            block_size: 64 << 10,
            qd: 4,
            mode: SsdMode::Read,
            duration: Duration::from_secs(1),
            seed: 1,
            no_fio: true,
            json: true,
        }
    }

    fn flag_of(a: SsdArgs) -> &'static str {
        match check(&a) {
            Err(Error::InvalidArgument { flag, .. }) => flag,
            other => panic!("{a:?} gave {other:?}"),
        }
    }

    #[test]
    fn bad_values_name_their_flag() {
        assert!(check(&args()).is_ok());
        assert_eq!(flag_of(SsdArgs { block_size: 6000, ..args() }), "--block-size");
        assert_eq!(flag_of(SsdArgs { block_size: 0, ..args() }), "--block-size");
        assert_eq!(flag_of(SsdArgs { block_size: 2 << 30, ..args() }), "--block-size");
        assert_eq!(flag_of(SsdArgs { qd: 0, ..args() }), "--qd");
        assert_eq!(flag_of(SsdArgs { qd: 4096, block_size: 4 << 20, ..args() }), "--qd");
        assert_eq!(flag_of(SsdArgs { duration: Duration::ZERO, ..args() }), "--duration");
        assert_eq!(flag_of(SsdArgs { file_size: 60 << 10, ..args() }), "--file-size");
        let exact = SsdArgs { file_size: 64 << 10, ..args() };
        assert!(check(&exact).is_ok());
        assert!(check(&SsdArgs { mode: SsdMode::Write, ..exact }).is_ok());
    }
}
