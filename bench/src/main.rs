//! `sluice-bench`: the benchmark driver behind `bench/run`.
//!
//! - `run`: the orchestrator (data, cases, table, JSON); see `run.rs`.
//! - `stage`, `archive`, `restore`, `rss`, `compress`: one sluice operation each, through the agent's
//!   own engine, so the orchestrator can measure it like any other command (`engine.rs`).

mod data;
mod engine;
mod measure;
mod run;

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

#[derive(clap::Args, Clone)]
struct Job {
    #[arg(long)]
    uid: u32,
    #[arg(long)]
    gid: u32,
    #[arg(long)]
    user: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the benchmark.
    Run {
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
        /// Only these cases (comma-separated): s3, az, posix, ckpt, compress, job, rss.
        #[arg(long, value_delimiter = ',')]
        cases: Option<Vec<String>>,
        #[arg(long, default_value = "/etc/slurm/plugstack.conf")]
        plugstack: PathBuf,
        /// Which build this is (for the report).
        #[arg(long, default_value = "release")]
        build: String,
    },
    /// Stage datasets into a stage directory with the agent's staging code.
    Stage {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        stage_dir: PathBuf,
        #[command(flatten)]
        job: Job,
        /// sluiced (the copy-as-user helper for POSIX sources).
        #[arg(long)]
        helper: PathBuf,
        /// NAME=URL, as --stage-in takes it; repeatable.
        #[arg(long = "source", required = true)]
        sources: Vec<String>,
    },
    /// Archive a checkpoint directory as one node's part, and publish it.
    Archive {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        url: String,
        #[arg(long)]
        tag: String,
        #[arg(long)]
        dir: PathBuf,
        #[command(flatten)]
        job: Job,
    },
    /// Restore a checkpoint into an empty directory.
    Restore {
        #[command(flatten)]
        common: Common,
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
        common: Common,
        #[arg(long)]
        stage_dir: PathBuf,
        #[command(flatten)]
        job: Job,
        #[arg(long)]
        helper: PathBuf,
        #[arg(long = "source", required = true)]
        sources: Vec<String>,
        #[arg(long)]
        url: String,
        #[arg(long)]
        tag: String,
        #[arg(long)]
        dir: PathBuf,
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
        Cmd::Run {
            common,
            repo,
            out,
            cache,
            reps,
            smoke,
            full,
            sluiced,
            rclone,
            user,
            cases,
            plugstack,
            build,
        } => {
            let mode = match (smoke, full) {
                (true, _) => run::Mode::Smoke,
                (false, true) => run::Mode::Full,
                _ => run::Mode::Scaled,
            };
            let args = run::Args {
                env: common.env,
                root: common.root,
                repo,
                out,
                cache,
                reps: if smoke { 1 } else { reps.max(1) },
                mode,
                sluiced,
                rclone,
                user,
                cases,
                plugstack,
                build,
            };
            run::Bench::new(args)?.run()
        }
        Cmd::Stage {
            common,
            stage_dir,
            job,
            helper,
            sources,
        } => engine::stage(stage_job(common, stage_dir, job, helper, sources)).map(|_| true),
        Cmd::Archive {
            common,
            url,
            tag,
            dir,
            job,
        } => engine::archive(engine::ArchiveJob {
            env: common.env,
            root: common.root,
            url,
            tag,
            dir,
            uid: job.uid,
            user: job.user,
        })
        .map(|_| true),
        Cmd::Restore {
            common,
            url,
            tag,
            dest,
            job,
        } => engine::restore(engine::RestoreJob {
            env: common.env,
            root: common.root,
            url,
            tag,
            dest,
            uid: job.uid,
            gid: job.gid,
        })
        .map(|_| true),
        Cmd::Rss {
            common,
            stage_dir,
            job,
            helper,
            sources,
            url,
            tag,
            dir,
        } => {
            let archive = engine::ArchiveJob {
                env: common.env.clone(),
                root: common.root.clone(),
                url,
                tag,
                dir,
                uid: job.uid,
                user: job.user.clone(),
            };
            engine::rss(stage_job(common, stage_dir, job, helper, sources), archive).map(|_| true)
        }
        Cmd::Table { files } => run::print_tables(&files).map(|_| true),
        Cmd::Compress {
            input,
            output,
            threads,
            level,
        } => engine::compress(&input, &output, threads, level).map(|_| true),
    }
}

fn stage_job(
    common: Common,
    stage_dir: PathBuf,
    job: Job,
    helper: PathBuf,
    sources: Vec<String>,
) -> engine::StageJob {
    engine::StageJob {
        env: common.env,
        root: common.root,
        stage_dir,
        uid: job.uid,
        gid: job.gid,
        user: job.user,
        helper,
        sources,
    }
}
