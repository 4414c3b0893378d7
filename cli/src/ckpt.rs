//! `sluice ckpt`: checkpoints of a job through this node's agent (`commit`, `list`), and archives
//! reached directly by URL (`list URL`, `verify`, `restore`) with the agent's own archive engine,
//! store profiles and archive-access rules ([`sluice_archive::access`], as root: every checkpoint)
//! — how admins inspect and rescue what is in object storage. Users who may not read the agent's
//! configuration reach their own archived checkpoints through the agent instead ([`route`],
//! [`crate::remote`]), which applies the same module. Both routes print the same values: the
//! socket's answers are turned into this module's output types once (`Verified::from`,
//! `Restored::new`, `RestorePlan::new`).
//!
//! Choices that need the environment (`$SLURM_JOB_ID`, the node's name, the config file) are pure
//! functions of their inputs here, so they are unit-tested; `main` passes the real environment.

use crate::progress::{Mode, Shown};
use anyhow::{Context, anyhow, bail};
use serde::Serialize;
use sluice_archive::access::{self, AccessError, DestRefusal, Destination, Reader};
use sluice_archive::{Archiver, CheckpointInfo};
use sluice_core::config::{Config, ConfigError};
use sluice_core::safefs::{self, Owner, RemoveAs};
use sluice_proto::msg::{
    ArchiveRestored, ArchiveVerified, CkptPoisoned, CkptStatus, JobId, PoisonMark,
};
use std::ffi::OsString;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Set by Slurm in every job environment.
pub const JOB_ID_ENV: &str = "SLURM_JOB_ID";
/// The agent's configuration: store profiles and archive settings for URL mode.
pub const DEFAULT_CONFIG: &str = "/etc/sluice/sluice.toml";
/// `TAG` of `verify` and `restore` that means the newest intact checkpoint.
pub use sluice_archive::access::LATEST;

/// The job a command is about: `--job`, else `$SLURM_JOB_ID` (empty counts as unset). `other` names
/// another way to say what is meant, for the error outside a job (e.g. "or give an archive URL").
pub fn job_id(
    flag: Option<JobId>,
    env: impl Fn(&str) -> Option<OsString>,
    other: &str,
) -> anyhow::Result<JobId> {
    if let Some(id) = flag {
        return Ok(id);
    }
    let Some(value) = env(JOB_ID_ENV).filter(|v| !v.is_empty()) else {
        bail!(
            "not inside a Slurm job (${JOB_ID_ENV} is not set): run this in the job's script or an \
             srun step, or pass --job JOBID{other}"
        );
    };
    value
        .to_str()
        .and_then(|s| s.trim().parse::<JobId>().ok())
        .with_context(|| {
            format!(
                "${JOB_ID_ENV} is '{}', not a job id; pass --job JOBID",
                value.to_string_lossy()
            )
        })
}

/// This node's Slurm name: `$SLURMD_NODENAME`, else the short hostname.
pub fn node_name(
    env: impl Fn(&str) -> Option<OsString>,
    hostname: impl FnOnce() -> Option<String>,
) -> Option<String> {
    env(crate::socket::NODENAME_ENV)
        .filter(|v| !v.is_empty())
        .and_then(|v| v.into_string().ok())
        .or_else(|| {
            hostname()
                .map(|h| crate::socket::short_hostname(&h).to_string())
                .filter(|h| !h.is_empty())
        })
}

/// Checks a tag before bothering the agent with it.
pub fn check_tag(tag: &str) -> anyhow::Result<()> {
    sluice_proto::options::validate_tag("ckpt", tag).map_err(|e| anyhow!("{}", e.message))
}

/// The archive URL the agent reports for `tag`, if it has one.
pub fn archive_url_of(ckpts: &[CkptStatus], tag: &str) -> Option<String> {
    ckpts
        .iter()
        .find(|c| c.tag == tag)
        .map(|c| c.archive_url.clone())
        .filter(|u| !u.is_empty())
}

// ------------------------------------------------------------------------------------ config

/// Enough of a configuration to open archives with the built-in settings and the object stores'
/// usual environment credentials (the paths are never used by the CLI).
const BUILTIN_CONFIG: &str = "[agent]\nsocket = \"/run/sluice/%n.sock\"\n\
    state_dir = \"/var/lib/sluice/%n/state\"\n[hot_tier]\nroot = \"/var/lib/sluice/%n/hot\"\n";

