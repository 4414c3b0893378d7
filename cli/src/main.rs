//! `sluice`: the command line for users (how is my job's staging going? commit my checkpoint) and
//! admins (what is this node's agent doing? what is in this archive, or in this node's cache?). It
//! talks to the node's agent over its Unix socket through the blocking client of `sluice-proto`;
//! the agent decides what the caller may see from the socket's peer credentials, so the CLI needs
//! no privileges of its own.
//! `sluice ckpt list|verify|restore URL` open archives directly with the agent's archive engine,
//! with the caller's own access to the store (and to the agent's configuration); a user who may
//! not read that configuration is served by the node's agent instead, which shows them only their
//! own checkpoints ([`ckpt::route`], [`remote`]).
#![forbid(unsafe_code)]

mod agent;
mod cache;
mod ckpt;
mod doctor;
#[cfg(test)]
mod fixtures;
mod generate;
mod progress;
mod remote;
mod render;
mod socket;

use agent::Agent;
use clap::{Args, CommandFactory, Parser, Subcommand};
use sluice_core::safefs::Owner;
use sluice_proto::msg::JobId;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version = version(),
    about = "Stage datasets and checkpoints around Slurm jobs",
    after_help = generate::exit_status_help(EXIT_CODES),
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

/// One variant per command. Planned next to these, under the same global options: `trim`.
/// (`sluice generate`, for the install steps, is parsed apart: see [`generate`].)
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
    /// Checkpoints: commit one from a job, list a job's or an archive's, verify and restore archived ones
    #[command(subcommand)]
    Ckpt(CkptCommand),
    /// This node's cross-job cache, for admins (root): list, stats, warm, evict
    #[command(subcommand)]
    Cache(CacheCommand),
    /// Check this node's sluice set-up: config, agent, Slurm plugin, hot tier, stores, squeue.
    ///
    /// Prints PASS, WARN or FAIL per check with what it found and, unless it passed, the fix.
    /// Run it as root (the config is root's). Exits 1 when a check fails (warnings do not).
    Doctor {
        /// The agent's configuration
        #[arg(long, value_name = "PATH", default_value = "/etc/sluice/sluice.toml")]
        config: PathBuf,
        /// This node's name, for %n in the configuration [default: the short hostname]
        #[arg(long, value_name = "NAME")]
        node: Option<String>,
        /// Slurm's plugstack file [default: PlugStackConfig, else /etc/slurm/plugstack.conf]
        #[arg(long, value_name = "PATH")]
        plugstack: Option<PathBuf>,
        /// Print the checks as JSON: [{check, status, detail, fix}] (stable for scripts)
        #[arg(long)]
        json: bool,
    },
    /// The agent's configuration file
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validate FILE as the agent does, and summarise it; exits 1 with the error when it is invalid
    Check {
        /// The configuration file
        file: PathBuf,
        /// The node to read it for (%n) [default: the short hostname]
        #[arg(long, value_name = "NAME")]
        node: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum CacheCommand {
    /// The cache's entries, least recently used (the next to be evicted) first, under a header
    /// with its size and hit ratio
    List {
        /// Only the entries whose source URL starts with PREFIX, e.g. s3://datasets/imagenet/
        prefix: Option<String>,
        /// Print the agent's answer as JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
    /// The cache's size, watermarks and counters since the agent started: hits, misses, hit
    /// ratio, bytes served from the cache (the origin traffic it saved), filled, evicted
    Stats {
        /// Print JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
    /// Put the dataset at URL into this node's cache, as a job staging it would, before the jobs
    /// that read it.
    ///
    /// Waits until it is done, then prints what was cached, what was there already, and what
    /// could not be cached and why. With --nodes, warms each listed node's cache through its own
    /// agent (this node's agent asks them over the peer port) and prints one row per node; a node
    /// that fails is reported in its row, the others are still warmed, and the exit status is 1.
    /// The answer is awaited up to 12 hours (--timeout bounds connecting and sending).
    Warm {
        /// The dataset's URL, as --stage-in names it (s3://bucket/prefix, az://..., gs://...)
        url: String,
        /// Warm these nodes instead of this one: a Slurm hostlist, e.g. gpu[01-08] (this node may
        /// be among them). Needs [peer] and its secret on every node
        #[arg(long, value_name = "HOSTLIST")]
        nodes: Option<String>,
        /// Print the agent's answer as JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
    /// Remove the entries whose source URL starts with PREFIX (or every entry, with --all).
    ///
    /// Entries a job is reading or filling right now stay, and are counted. The answer is awaited
    /// up to 10 minutes (--timeout bounds connecting and sending).
    #[command(group = clap::ArgGroup::new("what").required(true).args(["prefix", "all"]))]
    Evict {
        /// The source URL prefix, e.g. s3://datasets/imagenet/
        prefix: Option<String>,
        /// Every entry of the cache
        #[arg(long)]
        all: bool,
        /// Only say what would be removed; remove nothing
        #[arg(long)]
        dry_run: bool,
        /// Print the agent's answer as JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum CkptCommand {
    /// Mark $SLUICE_CKPT_DIR/TAG complete: the agent archives it in the background.
    ///
    /// Run it once the checkpoint's files are all written. One call on one node commits the
    /// checkpoint on every node of the job (the agents find each other's commits in the archive).
    Commit {
        /// The checkpoint: the directory $SLUICE_CKPT_DIR/TAG
        tag: String,
        /// The job [default: $SLURM_JOB_ID]
        #[arg(long, value_name = "JOBID")]
        job: Option<JobId>,
        /// Accepted for scripts that commit on every node; one node is enough either way
        #[arg(long)]
        local: bool,
    },
    /// A job's checkpoints on this node, or the checkpoints in an archive.
    ///
    /// With a URL, root (or whoever may read the agent's configuration, or gives --config) reads
    /// the archive directly and sees every checkpoint; any other user is answered by this node's
    /// agent, which reads it with the site's credentials and shows only their own checkpoints.
    List {
        /// An archive URL (s3://, az://, gs://, file:///) to read directly instead of asking the agent
        url: Option<String>,
        /// The job [default: $SLURM_JOB_ID when no URL is given]
        #[arg(long, value_name = "JOBID", conflicts_with = "url")]
        job: Option<JobId>,
        /// The agent's configuration, for store profiles [default: /etc/sluice/sluice.toml]
        #[arg(long, value_name = "PATH", requires = "url")]
        config: Option<PathBuf>,
        /// Print JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
    /// Re-check an archived checkpoint against its MANIFEST: every object, chunk and file checksum.
    ///
    /// Exits 1 when a file is damaged, naming every damaged file. Shows its progress on stderr: a
    /// bar on a terminal, else a line every few seconds and a last one. Root (or whoever may read
    /// the agent's configuration, or gives --config) reads the archive directly; any other user
    /// asks this node's agent, which verifies only their own checkpoints (no progress is shown).
    Verify {
        /// The archive URL (s3://, az://, gs://, file:///)
        url: String,
        /// The checkpoint, or `latest` for the newest complete one
        tag: String,
        #[command(flatten)]
        read: ArchiveRead,
    },
    /// Restore an archived checkpoint into a directory, checking every checksum.
    ///
    /// DEST must not exist or be empty; it is created, and every file is owned, by you. With
    /// `latest`, damaged checkpoints are skipped (and named on stderr). A failed restore leaves
    /// DEST as it was; an interrupted one leaves a partial DEST to remove. Shows its progress on
    /// stderr: a bar on a terminal, else a line every few seconds and a last one. Root (or whoever
    /// may read the agent's configuration, or gives --config) reads the archive directly; any other
    /// user asks this node's agent, which restores only their own checkpoints, into the directory
    /// this command opened as them (no progress is shown).
    Restore {
        /// The archive URL (s3://, az://, gs://, file:///)
        url: String,
        /// The checkpoint, or `latest` for the newest intact one
        tag: String,
        /// Where the checkpoint's files go
        dest: PathBuf,
        #[command(flatten)]
        read: ArchiveRead,
        /// Only say what would be restored (checkpoint, files, bytes) and whether DEST would be
        /// accepted; write nothing, create nothing. Exits 1 when DEST would be refused
        #[arg(long)]
        dry_run: bool,
        /// Restore TAG even though it is poisoned (see `sluice ckpt poison`)
        #[arg(long)]
        force: bool,
    },
    /// Mark a checkpoint bad: --ckpt-restore=latest never restores it again.
    ///
    /// Inside a job, `sluice ckpt poison TAG --reason "..."` marks a checkpoint of the job (one it
    /// committed, archived yet or not, or the one it restored) at the job's archive; elsewhere,
    /// give the archive URL. The mark, beside the checkpoint's MANIFEST, records who, when and
    /// why; it is written once (a second poison keeps the first reason) and changes nothing of
    /// the checkpoint. `latest` passes over a poisoned checkpoint, naming it and the reason in the
    /// job's output; a named restore of it is refused unless forced (--ckpt-restore=TAG!, or
    /// `sluice ckpt restore --force`). Only the checkpoint's owner, or root, may poison it.
    #[command(override_usage = "sluice ckpt poison [URL] TAG --reason TEXT")]
    Poison {
        /// The archive URL (s3://, az://, gs://, file:///); leave it out inside a job
        #[arg(value_name = "URL")]
        first: String,
        /// The checkpoint
        #[arg(value_name = "TAG")]
        tag: Option<String>,
        /// Why it is bad (one line): what the next job's output shows
        #[arg(long, value_name = "TEXT")]
        reason: String,
        /// The job, without a URL [default: $SLURM_JOB_ID]
        #[arg(long, value_name = "JOBID")]
        job: Option<JobId>,
        /// The agent's configuration, for store profiles [default: /etc/sluice/sluice.toml]
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
        /// Print JSON (stable for scripts)
        #[arg(long)]
        json: bool,
    },
}

// How `ckpt verify` and `ckpt restore` read an archive and report. (Plain comments: a doc comment
// here would become the subcommands' help text.)
#[derive(Debug, Args)]
struct ArchiveRead {
    /// The agent's configuration, for store profiles [default: /etc/sluice/sluice.toml]
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Print JSON (stable for scripts)
    #[arg(long)]
    json: bool,
    /// No progress on stderr (warnings and errors are still printed)
    #[arg(long, short)]
    quiet: bool,
}

/// What a command prints on stdout, and whether it succeeded (`verify` prints its findings and
/// fails when a file is damaged).
struct Output {
    text: String,
    ok: bool,
}

impl From<String> for Output {
    fn from(text: String) -> Output {
        Output { text, ok: true }
    }
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

fn env(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name)
}

fn run(cli: Cli) -> anyhow::Result<Output> {
    let agent = || -> anyhow::Result<Agent> {
        let socket = socket::resolve(
            cli.socket.as_deref().map(|p| p.as_os_str()),
            env,
            socket::system_hostname,
        )?;
        Ok(Agent {
            socket,
            timeout: cli.timeout,
        })
    };
    Ok(match cli.command {
        Command::Status { json: true } => json(&agent()?.status()?)?.into(),
        Command::Status { json: false } => {
            render::node_status(&agent()?.status()?, SystemTime::now()).into()
        }
        Command::Job { job_id, json: true } => json(&agent()?.job(job_id)?)?.into(),
        Command::Job {
            job_id,
            json: false,
        } => render::job_detail(&agent()?.job(job_id)?, SystemTime::now()).into(),
        Command::Ckpt(c) => return run_ckpt(c, agent),
        Command::Cache(c) => {
            cache::require_admin(nix::unistd::geteuid().is_root())?;
            run_cache(c, &agent()?)?
        }
        Command::Doctor {
            config,
            node,
            plugstack,
            json: as_json,
        } => {
            let opts = doctor::Options {
                config,
                node: node.unwrap_or_else(sluice_core::config::default_node_name),
                socket: cli.socket,
                plugstack,
                timeout: cli.timeout,
            };
            let findings = doctor::run(&opts)?;
            let text = if as_json {
                json(&findings)?
            } else {
                doctor::render(&findings)
            };
            Output {
                text,
                ok: doctor::healthy(&findings),
            }
        }
        Command::Config(ConfigCommand::Check { file, node }) => {
            let node = node.unwrap_or_else(sluice_core::config::default_node_name);
            doctor::config_check(&file, &node)?.into()
        }
    })
}

fn run_cache(command: CacheCommand, agent: &Agent) -> anyhow::Result<Output> {
    let text = match command {
        CacheCommand::List { prefix, json: j } => {
            let listing = cache::list(agent, prefix.clone(), true)?;
            if j {
                json(&listing)
            } else {
                Ok(render::cache_list(&listing, prefix.as_deref()))
            }
        }
        CacheCommand::Stats { json: j } => {
            let listing = cache::list(agent, None, false)?;
            if j {
                json(&cache::StatsReport::from(listing))
            } else {
                Ok(render::cache_stats(&listing))
            }
        }
        CacheCommand::Warm {
            url,
            nodes: Some(list),
            json: j,
        } => {
            let nodes = cache::expand_nodes(&list)?;
            let rows = cache::warm_nodes(agent, url.clone(), nodes)?;
            let ok = rows.iter().all(|r| r.error.is_none());
            let text = if j {
                json(&cache::WarmedNodes { url, nodes: rows })?
            } else {
                render::cache_warmed_nodes(&url, &rows)
            };
            return Ok(Output { text, ok });
        }
        CacheCommand::Warm {
            url,
            nodes: None,
            json: j,
        } => {
            let warmed = cache::warm(agent, url)?;
            if j {
                json(&warmed)
            } else {
                Ok(render::cache_warmed(&warmed))
            }
        }
        CacheCommand::Evict {
            prefix,
            all: _,
            dry_run,
            json: j,
        } => {
            if prefix.as_deref() == Some("") {
                anyhow::bail!("the PREFIX is empty; to evict every entry, say --all");
            }
            // --all is the empty prefix: every URL starts with it.
            let prefix = prefix.unwrap_or_default();
            let evicted = cache::evict(agent, prefix.clone(), dry_run)?;
            if j {
                json(&evicted)
            } else {
                Ok(render::cache_evicted(&evicted, &prefix))
            }
        }
    };
    text.map(Output::from)
}

fn run_ckpt(
    command: CkptCommand,
    agent: impl FnOnce() -> anyhow::Result<Agent>,
) -> anyhow::Result<Output> {
    match command {
        CkptCommand::Commit { tag, job, local: _ } => {
            let job_id = ckpt::job_id(job, env, "")?;
            ckpt::check_tag(&tag)?;
            let agent = agent()?;
            agent.ckpt_commit(job_id, &tag)?;
            // Only to say where it goes, and what the user must know about the job's other
            // checkpoints (refused, given up): the commit is done whatever this answers.
            let ckpts = agent.ckpt_list(job_id).unwrap_or_default();
            for problem in ckpts.iter().filter_map(|c| c.problem()) {
                eprintln!("sluice: {problem}");
            }
            let url = ckpt::archive_url_of(&ckpts, &tag);
            let node = ckpt::node_name(env, socket::system_hostname);
            Ok(render::committed(&tag, job_id, node.as_deref(), url.as_deref()).into())
        }
        CkptCommand::List {
            url: None,
            job,
            json: as_json,
            ..
        } => {
            let job_id = ckpt::job_id(job, env, " or give an archive URL")?;
            let ckpts = agent()?.ckpt_list(job_id)?;
            Ok(if as_json {
                json(&ckpt::JobListing { job_id, ckpts })?
            } else {
                render::job_ckpts(job_id, &ckpts)
            }
            .into())
        }
        CkptCommand::List {
            url: Some(url),
            config,
            json: as_json,
            ..
        } => {
            let listing = match route(config.as_deref()) {
                ckpt::Route::Agent => remote::list(&agent()?, &url)?,
                ckpt::Route::Direct => {
                    let archiver = open_archive(config, &url)?;
                    ckpt::runtime()?.block_on(ckpt::list(&archiver))?
                }
            };
            Ok(if as_json {
                json(&listing)?
            } else {
                render::archive_ckpts(&listing.url, &listing.ckpts)
            }
            .into())
        }
        CkptCommand::Verify {
            url,
            tag,
            read:
                ArchiveRead {
                    config,
                    json: as_json,
                    quiet,
                },
        } => {
            let verified = match route(config.as_deref()) {
                ckpt::Route::Agent => {
                    if tag != ckpt::LATEST {
                        ckpt::check_tag(&tag)?;
                    }
                    remote::verify(&agent()?, &url, &tag)?
                }
                ckpt::Route::Direct => {
                    let archiver = open_archive(config, &url)?;
                    let progress = progress::Mode::for_stderr(quiet);
                    ckpt::runtime()?.block_on(ckpt::verify(&archiver, &tag, progress))?
                }
            };
            let text = if as_json {
                json(&verified)?
            } else {
                render::verify(&verified)
            };
            Ok(Output {
                text,
                ok: verified.ok,
            })
        }
        CkptCommand::Restore {
            url,
            tag,
            dest,
            read:
                ArchiveRead {
                    config,
                    json: as_json,
                    quiet,
                },
            dry_run,
            force,
        } => {
            if tag != ckpt::LATEST {
                ckpt::check_tag(&tag)?;
            }
            let which = (tag.as_str(), force);
            let owner = Owner {
                uid: nix::unistd::geteuid().as_raw(),
                gid: nix::unistd::getegid().as_raw(),
            };
            if route(config.as_deref()) == ckpt::Route::Agent {
                let agent = agent()?;
                if dry_run {
                    let plan = remote::plan_restore(&agent, &url, which, &dest, owner.uid)?;
                    return restore_plan(&plan, as_json);
                }
                let dest = ckpt::prepare_dest(&dest, owner)?;
                let restored = remote::restore(&agent, &url, which, &dest)?;
                return restored_output(&restored, as_json);
            }
            let archiver = open_archive(config, &url)?;
            let rt = ckpt::runtime()?;
            if dry_run {
                let plan = rt.block_on(ckpt::plan_restore(&archiver, which, &dest, owner.uid))?;
                return restore_plan(&plan, as_json);
            }
            let dest = ckpt::prepare_dest(&dest, owner)?;
            let note = |n: &str| eprintln!("sluice: {n}");
            let progress = progress::Mode::for_stderr(quiet);
            // The archive's errors name the checkpoint and the archive.
            let restored = rt.block_on(ckpt::restore(&archiver, which, &dest, note, progress))?;
            restored_output(&restored, as_json)
        }
        CkptCommand::Poison {
            first,
            tag,
            reason,
            job,
            config,
            json: as_json,
        } => {
            let (url, tag) = match tag {
                Some(tag) => (Some(first), tag),
                None => (None, first),
            };
            if tag == ckpt::LATEST {
                anyhow::bail!(
                    "name the checkpoint to poison (a tag such as step-100), not 'latest': which one is newest may change under you"
                );
            }
            ckpt::check_tag(&tag)?;
            let reason = reason.trim();
            sluice_archive::poison::check_reason(reason).map_err(|e| anyhow::anyhow!(e))?;
            let poisoned = match url {
                None => {
                    let job_id = ckpt::job_id(job, env, " or give the archive URL")?;
                    agent()?.ckpt_poison(job_id, &tag, reason)?
                }
                Some(url) => match route(config.as_deref()) {
                    ckpt::Route::Agent => remote::poison(&agent()?, &url, &tag, reason)?,
                    ckpt::Route::Direct => {
                        let archiver = open_archive(config, &url)?;
                        ckpt::runtime()?.block_on(ckpt::poison(&archiver, &tag, reason))?
                    }
                },
            };
            Ok(if as_json {
                json(&poisoned)?
            } else {
                render::poisoned(&poisoned)
            }
            .into())
        }
    }
}

/// What `ckpt restore --dry-run` prints; it fails when DEST would be refused.
fn restore_plan(plan: &ckpt::RestorePlan, as_json: bool) -> anyhow::Result<Output> {
    Ok(Output {
        text: if as_json {
            json(plan)?
        } else {
            render::restore_plan(plan)
        },
        ok: !matches!(plan.dest_check, ckpt::DestCheck::Refused { .. }),
    })
}

/// What `ckpt restore` prints once the checkpoint is restored.
fn restored_output(restored: &ckpt::Restored, as_json: bool) -> anyhow::Result<Output> {
    Ok(if as_json {
        json(restored)?
    } else {
        render::restored(restored)
    }
    .into())
}

/// Whether `ckpt list|verify|restore URL` reads the archive itself or asks the agent
/// ([`ckpt::route`]).
fn route(config: Option<&std::path::Path>) -> ckpt::Route {
    let is_root = nix::unistd::geteuid().is_root();
    ckpt::route(config, is_root, |p| std::fs::File::open(p).map(drop))
}

/// Opens an archive by URL with the agent's configuration (see [`ckpt::load_config`]).
fn open_archive(config: Option<PathBuf>, url: &str) -> anyhow::Result<sluice_archive::Archiver> {
    let node = sluice_core::config::default_node_name();
    let (cfg, note) = ckpt::load_config(config.as_deref(), url, &node)?;
    if let Some(note) = note {
        eprintln!("sluice: {note}");
    }
    Ok(sluice_archive::access::open(&cfg, url)?)
}

/// `sluice --version`: this build, and the socket protocol it speaks (the plugin, the agent and the
/// CLI of one installation must speak the same).
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

/// What `main` returns, as `sluice --help` and the man pages document it. 2 is clap's, for a
/// command line it cannot parse.
const EXIT_CODES: generate::ExitCodes = &[
    (0, "success"),
    (
        1,
        "failure (stderr says why): a request failed or was refused, or ckpt verify found a damaged file",
    ),
    (
        2,
        "usage error: an unknown command or option, or a bad value",
    ),
];

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if generate::is_internal(&args) {
        let generate::InternalCommand::Generate(what) =
            generate::Internal::parse_from(args).command;
        let manual = generate::Manual {
            section: "1",
            manual: "sluice manual",
            source: format!("sluice {}", env!("CARGO_PKG_VERSION")),
            exit_codes: EXIT_CODES,
        };
        return finish(generate::run(what, Cli::command(), &manual).map(Output::from));
    }
    finish(run(Cli::parse_from(args)))
}

/// Prints what a command produced, or its error, and says how it went in the exit status.
fn finish(result: anyhow::Result<Output>) -> ExitCode {
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            eprintln!("sluice: {}", render::error_text(&e));
            return ExitCode::FAILURE;
        }
    };
    let status = if out.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    };
    match io::stdout().lock().write_all(out.text.as_bytes()) {
        Ok(()) => status,
        // `sluice status | head`: the reader has what it wanted.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => status,
        Err(e) => {
            eprintln!("sluice: writing to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
