//! `orbitkv-perf`: OrbitKV benchmarks (see `orbitkv-perf --help`).
//!
//! Exit status: 0 when the run completed and every byte read back was right, 1 when some read
//! did not verify (`serve`) or some I/O failed (`ssd`), 2 when the benchmark could not run (bad
//! flags, server unreachable, unusable directory, ...).

#![deny(unsafe_code)]

mod admin;
mod arena;
mod args;
mod barrier;
mod baseline;
mod checksum;
mod dma;
mod embedded;
mod error;
mod gate;
mod idle;
mod peer;
mod placement;
mod progress;
mod report;
mod sampler;
mod serve;
mod soak;
mod ssd;
mod stats;
mod wake;
mod worker;
mod workload;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
use crate::report::Report;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (name, outcome) = match cli.command {
        Command::Serve(a) => ("serve", serve::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Idle(a) => ("idle", idle::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Wake(a) => ("wake", wake::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Ssd(a) => ("ssd", ssd::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Dma(a) => ("dma", dma::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Checksum(a) => ("checksum", checksum::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Peer(a) => ("peer", peer::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Soak(a) => ("soak", soak::run(&a).and_then(|r| emit(&r, a.json))),
        Command::Arena(a) => ("arena", arena::run(&a).and_then(|r| emit(&r, a.json))),
        Command::SoakClient(a) => ("soak-client", soak::client(&a)),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("orbitkv-perf {name}: {e}");
            ExitCode::from(2)
        }
    }
}

fn emit(report: &impl Report, json: bool) -> Result<bool, error::Error> {
    let stdout_err =
        |source| error::Error::Io { op: "writing the report to", path: "stdout".into(), source };
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, report).map_err(|e| stdout_err(e.into()))?;
        writeln!(out).map_err(stdout_err)?;
    } else {
        report.write_table(&mut out).map_err(stdout_err)?;
    }
    out.flush().map_err(stdout_err)?;
    Ok(report.passed())
}