/// Loads the agent's configuration for URL mode: `--config`, else [`DEFAULT_CONFIG`]. Without
/// `--config` and without the default file (a login node), the built-in settings serve, and the
/// note says so when it matters (object stores: credentials then come from the environment).
pub fn load_config(
    flag: Option<&Path>,
    url: &str,
    node: &str,
) -> anyhow::Result<(Config, Option<String>)> {
    let path = flag.unwrap_or(Path::new(DEFAULT_CONFIG));
    match Config::load(path, node, sluice_archive::upload_memory) {
        Ok(cfg) => Ok((cfg, None)),
        Err(ConfigError::Read { source, .. })
            if flag.is_none() && source.kind() == ErrorKind::NotFound =>
        {
            let cfg = Config::parse(BUILTIN_CONFIG, node, sluice_archive::upload_memory)
                .map_err(|e| anyhow!("{e}"))?;
            let note = (!url.starts_with("file:")).then(|| {
                format!(
                    "{DEFAULT_CONFIG} does not exist: using the object store's credentials from the \
                     environment (pass --config PATH for the agent's store profiles)"
                )
            });
            Ok((cfg, note))
        }
        Err(ConfigError::Read { path, source }) if source.kind() == ErrorKind::PermissionDenied => {
            Err(anyhow!(
                "cannot read {}: {source}; reading archives directly takes the agent's \
                 configuration, which only root may read (inside a job, `sluice ckpt list` asks \
                 the agent instead)",
                path.display()
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// How `sluice ckpt list|verify|restore URL` reaches an archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// With the agent's configuration and store profiles, in this process.
    Direct,
    /// Through this node's agent, which holds the credentials and shows only the caller's own
    /// checkpoints ([`crate::remote`]).
    Agent,
}

/// Direct when `--config` names a file, when the caller is root, or when the agent's
/// configuration can be read or does not exist (a login node: credentials then come from the
/// environment, as before); through the agent when the caller may not read it — a user on a node
/// whose configuration is root's. `open` tries to read a file.
pub fn route(
    flag: Option<&Path>,
    is_root: bool,
    open: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Route {
    if flag.is_some() || is_root {
        return Route::Direct;
    }
    match open(Path::new(DEFAULT_CONFIG)) {
        Err(e) if e.kind() == ErrorKind::PermissionDenied => Route::Agent,
        _ => Route::Direct,
    }
}

/// A small runtime for the archive engine: its blocking work runs on tokio's blocking pool.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

// ------------------------------------------------------------------------------------ list

#[derive(Debug, Serialize)]
pub struct ArchiveListing {
    pub url: String,
    pub ckpts: Vec<CheckpointInfo>,
}

#[derive(Debug, Serialize)]
pub struct JobListing {
    pub job_id: JobId,
    pub ckpts: Vec<CkptStatus>,
}

/// Every checkpoint of the archive (root reads them all), oldest first.
pub async fn list(a: &Archiver) -> anyhow::Result<ArchiveListing> {
    Ok(ArchiveListing {
        url: a.url().to_string(),
        ckpts: access::list(a, &Reader::Anyone).await?,
    })
}

// ------------------------------------------------------------------------------------ verify

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DamagedFile {
    pub path: String,
    pub detail: String,
}

/// What `sluice ckpt verify` found; `--json` prints it as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verified {
    pub url: String,
    pub tag: String,
    pub ok: bool,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub damaged: Vec<DamagedFile>,
}

impl From<ArchiveVerified> for Verified {
    fn from(v: ArchiveVerified) -> Verified {
        Verified {
            url: v.url,
            tag: v.tag,
            ok: v.ok,
            files: v.files,
            raw_bytes: v.raw_bytes,
            stored_bytes: v.stored_bytes,
            damaged: v
                .damaged
                .into_iter()
                .map(|(path, detail)| DamagedFile { path, detail })
                .collect(),
        }
    }
}

/// Reads every object of the checkpoint and checks it against the MANIFEST ([`access::verify`]),
/// showing how far it is as `progress` says. Damage is an answer, not an error.
pub async fn verify(a: &Archiver, tag: &str, progress: Mode) -> anyhow::Result<Verified> {
    let mut shown = Shown::new(progress, |_| {});
    Ok(access::verify(a, &Reader::Anyone, tag, &mut shown)
        .await?
        .into())
}

// ------------------------------------------------------------------------------------ restore

/// The directory a restore writes into, opened without following a symlink and checked
/// ([`Destination::check`]).
pub struct Dest {
    pub path: PathBuf,
    dest: Destination,
    /// Made by this restore, so removed again when it fails.
    created: bool,
}

/// `path` cannot be created, for `e`.
fn cannot_create(path: &Path, e: &std::io::Error) -> String {
    let hint = if e.kind() == ErrorKind::NotFound {
        "; create its parent directory first"
    } else {
        ""
    };
    format!("cannot create {}: {e}{hint}", path.display())
}

/// The directory `path` would be created in, when it is missing.
fn parent_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Whether `dir` is on a kernel file system ([`access::is_kernel_fs`]); unknown counts as not
/// (creating there then fails on its own).
fn on_kernel_fs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir).is_ok_and(|s| access::is_kernel_fs(s.filesystem_type()))
}

/// Opens `path` for a restore whose files become `owner`'s: created when missing (its parent must
/// exist, and not be on a kernel file system), else an empty directory of that user. Never a
/// symlink; the open directory passes [`Destination::check`].
pub fn prepare_dest(path: &Path, owner: Owner) -> anyhow::Result<Dest> {
    let shown = path.display();
    let refused = |r: DestRefusal| anyhow!(r.message(&shown.to_string()));
    let created = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            if on_kernel_fs(parent_of(path)) {
                return Err(refused(DestRefusal::KernelFs));
            }
            std::fs::create_dir(path).map_err(|e| anyhow!(cannot_create(path, &e)))?;
            true
        }
        Err(e) => bail!("{shown}: {e}"),
        Ok(m) if m.file_type().is_symlink() => return Err(refused(DestRefusal::Symlink)),
        Ok(m) if !m.is_dir() => return Err(refused(DestRefusal::NotDir)),
        Ok(_) => false,
    };
    let fd = safefs::open_root_dir(path).with_context(|| format!("opening {shown}"))?;
    let fd = Arc::new(fd);
    match Destination::check(fd.clone(), owner, shown.to_string()) {
        Ok(dest) => Ok(Dest {
            path: path.to_path_buf(),
            dest,
            created,
        }),
        Err(e) => {
            // Only a directory this call made (and someone swapped meanwhile) is cleaned up; an
            // existing one is left exactly as it is.
            if created {
                let me = RemoveAs {
                    uid: nix::unistd::geteuid().as_raw(),
                };
                let _ = safefs::clear_dir(&fd, me);
                let _ = std::fs::remove_dir(path);
            }
            Err(e.into())
        }
    }
}

