//! Reading archived checkpoints on someone's behalf: which exist (`list`, `latest` resolved),
//! whether one is intact (`verify`), what a restore would take (`plan`), and the restore itself
//! into a directory passed open. The one implementation behind `sluice ckpt list|verify|restore
//! URL`, whether the CLI reads the archive itself (root, an admin) or the agent reads it for a
//! user over its socket; the agent adds only who may name which archive (its policy) and how many
//! requests one user may run (its gate).
//!
//! The rules, stated once (docs/SECURITY.md, "Archives for users outside jobs"):
//! - a [`Reader`] sees, verifies and restores only the checkpoints whose MANIFEST names them as
//!   the job's user; another user's checkpoint is answered exactly like a missing one;
//! - a restore writes only below a directory the caller opened ([`Destination`]), fd-relative,
//!   never re-resolving a path; that directory must be a directory, the caller's, empty, and not
//!   on a kernel file system (proc, sys, cgroup, …: root creating files there changes the
//!   kernel's state). A failed restore leaves it empty again.
//!
//! Answers are the socket's types ([`ArchiveVerified`], [`ArchiveRestored`]); errors carry the
//! code they travel with ([`AccessError::code`]).

use crate::manifest::Manifest;
use crate::poison::{self, Poisoned};
use crate::{
    ArchiveError, ArchiveProgress, ArchiveStore, Archiver, CheckpointInfo, CheckpointState,
    JobMeta, check_name, open_archive, parse_archive_url,
};
use sluice_core::config::Config;
use sluice_core::rt::blocking;
use sluice_core::safefs::{Owner, RemoveAs};
use sluice_proto::msg::{
    ArchiveRestored, ArchiveVerified, ArchivedCkpt, CkptPoisoned, ErrorCode, ErrorReply, PoisonMark,
};
use std::future::Future;
use std::io::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// `TAG` meaning the newest intact checkpoint.
pub const LATEST: &str = "latest";

/// Why a checkpoint cannot be read, listed or restored for a caller.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// A `file://` archive that does not exist (opening it would create it, as root).
    #[error("{url}: {path} does not exist; nothing is archived there")]
    NothingThere { url: String, path: String },
    #[error("{url}: {path}: {source}")]
    Unreadable {
        url: String,
        path: String,
        source: std::io::Error,
    },
    /// The URL or the store settings are unusable.
    #[error(transparent)]
    Open(ArchiveError),
    /// `latest` found no complete checkpoint (of the reader's; `other`: besides those passed over).
    #[error(
        "{url}: no{} complete checkpoint{} to use as 'latest'",
        if *other { " other" } else { "" },
        if *of_yours { " of yours" } else { "" }
    )]
    NoLatest {
        url: String,
        other: bool,
        of_yours: bool,
    },
    /// A tag that is missing or another user's: the two read the same.
    #[error("{url}: no archived checkpoint {tag} of yours")]
    NotYours { url: String, tag: String },
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error("{}", refusal.message(dest))]
    Refused { dest: String, refusal: DestRefusal },
    #[error("{dest} cannot be checked: {source}")]
    Unchecked { dest: String, source: nix::Error },
    /// A named restore of a poisoned checkpoint, not forced.
    #[error(
        "{url}: checkpoint {tag} is poisoned ({}); restore another one, or force this one (sluice ckpt restore --force, or --ckpt-restore={tag}!)",
        poison::describe(mark)
    )]
    Poisoned {
        url: String,
        tag: String,
        mark: Box<PoisonMark>,
    },
    /// The tag has a poison mark that does not count (not its owner's nor root's), which cannot
    /// be replaced: the owner's poison would be lost.
    #[error(
        "{url}: checkpoint {tag} holds a POISON mark by {user}, who does not own it, so it does not count and cannot be replaced; ask your admin to remove {tag}/POISON from the archive, then poison it again"
    )]
    ForeignMark {
        url: String,
        tag: String,
        user: String,
    },
    /// A request that cannot be served as given (the message says what to give instead).
    #[error("{0}")]
    Usage(String),
    /// A failed restore whose partial files could not all be removed.
    #[error("{source}; {dest} holds a partial restore ({left}): remove it")]
    Partial {
        source: Box<AccessError>,
        dest: String,
        left: String,
    },
}

