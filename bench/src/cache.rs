//! The cross-job cache case (`cache`, issue 12): real one-node Slurm jobs on n1, whose agent runs for
//! the case with the cluster's configuration plus a `[cache]` section (restarted with it, and
//! restored afterwards as the harness started it). Garage is read through the byte-counting relay
//! on the port of the agents' `s3://datasets-relayed` profile (`tests/harness/cluster.sh`), so the
//! origin's bytes are counted on its side.
//!
//! Two measurements:
//! 1. a second job staging the same big object, and the same small objects (2,000 × 256 KiB) (on
//!    the harness's ext4 hot tier with hits copied, again with `[cache] link_hits` where a hit is a
//!    hard link to the entry, and on an XFS hot tier where a copy is a reflink): the
//!    share of its bytes the agent placed from the cache (`StageProgress.cache_bytes`), the origin
//!    bytes during the job ÷ the dataset, and the cold ÷ warm staging time (the stage's
//!    `elapsed_ms` as the agent reports it; submission to the end of the job in the note). Before
//!    each cold job the cache is emptied (`CacheEvict` of every entry).
//! 2. a working set 1.5× the cache's size (objects of one unit size) streamed three times, one job
//!    per pass: the cache's usage sampled every 100 ms — the agent's count and the bytes its
//!    directory takes on disk — against the high watermark plus one unit, and the hit ratio over
//!    the passes (objects and bytes).
//!
//! Each job's task lists what it holds (`find -printf '%s %P'`), which the driver compares with the
//! source tree; a stage that is not `done`, or a wrong listing, is an error, never a number.

use crate::cluster::{
    AgentProc, Patience, RELAYED, Tree, agent_job, describe_diff, parse_listing, source_tree,
    tree_label,
};
use crate::measure::{median, run_quiet};
use crate::run::{Bench, MIB, Mode, Report, Row, log, remove, size_label};
use anyhow::{Context, Result, anyhow, bail};
use sluice_e2e::relay::CountingRelay;
use sluice_proto::msg::{CacheListing, CacheStats, Request, Response, StageProgress, StageState};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The node the case's jobs run on (the cache is per node).
const NODE: &str = "n1";
/// The targets: bytes from the cache, origin bytes ÷ dataset, cold ÷ warm time.
const FROM_CACHE_TARGET: f64 = 99.0;
const ORIGIN_TARGET: f64 = 1.0;
const SPEEDUP_TARGET: f64 = 10.0;
/// A job, staging included, and its end after the epilogs.
const JOBS: Patience = Patience {
    limit: Duration::from_secs(400),
    every: Duration::from_millis(50),
};

/// The case's sizes: the cache of part 1 (room for the big object and the small ones), the
/// working set's cache and its objects.
struct CacheSizes {
    hit_cache: u64,
    ws_cache: u64,
    ws_unit: u64,
    ws_count: u64,
}

impl CacheSizes {
    fn of(mode: Mode) -> CacheSizes {
        match mode {
            Mode::Smoke => CacheSizes {
                hit_cache: 128 * MIB,
                ws_cache: 32 * MIB,
                ws_unit: 4 * MIB,
                ws_count: 12,
            },
            Mode::Scaled => CacheSizes {
                hit_cache: 2048 * MIB,
                ws_cache: 256 * MIB,
                ws_unit: 16 * MIB,
                ws_count: 24,
            },
            Mode::Full => CacheSizes {
                hit_cache: 4096 * MIB,
                ws_cache: 1024 * MIB,
                ws_unit: 16 * MIB,
                ws_count: 96,
            },
        }
    }
}

// ------------------------------------------------------------------------------ the agent

impl Bench {
    fn agent_socket(&self) -> PathBuf {
        self.socket_of(NODE)
    }

    /// n1's hot tier as the harness configured it.
    fn harness_hot_root(&self) -> PathBuf {
        PathBuf::from(self.env("SLUICE_TEST_HOT_ROOT").replace("%n", NODE))
    }

