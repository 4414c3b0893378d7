//! `sluice doctor`: is this node set up for sluice? Each check says PASS, WARN or FAIL, what it
//! found and, unless it passed, what to run or change. The checks are independent: one failing
//! never hides another (a check that needs what a failed one would have given says it was not
//! checked, and why). Every decision is a pure function of what was read (file modes, plugstack
//! text, versions, flags), unit-tested with fakes; [`run`] does the reading.
//!
//! Nothing here writes anywhere but one probe file in the hot tier (created and removed at once,
//! to see whether O_DIRECT opens work); the stores are only listed, one page per bucket, and each
//! store endpoint gets one unauthenticated `HEAD` for its clock ([`clock`]).
//!
//! Also `sluice config check FILE`: the agent's own validation ([`Config::parse`]) and a summary.

mod clock;
mod slurm;

use crate::socket::{self, Socket};
use serde::Serialize;
use sluice_core::config::{Config, SharedTierConfig, StoreProfile};
use sluice_proto::client::{self, ClientError};
use sluice_proto::msg::{Request, Response};
use sluice_proto::options::ObjectScheme;
use std::fmt::Write as _;
use std::io::{self, ErrorKind};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use slurm::SlurmConf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Warn,
    Fail,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }
}

/// One check's outcome; `--json` prints a list of these.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub check: String,
    pub status: Status,
    pub detail: String,
    pub fix: Option<String>,
}

impl Finding {
    pub fn new(check: &str, status: Status, detail: String, fix: Option<String>) -> Finding {
        Finding {
            check: check.to_string(),
            status,
            detail,
            fix,
        }
    }
}

/// What the doctor looks at.
#[derive(Debug, Clone)]
pub struct Options {
    pub config: PathBuf,
    pub node: String,
    /// `--socket`: else the config's `agent.socket`, else the CLI's default.
    pub socket: Option<PathBuf>,
    /// `--plugstack`: else Slurm's `PlugStackConfig`, else /etc/slurm/plugstack.conf.
    pub plugstack: Option<PathBuf>,
    /// Bound on each probe (agent, scontrol, squeue, each store listing).
    pub timeout: Duration,
}

/// Runs every check, in order.
pub fn run(opts: &Options) -> anyhow::Result<Vec<Finding>> {
    let rt = crate::ckpt::runtime()?;
    let is_root = nix::unistd::geteuid().is_root();
    let mut out = Vec::new();

    let (finding, cfg) = check_config(&opts.config, &opts.node, is_root);
    out.push(finding);
    out.push(check_agent(opts, cfg.as_ref()));

    let conf = rt.block_on(slurm_conf(opts.timeout));
    let (finding, so) = check_plugstack(opts, conf.as_ref());
    out.push(finding);
    let slurm_version = rt
        .block_on(command_output("scontrol", &["--version"], opts.timeout))
        .and_then(|t| {
            slurm::parse_slurm_version(&t).ok_or_else(|| format!("scontrol --version said {t:?}"))
        });
    let plugin = so.as_deref().map(|so| {
        std::fs::read(so)
            .map_err(|e| e.to_string())
            .and_then(|b| slurm::plugin_version(&b))
    });
    out.push(slurm::judge_plugin_version(
        so.as_deref(),
        plugin.unwrap_or(Err(String::new())),
        slurm_version,
    ));
    out.push(slurm::judge_prolog_flags(conf.as_ref()));

    out.push(match &cfg {
        Some(cfg) => check_hot_tier(cfg, is_root),
        None => not_checked("hot tier"),
    });
    if cfg
        .as_ref()
        .and_then(|c| c.cache.as_ref())
        .is_some_and(|c| c.link_hits)
    {
        let value = std::fs::read_to_string("/proc/sys/fs/protected_hardlinks");
        out.push(judge_cache_links(value));
    }
    if let Some(tier) = cfg.as_ref().and_then(|c| c.shared_tier.as_ref()) {
        out.push(check_shared_tier(tier, is_root));
    }
    match &cfg {
        Some(cfg) => {
            out.extend(rt.block_on(check_stores(cfg, opts.timeout)));
            out.extend(rt.block_on(clock::check_clocks(&cfg.stores, opts.timeout)));
        }
        None => out.push(not_checked("stores")),
    }
    let squeue = match &cfg {
        Some(cfg) => cfg.squeue.clone(),
        None => Some(PathBuf::from("squeue")),
    };
    out.push(rt.block_on(check_squeue(squeue.as_deref(), opts.timeout)));
    Ok(out)
}