impl AccessError {
    /// The code the error travels with over the agent's socket.
    pub fn code(&self) -> ErrorCode {
        match self {
            AccessError::NothingThere { .. }
            | AccessError::Unreadable { .. }
            | AccessError::NoLatest { .. }
            | AccessError::NotYours { .. }
            | AccessError::Archive(ArchiveError::NotArchived { .. }) => ErrorCode::NotFound,
            AccessError::Open(_)
            | AccessError::Unchecked { .. }
            | AccessError::Archive(ArchiveError::BadName { .. }) => ErrorCode::BadRequest,
            AccessError::Usage(_) => ErrorCode::BadRequest,
            AccessError::Refused { .. }
            | AccessError::Poisoned { .. }
            | AccessError::ForeignMark { .. } => ErrorCode::Forbidden,
            AccessError::Archive(_) => ErrorCode::Internal,
            AccessError::Partial { source, .. } => source.code(),
        }
    }
}

impl From<AccessError> for ErrorReply {
    fn from(e: AccessError) -> ErrorReply {
        ErrorReply::new(e.code(), e.to_string())
    }
}

/// Whose checkpoints a caller may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reader {
    /// Root: every checkpoint, partial and invalid ones too.
    Anyone,
    /// A user, by name (as `--ckpt-restore` matches: the MANIFEST records no uid): the complete
    /// checkpoints whose job was theirs. A partial or invalid one has no owner to show it to.
    User(String),
}

impl Reader {
    /// Whether a checkpoint whose MANIFEST names `job_user` (none: partial or invalid) is theirs.
    pub fn owns(&self, job_user: Option<&str>) -> bool {
        match self {
            Reader::Anyone => true,
            Reader::User(name) => job_user == Some(name.as_str()),
        }
    }

    /// Whether a listed checkpoint is theirs.
    fn sees(&self, i: &CheckpointInfo) -> bool {
        self.owns(i.job.as_ref().map(|j| j.user.as_str()))
    }

    /// The reader's checkpoints among `all`, in their order.
    pub fn visible(&self, all: Vec<CheckpointInfo>) -> Vec<CheckpointInfo> {
        all.into_iter().filter(|i| self.sees(i)).collect()
    }
}

/// One verify or restore a [`Watch`] follows.
pub struct Reading<'a, T> {
    /// `restore step-3`, `verify step-3`.
    pub label: String,
    /// What it has done so far, of what.
    pub counters: &'a ArchiveProgress,
    /// Tells an outcome that went through everything from one that stopped short.
    pub finished: fn(&T) -> bool,
}

/// How a caller follows a long read: the CLI shows progress and notes on a terminal, the agent
/// nothing ([`Unwatched`]).
pub trait Watch {
    /// Awaits `work`, the [`Reading`] `_what`; by default without showing anything.
    fn watch<F: Future>(
        &mut self,
        _what: Reading<'_, F::Output>,
        work: F,
    ) -> impl Future<Output = F::Output> {
        work
    }

    /// Something to tell the caller now (a damaged checkpoint `latest` passes over).
    fn note(&mut self, _text: &str) {}
}

/// A [`Watch`] that shows nothing.
pub struct Unwatched;

impl Watch for Unwatched {}

/// Opens `url` for reading. A `file://` archive must exist: the opener would create it, and a typo
/// should not leave an empty archive behind (made by root, for the agent).
pub fn open(cfg: &Config, url: &str) -> Result<Archiver, AccessError> {
    let loc = parse_archive_url(url).map_err(AccessError::Open)?;
    if let ArchiveStore::Local(path) = &loc.store {
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(AccessError::NothingThere {
                    url: loc.to_string(),
                    path: path.display().to_string(),
                });
            }
            Err(source) => {
                return Err(AccessError::Unreadable {
                    url: loc.to_string(),
                    path: path.display().to_string(),
                    source,
                });
            }
            Ok(_) => {}
        }
    }
    open_archive(cfg, url).map_err(AccessError::Open)
}

/// The reader's checkpoints in the archive, oldest first.
pub async fn list(a: &Archiver, reader: &Reader) -> Result<Vec<CheckpointInfo>, AccessError> {
    Ok(reader.visible(a.list().await?))
}