/// What a restore would make of its destination, found without changing anything (`--dry-run`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "dest_state", rename_all = "lowercase")]
pub enum DestCheck {
    /// It does not exist: the restore creates it.
    Create,
    /// An empty directory of the caller's: the restore fills it.
    Empty,
    /// The restore would refuse it, saying `reason`.
    Refused { reason: String },
}

/// [`prepare_dest`]'s decision for user `uid`, with the same words, but touching nothing: a
/// missing `path` is checked for a parent directory the user may create it in.
pub fn check_dest(path: &Path, uid: u32) -> DestCheck {
    use std::os::unix::fs::MetadataExt;
    let refused = |reason: String| DestCheck::Refused { reason };
    let refusal = |r: DestRefusal| refused(r.message(&path.display().to_string()));
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let parent = parent_of(path);
            let usable = match std::fs::metadata(parent) {
                Ok(m) if !m.is_dir() => Err(std::io::Error::from_raw_os_error(nix::libc::ENOTDIR)),
                Ok(_) if on_kernel_fs(parent) => return refusal(DestRefusal::KernelFs),
                Ok(_) => {
                    use nix::unistd::{AccessFlags, access};
                    access(parent, AccessFlags::W_OK | AccessFlags::X_OK)
                        .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))
                }
                Err(e) => Err(e),
            };
            match usable {
                Ok(()) => DestCheck::Create,
                Err(e) => refused(cannot_create(path, &e)),
            }
        }
        Err(e) => refused(format!("{}: {e}", path.display())),
        Ok(m) if m.file_type().is_symlink() => refusal(DestRefusal::Symlink),
        Ok(m) if !m.is_dir() => refusal(DestRefusal::NotDir),
        Ok(_) if on_kernel_fs(path) => refusal(DestRefusal::KernelFs),
        Ok(m) if m.uid() != uid => refusal(DestRefusal::Theirs(m.uid())),
        Ok(_) => match std::fs::read_dir(path).map(|mut d| d.next().is_none()) {
            Ok(true) => DestCheck::Empty,
            Ok(false) => refusal(DestRefusal::NotEmpty),
            Err(e) => refused(format!("{}: {e}", path.display())),
        },
    }
}