fn not_checked(check: &str) -> Finding {
    Finding::new(
        check,
        Status::Warn,
        "not checked: the configuration did not load (see config)".into(),
        Some("fix the config check first".into()),
    )
}

/// The table: one line per check, the fix indented under it, then a count.
pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    for f in findings {
        let _ = writeln!(
            out,
            "{}  {}: {}",
            f.status.label(),
            f.check,
            crate::render::clean(&f.detail)
        );
        if let (Some(fix), false) = (&f.fix, f.status == Status::Pass) {
            let _ = writeln!(out, "      fix: {}", crate::render::clean(fix));
        }
    }
    let count = |s| findings.iter().filter(|f| f.status == s).count();
    let _ = writeln!(
        out,
        "{} passed, {} warnings, {} failed",
        count(Status::Pass),
        count(Status::Warn),
        count(Status::Fail)
    );
    out
}

/// Whether doctor exits 0: nothing failed (warnings are advice).
pub fn healthy(findings: &[Finding]) -> bool {
    findings.iter().all(|f| f.status != Status::Fail)
}

// ---- 1. config --------------------------------------------------------------------------------

/// Owner and permission bits of a file.
#[derive(Debug, Clone, Copy)]
pub struct FileFacts {
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
}

fn check_config(path: &Path, node: &str, is_root: bool) -> (Finding, Option<Config>) {
    let meta = std::fs::metadata(path).map(|m| FileFacts {
        uid: m.uid(),
        gid: m.gid(),
        mode: m.mode() & 0o7777,
    });
    let text = std::fs::read_to_string(path);
    judge_config(path, meta, text, is_root, node)
}

/// Exists, root-owned, 0600 (it holds store credentials), and valid for this node.
pub fn judge_config(
    path: &Path,
    meta: io::Result<FileFacts>,
    text: io::Result<String>,
    is_root: bool,
    node: &str,
) -> (Finding, Option<Config>) {
    let check = "config";
    let p = path.display();
    let needs_root = || {
        Finding::new(
            check,
            Status::Warn,
            format!("cannot read {p} as this user: doctor needs root for this check"),
            Some("run it as root: sudo sluice doctor".into()),
        )
    };
    let meta = match meta {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let f = Finding::new(
                check,
                Status::Fail,
                format!("{p} does not exist"),
                Some(format!(
                    "install slurm-conf/sluice.toml as {p}, then chown root:root {p} and chmod 600 {p}"
                )),
            );
            return (f, None);
        }
        Err(e) if e.kind() == ErrorKind::PermissionDenied && !is_root => {
            return (needs_root(), None);
        }
        Err(e) => {
            let f = Finding::new(check, Status::Fail, format!("cannot stat {p}: {e}"), None);
            return (f, None);
        }
    };
    let mut status = Status::Pass;
    let (mut found, mut fixes) = (Vec::new(), Vec::new());
    if meta.uid != 0 || meta.gid != 0 {
        status = Status::Fail;
        found.push(format!("owned by {}:{}, not root:root", meta.uid, meta.gid));
        fixes.push(format!("chown root:root {p}"));
    }
    if meta.mode & 0o077 != 0 {
        status = Status::Fail;
        found.push(format!(
            "mode {:04o}: group or others may read its store credentials",
            meta.mode
        ));
        fixes.push(format!("chmod 600 {p}"));
    }
    let cfg = match text {
        Ok(text) => match Config::parse(&text, node, sluice_archive::upload_memory) {
            Ok(cfg) => {
                found.push(format!("valid for node {node}"));
                Some(cfg)
            }
            Err(e) => {
                status = Status::Fail;
                found.push(format!("invalid: {e}"));
                fixes.push(format!(
                    "correct it (sluice config check {p} --node {node} shows the error)"
                ));
                None
            }
        },
        Err(e) if e.kind() == ErrorKind::PermissionDenied && !is_root => {
            if status == Status::Pass {
                return (needs_root(), None);
            }
            found
                .push("not readable by this user: run doctor as root to check its contents".into());
            None
        }
        Err(e) => {
            status = Status::Fail;
            found.push(format!("cannot read it: {e}"));
            None
        }
    };
    if status == Status::Pass {
        found.insert(0, "root-owned, mode 0600".into());
    }
    let fix = (!fixes.is_empty()).then(|| fixes.join("; "));
    (
        Finding::new(check, status, format!("{p}: {}", found.join("; ")), fix),
        cfg,
    )
}