/// `tag`, checked, when it is the reader's; `latest` resolved to the reader's newest complete
/// checkpoint that is not poisoned and whose objects are all there, passing over those in `skip`.
/// Another user's tag reads as a missing one.
pub async fn resolve(
    a: &Archiver,
    reader: &Reader,
    tag: &str,
    skip: &[String],
) -> Result<String, AccessError> {
    Ok(resolve_noting(a, reader, tag, skip).await?.0)
}

/// [`resolve`], with a note for each poisoned checkpoint `latest` passed over.
async fn resolve_noting(
    a: &Archiver,
    reader: &Reader,
    tag: &str,
    skip: &[String],
) -> Result<(String, Vec<String>), AccessError> {
    let user = matches!(reader, Reader::User(_));
    if tag == LATEST {
        let mut exclude: Vec<String> = Vec::new();
        if user {
            let all = a.list().await?;
            exclude.extend(all.into_iter().filter(|i| !reader.sees(i)).map(|i| i.tag));
        }
        exclude.extend(skip.iter().cloned());
        let found = a.latest_good(&exclude).await?;
        let notes = found
            .poisoned
            .iter()
            .map(|(t, mark)| poison::skipped_note(a.url(), t, mark))
            .collect();
        let tag = found.tag.ok_or_else(|| AccessError::NoLatest {
            url: a.url().to_string(),
            other: !skip.is_empty() || !found.poisoned.is_empty(),
            of_yours: user,
        })?;
        return Ok((tag, notes));
    }
    check_name("checkpoint tag", tag)?;
    if !user {
        return Ok((tag.to_string(), Vec::new()));
    }
    let not_yours = || AccessError::NotYours {
        url: a.url().to_string(),
        tag: tag.to_string(),
    };
    match a.manifest(tag).await {
        Ok(m) if reader.owns(Some(&m.job.user)) => Ok((tag.to_string(), Vec::new())),
        Ok(_) | Err(ArchiveError::NotArchived { .. }) => Err(not_yours()),
        Err(e) => Err(e.into()),
    }
}

/// A named restore of `tag`: refused when it is poisoned, unless `force` (then the note says
/// what was restored).
async fn check_poison(a: &Archiver, tag: &str, force: bool) -> Result<Vec<String>, AccessError> {
    match a.poison_of(tag).await? {
        None => Ok(Vec::new()),
        Some(mark) if force => Ok(vec![poison::forced_note(a.url(), tag, &mark)]),
        Some(mark) => Err(AccessError::Poisoned {
            url: a.url().to_string(),
            tag: tag.to_string(),
            mark: Box::new(mark),
        }),
    }
}

/// Marks the reader's checkpoint `tag` bad with `mark` ([`crate::poison`]): once; a second
/// poison answers the first mark (`already`). `unpublished_ok`: the caller knows the tag is
/// theirs without a MANIFEST (the job that committed it; root), so a tag not archived yet is
/// marked too, ahead of its MANIFEST; otherwise such a tag reads as a missing one.
pub async fn poison(
    a: &Archiver,
    reader: &Reader,
    tag: &str,
    mark: PoisonMark,
    unpublished_ok: bool,
) -> Result<CkptPoisoned, AccessError> {
    if tag == LATEST {
        return Err(AccessError::Usage(format!(
            "name the checkpoint to poison (a tag such as step-100), not '{LATEST}': which one is newest may change under you"
        )));
    }
    check_name("checkpoint tag", tag)?;
    poison::check_reason(&mark.reason).map_err(AccessError::Usage)?;
    let not_yours = || AccessError::NotYours {
        url: a.url().to_string(),
        tag: tag.to_string(),
    };
    let owner = match a.manifest(tag).await {
        Ok(m) if reader.owns(Some(&m.job.user)) => Some(m.job.user),
        Ok(_) => return Err(not_yours()),
        Err(ArchiveError::NotArchived { .. }) if unpublished_ok => None,
        Err(ArchiveError::NotArchived { .. }) => return Err(not_yours()),
        Err(e) => return Err(e.into()),
    };
    let (mark, already) = match a.poison(tag, mark).await? {
        Poisoned::Now(m) => (m, false),
        Poisoned::Already(m) => (m, true),
    };
    if let Some(owner) = &owner
        && !poison::counts_for(&mark, owner)
    {
        return Err(AccessError::ForeignMark {
            url: a.url().to_string(),
            tag: tag.to_string(),
            user: mark.user,
        });
    }
    Ok(CkptPoisoned {
        url: a.url().to_string(),
        tag: tag.to_string(),
        mark,
        already,
        unpublished: owner.is_none(),
    })
}

