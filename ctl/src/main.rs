//! `orbitkv-ctl`: operator CLI for a running `orbitkv-server` (through its admin socket).

#![deny(unsafe_code)]

mod error;
mod ssd;
mod table;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use orbitkv_proto::admin::{
    AdminClient, AdminError, AdminRequest, AuditReply, EvictReply, EvictTarget, HealthReply,
    PeersReply, ServerState, SessionsReply,
};
use orbitkv_proto::{admin_socket_path, default_socket_path, parse_duration};

use crate::error::CtlError;

/// Operate a running orbitkv-server.
#[derive(Parser, Debug)]
#[command(name = "orbitkv-ctl", version, about)]
struct Cli {
    /// Server socket (default: $ORBITKV_SOCKET, /run/orbitkv/orbitkv.sock for root, else
    /// /tmp/orbitkv-<uid>/orbitkv.sock). The admin socket is `<socket>.admin`.
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Exit 0 only when the server is serving (admitting sessions and writes).
    Health {
        /// Print the answer as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Per-shard state and counters.
    Stats {
        /// Print the server's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Stop admitting new sessions and writes, wait until in-flight writes finish.
    Drain {
        /// Give up (exit 1) if not drained by then.
        #[arg(long, default_value = "30s", value_name = "DUR")]
        timeout: String,
    },
    /// Admit sessions and writes again.
    Resume,
    /// Remove chunks from every tier: one namespace's, or all. Leased chunks, and chunks
    /// being moved between tiers, stay (reported as busy).
    #[command(group(clap::ArgGroup::new("what").required(true).args(["namespace", "all"])))]
    Evict {
        /// The namespace id (decimal, or hex with 0x), as `register_namespace` returned it.
        #[arg(long, value_name = "ID", value_parser = namespace_id)]
        namespace: Option<u64>,
        /// Every chunk of every namespace.
        #[arg(long)]
        all: bool,
        /// Print the server's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Open sessions.
    Sessions {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Cluster mode: this node's membership and the members with their epochs (exit 1 when
    /// the cluster is unavailable or the server is standalone).
    Peers {
        /// Print the server's JSON.
        #[arg(long)]
        json: bool,
    },
    /// A full scan of every shard's bookkeeping against its counters (entries, arena pages,
    /// leases, reservations, the SSD log); exit 1 when anything does not add up.
    Audit {
        /// Print the server's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Offline tools for the SSD tier's files (run on a stopped server's --ssd-dir).
    Ssd {
        #[command(subcommand)]
        command: SsdCommand,
    },
}

#[derive(Subcommand, Debug)]
enum SsdCommand {
    /// Verify every record header and payload checksum; exit 1 on any corruption.
    Check {
        /// The server's --ssd-dir.
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List every live record.
    Dump {
        /// The server's --ssd-dir.
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let socket = cli.socket.unwrap_or_else(|| default_socket_path(nix::unistd::getuid().as_raw()));
    let admin = AdminClient::new(admin_socket_path(&socket));
    match run(&admin, cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("orbitkv-ctl: error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(admin: &AdminClient, command: Command) -> Result<ExitCode, CtlError> {
    match command {
        Command::Health { json } => Ok(health(admin, json)),
        Command::Stats { json } => {
            // The whole answer: the table reads many more keys than programs do.
            let v = admin.request(&AdminRequest::Stats)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v).expect("JSON values serialize"));
            } else {
                print!("{}", table::stats(&v));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Drain { timeout } => {
            let timeout = parse_duration(&timeout)
                .map_err(|source| CtlError::Flag { flag: "--timeout", source })?;
            drain(admin, timeout)
        }
        Command::Resume => {
            println!("{}", admin.resume()?.state);
            Ok(ExitCode::SUCCESS)
        }
        Command::Ssd { command: SsdCommand::Check { dir, json } } => {
            Ok(if ssd::check(&dir, json)? { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Ssd { command: SsdCommand::Dump { dir, json } } => {
            ssd::dump(&dir, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Evict { namespace, all: _, json } => evict(admin, namespace, json),
        Command::Peers { json } => peers(admin, json),
        Command::Audit { json } => audit(admin, json),
        Command::Sessions { json } => {
            let request = AdminRequest::Sessions;
            let v = admin.request(&request)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&v["sessions"]).expect("JSON values serialize")
                );
            } else {
                print!("{}", table::sessions(&admin.read::<SessionsReply>(&request, &v)?));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `audit`: 0 when every shard's scan is consistent, 1 when one is not (its problems printed).
fn audit(admin: &AdminClient, json: bool) -> Result<ExitCode, CtlError> {
    let request = AdminRequest::Audit;
    match admin.request(&request) {
        Ok(v) if json => {
            println!("{}", serde_json::to_string_pretty(&v).expect("JSON values serialize"));
            Ok(ExitCode::SUCCESS)
        }
        Ok(v) => {
            let audit: AuditReply = admin.read(&request, &v)?;
            let scans: Vec<_> = audit.shards.iter().filter_map(|s| s.answer.as_ref()).collect();
            let sum = |f: fn(&orbitkv_proto::admin::ShardAudit) -> u64| {
                scans.iter().map(|s| f(s)).sum::<u64>()
            };
            println!(
                "consistent: {} shards, {} entries, {} leases ({} lookup pins), {} reservations, \
                 {} SSD records, {} sessions",
                audit.shards.len(),
                sum(|s| s.entries),
                sum(|s| s.leases),
                sum(|s| s.pins),
                sum(|s| s.reservations),
                sum(|s| s.ssd_records),
                audit.sessions
            );
            Ok(ExitCode::SUCCESS)
        }
        // The server answered, and what it found does not add up.
        Err(AdminError::Refused { error, .. }) => {
            println!("inconsistent: {error}");
            Ok(ExitCode::from(1))
        }
        Err(e) => Err(e.into()),
    }
}

/// `health`: 0 when ready, 1 when not (or the server does not answer).
fn health(admin: &AdminClient, json: bool) -> ExitCode {
    let request = AdminRequest::Health;
    let answer =
        admin.request(&request).and_then(|v| Ok((admin.read::<HealthReply>(&request, &v)?, v)));
    let (h, v) = match answer {
        Ok(answer) => answer,
        Err(e) => {
            if json {
                println!("{}", serde_json::json!({"ready": false, "reason": e.to_string()}));
            } else {
                println!("not ready: {e}");
            }
            return ExitCode::from(1);
        }
    };
    if json {
        println!("{v}");
    } else if h.ready {
        if h.degraded.is_empty() {
            println!("ready: {}", h.state);
        } else {
            println!("ready (degraded: {})", h.degraded.join("; "));
        }
        // Cluster mode: reported apart; local work does not depend on it.
        if let Some(c) = h.cluster.as_ref().filter(|c| !c.available) {
            println!("cluster {}: {}", c.state, c.reason);
        }
    } else if h.state == ServerState::Starting {
        // e.g. "starting: populating the arena: 42% (3.4GiB of 8GiB in 2.1 s)"
        println!("starting: {}", h.reason);
    } else {
        println!("not ready: {}", h.reason);
    }
    if h.ready {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// `drain`: asks for a drain, then polls until the server is drained (0), resumed or still
/// draining at `timeout` (1).
fn drain(admin: &AdminClient, timeout: Duration) -> Result<ExitCode, CtlError> {
    let deadline = Instant::now() + timeout;
    let mut state = admin.drain()?.state;
    // Uncommitted reservations, as the last `stats` said.
    let mut reservations = 0;
    loop {
        if state == ServerState::Drained {
            println!("drained");
            return Ok(ExitCode::SUCCESS);
        }
        if state == ServerState::Serving {
            println!("not drained: the server was resumed");
            return Ok(ExitCode::from(1));
        }
        if Instant::now() >= deadline {
            println!(
                "not drained after {timeout:?}: {reservations} uncommitted reservations remain"
            );
            return Ok(ExitCode::from(1));
        }
        std::thread::sleep(Duration::from_millis(50));
        let stats = admin.stats()?;
        state = stats.state;
        reservations = stats.sum(|s| s.reservations);
    }
}

/// `peers`: exit 0 while the cluster is available, 1 otherwise.
fn peers(admin: &AdminClient, json: bool) -> Result<ExitCode, CtlError> {
    let request = AdminRequest::Peers;
    let v = admin.request(&request)?;
    let peers: PeersReply = admin.read(&request, &v)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON values serialize"));
    } else {
        print!("{}", table::peers(&peers));
    }
    Ok(if peers.cluster.available { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// `evict`: one namespace, or everything when `namespace` is None.
fn evict(admin: &AdminClient, namespace: Option<u64>, json: bool) -> Result<ExitCode, CtlError> {
    let request = AdminRequest::Evict(namespace.map_or(EvictTarget::All, EvictTarget::Namespace));
    let v = admin.request(&request)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON values serialize"));
    } else {
        let EvictReply { removed, busy, not_durable, .. } = admin.read(&request, &v)?;
        print!("removed {removed} chunks");
        if busy > 0 {
            print!(
                "; {busy} busy (leased, or being moved between tiers) stayed: evict again once \
                 they are released"
            );
        }
        if not_durable > 0 {
            print!(
                "; the SSD tier could not record the deletion of {not_durable}: they may come \
                 back after a restart (see the server log; evict again)"
            );
        }
        println!();
    }
    Ok(ExitCode::SUCCESS)
}

/// A namespace id: decimal, or hexadecimal after `0x`.
fn namespace_id(s: &str) -> Result<u64, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("{s:?} is not a namespace id (decimal, or hex after 0x): {e}"))
}