// ---- 2. agent ---------------------------------------------------------------------------------

fn check_agent(opts: &Options, cfg: Option<&Config>) -> Finding {
    let socket = match (&opts.socket, cfg) {
        (Some(flag), _) => {
            socket::resolve(Some(flag.as_os_str()), crate::env, socket::system_hostname)
        }
        (None, Some(cfg)) => Ok(Socket {
            path: cfg.socket.clone(),
            origin: socket::Origin::Default,
        }),
        (None, None) => socket::resolve(None, crate::env, socket::system_hostname),
    };
    match socket {
        Ok(s) => judge_agent(
            &s.path,
            client::call(&s.path, Request::Status, opts.timeout),
            opts.timeout,
        ),
        Err(e) => Finding::new("agent", Status::Fail, format!("{e:#}"), None),
    }
}

pub fn judge_agent(
    path: &Path,
    answer: Result<Response, ClientError>,
    timeout: Duration,
) -> Finding {
    let check = "agent";
    let p = path.display();
    match answer {
        Ok(Response::Status(s)) => Finding::new(
            check,
            Status::Pass,
            format!("sluiced {} answers at {p} (node {})", s.agent_version, s.node),
            None,
        ),
        Ok(other) => Finding::new(
            check,
            Status::Fail,
            format!("{p} answered Status with {other:?}"),
            Some("the agent and this CLI differ: install both from one build".into()),
        ),
        Err(ClientError::Connect { source, .. }) if source.kind() == ErrorKind::PermissionDenied => {
            Finding::new(
                check,
                Status::Warn,
                format!("not allowed to connect to {p}: {source}"),
                Some("run doctor as root".into()),
            )
        }
        Err(ClientError::Connect { source, .. }) => Finding::new(
            check,
            Status::Fail,
            format!("nothing answers at {p}: {source}"),
            Some("start sluiced (systemctl start sluiced)".into()),
        ),
        Err(ClientError::Frame { source, .. }) => Finding::new(
            check,
            Status::Fail,
            format!(
                "the agent at {p} did not answer Status within {}: {source}",
                humantime::format_duration(timeout)
            ),
            Some("see its log (journalctl -u sluiced); restart it if it is stuck (systemctl restart sluiced)".into()),
        ),
        Err(ClientError::Agent(reply)) => Finding::new(
            check,
            Status::Fail,
            format!("the agent at {p} refused Status: {reply}"),
            None,
        ),
    }
}

// ---- 3.-5. Slurm ------------------------------------------------------------------------------

/// Runs a program with a bound; its stdout, or why not.
async fn command_output(program: &str, args: &[&str], timeout: Duration) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let what = format!("{program} {}", args.join(" "));
    match tokio::time::timeout(timeout, cmd.output()).await {
        Err(_) => Err(format!(
            "{what} did not finish within {}",
            humantime::format_duration(timeout)
        )),
        Ok(Err(e)) => Err(format!("cannot run {what}: {e}")),
        Ok(Ok(out)) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        }
        Ok(Ok(out)) => Err(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Slurm's running configuration, else slurm.conf as written (slurmctld down or unreachable).
async fn slurm_conf(timeout: Duration) -> Option<SlurmConf> {
    if let Ok(text) = command_output("scontrol", &["show", "config"], timeout).await {
        return Some(SlurmConf {
            source: "scontrol show config".into(),
            values: slurm::parse_show_config(&text),
        });
    }
    let path = crate::env("SLURM_CONF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/slurm/slurm.conf"));
    let text = std::fs::read_to_string(&path).ok()?;
    Some(SlurmConf {
        source: format!("{}; slurmctld did not answer scontrol", path.display()),
        values: slurm::parse_slurm_conf(&text),
    })
}

