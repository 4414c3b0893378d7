//! The writer's ceiling (issue 31, item 3): whether one rank's checkpoint writer can feed a fast
//! node. One file written from 4 KiB-aligned host memory (as pinned memory is) through
//! `AlignedWriter` with 1, 2 (and 4) writer threads, open to close (fsync and rename included),
//! against `fio` with the same parallelism (`--numjobs`, one file each, `--direct=1 --bs=4M`) on the
//! same target: ext4 on a loop device with direct I/O over a file in `/dev/shm`, a RAM-backed block
//! device that takes `O_DIRECT` and costs no disk time. No cluster; root (the loop device).
//!
//! The driver (`sluice-bench ceiling`) times open to close after filling its source; fio's figure
//! is its own write phase (`write.runtime` of its JSON: no process start, no `end_fsync`), which
//! leans the comparison towards fio. Targets: ≥ 0.9× fio at each thread count, and ≥ 10 GB/s at
//! the best one; a 2-core machine reaches neither, and the rows say what it does reach.

use crate::measure::{interleaved, measure, median, run_quiet};
use crate::run::{Bench, MIB, Mode, Report, Row, Target, log, remove, size_label};
use anyhow::{Context, Result, anyhow};
use std::path::{Path, PathBuf};
use std::process::Command;

const FIO_GAIN: f64 = 0.9;
const CEILING_GBPS: f64 = 10.0;

/// ext4 on a loop device with direct I/O over a file in /dev/shm, mounted; undone when dropped.
struct RamDisk {
    image: PathBuf,
    device: String,
    mount: PathBuf,
}

impl RamDisk {
    fn make(root: &Path, bytes: u64) -> Result<RamDisk> {
        let image = PathBuf::from("/dev/shm/sluice-bench-ceiling.img");
        let _ = std::fs::remove_file(&image);
        // Allocated up front: tmpfs pages faulted in while a run writes would be measured (the
        // first run of a sparse image wrote at a tenth of the others' rate).
        let file = std::fs::File::create(&image)?;
        // SAFETY: fallocate(2) on an open file descriptor, no pointers.
        let rc =
            unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, bytes as i64) };
        if rc != 0 {
            return Err(anyhow!(
                "fallocate {} ({}): {}",
                image.display(),
                size_label(bytes),
                std::io::Error::last_os_error()
            ));
        }
        drop(file);
        let device = run_quiet(
            Command::new("losetup")
                .args(["--direct-io=on", "--show", "-f"])
                .arg(&image),
        )
        .context("losetup --direct-io=on (a loop device over /dev/shm)")?
        .trim()
        .to_string();
        let mut disk = RamDisk {
            image,
            device,
            mount: root.join("ceiling"),
        };
        run_quiet(Command::new("mkfs.ext4").args(["-q", &disk.device]))?;
        std::fs::create_dir_all(&disk.mount)?;
        run_quiet(Command::new("mount").arg(&disk.device).arg(&disk.mount)).inspect_err(|_| {
            disk.mount = PathBuf::new();
        })?;
        Ok(disk)
    }
}

impl Drop for RamDisk {
    fn drop(&mut self) {
        if !self.mount.as_os_str().is_empty() {
            let _ = run_quiet(Command::new("umount").arg(&self.mount));
            let _ = std::fs::remove_dir(&self.mount);
        }
        let _ = run_quiet(Command::new("losetup").args(["-d", &self.device]));
        let _ = std::fs::remove_file(&self.image);
    }
}

/// fio's own rate of its write phase, GB/s, from its JSON (`--group_reporting`: all jobs).
fn fio_gbps(json: &str) -> Result<f64> {
    let v: serde_json::Value = serde_json::from_str(json).context("fio's JSON")?;
    let w = &v["jobs"][0]["write"];
    let (bytes, ms) = (w["io_bytes"].as_f64(), w["runtime"].as_f64());
    match (bytes, ms) {
        (Some(b), Some(ms)) if ms > 0.0 => Ok(b / (ms / 1000.0) / 1e9),
        _ => Err(anyhow!("fio's JSON has no write.io_bytes and runtime: {w}")),
    }
}

