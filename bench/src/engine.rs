//! The sluice side of every case: the agent's own engine (`sluice_stage`, `Archiver`, its
//! upload pipeline for compression too), run in this process exactly as `sluiced` runs it — same
//! code, same default tunables, integrity checks on — one operation per process, so the orchestrator measures it like
//! any peer tool (wall time, and CPU of the process tree from `wait`'s rusage).

use anyhow::{Context, Result, bail};
use sluice_archive::{ArchiveConfig, ArchiveProgress, Archiver, JobMeta, open_archive};
use sluice_core::config::Config;
use sluice_core::safefs::Owner;
use sluice_stage::{self as stage, Progress, StageCtx};
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// `KEY='value'` lines of the test cluster's env file (`tests/harness/cluster.sh up` writes it).
pub fn read_env(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "reading {} (bring the test cluster up: tests/harness/cluster.sh up)",
            path.display()
        )
    })?;
    Ok(text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_string(),
                v.trim().trim_matches('\'').to_string(),
            )
        })
        .collect())
}

/// The agent configuration of the benchmark node: the cluster's Garage and Azurite as store
/// profiles, and every tunable at the agent's defaults (what an admin gets without tuning).
pub fn agent_config(env: &BTreeMap<String, String>, root: &Path) -> Result<Config> {
    let v = |k: &str| {
        env.get(k)
            .cloned()
            .with_context(|| format!("the cluster env file has no {k}"))
    };
    let text = format!(
        "[agent]\nsocket = '{r}/agent.sock'\nstate_dir = '{r}/state'\n[hot_tier]\nroot = '{r}/hot'\n\
         [[store]]\nprefix = 's3://'\nendpoint = '{}'\nregion = '{}'\naccess_key_id = '{}'\n\
         secret_access_key = '{}'\nallow_http = true\n[[store]]\nprefix = 'az://'\nuse_emulator = true\n",
        v("SLUICE_TEST_S3_ENDPOINT")?,
        v("SLUICE_TEST_S3_REGION")?,
        v("SLUICE_TEST_S3_KEY_ID")?,
        v("SLUICE_TEST_S3_SECRET")?,
        r = root.display()
    );
    // For experiments only (bench/run never sets it): extra agent TOML, e.g. "[stage]\nconcurrency = 32".
    let extra = std::env::var("SLUICE_BENCH_AGENT_TOML").unwrap_or_default();
    let text = format!("{text}\n{extra}\n");
    Config::parse(&text, "n1", sluice_archive::upload_memory)
        .map_err(|e| anyhow::anyhow!("agent config: {e}"))
}

/// The tunables in force, for the report.
pub fn describe_defaults(cfg: &Config) -> String {
    let a = ArchiveConfig::default();
    format!(
        "stage concurrency {}, part {} MiB, memory {} MiB; archive part {} MiB, concurrency {}, zstd level {}, chunk {} MiB, {} compress thread(s)",
        cfg.stage.concurrency,
        cfg.stage.part_size >> 20,
        cfg.stage.memory >> 20,
        cfg.ckpt.part_size >> 20,
        cfg.ckpt.concurrency,
        cfg.ckpt.zstd_level,
        a.chunk_size >> 20,
        a.compress_threads
    )
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    // As sluiced builds its runtime.
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn open_dir(path: &Path) -> Result<Arc<OwnedFd>> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(Arc::new(f.into()))
}

/// Reads a line of /proc/self/status in KiB (VmHWM, VmRSS).
pub fn proc_status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

pub struct StageJob {
    pub env: PathBuf,
    pub root: PathBuf,
    /// The job's stage directory (exists, empty, owned by the job user).
    pub stage_dir: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub user: String,
    /// `sluiced`, for POSIX sources (the copy-as-user helper).
    pub helper: PathBuf,
    /// `NAME=URL` entries, as `--stage-in` takes them.
    pub sources: Vec<String>,
}