/// Reads the plugstack file and its includes; returns the plugin's file when one line loads it.
fn check_plugstack(opts: &Options, conf: Option<&SlurmConf>) -> (Finding, Option<PathBuf>) {
    let main = opts
        .plugstack
        .clone()
        .or_else(|| {
            conf.and_then(|c| c.get("PlugStackConfig"))
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from("/etc/slurm/plugstack.conf"));
    let mut files = Vec::new();
    let read = read_plugstack(&main, 0, &mut files);
    let lines = slurm::sluice_lines(&files, conf.and_then(|c| c.get("PluginDir")));
    let names: Vec<PathBuf> = files.iter().map(|(f, _)| f.clone()).collect();
    let finding = slurm::judge_plugstack(&main, read, &names, &lines, Path::exists);
    let so = lines.first().map(|l| l.so.clone()).filter(|so| so.exists());
    (finding, so)
}

fn read_plugstack(
    path: &Path,
    depth: usize,
    files: &mut Vec<(PathBuf, Vec<slurm::PlugLine>)>,
) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let lines = slurm::parse_plugstack(&text);
    let includes: Vec<String> = lines
        .iter()
        .filter_map(|l| match l {
            slurm::PlugLine::Include { pattern } => Some(pattern.clone()),
            _ => None,
        })
        .collect();
    files.push((path.to_path_buf(), lines));
    if depth >= 4 {
        return Ok(());
    }
    for pattern in includes {
        let pattern = path.parent().unwrap_or(Path::new("/")).join(pattern);
        let (Some(dir), Some(name)) = (
            pattern.parent(),
            pattern.file_name().and_then(|n| n.to_str()),
        ) else {
            continue;
        };
        let mut matched: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| slurm::glob_match(name, n))
            })
            .map(|e| e.path())
            .collect();
        matched.sort();
        for file in matched {
            // An unreadable include is Slurm's problem to report; the lines it holds are unknown.
            let _ = read_plugstack(&file, depth + 1, files);
        }
    }
    Ok(())
}

// ---- 6. hot tier ------------------------------------------------------------------------------

/// What the hot tier's root sits on, from /proc/self/mounts: the longest mount point above it.
pub fn mount_of(mounts: &str, path: &Path) -> Option<(String, PathBuf)> {
    let unescape = |s: &str| {
        s.replace("\\040", " ")
            .replace("\\011", "\t")
            .replace("\\134", "\\")
    };
    mounts
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (_dev, at, fs) = (w.next()?, w.next()?, w.next()?);
            Some((fs.to_string(), PathBuf::from(unescape(at))))
        })
        .filter(|(_, at)| path.starts_with(at))
        .max_by_key(|(_, at)| at.as_os_str().len())
}

/// Space and O_DIRECT as probed.
#[derive(Debug)]
pub struct HotTierFacts {
    pub mount: Option<(String, PathBuf)>,
    /// Bytes: size of the file system and free for unprivileged writers.
    pub space: Option<(u64, u64)>,
    pub o_direct: io::Result<()>,
}

fn check_hot_tier(cfg: &Config, is_root: bool) -> Finding {
    let root = &cfg.hot_root;
    if let Err(e) = std::fs::metadata(root) {
        return judge_hot_tier(root, Err(e), cfg.ckpt.high_water, is_root);
    }
    let canonical = std::fs::canonicalize(root).unwrap_or_else(|_| root.clone());
    let mount = std::fs::read_to_string("/proc/self/mounts")
        .ok()
        .and_then(|m| mount_of(&m, &canonical));
    let space = nix::sys::statvfs::statvfs(root).ok().map(|s| {
        let unit = s.fragment_size();
        (s.blocks() * unit, s.blocks_available() * unit)
    });
    let probe = root.join(format!(".sluice-doctor-{}", std::process::id()));
    let o_direct = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(&probe)
        .map(|_| ());
    let _ = std::fs::remove_file(&probe);
    let facts = HotTierFacts {
        mount,
        space,
        o_direct,
    };
    judge_hot_tier(root, Ok(facts), cfg.ckpt.high_water, is_root)
}

