//! `orbitkv-server`: the per-host OrbitKV Manager. The binary's `main` is [`main`]; this root
//! only composes the modules: `start` runs the server, `shard` the per-core executors,
//! `requests` what they do with requests, `control` the control plane, `gpu` the GPU service,
//! `metrics` the operators' view; the options are `orbitkv-config`'s.

#![deny(unsafe_code)]
// The stats reply is one json! object of many keys.
#![recursion_limit = "256"]

pub use orbitkv_config as config;
mod control;
mod deadline;
mod error;
mod gpu;
mod metrics;
mod placement;
mod requests;
mod shard;
mod start;

use std::process::ExitCode;

/// The server: parses the command line, runs until SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ORBITKV_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    iceoryx2::prelude::set_log_level_from_env_or(iceoryx2::prelude::LogLevel::Warn);
    // Test builds: the failpoints named in FAILPOINTS, for the process's life.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let (config, print_config) = match config::from_command_line(std::env::args_os()) {
        Ok(c) => c,
        // Usage errors, --help and --version: clap prints them and picks the exit code.
        Err(config::CommandLineError::Flags(e)) => e.exit(),
        Err(e) => return fail(&e.to_string()),
    };
    if print_config {
        print!("{}", toml::to_string(&config).expect("the config struct serializes to TOML"));
        return ExitCode::SUCCESS;
    }
    let settings = match config.validate() {
        Ok(s) => s,
        Err(e) => return fail(&e.to_string()),
    };
    #[cfg(feature = "te-python")]
    if !settings.config.etcd.is_empty() && settings.config.te_library.is_none() {
        wheel_waits_for_every_transfer();
    }
    match start::run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e.to_string()),
    }
}

/// The wheel's engine (the `te-python` route) gives up on a batch after `MC_TRANSFER_TIMEOUT`
/// seconds (30 unless set) while its transfers may still run: under an owner that is paused,
/// not dead, a read given up so could land after its slots were freed. As on the C route, a
/// batch is waited for until TE has ended every transfer of it (completed or failed): the
/// wheel reads the variable when its engine is made, so it is set here to the largest value
/// it takes (about 68 years), replacing any other.
#[cfg(feature = "te-python")]
fn wheel_waits_for_every_transfer() {
    const FOREVER: &str = "2147483647";
    let was = std::env::var("MC_TRANSFER_TIMEOUT").ok();
    if was.as_deref() != Some(FOREVER) {
        if let Some(was) = was {
            tracing::info!(
                was = %was,
                "MC_TRANSFER_TIMEOUT replaced: peer reads wait until the Transfer Engine ends them"
            );
        }
        // Called from `main` before the server starts any thread: nothing reads the
        // environment meanwhile.
        std::env::set_var("MC_TRANSFER_TIMEOUT", FOREVER);
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("orbitkv-server: error: {message}");
    ExitCode::from(2)
}