    /// Restarts n1's agent with the harness's configuration plus `[cache] size = SIZE` and the
    /// `[cache]` lines `more` (an empty cache), its hot tier at `hot` (the harness's, or the case's
    /// XFS file system).
    fn start_cached_agent(
        &self,
        original: &AgentProc,
        size: u64,
        hot: &Path,
        more: &str,
    ) -> Result<()> {
        let at = 1 + original
            .argv
            .iter()
            .position(|a| a == "--config")
            .ok_or_else(|| anyhow!("the agent runs without --config: {:?}", original.argv))?;
        let text = with_hot_root(&std::fs::read_to_string(&original.argv[at])?, hot)?;
        let config = self.a.root.join("cache-agent.toml");
        // min_free 1 %: the machines' disks are shared with builds, and the cache must not decline
        // fills for want of 5 % of a large disk while the bench measures it.
        std::fs::write(
            &config,
            format!(
                "{text}\n[cache]\nsize = \"{}MiB\"\nhigh_water = 90\nlow_water = 75\nmin_free = 1\n{more}\n",
                size / MIB
            ),
        )?;
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600))?;
        let mut cached = original.clone();
        cached.argv[at] = config.display().to_string();
        self.kill_agent(NODE)?;
        remove(&hot.join("cache"))?;
        self.start_agent(NODE, &cached)
    }

    fn restore_agent(&self, original: &AgentProc, hot: &Path) -> Result<()> {
        self.kill_agent(NODE)?;
        remove(&hot.join("cache"))?;
        self.start_agent(NODE, original)
    }

    /// Free space of the file system of the hot tier at `hot`, as `df` says it (for notes).
    fn hot_free(&self, hot: &Path) -> String {
        Command::new("df")
            .args(["-h", "--output=avail"])
            .arg(hot)
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .nth(1)
                    .map(|l| l.trim().to_string())
            })
            .unwrap_or_else(|| "?".into())
    }

    fn cache_listing(&self) -> Result<CacheListing> {
        match sluice_proto::client::call(
            &self.agent_socket(),
            Request::CacheList {
                prefix: None,
                entries: false,
            },
            Duration::from_secs(10),
        ) {
            Ok(Response::Cache(l)) => Ok(l),
            other => bail!("cache list on {NODE}: {other:?}"),
        }
    }

    fn evict_all(&self) -> Result<()> {
        match sluice_proto::client::call(
            &self.agent_socket(),
            Request::CacheEvict {
                prefix: String::new(),
                dry_run: false,
            },
            Duration::from_secs(120),
        ) {
            Ok(Response::CacheEvicted(e)) if e.in_use == 0 => Ok(()),
            other => bail!("emptying the cache of {NODE}: {other:?}"),
        }
    }
}

// ------------------------------------------------------------------------------ jobs

/// What one job showed.
struct Outcome {
    /// Bytes the origin sent back through the relay from submission to the tasks' listing.
    served: u64,
    /// The stage's own time (`elapsed_ms`), and submission to the job's end.
    stage_s: f64,
    job_s: f64,
    progress: StageProgress,
}