pub fn judge_hot_tier(
    root: &Path,
    facts: io::Result<HotTierFacts>,
    high_water: u8,
    is_root: bool,
) -> Finding {
    let check = "hot tier";
    let r = root.display();
    let facts = match facts {
        Ok(f) => f,
        Err(e) => {
            return Finding::new(
                check,
                Status::Fail,
                format!("{r}: {e}"),
                Some(format!(
                    "create it on the node-local disk (install -d -m 0755 {r}), or correct hot_tier.root"
                )),
            );
        }
    };
    let mut status = Status::Pass;
    let mut found = vec![match &facts.mount {
        Some((fs, at)) => format!("{r} on {fs} (mounted at {})", at.display()),
        None => format!("{r} (file system unknown)"),
    }];
    let mut fixes = Vec::new();
    match facts.space {
        Some((total, avail)) if total > 0 => {
            let used = 100 - (u128::from(avail) * 100 / u128::from(total)) as u64;
            found.push(format!(
                "{} free of {} ({used}% used, high water {high_water}%)",
                crate::render::bytes(avail),
                crate::render::bytes(total)
            ));
            if used >= u64::from(high_water) {
                status = Status::Warn;
                fixes.push("free space on it: sluice trims archived checkpoints of ended jobs above high water, so what is left is held by running jobs or by other files (sluice status shows the jobs)".to_string());
            }
        }
        _ => {
            status = Status::Warn;
            found.push("free space unknown".into());
        }
    }
    match &facts.o_direct {
        Ok(()) => found.push("O_DIRECT works".into()),
        Err(e) if e.kind() == ErrorKind::PermissionDenied && !is_root => {
            status = status.max(Status::Warn);
            found.push("O_DIRECT not probed: doctor needs root to create a file there".into());
            fixes.push("run doctor as root".into());
        }
        Err(e) => {
            status = status.max(Status::Warn);
            found.push(format!(
                "O_DIRECT refused ({e}): restore falls back to buffered writes"
            ));
            fixes.push(
                "put the hot tier on a local file system that supports O_DIRECT (ext4, xfs)".into(),
            );
        }
    }
    let fix = (!fixes.is_empty()).then(|| fixes.join("; "));
    Finding::new(check, status, found.join(", "), fix)
}

/// `[cache] link_hits` links cache entries into jobs' directories: with
/// `fs.protected_hardlinks` off, a job user could link an entry (root's, read-only) to a place of
/// their own on the hot tier's file system and keep it past the job.
pub fn judge_cache_links(protected_hardlinks: io::Result<String>) -> Finding {
    let check = "cache links";
    let fix = "sysctl -w fs.protected_hardlinks=1, and keep it in /etc/sysctl.d (Linux's default)";
    match protected_hardlinks.as_deref().map(str::trim) {
        Ok("1") => Finding::new(
            check,
            Status::Pass,
            "[cache] link_hits with fs.protected_hardlinks = 1: a job user cannot link the cache's entries anywhere else".into(),
            None,
        ),
        Ok(v) => Finding::new(
            check,
            Status::Warn,
            format!(
                "[cache] link_hits with fs.protected_hardlinks = {v}: a job user can link a cache entry it was given to a directory of their own on the hot tier's file system and keep it after the job"
            ),
            Some(fix.into()),
        ),
        Err(e) => Finding::new(
            check,
            Status::Warn,
            format!("[cache] link_hits: fs.protected_hardlinks unknown ({e})"),
            Some(fix.into()),
        ),
    }
}

// ---- 7. shared tier ---------------------------------------------------------------------------

/// What the shared tier's root (the directory the jobs' directories are made in) is.
#[derive(Debug)]
pub struct SharedTierFacts {
    pub is_dir: bool,
    /// Owner uid and permission bits (`st_mode & 0o7777`).
    pub owner: u32,
    pub mode: u32,
    /// File system type and mount point, from /proc/self/mounts.
    pub mount: Option<(String, PathBuf)>,
    /// Where `shared_tier.lfs` was found (asked on Lustre only).
    pub lfs: Option<PathBuf>,
}

fn check_shared_tier(tier: &SharedTierConfig, is_root: bool) -> Finding {
    judge_shared_tier(tier, read_shared_tier(tier), is_root)
}

/// What the node sees of the shared tier's root: its type, owner, mode and file system.
fn read_shared_tier(tier: &SharedTierConfig) -> std::io::Result<SharedTierFacts> {
    let root = tier.root();
    std::fs::metadata(root).map(|m| {
        let canonical = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        let mount = std::fs::read_to_string("/proc/self/mounts")
            .ok()
            .and_then(|m| mount_of(&m, &canonical));
        let lfs = match &mount {
            Some((fs, _)) if fs == "lustre" => {
                find_program(&tier.lfs, &crate::env("PATH").unwrap_or_default())
            }
            _ => None,
        };
        SharedTierFacts {
            is_dir: m.is_dir(),
            owner: std::os::unix::fs::MetadataExt::uid(&m),
            mode: std::os::unix::fs::MetadataExt::mode(&m) & 0o7777,
            mount,
            lfs,
        }
    })
}

/// `program` if it is an executable file, else the first executable `program` in `path`'s
/// directories when it is a bare name (as the agent's `Command` looks it up).
pub fn find_program(program: &Path, path: &std::ffi::OsStr) -> Option<PathBuf> {
    let runnable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.components().count() != 1 || program.is_absolute() {
        return runnable(program).then(|| program.to_path_buf());
    }
    std::env::split_paths(path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(program))
        .find(|p| runnable(p))
}