/// What `sluice ckpt restore --dry-run` found; `--json` prints it as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestorePlan {
    /// Always true: tells this answer from a restore's.
    pub dry_run: bool,
    pub url: String,
    /// The checkpoint a restore would take now (`latest` resolved).
    pub tag: String,
    pub dest: PathBuf,
    #[serde(flatten)]
    pub dest_check: DestCheck,
    pub files: u64,
    pub raw_bytes: u64,
    /// What a restore would download.
    pub stored_bytes: u64,
}

impl RestorePlan {
    /// The plan of a restore into `dest` ([`access::plan`], here or the agent's), with what
    /// becomes of `dest`.
    pub fn new(r: ArchiveRestored, dest: &Path, dest_check: DestCheck) -> RestorePlan {
        RestorePlan {
            dry_run: true,
            url: r.url,
            tag: r.tag,
            dest: dest.to_path_buf(),
            dest_check,
            files: r.files,
            raw_bytes: r.raw_bytes,
            stored_bytes: r.stored_bytes,
        }
    }
}

/// What restoring `tag` into `dest` as user `uid` would do, without writing anything: the
/// checkpoint ([`access::plan`]), its size, and what becomes of `dest`.
pub async fn plan_restore(
    a: &Archiver,
    (tag, force): (&str, bool),
    dest: &Path,
    uid: u32,
) -> anyhow::Result<RestorePlan> {
    let dest_check = check_dest(dest, uid);
    let r = access::plan(a, &Reader::Anyone, tag, force).await?;
    for n in &r.notes {
        eprintln!("sluice: {n}");
    }
    Ok(RestorePlan::new(r, dest, dest_check))
}

impl Dest {
    /// The open directory (passed to the agent for a restore through it).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.dest.fd().as_fd()
    }

    /// Undoes a failed restore: the partial files (the caller's own entries and root's, never
    /// another user's moved in there), and the directory itself when it was made for this
    /// restore. Says what happened, for the error message.
    fn discard(&self) -> String {
        let shown = self.path.display();
        let me = RemoveAs {
            uid: nix::unistd::geteuid().as_raw(),
        };
        match safefs::clear_dir(self.dest.fd(), me) {
            Err(e) => format!("{shown} holds a partial restore ({e}); remove it by hand"),
            Ok(()) if self.created => match std::fs::remove_dir(&self.path) {
                Ok(()) => format!("{shown} was removed again"),
                Err(e) => format!("{shown} is empty but could not be removed: {e}"),
            },
            Ok(()) => format!("{shown} was emptied again"),
        }
    }
}

/// What `sluice ckpt restore` did; `--json` prints it as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Restored {
    pub url: String,
    pub tag: String,
    pub dest: PathBuf,
    pub files: u64,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    /// Damaged newer checkpoints skipped on the way to `latest`.
    pub skipped: Vec<String>,
    /// Poisoned newer checkpoints `latest` passed over; a poisoned one restored as forced.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl Restored {
    /// A restore ([`access::restore`], here or the agent's) into `dest`.
    pub fn new(r: ArchiveRestored, dest: &Path) -> Restored {
        Restored {
            url: r.url,
            tag: r.tag,
            dest: dest.to_path_buf(),
            files: r.files,
            raw_bytes: r.raw_bytes,
            stored_bytes: r.stored_bytes,
            skipped: r.skipped,
            notes: r.notes,
        }
    }
}

/// Restores `tag` (or the newest intact checkpoint, for `latest`) into `dest` with
/// [`access::restore`], every file owned by `dest`'s owner, showing how far it is as `progress`
/// says and telling `note` about each damaged checkpoint `latest` passes over. On failure `dest`
/// is left as it was found.
pub async fn restore(
    a: &Archiver,
    (tag, force): (&str, bool),
    dest: &Dest,
    note: impl FnMut(&str),
    progress: Mode,
) -> anyhow::Result<Restored> {
    let mut shown = Shown::new(progress, note);
    match access::restore(a, &Reader::Anyone, tag, force, &dest.dest, &mut shown).await {
        Ok(r) => Ok(Restored::new(r, &dest.path)),
        Err(e) => Err(fail(e.into(), dest)),
    }
}

// ------------------------------------------------------------------------------------ poison

