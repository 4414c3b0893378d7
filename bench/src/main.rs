//! `sluice-bench`: the benchmark driver behind `bench/run`.
//!
//! - `run`: the orchestrator (data, cases, table, JSON); see `run.rs`.
//! - `stage`, `archive`, `restore`, `rss`, `compress`: one sluice operation each, through the agent's
//!   own engine, so the orchestrator can measure it like any other command (`engine.rs`).

mod aggregation;
mod cache;
mod ceiling;
mod cluster;
mod data;
mod engine;
mod measure;
mod ramtier;
mod replicas;
mod run;
mod scale;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "sluice-bench",
    about = "sluice benchmark driver (use bench/run)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Common {
    /// The test cluster's env file (endpoints and keys).
    #[arg(long, default_value = "/run/sluice-test/env")]
    env: PathBuf,
    /// The benchmark's working directory (data, hot tier, caches).
    #[arg(long, default_value = "/var/lib/sluice-bench")]
    root: PathBuf,
}

/// One operation on behalf of a job user.
#[derive(clap::Args, Clone)]
struct Job {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    who: sluice_stage::copy_as_user::JobUser,
}

/// What to stage, and how.
#[derive(clap::Args, Clone)]
struct Staging {
    #[arg(long)]
    stage_dir: PathBuf,
    /// sluiced (the copy-as-user helper for POSIX sources).
    #[arg(long)]
    helper: PathBuf,
    /// NAME=URL, as --stage-in takes it; repeatable.
    #[arg(long = "source", required = true)]
    sources: Vec<String>,
}

/// Which checkpoint to archive, and where.
#[derive(clap::Args, Clone)]
struct Archiving {
    #[arg(long)]
    url: String,
    #[arg(long)]
    tag: String,
    #[arg(long)]
    dir: PathBuf,
}

/// `sluice-bench run`'s options (bench/run passes them).
#[derive(clap::Args)]
struct RunOpts {
    #[command(flatten)]
    common: Common,
    /// The repository (for the commit in the JSON).
    #[arg(long, default_value = ".")]
    repo: PathBuf,
    #[arg(long)]
    out: Option<PathBuf>,
    /// Downloads kept across runs (the model package).
    #[arg(long, default_value = "/var/lib/sluice-bench/cache")]
    cache: PathBuf,
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Tiny data, for the test command.
    #[arg(long)]
    smoke: bool,
    /// The full sizes (2 GiB objects, 1 GiB compression inputs, 4 GiB staged for RSS).
    #[arg(long)]
    full: bool,
    #[arg(long)]
    sluiced: PathBuf,
    #[arg(long)]
    rclone: PathBuf,
    #[arg(long, default_value = "sluiceuser")]
    user: String,
    /// Only these cases (comma-separated): s3, az, posix, ckpt, compress, job, rss, agg, cache, flush,
    /// writer, commit, ceiling, replicas, scale; one part of agg alone: agg.origin, agg.paced, agg.rss.
    #[arg(long, value_delimiter = ',')]
    cases: Option<Vec<String>>,
    #[arg(long, default_value = "/etc/slurm/plugstack.conf")]
    plugstack: PathBuf,
    /// Which build this is (for the report).
    #[arg(long, default_value = "release")]
    build: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the benchmark.
    Run(RunOpts),
    /// Stage datasets into a stage directory with the agent's staging code.
    Stage {
        #[command(flatten)]
        job: Job,
        #[command(flatten)]
        staging: Staging,
    },
    /// Archive a checkpoint directory as one node's part, and publish it.
    Archive {
        #[command(flatten)]
        job: Job,
        #[command(flatten)]
        archiving: Archiving,
    },
    /// Restore a checkpoint into an empty directory.
    Restore {
        #[arg(long)]
        url: String,
        #[arg(long)]
        tag: String,
        #[arg(long)]
        dest: PathBuf,
        #[command(flatten)]
        job: Job,
    },
    /// Stage and archive at once; report peak RSS.
    Rss {
        #[command(flatten)]
        job: Job,
        #[command(flatten)]
        staging: Staging,
        #[command(flatten)]
        archiving: Archiving,
    },
    /// Flush a checkpoint tree as the RAM tier does (sluice_archive::flush: aligned buffers,
    /// O_DIRECT, verified) from --src into --dst, an empty directory.
    Flush {
        #[arg(long)]
        src: PathBuf,
        #[arg(long)]
        dst: PathBuf,
        #[arg(long, default_value_t = 8 << 20)]
        block: usize,
    },
    /// Write one file of --size bytes at --path from 4 KiB-aligned host memory through the
    /// checkpoint writer (AlignedWriter) with --threads writer threads, open to close; prints the
    /// time of that alone (the source is filled beforehand).
    Ceiling {
        #[arg(long)]
        path: PathBuf,
        #[arg(long)]
        size: usize,
        #[arg(long)]
        threads: usize,
    },
    /// Print the table of result files (merging runs of different --cases).
    Table { files: Vec<PathBuf> },
    /// Compress one file through the archive's upload pipeline (the file must be alone in its
    /// directory).
    Compress {
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        output: PathBuf,
        /// Default: the archive's compress_threads.
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long, default_value_t = 1)]
        level: i32,
    },
}