/// The root exists and is a directory (FAIL otherwise, with the fix); on Lustre, `lfs` is found
/// when stripe classes need it; off Lustre a WARN (right for BeeOND or a stand-in, but no layouts).
pub fn judge_shared_tier(
    tier: &SharedTierConfig,
    facts: io::Result<SharedTierFacts>,
    is_root: bool,
) -> Finding {
    let check = "shared tier";
    let r = tier.root().display();
    let j = &tier.job_dir;
    let create = format!(
        "create it on the shared file system, the same path on every node (install -d -o root -g root -m 0755 {r}), or correct shared_tier.job_dir (now \"{j}\")"
    );
    let facts = match facts {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::PermissionDenied && !is_root => {
            return Finding::new(
                check,
                Status::Warn,
                format!("cannot look at {r} as this user: {e}"),
                Some("run doctor as root".into()),
            );
        }
        Err(e) => {
            return Finding::new(
                check,
                Status::Fail,
                format!("{r} (where each job's {j} is made): {e}"),
                Some(create),
            );
        }
    };
    if !facts.is_dir {
        return Finding::new(
            check,
            Status::Fail,
            format!("{r} (where each job's {j} is made) is not a directory"),
            Some(create),
        );
    }
    // A user who may rename entries of the root could move another job's directory aside and
    // make one of their own in its place (the jobs' directories are root's 0711, their data 0700).
    let writable_by_users = facts.mode & 0o022 != 0 && facts.mode & 0o1000 == 0;
    if facts.owner != 0 || writable_by_users {
        return Finding::new(
            check,
            Status::Fail,
            format!(
                "{r} (where each job's {j} is made) is owned by uid {} with mode {:04o}: it must be root's and writable by root alone, or users could replace other jobs' directories",
                facts.owner, facts.mode
            ),
            Some(format!("chown root:root {r} && chmod 0755 {r}")),
        );
    }
    let classes = tier.stripes.len();
    match &facts.mount {
        Some((fs, at)) if fs == "lustre" => {
            let on = format!("{r} on Lustre (mounted at {})", at.display());
            let lfs = tier.lfs.display();
            match (&facts.lfs, classes) {
                (Some(found), _) => Finding::new(
                    check,
                    Status::Pass,
                    format!(
                        "{on}, {lfs} at {}, {classes} stripe class(es)",
                        found.display()
                    ),
                    None,
                ),
                (None, 0) => Finding::new(
                    check,
                    Status::Pass,
                    format!("{on}, no stripe classes: files keep the directory's default layout ({lfs} not needed)"),
                    None,
                ),
                (None, _) => Finding::new(
                    check,
                    Status::Fail,
                    format!("{on}, but {lfs} is not found, and the {classes} stripe class(es) need it: staging to the shared tier would fail"),
                    Some("install Lustre's client tools on this node, or set shared_tier.lfs to lfs's path".into()),
                ),
            }
        }
        mount => {
            let on = match mount {
                Some((fs, at)) => format!("{r} on {fs} (mounted at {}), not Lustre", at.display()),
                None => format!("{r} (file system unknown), not Lustre"),
            };
            let unused = match classes {
                0 => String::new(),
                n => format!("; the {n} stripe class(es) are not applied"),
            };
            Finding::new(
                check,
                Status::Warn,
                format!("{on}: files keep the directory's default layout{unused}"),
                Some(format!(
                    "fine for BeeOND or a stand-in directory, if {r} is the same directory on every node; for Lustre, point shared_tier.job_dir at a Lustre mount"
                )),
            )
        }
    }
}

// ---- 8. stores --------------------------------------------------------------------------------

/// A bucket to list for a profile, and the prefix in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub scheme: ObjectScheme,
    pub bucket: String,
    pub prefix: String,
}

impl Target {
    fn url(&self) -> String {
        format!(
            "{}://{}/{}",
            self.scheme.url_scheme(),
            self.bucket,
            self.prefix
        )
    }
}

/// `s3://bucket/some/path/{user}/` → bucket and the fixed part of the path (up to the last `/`
/// before a placeholder). `None` for other schemes, no bucket, or a placeholder in the bucket.
pub fn target_of(url: &str) -> Option<Target> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = match scheme {
        "s3" => ObjectScheme::S3,
        "az" | "azure" => ObjectScheme::Azure,
        "gs" => ObjectScheme::Gcs,
        _ => return None,
    };
    let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() || bucket.contains(['{', '*']) {
        return None;
    }
    let fixed = &path[..path.find(['{', '*']).unwrap_or(path.len())];
    let prefix = &fixed[..fixed.rfind('/').map_or(0, |i| i + 1)];
    Some(Target {
        scheme,
        bucket: bucket.to_string(),
        prefix: prefix.to_string(),
    })
}