impl Bench {
    pub(crate) fn ceiling_case(&self, r: &mut Report) {
        let (size, threads): (u64, &[usize]) = match self.a.mode {
            Mode::Smoke => (64 * MIB, &[1, 2]),
            Mode::Scaled | Mode::Full => (2048 * MIB, &[1, 2, 4]),
        };
        let case = "writer ceiling: one file from host memory to ext4 on a RAM-backed loop device";
        // The file, fio's files (the same bytes), ext4's own room.
        let disk = match RamDisk::make(&self.a.root, 2 * size + 256 * MIB) {
            Ok(d) => d,
            Err(e) => return r.error(case, e),
        };
        let mut best = (0.0f64, 0usize);
        for &n in threads {
            match self.ceiling_at(&disk.mount, size, n) {
                Ok((s, p, direct)) => {
                    let (sm, pm) = (median(&s), median(&p));
                    if sm > best.0 {
                        best = (sm, n);
                    }
                    r.rows.push(Row {
                        case: format!("{case}, {n} writer thread(s)"),
                        size: size_label(size),
                        bytes: size,
                        unit: "GB/s".into(),
                        sluice: sm,
                        peer_name: format!("fio --direct=1 --bs=4M, {n} job(s)"),
                        peer: Some(pm),
                        ratio: Some(sm / pm),
                        target: Target::Gain(FIO_GAIN).text(),
                        met: Some(sm / pm >= FIO_GAIN),
                        note: format!(
                            "sluice: open to close, fsync and rename included, O_DIRECT {}; fio: \
                             its write phase, n files of size/n",
                            if direct { "on" } else { "refused: page cache" }
                        ),
                        sluice_samples: s,
                        peer_samples: p,
                        ..Row::default()
                    });
                }
                Err(e) => r.error(&format!("{case}, {n} writer thread(s)"), e),
            }
        }
        if best.1 > 0 {
            r.rows.push(Row {
                case: format!("{case}, best of 1-{} threads", threads[threads.len() - 1]),
                size: size_label(size),
                bytes: size,
                unit: "GB/s".into(),
                sluice: best.0,
                peer_name: "-".into(),
                target: Target::AtLeast(CEILING_GBPS).text() + " GB/s",
                met: Some(best.0 >= CEILING_GBPS),
                note: format!("at {} writer thread(s)", best.1),
                ..Row::default()
            });
        }
        drop(disk);
    }

    /// `reps` runs each of the writer and fio with `n` threads, interleaved: GB/s of each, and
    /// whether the writer wrote with O_DIRECT.
    fn ceiling_at(&self, dir: &Path, size: u64, n: usize) -> Result<(Vec<f64>, Vec<f64>, bool)> {
        let file = dir.join("sluice.dat");
        let mut direct = true;
        let runs = interleaved(2, self.a.reps, |tool, rep| {
            let what = format!(
                "{} with {n} thread(s), repetition {}",
                ["sluice", "fio"][tool],
                rep + 1
            );
            let gbps = if tool == 0 {
                let mut c = self.driver();
                c.arg("ceiling")
                    .arg("--path")
                    .arg(&file)
                    .arg("--size")
                    .arg(size.to_string())
                    .arg("--threads")
                    .arg(n.to_string());
                let s = measure(&mut c).context(what.clone())?;
                remove(&file)?;
                direct &= s.extra["direct"].as_bool() == Some(true);
                let secs = s.extra["inner_wall_s"]
                    .as_f64()
                    .ok_or_else(|| anyhow!("{what}: the driver said no time: {}", s.stdout))?;
                size as f64 / secs / 1e9
            } else {
                let out = run_quiet(
                    Command::new("fio")
                        .args([
                            "--name=ceiling",
                            "--rw=write",
                            "--bs=4M",
                            "--direct=1",
                            "--ioengine=psync",
                            "--end_fsync=1",
                            "--group_reporting",
                            "--output-format=json",
                        ])
                        .arg(format!("--directory={}", dir.display()))
                        .arg(format!("--numjobs={n}"))
                        .arg(format!("--size={}", size / n as u64)),
                )
                .context(what.clone())?;
                for e in std::fs::read_dir(dir)?.flatten() {
                    if e.file_name().to_string_lossy().starts_with("ceiling.") {
                        remove(&e.path())?;
                    }
                }
                fio_gbps(&out).context(what.clone())?
            };
            log(format!("ceiling: {what}: {gbps:.2} GB/s"));
            Ok(gbps)
        })?;
        let mut runs = runs.into_iter();
        let (s, p) = (
            runs.next().unwrap_or_default(),
            runs.next().unwrap_or_default(),
        );
        Ok((s, p, direct))
    }
}
