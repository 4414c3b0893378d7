//! The RAM tier and the training-code writer (issue 13): two cases.
//!
//! `writer` (no cluster): the training-visible stall of saving one state dict (bf16 + fp32
//! tensors) with the sluice writer into a tmpfs directory (/dev/shm, standing in for a
//! `--ckpt-tier=ram` job's `$SLUICE_CKPT_DIR`), measured in one Python process with the harness's
//! PyTorch (`bench/py/writer_bench.py`, `time.perf_counter` around each call), against a plain copy
//! of the same tensors into preallocated ones in the same process (target: at most 1.1× it, for
//! the asynchronous saves — `dcp.async_save(SluiceWriter)` and `sluice_ckpt.save(async_=True)` —
//! in steady state, the 2nd and later saves of the same state dict; their first save, which
//! allocates the kept staging buffers, is its own row), and against DCP's stock `FileSystemWriter`
//! (`dcp.save` into the hot tier's file system and into /dev/shm, `dcp.async_save` into /dev/shm).
//!
//! `commit` (the cluster): real one-node `--ckpt-tier=ram --ckpt-archive=file://…` jobs of the test
//! user (`bench/py/commit_job.py`) save a checkpoint into their tmpfs and run `sluice ckpt commit`;
//! the driver polls the archive until the tag's MANIFEST is there: commit → MANIFEST, which covers
//! the agent's flush to the NVMe hot tier and the archive upload. One job per repetition.

use crate::cluster::Patience;
use crate::measure::{ensure_success, median};
use crate::run::{Bench, MIB, Mode, Report, Row, log, remove, size_label};
use anyhow::{Context, Result, anyhow, bail};
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The harness's PyTorch (tests/harness/install.sh; SLUICE_TORCH_VENV as the e2e tests read it).
const DEFAULT_TORCH_VENV: &str = "/opt/sluice-test/torch-venv";
/// The target: the stall at most 1.1× the plain copy.
const STALL_TARGET: f64 = 1.1;
/// One commit job: start, save, commit, flush, archive; looked at often, since commit → MANIFEST
/// is timed by the look that finds the MANIFEST.
const JOBS: Patience = Patience {
    limit: Duration::from_secs(600),
    every: Duration::from_millis(20),
};
/// The harness's `[fast_tier] job_share` (tests/harness/cluster.sh): a job's tmpfs.
const HARNESS_JOB_SHARE: u64 = 768 * MIB;