async fn run_stage(job: &StageJob, cfg: Arc<Config>) -> Result<(u64, u64)> {
    let specs = job
        .sources
        .iter()
        .map(|s| {
            sluice_proto::options::parse_stage_entry(s).map_err(|e| anyhow::anyhow!("{s}: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let ctx = StageCtx {
        cfg: cfg.clone(),
        owner: Owner {
            uid: job.uid,
            gid: job.gid,
        },
        user: job.user.clone(),
        stage_path: job.stage_dir.clone(),
        stage_fd: open_dir(&job.stage_dir)?,
        helper_exe: job.helper.clone(),
        cancel: CancellationToken::new(),
        // As the agent: one budget for the node (this process), from the agent's defaults.
        budget: stage::Budget::new(&cfg.stage),
        shared_tier: None,
        // The in-process cases measure staging from the origin; the cache case runs real jobs.
        cache: None,
        resume: None,
    };
    let progress: Vec<Arc<Progress>> = specs.iter().map(|s| Arc::new(Progress::new(s))).collect();
    futures::future::try_join_all(
        specs
            .iter()
            .zip(&progress)
            .map(|(spec, p)| stage::stage(&ctx, spec, p.clone())),
    )
    .await?;
    Ok(progress.iter().fold((0, 0), |(f, b), p| {
        let s = p.snapshot();
        (f + s.files_done, b + s.bytes_done)
    }))
}

pub fn stage(job: StageJob) -> Result<()> {
    let env = read_env(&job.env)?;
    let cfg = Arc::new(agent_config(&env, &job.root)?);
    let t = Instant::now();
    let (files, bytes) = runtime()?.block_on(run_stage(&job, cfg))?;
    println!(
        "{}",
        serde_json::json!({"files": files, "bytes": bytes, "inner_wall_s": t.elapsed().as_secs_f64(),
            "vm_hwm_kib": proc_status_kib("VmHWM:")})
    );
    Ok(())
}

pub struct ArchiveJob {
    pub env: PathBuf,
    pub root: PathBuf,
    pub url: String,
    pub tag: String,
    pub dir: PathBuf,
    pub uid: u32,
    pub user: String,
}

async fn run_archive(job: &ArchiveJob, cfg: &Config) -> Result<(u64, u64, u64)> {
    let archiver = open_archive(cfg, &job.url)?;
    let progress = ArchiveProgress::default();
    archiver
        .upload_part(
            &job.tag,
            "n1",
            open_dir(&job.dir)?,
            job.uid,
            &progress,
            None,
        )
        .await?;
    let meta = JobMeta {
        job_id: 1,
        user: job.user.clone(),
        job_name: "sluice-bench".into(),
    };
    let Some(m) = archiver
        .try_publish(&job.tag, &["n1".into()], meta)
        .await?
        .into_manifest()
    else {
        bail!("checkpoint {} was not published", job.tag);
    };
    Ok((m.files.len() as u64, m.raw_bytes, m.stored_bytes))
}

pub fn archive(job: ArchiveJob) -> Result<()> {
    let env = read_env(&job.env)?;
    let cfg = agent_config(&env, &job.root)?;
    let t = Instant::now();
    let (files, raw, stored) = runtime()?.block_on(run_archive(&job, &cfg))?;
    println!(
        "{}",
        serde_json::json!({"files": files, "raw_bytes": raw, "stored_bytes": stored,
            "inner_wall_s": t.elapsed().as_secs_f64(), "vm_hwm_kib": proc_status_kib("VmHWM:")})
    );
    Ok(())
}

pub struct RestoreJob {
    pub env: PathBuf,
    pub root: PathBuf,
    pub url: String,
    pub tag: String,
    /// Exists, empty, owned by the job user.
    pub dest: PathBuf,
    pub uid: u32,
    pub gid: u32,
}

pub fn restore(job: RestoreJob) -> Result<()> {
    let env = read_env(&job.env)?;
    let cfg = agent_config(&env, &job.root)?;
    let t = Instant::now();
    let m = runtime()?.block_on(async {
        let archiver = open_archive(&cfg, &job.url)?;
        let owner = Owner {
            uid: job.uid,
            gid: job.gid,
        };
        Ok::<_, anyhow::Error>(
            archiver
                .restore(
                    &job.tag,
                    open_dir(&job.dest)?,
                    owner,
                    &ArchiveProgress::default(),
                )
                .await?,
        )
    })?;
    println!(
        "{}",
        serde_json::json!({"files": m.files.len(), "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes,
            "inner_wall_s": t.elapsed().as_secs_f64(), "vm_hwm_kib": proc_status_kib("VmHWM:")})
    );
    Ok(())
}

/// Staging and archiving at once in one process, as one agent does for two jobs on a node; reports
/// the process' peak RSS (VmHWM).
pub fn rss(stage_job: StageJob, archive_job: ArchiveJob) -> Result<()> {
    let env = read_env(&stage_job.env)?;
    let cfg = Arc::new(agent_config(&env, &stage_job.root)?);
    let rt = runtime()?;
    let base_kib = proc_status_kib("VmRSS:");
    let t = Instant::now();
    let ((staged, archived), samples) = rt.block_on(async {
        // Sample VmRSS while both run, for the profile of the peak.
        let stop = CancellationToken::new();
        let sampler = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while !stop.is_cancelled() {
                    samples.push(proc_status_kib("VmRSS:"));
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                samples
            })
        };
        let r = futures::future::try_join(
            run_stage(&stage_job, cfg.clone()),
            run_archive(&archive_job, &cfg),
        )
        .await;
        stop.cancel();
        let samples = sampler.await.unwrap_or_default();
        r.map(|r| (r, samples))
    })?;
    let hwm = proc_status_kib("VmHWM:");
    println!(
        "{}",
        serde_json::json!({"staged_files": staged.0, "staged_bytes": staged.1,
            "archived_raw_bytes": archived.1, "archived_stored_bytes": archived.2,
            "vm_hwm_kib": hwm, "baseline_rss_kib": base_kib,
            "rss_samples_kib": samples, "inner_wall_s": t.elapsed().as_secs_f64()})
    );
    Ok(())
}

/// Compresses one file through the archive's own upload pipeline (`Archiver::upload_part` with the
/// default tunables: sample → transform choice, a reader, `compress_threads` encoders that hash and
/// encode, part buffers), into a `file://` store next to `output`; the file's data object then
/// becomes `output`. `input` must be alone in its directory (the archive takes a directory, and
/// refuses hard links). Prints the stored size and the file's BLAKE3 from the part manifest.
pub fn compress(input: &Path, output: &Path, threads: Option<usize>, level: i32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let t = Instant::now();
    let defaults = ArchiveConfig::default();
    let cfg = ArchiveConfig {
        compress_threads: threads.unwrap_or(defaults.compress_threads).max(1),
        zstd_level: level,
        ..defaults
    };
    let threads = cfg.compress_threads;
    let src = input.parent().context("the input has no directory")?;
    let name = input.file_name().context("the input has no file name")?;
    let others: Vec<_> = std::fs::read_dir(src)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != name)
        .map(|e| e.path())
        .collect();
    if !others.is_empty() {
        bail!(
            "{} must be alone in its directory, which also holds {:?}",
            input.display(),
            others
        );
    }
    let uid = std::fs::metadata(input)?.uid();
    let store_dir = output.with_extension("store");
    let _ = std::fs::remove_dir_all(&store_dir);
    std::fs::create_dir_all(&store_dir)?;
    let store = object_store::local::LocalFileSystem::new_with_prefix(&store_dir)?;
    let archiver = Archiver::new(Arc::new(store), "", cfg)?;
    let part = runtime()?.block_on(archiver.upload_part(
        "bench",
        "n1",
        open_dir(src)?,
        uid,
        &ArchiveProgress::default(),
        None,
    ))?;
    let [f] = &part.files[..] else {
        bail!("{} archived as {} files", src.display(), part.files.len());
    };
    std::fs::rename(store_dir.join("bench/data").join(&f.path), output)?;
    std::fs::remove_dir_all(&store_dir)?;
    println!(
        "{}",
        serde_json::json!({"raw_bytes": f.size, "stored_bytes": f.stored_size, "threads": threads,
            "transform": format!("{:?}", f.compression.transform), "codec": format!("{:?}", f.compression.codec),
            "level": f.compression.level, "raw_blake3": f.blake3,
            "inner_wall_s": t.elapsed().as_secs_f64()})
    );
    Ok(())
}

