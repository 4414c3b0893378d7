//! `sluiced`: the sluice agent, one per node, run as root (see docs/SECURITY.md).
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use clap_mangen::Man;
use clap_mangen::roff::{Roff, bold, roman};
use sluice_core::config;
use sluice_stage::copy_as_user;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use tokio_util::sync::CancellationToken;

/// The agent's interface: what `sluiced --help`, its man page and its completions show.
#[derive(Parser)]
#[command(
    name = "sluiced",
    version = version(),
    about = "sluice per-node agent",
    long_about = "The sluice agent: one per node, run as root and started before slurmd \
        (slurm-conf/sluiced.service). It stages datasets onto the node's hot tier for the SPANK \
        plugin, archives committed checkpoints, trims the hot tier, and answers the sluice command \
        on its Unix socket (`socket` in the configuration).\n\n\
        It logs to stderr; SLUICE_LOG chooses what, as a tracing filter (default: info).",
    after_help = exit_status_help()
)]
struct Args {
    /// Configuration file.
    #[arg(long, value_name = "PATH", default_value = "/etc/sluice/sluice.toml")]
    config: PathBuf,
    /// This node's Slurm name (replaces %n in the config); default: the short host name.
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// Check the configuration and exit.
    #[arg(long)]
    check: bool,
}

/// Commands only the agent itself (`copy-as-user`) and the install steps (`generate`) run: parsed
/// apart from [`Args`], when the first argument names one, so that neither `--help`, the man page
/// nor the completions offer them (clap_complete completes even hidden subcommands).
#[derive(Parser)]
#[command(name = "sluiced")]
struct Internal {
    #[command(subcommand)]
    command: InternalCommand,
}

// Parsed once per process: the size of the largest variant costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum InternalCommand {
    /// Copy a POSIX dataset with a job user's identity (started by the agent).
    CopyAsUser(CopyAsUser),
    /// Render the man page or the shell completions.
    #[command(subcommand)]
    Generate(Generate),
}

/// `sluiced copy-as-user`'s arguments.
#[derive(clap::Args)]
struct CopyAsUser {
    #[command(flatten)]
    who: copy_as_user::JobUser,
    #[arg(long)]
    src: PathBuf,
    #[arg(long)]
    dst: PathBuf,
    #[command(flatten)]
    shard: copy_as_user::ShardArgs,
    /// Ask the agent (on stdin) which files its cache holds for this user (a whole copy).
    #[arg(long, conflicts_with = "shard_nodes")]
    cached: bool,
    /// A copy a restarted agent can resume: keep the files the agent offers on stdin whose
    /// source is unchanged, and report each file copied whole (the whole dataset, or a shard).
    #[arg(long, conflicts_with_all = ["cached", "peer_unit_size", "shared_tier"])]
    resume: bool,
}

#[derive(Subcommand)]
enum Generate {
    /// Write the man page sluiced.8 into DIR, creating it if needed, and print its path.
    Man {
        /// Where the page goes, e.g. /usr/local/share/man/man8
        dir: PathBuf,
    },
    /// Print the completion script for SHELL on stdout.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell
        shell: clap_complete::Shell,
    },
}

/// `sluiced --version`: this build, and the socket protocol it speaks (the plugin, the agent and
/// the CLI of one installation must speak the same).
fn version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        format!(
            "{} (protocol {})",
            env!("CARGO_PKG_VERSION"),
            sluice_proto::PROTO_VERSION
        )
    })
}

/// What `main` returns for the agent (`copy-as-user` has its own, read by the agent), as
/// `--help` and the man page document it. 2 is clap's, for a command line it cannot parse.
const EXIT_CODES: &[(u8, &str)] = &[
    (
        0,
        "stopped by SIGTERM or SIGINT, or --check found the configuration valid",
    ),
    (
        1,
        "failure (stderr and the log say why): a bad configuration, a socket it cannot bind, or an error that stopped the agent",
    ),
    (2, "usage error: an unknown option or a bad value"),
];

fn exit_status_help() -> String {
    let mut text = String::from("Exit status:");
    for (code, meaning) in EXIT_CODES {
        text += &format!("\n  {code}  {meaning}");
    }
    text
}

/// Runs `sluiced generate`, returning what goes to stdout.
fn generate(what: Generate) -> anyhow::Result<String> {
    let mut cmd = Args::command();
    match what {
        Generate::Man { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join("sluiced.8");
            std::fs::write(&path, man_page(cmd)?)
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(format!("{}\n", path.display()))
        }
        Generate::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "sluiced", &mut script);
            String::from_utf8(script).context("the completion script is not UTF-8")
        }
    }
}