/// Marks checkpoint `tag` bad directly in the archive ([`access::poison`]) as this process's
/// user: root any checkpoint, archived or not yet; another user (who may read the agent's
/// configuration, or gives --config) only an archived checkpoint of theirs, as the agent would.
pub async fn poison(a: &Archiver, tag: &str, reason: &str) -> anyhow::Result<CkptPoisoned> {
    let uid = nix::unistd::geteuid();
    let user = nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .map_or_else(|| uid.to_string(), |u| u.name);
    let (reader, unpublished_ok) = if uid.is_root() {
        (Reader::Anyone, true)
    } else {
        (Reader::User(user.clone()), false)
    };
    let mark = PoisonMark {
        user,
        uid: uid.as_raw(),
        at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        reason: reason.trim().to_string(),
    };
    Ok(access::poison(a, &reader, tag, mark, unpublished_ok).await?)
}

/// A failed restore: the error, then what became of `dest`. An error that already says what is
/// left there (clearing it failed) stands alone.
pub fn fail(e: anyhow::Error, dest: &Dest) -> anyhow::Error {
    if let Some(AccessError::Partial { .. }) = e.downcast_ref() {
        return e;
    }
    let left = dest.discard();
    anyhow!("{}; {left}", crate::render::error_text(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    #[test]
    fn job_id_comes_from_the_flag_then_slurm() {
        let inside = env_of(&[("SLURM_JOB_ID", "4242")]);
        assert_eq!(job_id(None, &inside, "").unwrap(), 4242);
        assert_eq!(job_id(Some(7), &inside, "").unwrap(), 7);
        assert_eq!(
            job_id(None, env_of(&[("SLURM_JOB_ID", " 99\n")]), "").unwrap(),
            99
        );
        assert_eq!(job_id(Some(7), env_of(&[]), "").unwrap(), 7);
    }

    #[test]
    fn outside_a_job_the_error_says_what_to_do() {
        for env in [env_of(&[]), env_of(&[("SLURM_JOB_ID", "")])] {
            let e = job_id(None, env, " or give an archive URL")
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("not inside a Slurm job ($SLURM_JOB_ID is not set)")
                    && e.ends_with("pass --job JOBID or give an archive URL"),
                "{e}"
            );
        }
        let e = job_id(None, env_of(&[("SLURM_JOB_ID", "12_3")]), "")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "$SLURM_JOB_ID is '12_3', not a job id; pass --job JOBID");
    }

    #[test]
    fn node_names_and_tags() {
        let host = || Some("gpu07.cluster.example".to_string());
        assert_eq!(
            node_name(env_of(&[("SLURMD_NODENAME", "n3")]), host).as_deref(),
            Some("n3")
        );
        assert_eq!(node_name(env_of(&[]), host).as_deref(), Some("gpu07"));
        assert_eq!(node_name(env_of(&[]), || None), None);
        check_tag("step-100_a.b+c").unwrap();
        for bad in ["", ".hidden", "a/b", "..", "x y"] {
            assert!(check_tag(bad).is_err(), "{bad}");
        }
        assert!(
            check_tag("a/b")
                .unwrap_err()
                .to_string()
                .starts_with("checkpoint tag 'a/b' may only hold")
        );
    }

    #[test]
    fn the_agents_url_for_a_tag() {
        let ckpts = crate::fixtures::job_ckpts();
        assert_eq!(
            archive_url_of(&ckpts, "step200").as_deref(),
            Some(crate::fixtures::CKPT_URL)
        );
        assert_eq!(archive_url_of(&ckpts, "step999"), None);
        let mut none = ckpts.clone();
        none[0].archive_url.clear();
        assert_eq!(archive_url_of(&none, "step100"), None);
    }

    #[test]
    fn config_falls_back_only_for_a_missing_default() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.toml");
        // An explicit --config must exist.
        let e = load_config(Some(&missing), "s3://b/x", "n1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read") && e.contains("nope.toml"), "{e}");
        // A real one is read, with %n as the node.
        let cfg = dir.path().join("sluice.toml");
        std::fs::write(
            &cfg,
            "[agent]\nsocket='/s/%n'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n[ckpt]\npart_size='8MiB'\n",
        )
        .unwrap();
        let (c, note) = load_config(Some(&cfg), "s3://b/x", "n1").unwrap();
        assert_eq!((c.ckpt.part_size, note), (8 << 20, None));
        assert_eq!(c.socket, PathBuf::from("/s/n1"));
        // A broken one is an error, never silently replaced.
        std::fs::write(&cfg, "[agent\n").unwrap();
        assert!(load_config(Some(&cfg), "file:///x", "n1").is_err());
        // The built-in settings parse, and serve when the default file is missing (a login node):
        // with a note where credentials matter.
        Config::parse(BUILTIN_CONFIG, "n1", sluice_archive::upload_memory).unwrap();
        if !Path::new(DEFAULT_CONFIG).exists() {
            let (_, note) = load_config(None, "s3://b/x", "n1").unwrap();
            assert!(note.unwrap().contains("--config PATH"));
            assert!(load_config(None, "file:///x", "n1").unwrap().1.is_none());
        }
    }

    #[test]
    fn users_who_cannot_read_the_config_go_through_the_agent() {
        use std::io::Error;
        let denied = |_: &Path| Err(Error::from(ErrorKind::PermissionDenied));
        let missing = |_: &Path| Err(Error::from(ErrorKind::NotFound));
        let readable = |_: &Path| Ok(());
        assert_eq!(route(None, false, denied), Route::Agent);
        assert_eq!(route(None, false, readable), Route::Direct);
        // A login node without the agent's config: credentials from the environment, as before.
        assert_eq!(route(None, false, missing), Route::Direct);
        // Root, and an explicit --config, read directly whatever the default file is.
        assert_eq!(route(None, true, denied), Route::Direct);
        let flag = Path::new("/etc/mine.toml");
        assert_eq!(route(Some(flag), false, denied), Route::Direct);
    }

    #[test]
    fn restore_destinations() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let owner = |uid| Owner {
            uid,
            gid: nix::unistd::getegid().as_raw(),
        };
        // Missing: created, and removed again when the restore fails.
        let new = dir.path().join("new");
        let d = prepare_dest(&new, owner(me)).unwrap();
        assert!(d.created && new.is_dir());
        std::fs::write(new.join("partial"), b"x").unwrap();
        std::fs::create_dir_all(new.join("a/b")).unwrap();
        assert_eq!(d.discard(), format!("{} was removed again", new.display()));
        assert!(!new.exists());
        // Existing and empty: used, and emptied again (not removed) on failure.
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let d = prepare_dest(&empty, owner(me)).unwrap();
        assert!(!d.created);
        std::fs::write(empty.join("partial"), b"x").unwrap();
        assert!(d.discard().ends_with("was emptied again"));
        assert!(empty.is_dir() && std::fs::read_dir(&empty).unwrap().next().is_none());
        // Refused: not empty, a file, a symlink, a missing parent, someone else's.
        std::fs::write(empty.join("x"), b"x").unwrap();
        let err = |p: &Path, uid| prepare_dest(p, owner(uid)).err().unwrap().to_string();
        assert!(
            err(&empty, me).ends_with("is not empty; give the path of a new or empty directory")
        );
        assert!(err(&empty.join("x"), me).contains("exists and is not a directory"));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &link).unwrap();
        assert!(err(&link, me).contains("is a symbolic link"));
        assert!(!dir.path().join("elsewhere").exists());
        assert!(
            err(&dir.path().join("no/such"), me).ends_with("create its parent directory first")
        );
        let theirs = dir.path().join("theirs");
        let e = err(&theirs, me + 1);
        assert!(e.contains(&format!("belongs to uid {me}")), "{e}");
        assert!(!theirs.exists(), "a refused destination it made is removed");
        // Someone else's directory is refused and left untouched, contents and all.
        let e = err(&empty, me + 1);
        assert!(e.contains(&format!("belongs to uid {me}")), "{e}");
        assert_eq!(std::fs::read(empty.join("x")).unwrap(), b"x");
    }

    /// Root's CLI refuses what the agent refuses: a destination on a kernel file system, existing
    /// or to be created there, before anything is made; the dry run says the same (a cgroup file
    /// system: tests/cli.rs).
    #[test]
    fn kernel_file_systems_are_no_restore_destinations() {
        let me = nix::unistd::geteuid().as_raw();
        let owner = Owner {
            uid: me,
            gid: nix::unistd::getegid().as_raw(),
        };
        let kernel =
            "is on a kernel file system (proc, sys, cgroup); restore into a directory on a disk";
        let mine = PathBuf::from(format!("/proc/{}", std::process::id()));
        let new = mine.join("sluice-restore");
        for p in [&mine, &new] {
            let e = prepare_dest(p, owner).err().unwrap().to_string();
            assert_eq!(e, format!("{} {kernel}", p.display()));
            assert_eq!(
                check_dest(p, me),
                DestCheck::Refused {
                    reason: format!("{} {kernel}", p.display())
                }
            );
        }
        assert!(!new.exists());
    }
}