/// `sluice-bench flush`: the RAM tier's flush of one checkpoint tree (`src`, e.g. on /dev/shm)
/// into `dst` on the hot tier, as the agent runs it; prints what it copied as JSON.
pub fn flush(src: &Path, dst: &Path, block: usize) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let t = Instant::now();
    let uid = std::fs::metadata(src)?.uid();
    let gid = std::fs::metadata(src)?.gid();
    let owner = sluice_core::safefs::Owner { uid, gid };
    let (s, d) = (open_dir(src)?, open_dir(dst)?);
    let done = sluice_archive::flush::flush_tree(&s, uid, &d, owner, block)?;
    println!(
        "{}",
        serde_json::json!({"files": done.files, "bytes": done.bytes, "direct": done.direct,
            "inner_wall_s": t.elapsed().as_secs_f64()})
    );
    Ok(())
}

/// `ceiling`: one file of `size` bytes written at `path` from 4 KiB-aligned host memory (as pinned
/// memory is: the blocks go to the file straight from it) through the checkpoint writer with
/// `threads` writer threads, in 64 MiB pieces as a tensor-by-tensor save writes them; timed from
/// open to close (fsync and rename included), the source filled beforehand. Checks the file's size.
pub fn ceiling(path: &Path, size: usize, threads: usize) -> Result<()> {
    use sluice_writer::file::{AlignedWriter, Options};
    let mut source = sluice_core::iobuf::AlignedBuf::new(size);
    for (i, b) in source.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761) as u8;
    }
    let t = Instant::now();
    let mut w = AlignedWriter::open(
        path,
        Options {
            block_size: 0,
            threads,
        },
    )?;
    let (direct, used) = (w.is_direct(), w.threads());
    for piece in source.as_slice()[..size].chunks(64 << 20) {
        w.write(piece)?;
    }
    w.close()?;
    let secs = t.elapsed().as_secs_f64();
    let written = std::fs::metadata(path)?.len();
    anyhow::ensure!(
        written == size as u64,
        "{} holds {written} bytes, {size} were written",
        path.display()
    );
    println!(
        "{}",
        serde_json::json!({"bytes": size, "direct": direct, "threads": used, "inner_wall_s": secs})
    );
    Ok(())
}