/// For each profile, the buckets to list: its own, and those of the allow rules and default
/// archive whose URLs it serves (a profile such as `s3://` names no bucket itself).
pub fn targets(cfg: &Config) -> Vec<(&StoreProfile, Vec<Target>)> {
    let urls: Vec<&str> = cfg
        .stage
        .allow
        .iter()
        .chain(&cfg.ckpt.allow)
        .map(|r| r.prefix.as_str())
        .chain(cfg.ckpt.default_archive.as_deref())
        .collect();
    cfg.stores
        .iter()
        .map(|profile| {
            let mut list: Vec<Target> = Vec::new();
            let own = target_of(&profile.prefix);
            let served = urls
                .iter()
                .filter(|u| cfg.store_for(u).is_some_and(|p| std::ptr::eq(p, profile)))
                .filter_map(|u| target_of(u));
            for t in own.into_iter().chain(served) {
                // One listing per bucket: the shortest prefix asked for.
                match list.iter_mut().find(|l| l.bucket == t.bucket) {
                    Some(l) if t.prefix.len() < l.prefix.len() => *l = t,
                    Some(_) => {}
                    None => list.push(t),
                }
            }
            (profile, list)
        })
        .collect()
}

async fn check_stores(cfg: &Config, timeout: Duration) -> Vec<Finding> {
    use futures::StreamExt;
    // The doctor asks once and says what happened: no minutes of retries behind one line.
    let mut cfg = cfg.clone();
    cfg.retry.max_retries = 1;
    cfg.retry.timeout = timeout;
    let mut out = Vec::new();
    for (profile, targets) in targets(&cfg) {
        let mut results = Vec::new();
        for t in &targets {
            let result = match sluice_archive::store::open(&cfg, t.scheme, &t.bucket) {
                Err(e) => Err(Probe::Store(e)),
                Ok(store) => {
                    let prefix = object_store::path::Path::from(t.prefix.trim_end_matches('/'));
                    let prefix = (!t.prefix.is_empty()).then_some(prefix);
                    let mut list = store.list(prefix.as_ref());
                    match tokio::time::timeout(timeout, list.next()).await {
                        Err(_) => Err(Probe::Timeout(timeout)),
                        Ok(Some(Err(e))) => Err(Probe::Store(e)),
                        Ok(_) => Ok(()),
                    }
                }
            };
            results.push((t.url(), result));
        }
        out.push(judge_store(profile, &results));
    }
    out
}

/// Why a listing failed.
#[derive(Debug)]
pub enum Probe {
    Store(object_store::Error),
    Timeout(Duration),
}

pub fn judge_store(profile: &StoreProfile, results: &[(String, Result<(), Probe>)]) -> Finding {
    use sluice_archive::store::{StoreErrorKind, classify, describe};
    let check = format!("store {}", profile.prefix);
    let endpoint = profile
        .endpoint
        .as_deref()
        .map(|e| format!(" ({e})"))
        .unwrap_or_default();
    let at = profile
        .endpoint
        .as_deref()
        .map(|e| format!(" at {e}"))
        .unwrap_or_default();
    if results.is_empty() {
        return Finding::new(
            &check,
            Status::Warn,
            format!(
                "not checked: the profile names no bucket and no allow rule or default archive uses it{endpoint}"
            ),
            Some(format!(
                "give the profile a bucket (prefix = \"{}BUCKET\") or remove it",
                profile.prefix
            )),
        );
    }
    let failed: Vec<(&String, &Probe)> = results
        .iter()
        .filter_map(|(u, r)| r.as_ref().err().map(|e| (u, e)))
        .collect();
    let Some((url, why)) = failed.first() else {
        let listed: Vec<&str> = results.iter().map(|(u, _)| u.as_str()).collect();
        return Finding::new(
            &check,
            Status::Pass,
            format!("listed {}{at}", listed.join(", ")),
            None,
        );
    };
    let (kind, text) = match why {
        Probe::Timeout(t) => (
            StoreErrorKind::TimedOut,
            format!("no answer within {}", humantime::format_duration(*t)),
        ),
        Probe::Store(e) => (classify(e), describe(e)),
    };
    let p = &profile.prefix;
    let (name, fix) = match kind {
        StoreErrorKind::NotFound => (
            "not found",
            format!(
                "create the bucket, or correct the prefix of profile {p} and the rules that use it"
            ),
        ),
        StoreErrorKind::Denied => (
            "denied",
            format!(
                "check the credentials of profile {p} (access_key_id/secret_access_key, account/access_key) and the bucket's grants for them"
            ),
        ),
        StoreErrorKind::Throttled => (
            "throttled",
            "the store asks for fewer requests: retry later".to_string(),
        ),
        StoreErrorKind::Unreachable => (
            "unreachable",
            format!(
                "check the endpoint{endpoint} of profile {p} and that the store is up and reachable from this node"
            ),
        ),
        StoreErrorKind::TimedOut => (
            "timed out",
            format!("check the endpoint{endpoint} of profile {p} and the network to it"),
        ),
        StoreErrorKind::Other => ("error", format!("see the error; check profile {p}")),
    };
    let more = match failed.len() {
        1 => String::new(),
        n => format!(" ({} of {} listings failed)", n, results.len()),
    };
    Finding::new(
        &check,
        Status::Fail,
        format!("listing {url}: {name}: {text}{more}"),
        Some(fix),
    )
}

