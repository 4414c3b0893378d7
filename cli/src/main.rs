//! `sluice`: the command line for users (how is my job's staging going?) and admins (what is this
//! node's agent doing?). It talks to the node's agent over its Unix socket through the blocking
//! client of `sluice-proto`; the agent decides what the caller may see from the socket's peer
//! credentials, so the CLI needs no privileges of its own.
#![forbid(unsafe_code)]

mod agent;
#[cfg(test)]
mod fixtures;
mod render;
mod socket;

use agent::Agent;
use clap::{Parser, Subcommand};
use sluice_proto::msg::JobId;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "Stage datasets and checkpoints around Slurm jobs",
    max_term_width = 100
)]
struct Cli {
    /// The agent's socket; %n is replaced by this node's name
    /// [default: $SLUICE_SOCKET, else /run/sluice/%n.sock, %n = $SLURMD_NODENAME or the short hostname]
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,

    /// Seconds to wait for the agent (each of connect, send and answer)
    #[arg(long, global = true, value_name = "SECS", default_value = "10", value_parser = parse_timeout)]
    timeout: Duration,

    #[command(subcommand)]
    command: Command,
}

/// One variant per command. Planned next to these, under the same global options: `ckpt commit|list|
/// restore|verify`, `cache`, `trim`, `doctor`, `config check`.
#[derive(Debug, Subcommand)]
enum Command {
    /// This node's agent: hot tier, and the jobs you may see with their staging progress
    Status {
        /// Print the agent's answer as JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
    /// One job on this node in detail, with every dataset
    Job {
        /// The Slurm job id
        job_id: JobId,
        /// Print the agent's answer as JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!("{s}: give a timeout above 0 seconds"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s}: too many seconds"))
}

fn json<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

fn run(cli: Cli) -> anyhow::Result<String> {
    let socket = socket::resolve(
        cli.socket.as_deref().map(|p| p.as_os_str()),
        |name| std::env::var_os(name),
        socket::system_hostname,
    )?;
    let agent = Agent {
        socket,
        timeout: cli.timeout,
    };
    match cli.command {
        Command::Status { json: true } => json(&agent.status()?),
        Command::Status { json: false } => Ok(render::node_status(&agent.status()?)),
        Command::Job { job_id, json: true } => json(&agent.job(job_id)?),
        Command::Job {
            job_id,
            json: false,
        } => Ok(render::job_detail(&agent.job(job_id)?, SystemTime::now())),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let text = match run(cli) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    match io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        // `sluice status | head`: the reader has what it wanted.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: writing to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_options_go_anywhere_and_timeouts_are_checked() {
        let cli = Cli::try_parse_from([
            "sluice",
            "job",
            "42",
            "--socket",
            "/s",
            "--timeout",
            "2.5",
            "--json",
        ])
        .unwrap();
        assert_eq!(cli.socket, Some(PathBuf::from("/s")));
        assert_eq!(cli.timeout, Duration::from_millis(2500));
        assert!(matches!(
            cli.command,
            Command::Job {
                job_id: 42,
                json: true
            }
        ));
        assert_eq!(
            Cli::try_parse_from(["sluice", "status"]).unwrap().timeout,
            Duration::from_secs(10)
        );
        for bad in ["0", "-1", "ten", "NaN", "1e30"] {
            assert!(
                Cli::try_parse_from(["sluice", "--timeout", bad, "status"]).is_err(),
                "{bad}"
            );
        }
        assert!(Cli::try_parse_from(["sluice", "job", "x"]).is_err());
    }
}