/// clap_mangen's sections, in the order of man-pages(7), with EXIT STATUS (in place of the
/// after-help, which clap_mangen would print as "EXTRA") and SEE ALSO.
fn man_page(cmd: clap::Command) -> std::io::Result<Vec<u8>> {
    let man = Man::new(cmd);
    let mut out = Vec::new();
    // clap_mangen writes an empty date as nothing, which shifts the source and manual into the
    // date's and source's places in man's header and footer.
    writeln!(
        out,
        ".TH sluiced 8 \"\" \"sluice {}\" \"sluice manual\"",
        env!("CARGO_PKG_VERSION")
    )?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    man.render_options_section(&mut out)?;
    let mut roff = Roff::new();
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in EXIT_CODES {
        roff.control("TP", []);
        roff.text([bold(code.to_string())]);
        roff.text([roman(*meaning)]);
    }
    roff.to_writer(&mut out)?;
    man.render_version_section(&mut out)?;
    let mut roff = Roff::new();
    roff.control("SH", ["SEE ALSO"]);
    roff.text([roman("sluice(1)")]);
    roff.to_writer(&mut out)?;
    Ok(out)
}

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if is_internal(&argv) {
        return run_internal(Internal::parse_from(argv).command);
    }
    let args = Args::parse_from(argv);
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("sluiced: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether `argv` is one of [`Internal`]'s commands: its first argument names one.
fn is_internal(argv: &[std::ffi::OsString]) -> bool {
    argv.get(1).and_then(|a| a.to_str()).is_some_and(|first| {
        Internal::command()
            .get_subcommands()
            .any(|c| c.get_name() == first)
    })
}

fn run_internal(command: InternalCommand) -> ExitCode {
    match command {
        InternalCommand::CopyAsUser(CopyAsUser {
            who,
            src,
            dst,
            shard,
            cached,
            resume,
        }) => {
            if let Err(e) = copy_as_user::become_user(who.uid, who.gid, &who.user) {
                eprintln!("{e}");
                return ExitCode::from(copy_as_user::Failure::Other.exit_code());
            }
            let shard = match shard.shard() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(copy_as_user::Failure::Other.exit_code());
                }
            };
            let mut out = std::io::stdout().lock();
            let copied = match &shard {
                _ if resume => {
                    let input = std::io::stdin().lock();
                    copy_as_user::copy_tree_resumable(&src, &dst, shard.as_ref(), input, &mut out)
                }
                Some(s) => copy_as_user::copy_shard(&src, &dst, s, &mut out),
                None if cached => {
                    copy_as_user::copy_tree_cached(&src, &dst, std::io::stdin().lock(), &mut out)
                }
                None => copy_as_user::copy_tree(&src, &dst, &mut out),
            };
            match copied {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(e.failure().exit_code())
                }
            }
        }
        InternalCommand::Generate(what) => match generate(what) {
            Ok(text) => match std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("sluiced: writing to stdout: {e}");
                    ExitCode::FAILURE
                }
            },
            Err(e) => {
                eprintln!("sluiced: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let node = args.node.unwrap_or_else(config::default_node_name);
    let cfg = Arc::new(config::Config::load(
        &args.config,
        &node,
        sluice_archive::upload_memory,
    )?);
    if args.check {
        println!(
            "{}: configuration is valid for node {node}",
            args.config.display()
        );
        return Ok(());
    }
    init_logging(cfg.log_format);
    install_panic_hook();
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

/// A panic is a bug: it is logged (with where it happened) in the agent's log. One inside a job's
/// set-up fails that job with a message in its output (`sluice_core::rt::contained`); any other
/// aborts the agent, so systemd restarts it and the journal resumes its jobs — never an agent
/// that runs on with a dead task (a listener, a worker) while it looks alive.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map_or_else(String::new, |l| format!(" at {l}"));
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let backtrace = std::backtrace::Backtrace::force_capture();
        if sluice_core::rt::panic_is_contained() {
            tracing::error!("bug (the job it happened for fails): panic{at}: {what}\n{backtrace}");
        } else {
            tracing::error!("bug: panic{at}: {what}; aborting so the agent restarts\n{backtrace}");
            eprintln!("sluiced: panic{at}: {what}; aborting");
            std::process::abort();
        }
    }));
}

/// The log on stderr, as `[agent] log_format` says: text lines, or one JSON object per line (with
/// the fields of every enclosing span, so a job's lines carry its job id and user). `SLUICE_LOG`
/// chooses what, as a tracing filter (default: info).
fn init_logging(format: config::LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG").unwrap_or_else(|_| "info".into());
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        config::LogFormat::Text => log.init(),
        config::LogFormat::Json => log.json().flatten_event(true).init(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definitions_are_consistent() {
        Args::command().debug_assert();
        Internal::command().debug_assert();
    }

    #[test]
    fn the_agent_starts_copy_as_user_as_it_always_has() {
        // stage::posix runs `sluiced copy-as-user --uid --gid --user --src --dst`.
        let parsed = Internal::try_parse_from([
            "sluiced",
            "copy-as-user",
            "--uid",
            "1000",
            "--gid",
            "100",
            "--user",
            "alice",
            "--src",
            "/data/a",
            "--dst",
            "/hot/a",
        ])
        .unwrap();
        let InternalCommand::CopyAsUser(copy) = parsed.command else {
            panic!("not copy-as-user");
        };
        assert!(!copy.cached, "the cache is asked only with --cached");
        assert!(!copy.resume, "resumable only with --resume");
        let who = &copy.who;
        assert_eq!((who.uid, who.gid, who.user.as_str()), (1000, 100, "alice"));
        assert_eq!(
            (copy.src, copy.dst),
            (PathBuf::from("/data/a"), PathBuf::from("/hot/a"))
        );
        assert!(copy.shard.shard().unwrap().is_none(), "the whole dataset");
        // A shard needs all four of its arguments.
        let partial = Internal::try_parse_from([
            "sluiced",
            "copy-as-user",
            "--uid",
            "1",
            "--gid",
            "1",
            "--user",
            "a",
            "--src",
            "/s",
            "--dst",
            "/d",
            "--shard-nodes",
            "n1,n2",
        ]);
        assert!(partial.is_err());
        // It is no part of the agent's own interface, and only the first argument selects it.
        assert!(Args::try_parse_from(["sluiced", "copy-as-user"]).is_err());
        let argv = |a: &[&str]| a.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert!(is_internal(&argv(&[
            "sluiced",
            "copy-as-user",
            "--uid",
            "1"
        ])));
        assert!(is_internal(&argv(&["sluiced", "generate", "man", "/d"])));
        assert!(!is_internal(&argv(&["sluiced", "--node", "generate"])));
        assert!(!is_internal(&argv(&["sluiced"])));
    }
}