/// Reads every object of the reader's checkpoint `tag` and checks it against the MANIFEST's
/// checksums. Damage is an answer (`ok: false`, every damaged file named), not an error; a missing
/// MANIFEST or an unreachable store is an error.
pub async fn verify(
    a: &Archiver,
    reader: &Reader,
    tag: &str,
    watch: &mut impl Watch,
) -> Result<ArchiveVerified, AccessError> {
    let tag = resolve(a, reader, tag, &[]).await?;
    let m = a.manifest(&tag).await?;
    let mut out = ArchiveVerified {
        url: a.url().to_string(),
        tag: tag.clone(),
        ok: true,
        files: m.files.len() as u64,
        raw_bytes: m.raw_bytes,
        stored_bytes: m.stored_bytes,
        damaged: Vec::new(),
    };
    drop(m);
    let counters = ArchiveProgress::default();
    let what = Reading {
        label: format!("verify {tag}"),
        counters: &counters,
        // Damage found is a verify that went through everything.
        finished: |r| matches!(r, Ok(_) | Err(ArchiveError::Corrupt { .. })),
    };
    let checked = watch
        .watch(what, a.verify_with_progress(&tag, &counters))
        .await;
    match checked {
        Ok(_) => Ok(out),
        Err(ArchiveError::Corrupt { damaged, .. }) => {
            out.ok = false;
            out.damaged = damaged.into_iter().map(|d| (d.path, d.detail)).collect();
            Ok(out)
        }
        Err(e) => Err(e.into()),
    }
}

/// What a restore of the reader's `tag` would take now (`latest` resolved to the newest whose
/// objects are all there) and its size; nothing is written, no checksum read (a restore checks
/// them as the data arrives).
pub async fn plan(
    a: &Archiver,
    reader: &Reader,
    tag: &str,
    force: bool,
) -> Result<ArchiveRestored, AccessError> {
    let (resolved, mut notes) = resolve_noting(a, reader, tag, &[]).await?;
    if tag != LATEST {
        notes.extend(check_poison(a, &resolved, force).await?);
    }
    let m = a.manifest(&resolved).await?;
    if tag != LATEST {
        // `latest` found its objects all there already.
        a.check_objects(&m).await?;
    }
    Ok(restored(a, resolved, &m, Vec::new(), notes))
}

/// The answer about a restore of `tag` (by its MANIFEST `m`), which passed over `skipped`.
fn restored(
    a: &Archiver,
    tag: String,
    m: &Manifest,
    skipped: Vec<String>,
    notes: Vec<String>,
) -> ArchiveRestored {
    ArchiveRestored {
        url: a.url().to_string(),
        tag,
        files: m.files.len() as u64,
        raw_bytes: m.raw_bytes,
        stored_bytes: m.stored_bytes,
        skipped,
        notes,
    }
}

/// Why a restore's directory is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestRefusal {
    /// Its path ends in a symbolic link (seen only where a path is looked at: the CLI's).
    Symlink,
    NotDir,
    /// On proc, sys, a cgroup or another kernel pseudo file system.
    KernelFs,
    /// Another uid's.
    Theirs(u32),
    NotEmpty,
}

impl DestRefusal {
    /// What is wrong with `dest` (its path, or "the destination"), and what to do.
    pub fn message(&self, dest: &str) -> String {
        let again = "give the path of a new or empty directory";
        match self {
            DestRefusal::Symlink => format!("{dest} is a symbolic link; {again}"),
            DestRefusal::NotDir => format!("{dest} exists and is not a directory; {again}"),
            DestRefusal::KernelFs => format!(
                "{dest} is on a kernel file system (proc, sys, cgroup); restore into a directory on a disk"
            ),
            DestRefusal::Theirs(uid) => {
                format!("{dest} belongs to uid {uid}; restore into a directory of your own")
            }
            DestRefusal::NotEmpty => format!("{dest} is not empty; {again}"),
        }
    }
}