// ---- 9. squeue --------------------------------------------------------------------------------

async fn check_squeue(squeue: Option<&Path>, timeout: Duration) -> Finding {
    let Some(squeue) = squeue else {
        return Finding::new(
            "squeue",
            Status::Pass,
            "agent.squeue = \"\": the agent never asks Slurm (not checked)".into(),
            None,
        );
    };
    let program = squeue.to_string_lossy();
    let version = command_output(&program, &["--version"], timeout).await;
    // What the agent asks after a restart; job 1 is long gone on any real cluster, and squeue's
    // "Invalid job id" answer proves slurmctld answered.
    let query = command_output(
        &program,
        &["--noheader", "--jobs", "1", "--format", "%T"],
        timeout,
    )
    .await;
    judge_squeue(&program, version, query)
}

pub fn judge_squeue(
    program: &str,
    version: Result<String, String>,
    query: Result<String, String>,
) -> Finding {
    let check = "squeue";
    let version = match version {
        Ok(v) => v.trim().to_string(),
        Err(e) => {
            return Finding::new(
                check,
                Status::Fail,
                e,
                Some(format!(
                    "install Slurm's client commands, or set agent.squeue to squeue's path (now {program})"
                )),
            );
        }
    };
    match query {
        Ok(_) => Finding::new(check, Status::Pass, format!("{version} reaches slurmctld"), None),
        Err(e) if e.contains("Invalid job id") => {
            Finding::new(check, Status::Pass, format!("{version} reaches slurmctld"), None)
        }
        Err(e) => Finding::new(
            check,
            Status::Fail,
            format!("{version} cannot ask slurmctld: {e}"),
            Some("check that slurmctld runs and this node reaches it (scontrol ping); until then the agent keeps journaled jobs' data after a restart".into()),
        ),
    }
}

// ---- sluice config check ----------------------------------------------------------------------

/// `sluice config check FILE`: the agent's own validation, and what it found.
pub fn config_check(path: &Path, node: &str) -> anyhow::Result<String> {
    let cfg = Config::load(path, node, sluice_archive::upload_memory)?;
    Ok(config_summary(&cfg))
}

pub fn config_summary(cfg: &Config) -> String {
    let stores: Vec<&str> = cfg.stores.iter().map(|s| s.prefix.as_str()).collect();
    let stores = if stores.is_empty() {
        "none (each provider's environment)".to_string()
    } else {
        stores.join(", ")
    };
    let shared = match &cfg.shared_tier {
        None => String::new(),
        Some(t) => format!(
            "  shared:     {} ({} stripe class(es))\n",
            t.job_dir,
            t.stripes.len()
        ),
    };
    format!(
        "OK (node {})\n  socket:     {}\n  hot tier:   {}\n{shared}  stores:     {stores}\n  rules:      {} stage allow, {} archive allow\n  archive:    {}\n",
        cfg.node,
        cfg.socket.display(),
        cfg.hot_root.display(),
        cfg.stage.allow.len(),
        cfg.ckpt.allow.len(),
        cfg.ckpt
            .default_archive
            .as_deref()
            .unwrap_or("none (jobs give --ckpt-archive)"),
    )
}

#[cfg(test)]
mod tests;
