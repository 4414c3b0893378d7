//! `sluiced`: the sluice agent, one per node, run as root (see docs/SECURITY.md).
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::{Parser, Subcommand};
use sluice_agent::stage::copy_as_user;
use sluice_archive::config;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "sluiced", version, about = "sluice per-node agent")]
struct Args {
    /// Configuration file.
    #[arg(long, default_value = "/etc/sluice/sluice.toml")]
    config: PathBuf,
    /// This node's Slurm name (replaces %n in the config); default: the short host name.
    #[arg(long)]
    node: Option<String>,
    /// Check the configuration and exit.
    #[arg(long)]
    check: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Internal: copy a POSIX dataset with a job user's identity (started by the agent).
    #[command(hide = true)]
    CopyAsUser {
        #[command(flatten)]
        who: copy_as_user::JobUser,
        #[arg(long)]
        src: PathBuf,
        #[arg(long)]
        dst: PathBuf,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::CopyAsUser { who, src, dst }) = args.command {
        if let Err(e) = copy_as_user::become_user(who.uid, who.gid, &who.user) {
            eprintln!("{e}");
            return ExitCode::from(copy_as_user::EXIT_OTHER as u8);
        }
        let mut out = std::io::stdout().lock();
        return match copy_as_user::copy_tree(&src, &dst, &mut out) {
            Ok(()) => ExitCode::SUCCESS,
            Err((code, message)) => {
                eprintln!("{message}");
                ExitCode::from(code as u8)
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("sluiced: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let node = args.node.unwrap_or_else(config::default_node_name);
    let cfg = Arc::new(config::Config::load(&args.config, &node)?);
    if args.check {
        println!(
            "{}: configuration is valid for node {node}",
            args.config.display()
        );
        return Ok(());
    }
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = bind(&cfg.socket)?;
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("shutting down");
            stop.cancel();
        });
        let ran = sluice_agent::run(cfg.clone(), listener, shutdown).await;
        let _ = std::fs::remove_file(&cfg.socket);
        Ok(ran?)
    })
}

/// Binds the agent socket, replacing a stale socket file. Mode 0666: every user may connect;
/// authorisation happens per request from the peer credentials.
fn bind(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(md) if std::os::unix::fs::FileTypeExt::is_socket(&md.file_type()) => {
            std::fs::remove_file(path)?
        }
        Ok(_) => anyhow::bail!("{} exists and is not a socket; remove it", path.display()),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// The agent holds up to the server's connection limit (1024) plus the files of concurrent stage-ins
/// and archives: raise the soft descriptor limit to the hard one (systemd's `LimitNOFILE`), since a
/// daemon started by hand or by a harness gets the default soft limit of 1024.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!("open-file limit raised from {soft} to {hard}"),
            Err(e) => tracing::warn!("cannot raise the open-file limit from {soft}: {e}"),
        },
        Ok((soft, _)) if soft < 4096 => tracing::warn!(
            "the open-file limit is {soft}; set LimitNOFILE=65536 in sluiced.service"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read the open-file limit: {e}"),
    }
}