pub(crate) fn torch_python() -> PathBuf {
    std::env::var_os("SLUICE_TORCH_VENV")
        .map_or_else(|| DEFAULT_TORCH_VENV.into(), PathBuf::from)
        .join("bin/python")
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The state dict of the `writer` case and the checkpoint of the `commit` case.
fn ckpt_bytes(mode: Mode) -> (u64, u64) {
    match mode {
        Mode::Smoke => (256 * MIB, 256 * MIB),
        // The commit job's checkpoint must fit the harness's 768 MiB RAM-tier share.
        Mode::Scaled | Mode::Full => (1024 * MIB, 640 * MIB),
    }
}

impl Bench {
    /// The build's file next to the measured `sluiced` (bench/run builds them together).
    fn built(&self, name: &str) -> Result<PathBuf> {
        let p = self
            .a
            .sluiced
            .parent()
            .map(|d| d.join(name))
            .unwrap_or_default();
        if !p.is_file() {
            bail!(
                "no {} (bench/run builds it with -p sluice-writer -p sluice-cli)",
                p.display()
            );
        }
        Ok(p)
    }

    // ------------------------------------------------------------------------------ writer

    pub(crate) fn writer_case(&self, r: &mut Report) {
        let case = "writer: save stall";
        if let Err(e) = self.writer_rows(r) {
            r.error(case, e);
        }
        let _ = remove(Path::new("/dev/shm/sluice-bench-writer"));
        let _ = remove(&self.hot_dir().join("writer-dcp"));
    }

    fn hot_dir(&self) -> PathBuf {
        self.a.root.join("hot")
    }

    fn writer_rows(&self, r: &mut Report) -> Result<()> {
        let (bytes, _) = ckpt_bytes(self.a.mode);
        let shm = PathBuf::from("/dev/shm/sluice-bench-writer");
        let (ram, shm_dcp, hot) = (
            shm.join("ram"),
            shm.join("dcp"),
            self.hot_dir().join("writer-dcp"),
        );
        for d in [&ram, &shm_dcp, &hot] {
            remove(d)?;
            std::fs::create_dir_all(d)?;
        }
        let py = torch_python();
        let script = self.a.repo.join("bench/py/writer_bench.py");
        log(format!(
            "writer: {} state dict, {} repetition(s) of every tool in one process ({})",
            size_label(bytes),
            self.a.reps,
            py.display()
        ));
        let out = Command::new(&py)
            .arg(&script)
            .args(["--bytes", &bytes.to_string()])
            .args(["--reps", &self.a.reps.to_string()])
            .arg("--ram")
            .arg(&ram)
            .arg("--hot")
            .arg(&hot)
            .arg("--shm")
            .arg(&shm_dcp)
            .env("PYTHONPATH", self.a.repo.join("python"))
            .env("SLUICE_WRITER_LIB", self.built("libsluice_writer.so")?)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("SLURM_JOB_ID")
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {}", py.display()))?;
        ensure_success(script.display(), &out, 12, "\n")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(stdout.trim().lines().last().unwrap_or(""))
            .with_context(|| format!("writer_bench.py printed {stdout:?}"))?;
        if let Some(errs) = v["errors"].as_object() {
            for (tool, e) in errs {
                r.error(
                    &format!("writer: {tool}"),
                    anyhow!("{}", e.as_str().unwrap_or("")),
                );
            }
        }
        let secs = |tool: &str| -> Vec<f64> {
            v["seconds"][tool]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                .unwrap_or_default()
        };
        let size = format!(
            "{} ({} tensors, bf16+fp32)",
            size_label(bytes),
            v["tensors"].as_u64().unwrap_or(0)
        );
        let memcpy = secs("memcpy");
        if memcpy.is_empty() {
            bail!("no memcpy time from writer_bench.py: {v}");
        }
        let gib = bytes as f64 / crate::run::GIB;
        let env_note = format!(
            "torch {}, {} threads; {:.2} GiB/s memcpy",
            v["torch"].as_str().unwrap_or("?"),
            v["threads"],
            gib / median(&memcpy)
        );
        let row = |case: &str,
                   sluice: &[f64],
                   peer_name: &str,
                   peer: &[f64],
                   with_target: bool,
                   note: &str| {
            let (s, p) = (median(sluice), median(peer));
            let ratio = p / s;
            Row {
                case: case.into(),
                size: size.clone(),
                bytes,
                unit: "s".into(),
                sluice: s,
                peer_name: peer_name.into(),
                peer: Some(p),
                ratio: Some(ratio),
                target: if with_target {
                    format!(">= {:.2}x (<= {STALL_TARGET:.1}x)", 1.0 / STALL_TARGET)
                } else {
                    "-".into()
                },
                met: with_target.then_some(s <= STALL_TARGET * p),
                note: note.into(),
                sluice_samples: sluice.to_vec(),
                peer_samples: peer.to_vec(),
                ..Row::default()
            }
        };
        let memcpy_name = "memcpy (dst.copy_(src), same process)";
        let mut rows = Vec::new();
        // The asynchronous saves carry the target: training waits for one copy into staging
        // buffers kept from save to save; their steady state (the 2nd and later saves of the same
        // state dict) is what a training loop sees, the first save (which allocates the buffers)
        // is its own row.
        let asy = secs("sluice-async");
        let asy_first = secs("sluice-async-first");
        let save_asy = secs("sluice-save-async");
        let save_asy_first = secs("sluice-save-async-first");
        let reserved_first = secs("sluice-save-reserved-first");
        for (case, samples, with_target, note) in [
            (
                "writer: dcp.async_save(SluiceWriter) to tmpfs, blocking part, 2nd+ save",
                &asy,
                true,
                format!(
                    "until async_save returns: one copy into the kept staging buffers (the write, metadata and commit run in DCP's thread; waited for untimed); /dev/shm stands in for the RAM tier's tmpfs; {env_note}"
                ),
            ),
            (
                "writer: sluice_ckpt.save(async_=True) to tmpfs, stall, 2nd+ save",
                &save_asy,
                true,
                "until save returns: one copy into the kept staging buffers (torch.save through the aligned writer, fsync and commit in a thread; waited for untimed)".to_string(),
            ),
            (
                "writer: dcp.async_save(SluiceWriter) to tmpfs, blocking part, 1st save",
                &asy_first,
                false,
                "the process's first save: allocates and faults in the staging buffers (once per state-dict shape)".to_string(),
            ),
            (
                "writer: sluice_ckpt.save(async_=True) to tmpfs, stall, 1st save",
                &save_asy_first,
                false,
                "the first save of its Stager: allocates and faults in the buffers".to_string(),
            ),
            (
                "writer: sluice_ckpt.save(async_=True) after Stager.reserve, stall, 1st save",
                &reserved_first,
                true,
                "the first save of a Stager whose buffers were reserved at set-up (allocated and faulted in by a background thread, finished before the save): the first save is one copy too".to_string(),
            ),
        ] {
            if !samples.is_empty() {
                rows.push(row(case, samples, memcpy_name, &memcpy, with_target, &note));
            }
        }
        if !reserved_first.is_empty() && !save_asy_first.is_empty() {
            rows.push(row(
                "writer: sluice_ckpt.save(async_=True) after Stager.reserve, stall, 1st save",
                &reserved_first,
                "the same without a reserve (the save allocates the buffers)",
                &save_asy_first,
                false,
                "what a reserve at set-up takes off the first save (with CUDA, pinning: about 1 s per GiB)",
            ));
        }
        let stock_async = secs("dcp-async-shm");
        if !asy.is_empty() && !stock_async.is_empty() {
            rows.push(row(
                "writer: dcp.async_save(SluiceWriter) to tmpfs, blocking part, 2nd+ save",
                &asy,
                "stock dcp.async_save(FileSystemWriter) -> /dev/shm, blocking part",
                &stock_async,
                false,
                "DCP's own staging: a fresh CPU copy at every save",
            ));
        }
        // The synchronous calls write (and fsync) before they return: what they cost, not the
        // stall a training loop that wants the target takes (it uses the asynchronous forms).
        for (key, case, note) in [
            (
                "sluice",
                "writer: dcp.save(SluiceWriter) to tmpfs, stall (synchronous)",
                "the call's time, in-process (perf_counter): serialise, write, fsync, commit before it returns",
            ),
            (
                "sluice-save",
                "writer: sluice_ckpt.save (torch.save) to tmpfs, stall (synchronous)",
                "one file through the aligned writer, fsynced, before it returns",
            ),
        ] {
            let samples = secs(key);
            if !samples.is_empty() {
                rows.push(row(case, &samples, memcpy_name, &memcpy, false, note));
            }
        }
        let sluice = secs("sluice");
        for (tool, name, note) in [
            (
                "dcp-hot",
                "DCP FileSystemWriter -> hot tier (NVMe)",
                format!(
                    "stock writer into {} (fsyncs each file)",
                    self.hot_dir().display()
                ),
            ),
            (
                "dcp-shm",
                "DCP FileSystemWriter -> /dev/shm",
                "stock writer, same tmpfs as sluice's".to_string(),
            ),
        ] {
            let peer = secs(tool);
            if !sluice.is_empty() && !peer.is_empty() {
                rows.push(row(
                    "writer: dcp.save(SluiceWriter) to tmpfs, stall (synchronous)",
                    &sluice,
                    name,
                    &peer,
                    false,
                    &note,
                ));
            }
        }
        r.rows.extend(rows);
        Ok(())
    }

    // ------------------------------------------------------------------------------ commit

    pub(crate) fn commit_case(&self, r: &mut Report) {
        let case = "commit -> MANIFEST (RAM tier job)";
        match self.commit_rows() {
            Ok(rows) => r.rows.extend(rows),
            Err(e) => r.error(case, e),
        }
    }

    fn commit_workdir(&self) -> Result<PathBuf> {
        self.job_workdir("sluice-bench-commit", "commit_job.py")
    }

    /// A fresh `~/NAME` of the test user for a job of `bench/py/SCRIPT`: the script, the report
    /// writer it imports, the writer's Python package and library, and the sluice CLI.
    pub(crate) fn job_workdir(&self, name: &str, script: &str) -> Result<PathBuf> {
        let dir = PathBuf::from(format!("/home/{}/{name}", self.a.user));
        remove(&dir)?;
        for d in [dir.clone(), dir.join("py/sluice_ckpt"), dir.join("lib")] {
            std::fs::create_dir_all(&d)?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))?;
        }
        let pkg = self.a.repo.join("python/sluice_ckpt");
        for e in std::fs::read_dir(&pkg)?.flatten() {
            if e.path().extension().is_some_and(|x| x == "py") {
                std::fs::copy(e.path(), dir.join("py/sluice_ckpt").join(e.file_name()))?;
            }
        }
        std::fs::copy(
            self.built("libsluice_writer.so")?,
            dir.join("lib/libsluice_writer.so"),
        )?;
        std::fs::copy(self.built("sluice")?, dir.join("lib/sluice"))?;
        // The job script, and the report writer it imports from beside it.
        for (script, from) in [(script, "bench/py"), ("jobreport.py", "tests/harness")] {
            std::fs::copy(self.a.repo.join(from).join(script), dir.join(script))?;
        }
        Ok(dir)
    }

    fn commit_submit(&self, w: &Path, archive: &str, bytes: u64, tag: &str) -> Result<u32> {
        let wd = w.display();
        let job_w = w.join(tag);
        std::fs::create_dir_all(&job_w)?;
        chown(&job_w, Some(self.uid), Some(self.gid))?;
        let script = format!(
            "#!/bin/bash\nexport OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
             PYTHONPATH={wd}/py SLUICE_WRITER_LIB={wd}/lib/libsluice_writer.so SLUICE_CLI={wd}/lib/sluice\n\
             {py} {wd}/commit_job.py {jw} {bytes} {tag}\n",
            py = torch_python().display(),
            jw = job_w.display(),
        );
        let args = [
            "-N1".to_string(),
            "--ckpt-tier=ram".to_string(),
            format!("--ckpt-archive={archive}"),
        ];
        self.sbatch(
            "sluice-bench-commit",
            w,
            &job_w.join("job.out"),
            &args,
            &script,
        )
    }

    /// One job: returns (commit → MANIFEST seconds, the checkpoint's bytes, the job's report).
    fn commit_once(
        &self,
        w: &Path,
        archive_url: &str,
        archive_dir: &Path,
        bytes: u64,
        tag: &str,
    ) -> Result<(f64, u64, serde_json::Value)> {
        let id = self.commit_submit(w, archive_url, bytes, tag)?;
        let job_w = w.join(tag);
        let report_file = job_w.join("report.json");
        let manifest = archive_dir.join(tag).join("MANIFEST");
        let measured = (|| -> Result<(f64, u64, serde_json::Value)> {
            self.wait_job(id, &job_w, JOBS, &|| report_file.exists(), "its commit")?;
            let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&report_file)?)?;
            if let Some(e) = rep["errors"].as_array().filter(|e| !e.is_empty()) {
                bail!("job {id}: {e:?}");
            }
            if rep["fs_type"] != "tmpfs" {
                bail!(
                    "job {id}'s $SLUICE_CKPT_DIR {} is on {}, not the RAM tier's tmpfs ({})",
                    rep["ckpt_dir"],
                    rep["fs_type"],
                    rep["commit_output"]
                );
            }
            self.wait_job(
                id,
                &job_w,
                JOBS,
                &|| manifest.exists(),
                "the MANIFEST in the archive",
            )?;
            let seen = now_s();
            let t0 = rep["t_commit"]
                .as_f64()
                .ok_or_else(|| anyhow!("no t_commit in {rep}"))?;
            let size = rep["size"].as_u64().unwrap_or(0);
            // What the archive's MANIFEST names (read after the timing): the job's file, whole.
            let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest)?)
                .with_context(|| format!("{} is not JSON", manifest.display()))?;
            let named = m["files"]
                .as_array()
                .map(|f| {
                    f.iter()
                        .filter_map(|x| x["path"].as_str())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            if named != ["state.pt"] {
                bail!("{tag}/MANIFEST names {named:?}, the job wrote state.pt: {m}");
            }
            Ok((seen - t0, size, rep))
        })();
        std::fs::write(job_w.join("go"), "")?;
        let result = measured?;
        self.wait_completed(id, &job_w, JOBS)?;
        Ok(result)
    }

    fn commit_rows(&self) -> Result<Vec<Row>> {
        let (_, bytes) = ckpt_bytes(self.a.mode);
        let w = self.commit_workdir()?;
        chown(&w, Some(self.uid), Some(self.gid))?;
        let archive_root = PathBuf::from(self.env("SLUICE_TEST_ARCHIVE_ROOT"));
        if archive_root.as_os_str().is_empty() {
            bail!("no SLUICE_TEST_ARCHIVE_ROOT in {}", self.a.env.display());
        }
        let name = format!("bench-commit-{}", std::process::id());
        let archive_dir = archive_root.join(&self.a.user).join(&name);
        let archive_url = format!("file://{}", archive_dir.display());
        let (mut secs, mut sizes, mut cli) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..self.a.reps {
            let tag = format!("c{rep}");
            let (s, size, rep_json) =
                self.commit_once(&w, &archive_url, &archive_dir, bytes, &tag)?;
            let cli_s = rep_json["t_cli_returned"].as_f64().unwrap_or(0.0)
                - rep_json["t_commit"].as_f64().unwrap_or(0.0);
            log(format!(
                "commit {}/{}: {} -> MANIFEST in {s:.2} s ({:.2} GiB/s; the CLI returned after {cli_s:.2} s)",
                rep + 1,
                self.a.reps,
                size_label(size),
                size as f64 / crate::run::GIB / s
            ));
            secs.push(s);
            sizes.push(size);
            cli.push(cli_s);
        }
        let _ = remove(&archive_dir);
        let _ = remove(&w);
        let size = sizes.iter().copied().max().unwrap_or(0);
        let s = median(&secs);
        let case = "commit -> MANIFEST in the archive (--ckpt-tier=ram, 1 node)";
        let note = format!(
            "flush tmpfs -> NVMe hot tier, then archive to file://; `sluice ckpt commit` returned after {:.2} s; \
             MANIFEST polled every 20 ms; one job per repetition{}",
            median(&cli),
            if bytes < 1024 * MIB {
                format!(
                    "; {} since the harness's RAM-tier share is {}",
                    size_label(bytes),
                    size_label(HARNESS_JOB_SHARE)
                )
            } else {
                String::new()
            }
        );
        let rates: Vec<f64> = secs
            .iter()
            .zip(&sizes)
            .map(|(s, b)| *b as f64 / MIB as f64 / s)
            .collect();
        let rate = median(&rates);
        let plain = |unit: &str, value: f64, samples: Vec<f64>, note: String| Row {
            case: case.into(),
            size: format!("{} (1 file)", size_label(size)),
            bytes: size,
            unit: unit.into(),
            sluice: value,
            peer_name: "-".into(),
            target: "-".into(),
            note,
            sluice_samples: samples,
            ..Row::default()
        };
        Ok(vec![
            plain("s", s, secs.clone(), note),
            plain(
                "MiB/s",
                rate,
                rates,
                format!(
                    "the same, end to end: {:.2} GiB/s",
                    rate * MIB as f64 / crate::run::GIB
                ),
            ),
        ])
    }
}