/// Whether a file system type is one of the kernel's pseudo file systems, where creating files
/// and directories changes the kernel's state (a directory made in cgroupfs is a new cgroup).
pub fn is_kernel_fs(fs: nix::sys::statfs::FsType) -> bool {
    use nix::sys::statfs::{
        BPF_FS_MAGIC, CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, DEBUGFS_MAGIC, PROC_SUPER_MAGIC,
        SECURITYFS_MAGIC, SYSFS_MAGIC, TRACEFS_MAGIC,
    };
    [
        PROC_SUPER_MAGIC,
        SYSFS_MAGIC,
        CGROUP_SUPER_MAGIC,
        CGROUP2_SUPER_MAGIC,
        BPF_FS_MAGIC,
        DEBUGFS_MAGIC,
        SECURITYFS_MAGIC,
        TRACEFS_MAGIC,
    ]
    .contains(&fs)
}

/// The checks on a restore's directory, on the open descriptor itself (no path is looked at): a
/// directory, not on a kernel file system, owned by `uid`, empty.
pub fn dest_refusal(dir: &OwnedFd, uid: u32) -> Result<Option<DestRefusal>, nix::Error> {
    let st = nix::sys::stat::fstat(dir)?;
    if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFDIR {
        return Ok(Some(DestRefusal::NotDir));
    }
    if is_kernel_fs(nix::sys::statfs::fstatfs(dir)?.filesystem_type()) {
        return Ok(Some(DestRefusal::KernelFs));
    }
    if st.st_uid != uid {
        return Ok(Some(DestRefusal::Theirs(st.st_uid)));
    }
    let flags =
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC;
    let mut d = nix::dir::Dir::openat(dir, ".", flags, nix::sys::stat::Mode::empty())?;
    for e in d.iter() {
        let name = e?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            return Ok(Some(DestRefusal::NotEmpty));
        }
    }
    Ok(None)
}

/// A restore's directory, open and checked ([`dest_refusal`]): the only place a restore writes.
#[derive(Debug, Clone)]
pub struct Destination {
    fd: Arc<OwnedFd>,
    owner: Owner,
    /// How messages name it: its path, or "the destination".
    shown: String,
}

impl Destination {
    /// Takes `dir` for a restore whose files become `owner`'s, or says why not. Blocking (a few
    /// system calls); `shown` names it in messages.
    pub fn check(
        dir: Arc<OwnedFd>,
        owner: Owner,
        shown: impl Into<String>,
    ) -> Result<Destination, AccessError> {
        let dest = shown.into();
        match dest_refusal(&dir, owner.uid) {
            Ok(None) => Ok(Destination {
                fd: dir,
                owner,
                shown: dest,
            }),
            Ok(Some(refusal)) => Err(AccessError::Refused { dest, refusal }),
            Err(source) => Err(AccessError::Unchecked { dest, source }),
        }
    }

    /// The open directory.
    pub fn fd(&self) -> &Arc<OwnedFd> {
        &self.fd
    }

    /// Removes what a failed restore left below the directory, fd-relative, never following a
    /// link: the owner's entries and root's, never another user's moved in there. `Err` says what
    /// is left.
    pub async fn clear(&self) -> Result<(), String> {
        let (dir, who) = (self.fd.clone(), RemoveAs::from(self.owner));
        blocking(move || sluice_core::safefs::clear_dir(&dir, who)).await
    }

    /// `e`, and what is left in the directory if clearing it failed.
    async fn cleared_after(&self, e: AccessError) -> AccessError {
        match self.clear().await {
            Ok(()) => e,
            Err(left) => AccessError::Partial {
                source: Box::new(e),
                dest: self.shown.clone(),
                left,
            },
        }
    }
}