/// Bytes the files below `dir` take on disk (allocated blocks), 0 when it is gone.
fn disk_usage(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(md) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            } else {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

impl Bench {
    /// One job of the test user on [`NODE`] staging `s3://datasets-relayed/PREFIX` as `ds`: its
    /// task lists what it holds and waits for the driver's go, so the agent still holds the job
    /// while the driver reads its stage; the listing must match `tree`.
    fn cache_job(
        &self,
        relay: &CountingRelay,
        prefix: &str,
        tree: &Tree,
        label: &str,
    ) -> Result<Outcome> {
        let w = self.user_workdir("sluice-bench-cache", label)?;
        let wd = w.display();
        let script = format!(
            "#!/bin/bash\nsrun --ntasks-per-node=1 /bin/bash -c 'find \"$SLUICE_STAGE_DIR/ds\" -type f -printf \"%s %P\\n\" > \"{wd}/files\"'\n\
             rc=$?\ntouch \"{wd}/staged\"\n\
             i=0; while [ ! -e \"{wd}/go\" ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done\nexit $rc\n"
        );
        let args = [
            "-N1".to_string(),
            "-w".to_string(),
            NODE.to_string(),
            format!("--stage-in=ds=s3://{RELAYED}/{prefix}"),
        ];
        let before = relay.served();
        let t = Instant::now();
        let id = self.sbatch("sluice-bench-cache", &w, &w.join("job.out"), &args, &script)?;
        let staged = w.join("staged");
        let read = (|| -> Result<(u64, StageProgress)> {
            self.wait_job(
                id,
                &w,
                JOBS,
                &|| staged.exists(),
                "its task listed the stage",
            )?;
            let served = relay.served() - before;
            let status = agent_job(&self.agent_socket(), NODE, id)?;
            let p = status
                .stages
                .first()
                .cloned()
                .ok_or_else(|| anyhow!("job {id} has no stage on {NODE}"))?;
            if p.state != StageState::Done {
                bail!("job {id}'s stage is {:?} ({:?})", p.state, p.error);
            }
            Ok((served, p))
        })();
        std::fs::write(w.join("go"), "")?;
        let (served, progress) = read?;
        self.wait_completed(id, &w, JOBS)?;
        let job_s = t.elapsed().as_secs_f64();
        let got = parse_listing(&std::fs::read_to_string(w.join("files"))?)?;
        if &got != tree {
            bail!("job {id} holds {}", describe_diff(tree, &got));
        }
        remove(&w)?;
        Ok(Outcome {
            served,
            stage_s: progress.elapsed_ms as f64 / 1000.0,
            job_s,
            progress,
        })
    }

    // ------------------------------------------------------------------------------ the case

    pub(crate) fn cache_cases(&self, r: &mut Report) {
        let sizes = CacheSizes::of(self.a.mode);
        let result = (|| -> Result<()> {
            let original = self.agent_proc(NODE)?;
            let relay = self.origin_relay()?;
            self.cache_upload(&sizes)?;
            r.note(format!(
                "cache rows: real one-node Slurm jobs on {NODE} as {}, its agent restarted with [cache] \
                 (high_water 90, low_water 75, min_free 1); Garage read through the bench's \
                 byte-counting relay on 127.0.0.1:{}",
                self.a.user,
                relay.port()
            ));
            let hot = self.harness_hot_root();
            let parts = (|| -> Result<()> {
                self.start_cached_agent(&original, sizes.hit_cache, &hot, "")?;
                self.cache_hits(r, &relay, &hot, "")?;
                // The same on the same ext4 hot tier, a hit a hard link to the entry.
                self.start_cached_agent(&original, sizes.hit_cache, &hot, "link_hits = true")?;
                self.cache_hits(r, &relay, &hot, ", hits linked (link_hits)")?;
                self.start_cached_agent(&original, sizes.ws_cache, &hot, "")?;
                self.cache_working_set(r, &relay, &sizes, &hot)?;
                self.cache_hits_on_xfs(r, &relay, &original, &sizes)
            })();
            let restored = self.restore_agent(&original, &hot);
            parts.and(restored)
        })();
        if let Err(e) = result {
            r.error("cache", e);
        }
    }

    /// Uploads the big and small datasets and the working set to the relayed bucket, straight to
    /// Garage (untimed; rclone skips what is there already).
    fn cache_upload(&self, s: &CacheSizes) -> Result<()> {
        let ws = self.data.join("cache-ws");
        crate::data::cached(
            &ws,
            &format!("cache-ws {} {}", s.ws_count, s.ws_unit),
            |d| crate::data::random_tree(d, s.ws_count, s.ws_unit),
        )?;
        crate::data::chown_tree(&ws, 0, 0)?;
        self.upload_relayed(&["big", "small", "cache-ws"])
    }

    /// Part 1 again with n1's hot tier on XFS (`reflink=1`, mkfs.xfs's default), in a file-backed
    /// file system the case makes and removes. On XFS (and btrfs) a hit is a reflink, no data
    /// written; on ext4, as the harness's hot tier is here, it is an in-kernel copy, as fast as the
    /// disk takes writes, which against a loopback Garage leaves the big object short of 10×.
    fn cache_hits_on_xfs(
        &self,
        r: &mut Report,
        relay: &CountingRelay,
        original: &AgentProc,
        sizes: &CacheSizes,
    ) -> Result<()> {
        if Command::new("mkfs.xfs").arg("-V").output().is_err() {
            r.note(
                "cache: no mkfs.xfs on this machine (apt-get install xfsprogs): the rows with \
                 the hot tier on XFS are left out"
                    .into(),
            );
            return Ok(());
        }
        let (image, hot) = (
            self.a.root.join("cache-xfs.img"),
            self.a.root.join("cache-xfs"),
        );
        // Room for the cache and a job's copies (sparse: only what is written takes disk).
        std::fs::File::create(&image)?.set_len(3 * sizes.hit_cache.max(1024 * MIB))?;
        run_quiet(
            Command::new("mkfs.xfs")
                .args(["-q", "-f", "-m", "reflink=1"])
                .arg(&image),
        )?;
        std::fs::create_dir_all(&hot)?;
        run_quiet(
            Command::new("mount")
                .args(["-o", "loop"])
                .arg(&image)
                .arg(&hot),
        )?;
        r.note(format!(
            "cache rows 'hot tier on XFS': n1's hot tier on a {} XFS file system (reflink=1) in a \
             file on the same disk, loop-mounted at {}; a hit is a reflink there",
            size_label(3 * sizes.hit_cache.max(1024 * MIB)),
            hot.display()
        ));
        let measured = self
            .start_cached_agent(original, sizes.hit_cache, &hot, "")
            .and_then(|()| self.cache_hits(r, relay, &hot, ", hot tier on XFS"));
        // The agent lets go of the file system before it is unmounted.
        let restored = self.restore_agent(original, &hot);
        let unmounted = run_quiet(Command::new("umount").arg(&hot)).map(drop);
        let removed = remove(&image).and(remove(&hot));
        measured.and(restored).and(unmounted).and(removed)
    }

    /// Part 1: cold and warm job on one object and on many, alternating, the cache emptied before
    /// each cold job; `hot` is n1's hot tier, `label` what the rows add to their case.
    fn cache_hits(
        &self,
        r: &mut Report,
        relay: &CountingRelay,
        hot: &Path,
        label: &str,
    ) -> Result<()> {
        for (shape, name) in [("one object", "big"), ("many objects", "small")] {
            let shape = format!("{shape}{label}");
            let tree = source_tree(&self.data.join(name))?;
            let bytes: u64 = tree.values().sum();
            let prefix = format!("bench/{name}");
            let (mut cold, mut warm) = (Vec::new(), Vec::new());
            for rep in 0..self.a.reps {
                self.evict_all()?;
                let c = self
                    .cache_job(relay, &prefix, &tree, &format!("{name}-cold"))
                    .with_context(|| format!("cold job, {shape}, repetition {}", rep + 1))?;
                let w = self
                    .cache_job(relay, &prefix, &tree, &format!("{name}-warm"))
                    .with_context(|| format!("warm job, {shape}, repetition {}", rep + 1))?;
                log(format!(
                    "cache: {shape}: cold {:.2} s (origin {} bytes), warm {:.2} s (origin {} bytes, \
                     {} bytes from the cache)",
                    c.stage_s, c.served, w.stage_s, w.served, w.progress.cache_bytes
                ));
                // A cold job that left its dataset out of the cache makes the warm row a miss;
                // say why it may have (the cache declines fills that would take the hot tier's
                // file system below min_free).
                let used = self.cache_listing()?.stats.used_bytes;
                if used < bytes {
                    r.note(format!(
                        "cache: {shape}, repetition {}: after the cold job the cache held {} of the \
                         dataset's {}; the hot tier's file system had {} free",
                        rep + 1,
                        size_label(used),
                        size_label(bytes),
                        self.hot_free(hot)
                    ));
                }
                if c.progress.cache_bytes != 0 {
                    bail!(
                        "the cold job placed {} bytes from an emptied cache",
                        c.progress.cache_bytes
                    );
                }
                cold.push(c);
                warm.push(w);
            }
            let size = tree_label(&tree);
            let pct_cache: Vec<f64> = warm
                .iter()
                .map(|o| 100.0 * o.progress.cache_bytes as f64 / bytes as f64)
                .collect();
            let pct_origin: Vec<f64> = warm
                .iter()
                .map(|o| 100.0 * o.served as f64 / bytes as f64)
                .collect();
            let cold_origin = median(&cold.iter().map(|o| o.served as f64).collect::<Vec<_>>());
            let times = |v: &[Outcome]| v.iter().map(|o| o.stage_s).collect::<Vec<_>>();
            let jobs = |v: &[Outcome]| v.iter().map(|o| o.job_s).collect::<Vec<_>>();
            let (ct, wt) = (median(&times(&cold)), median(&times(&warm)));
            // What the three rows of this shape share: the case's wording, the dataset, the unit.
            let row = |case: &str, unit: &str| Row {
                case: format!("cache: {case}, {shape}"),
                size: size.clone(),
                bytes,
                unit: unit.into(),
                ..Row::default()
            };
            let m = median(&pct_cache);
            r.rows.push(Row {
                sluice: m,
                peer_name: "-".into(),
                target: format!(">= {FROM_CACHE_TARGET:.0} %"),
                met: Some(m >= FROM_CACHE_TARGET),
                note: "StageProgress.cache_bytes of the warm job ÷ the dataset".into(),
                sluice_samples: pct_cache,
                ..row("second job, % of bytes from the cache", "%")
            });
            let m = median(&pct_origin);
            r.rows.push(Row {
                sluice: m,
                peer_name: "cold job".into(),
                peer: Some(100.0 * cold_origin / bytes as f64),
                target: format!("<= {ORIGIN_TARGET:.0} %"),
                met: Some(m <= ORIGIN_TARGET),
                note: "counted by the bench's relay in front of Garage from submission to the \
                       task's listing (listing and headers included)"
                    .into(),
                sluice_samples: pct_origin,
                ..row("second job, origin bytes / dataset", "%")
            });
            r.rows.push(Row {
                sluice: wt,
                peer_name: "cold job".into(),
                peer: Some(ct),
                ratio: Some(ct / wt),
                target: format!(">= {SPEEDUP_TARGET:.0}x"),
                met: Some(ct / wt >= SPEEDUP_TARGET),
                note: format!(
                    "the stage's elapsed_ms as the agent reports it; submission to the job's end: \
                     cold {:.2} s, warm {:.2} s (Slurm's scheduling included)",
                    median(&jobs(&cold)),
                    median(&jobs(&warm))
                ),
                sluice_samples: times(&warm),
                peer_samples: times(&cold),
                ..row("staging time, cold / warm", "s")
            });
        }
        Ok(())
    }

    /// Part 2: a working set 1.5× the cache streamed three times, usage sampled throughout.
    fn cache_working_set(
        &self,
        r: &mut Report,
        relay: &CountingRelay,
        s: &CacheSizes,
        hot: &Path,
    ) -> Result<()> {
        let tree = source_tree(&self.data.join("cache-ws"))?;
        let bytes: u64 = tree.values().sum();
        let start = self.cache_listing()?.stats;
        let high = start.high_water_bytes;
        let stop = Arc::new(AtomicBool::new(false));
        let (max_used, max_disk) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let sampler = {
            let (stop, max_used, max_disk) = (stop.clone(), max_used.clone(), max_disk.clone());
            let (socket, dir) = (self.agent_socket(), hot.join("cache"));
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(Response::Cache(l)) = sluice_proto::client::call(
                        &socket,
                        Request::CacheList {
                            prefix: None,
                            entries: false,
                        },
                        Duration::from_secs(5),
                    ) {
                        max_used.fetch_max(l.stats.used_bytes, Ordering::SeqCst);
                    }
                    max_disk.fetch_max(disk_usage(&dir), Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let passes: Result<Vec<Outcome>> = (1..=3)
                .map(|pass| {
                    let o = self
                        .cache_job(relay, "bench/cache-ws", &tree, "ws")
                        .with_context(|| format!("working set, pass {pass}"))?;
                    log(format!(
                        "cache: working set pass {pass}: {} of {bytes} bytes from the cache, origin {} bytes",
                        o.progress.cache_bytes, o.served
                    ));
                    Ok(o)
                })
                .collect();
        stop.store(true, Ordering::SeqCst);
        let _ = sampler.join();
        let passes = passes?;
        let end: CacheStats = self.cache_listing()?.stats;
        let (used, disk) = (
            max_used.load(Ordering::SeqCst),
            max_disk.load(Ordering::SeqCst),
        );
        let bound = high + s.ws_unit;
        let (hits, misses) = (end.hits - start.hits, end.misses - start.misses);
        let hit_ratio = hits as f64 / (hits + misses).max(1) as f64;
        let from_cache: u64 = passes.iter().map(|o| o.progress.cache_bytes).sum();
        let size = format!(
            "{} x {} through a {} cache",
            tree.len(),
            size_label(s.ws_unit),
            size_label(s.ws_cache)
        );
        let peak = used.max(disk);
        r.rows.push(Row {
            case: "cache: working set 1.5x the cache, 3 passes: peak usage / (high water + 1 unit)"
                .into(),
            size: size.clone(),
            bytes,
            unit: "x".into(),
            sluice: peak as f64 / bound as f64,
            peer_name: "-".into(),
            target: "<= 1.000x".into(),
            met: Some(peak <= bound),
            note: format!(
                "sampled every 100 ms: the agent's used_bytes peaked at {} MiB, the cache directory \
                 on disk at {} MiB; high water {} MiB + one {} unit; {} evictions",
                used / MIB,
                disk / MIB,
                high / MIB,
                size_label(s.ws_unit),
                end.evictions - start.evictions
            ),
            sluice_samples: vec![used as f64, disk as f64],
            ..Row::default()
        });
        r.rows.push(Row {
            case: "cache: working set 1.5x the cache, 3 passes: hit ratio".into(),
            size,
            bytes: 3 * bytes,
            unit: "%".into(),
            sluice: 100.0 * hit_ratio,
            peer_name: "-".into(),
            target: "-".into(),
            note: format!(
                "{hits} hits, {misses} misses over the 3 passes; {:.1} % of the bytes staged came \
                 from the cache (per pass: {:?})",
                100.0 * from_cache as f64 / (3 * bytes) as f64,
                passes
                    .iter()
                    .map(|o| o.progress.cache_bytes * 100 / bytes.max(1))
                    .collect::<Vec<_>>()
            ),
            sluice_samples: passes
                .iter()
                .map(|o| 100.0 * o.progress.cache_bytes as f64 / bytes as f64)
                .collect(),
            ..Row::default()
        });
        Ok(())
    }
}

/// The agent configuration `text` with its `[hot_tier]` root at `hot`.
fn with_hot_root(text: &str, hot: &Path) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let (mut section, mut replaced) = (String::new(), false);
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            section = t.to_string();
        }
        if section == "[hot_tier]" && t.starts_with("root") && t.contains('=') {
            out.push_str(&format!("root = {:?}\n", hot.display().to_string()));
            replaced = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !replaced {
        bail!(
            "the agent's configuration has no [hot_tier] root to move to {}",
            hot.display()
        );
    }
    Ok(out)
}