fn main() -> ExitCode {
    match real_main() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("sluice-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<bool> {
    match Cli::parse().cmd {
        Cmd::Run(r) => {
            let mode = match (r.smoke, r.full) {
                (true, _) => run::Mode::Smoke,
                (false, true) => run::Mode::Full,
                _ => run::Mode::Scaled,
            };
            let args = run::Args {
                env: r.common.env,
                root: r.common.root,
                repo: r.repo,
                out: r.out,
                cache: r.cache,
                reps: if r.smoke { 1 } else { r.reps.max(1) },
                mode,
                sluiced: r.sluiced,
                rclone: r.rclone,
                user: r.user,
                cases: r.cases,
                plugstack: r.plugstack,
                build: r.build,
            };
            run::Bench::new(args)?.run()
        }
        Cmd::Stage { job, staging } => engine::stage(stage_job(job, staging)).map(|_| true),
        Cmd::Archive { job, archiving } => {
            engine::archive(archive_job(job, archiving)).map(|_| true)
        }
        Cmd::Restore {
            url,
            tag,
            dest,
            job,
        } => engine::restore(engine::RestoreJob {
            env: job.common.env,
            root: job.common.root,
            url,
            tag,
            dest,
            uid: job.who.uid,
            gid: job.who.gid,
        })
        .map(|_| true),
        Cmd::Rss {
            job,
            staging,
            archiving,
        } => {
            let archive = archive_job(job.clone(), archiving);
            engine::rss(stage_job(job, staging), archive).map(|_| true)
        }
        Cmd::Table { files } => run::print_tables(&files).map(|_| true),
        Cmd::Flush { src, dst, block } => engine::flush(&src, &dst, block).map(|_| true),
        Cmd::Ceiling {
            path,
            size,
            threads,
        } => engine::ceiling(&path, size, threads).map(|_| true),
        Cmd::Compress {
            input,
            output,
            threads,
            level,
        } => engine::compress(&input, &output, threads, level).map(|_| true),
    }
}

fn stage_job(job: Job, staging: Staging) -> engine::StageJob {
    engine::StageJob {
        env: job.common.env,
        root: job.common.root,
        stage_dir: staging.stage_dir,
        uid: job.who.uid,
        gid: job.who.gid,
        user: job.who.user,
        helper: staging.helper,
        sources: staging.sources,
    }
}

fn archive_job(job: Job, archiving: Archiving) -> engine::ArchiveJob {
    engine::ArchiveJob {
        env: job.common.env,
        root: job.common.root,
        url: archiving.url,
        tag: archiving.tag,
        dir: archiving.dir,
        uid: job.who.uid,
        user: job.who.user,
    }
}