/// Restores the reader's `tag` (`latest`: their newest intact one that is not poisoned, passing
/// over damaged and poisoned ones and telling `watch` about each; a named one that is poisoned
/// only with `force`) into `dest`, every file owned by its owner and checked against its
/// checksums. A failed restore leaves `dest` empty again (or says what is left).
pub async fn restore(
    a: &Archiver,
    reader: &Reader,
    tag: &str,
    force: bool,
    dest: &Destination,
    watch: &mut impl Watch,
) -> Result<ArchiveRestored, AccessError> {
    let mut skipped: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    loop {
        let (t, poisoned) = resolve_noting(a, reader, tag, &skipped).await?;
        for n in poisoned {
            if !notes.contains(&n) {
                watch.note(&n);
                notes.push(n);
            }
        }
        if tag != LATEST {
            for n in check_poison(a, &t, force).await? {
                watch.note(&n);
                notes.push(n);
            }
        }
        let counters = ArchiveProgress::default();
        let what = Reading {
            label: format!("restore {t}"),
            counters: &counters,
            finished: Result::is_ok,
        };
        let work = a.restore(&t, dest.fd.clone(), dest.owner, &counters);
        let outcome = watch.watch(what, work).await;
        match outcome {
            // The MANIFEST the restore used may have been replaced since `resolve` read it.
            Ok(m) if reader.owns(Some(&m.job.user)) => {
                return Ok(restored(a, t, &m, skipped, notes));
            }
            Ok(_) => {
                let e = AccessError::NotYours {
                    url: a.url().to_string(),
                    tag: t,
                };
                return Err(dest.cleared_after(e).await);
            }
            Err(e) if tag == LATEST && e.is_corrupt() => {
                let note = format!(
                    "checkpoint {t} cannot be restored ({e}); falling back to the next newest"
                );
                if let e @ AccessError::Partial { .. } = dest.cleared_after(e.into()).await {
                    return Err(e);
                }
                watch.note(&note);
                skipped.push(t);
            }
            Err(e) => return Err(dest.cleared_after(e.into()).await),
        }
    }
}

// ------------------------------------------------------------------------------ on the socket

impl From<CheckpointInfo> for ArchivedCkpt {
    fn from(i: CheckpointInfo) -> ArchivedCkpt {
        let (state, reason) = match i.state {
            CheckpointState::Complete => ("complete", None),
            CheckpointState::Partial => ("partial", None),
            CheckpointState::Invalid { reason } => ("invalid", Some(reason)),
        };
        ArchivedCkpt {
            tag: i.tag,
            state: state.into(),
            reason,
            files: i.files,
            raw_bytes: i.raw_bytes,
            stored_bytes: i.stored_bytes,
            created_unix_ms: i.created_unix_ms,
            job_id: i.job.as_ref().map(|j| j.job_id),
            user: i.job.as_ref().map(|j| j.user.clone()),
            job_name: i.job.map(|j| j.job_name),
            nodes: i.nodes,
            data_classes: i.data_classes,
            poison: i.poison,
        }
    }
}

impl From<ArchivedCkpt> for CheckpointInfo {
    /// A checkpoint as the agent sent it, as the archive engine describes it; a state this build
    /// does not know reads as invalid, saying so.
    fn from(c: ArchivedCkpt) -> CheckpointInfo {
        let state = match c.state.as_str() {
            "complete" => CheckpointState::Complete,
            "partial" => CheckpointState::Partial,
            "invalid" => CheckpointState::Invalid {
                reason: c.reason.unwrap_or_default(),
            },
            other => CheckpointState::Invalid {
                reason: format!("the agent reports a state this CLI does not know: {other}"),
            },
        };
        let job = match (c.job_id, c.user, c.job_name) {
            (Some(job_id), Some(user), Some(job_name)) => Some(JobMeta {
                job_id,
                user,
                job_name,
            }),
            _ => None,
        };
        CheckpointInfo {
            ratio: (state == CheckpointState::Complete)
                .then(|| crate::manifest::ratio(c.raw_bytes, c.stored_bytes)),
            tag: c.tag,
            state,
            files: c.files,
            raw_bytes: c.raw_bytes,
            stored_bytes: c.stored_bytes,
            created_unix_ms: c.created_unix_ms,
            job,
            nodes: c.nodes,
            data_classes: c.data_classes,
            poison: c.poison,
        }
    }
}

#[cfg(test)]
mod tests;
