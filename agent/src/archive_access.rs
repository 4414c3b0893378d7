//! Users reach their own archives without root: `sluice ckpt list|verify|restore URL` from a user
//! who cannot read the agent's configuration (it holds the site's store credentials) comes here
//! over the socket, and the agent reads the archive for them.
//!
//! The same rules as for jobs (docs/SECURITY.md, "Archives for users outside jobs"):
//! - the URL must be one a job of the caller's could archive to under `[[ckpt.allow]]`
//!   ([`Policy::check_archive_read`]); root may name any;
//! - a user sees, verifies and restores only checkpoints whose MANIFEST names them as the job's
//!   user (by name, as `--ckpt-restore` does: the MANIFEST records no uid); another user's
//!   checkpoint is answered exactly like a missing one, so its existence is not told either;
//! - a restore writes only into the directory the caller passed open over the socket: a directory
//!   of their own, empty, never a path the agent resolves (root must not write where a path a user
//!   names leads). Files and directories are created below it fd-relative and owned by the caller.
//!
//! What one request may cost is bounded: at most [`MAX_AT_ONCE`] run on a node at once (the rest
//! wait up to [`QUEUE_WAIT`]), one user holds at most [`MAX_PER_USER`] of them, and each has a
//! deadline ([`LIST_LIMIT`], [`READ_LIMIT`]). The server cancels a request whose client hangs up.
//! Those places are the agent's own ([`ArchiveAccess`]): two agents in one process (the tests')
//! share none.

use crate::identity::Peer;
use crate::policy::{Policy, PolicyError, Requester};
use sluice_archive::{
    ArchiveError, ArchiveProgress, ArchiveStore, Archiver, CheckpointInfo, CheckpointState,
    check_name, open_archive, parse_archive_url,
};
use sluice_core::config::Config;
use sluice_core::rt::{blocking, lock};
use sluice_core::safefs::{self, Owner};
use sluice_proto::msg::{
    ArchiveListing, ArchiveRestored, ArchiveVerified, ArchivedCkpt, ErrorCode, ErrorReply, Request,
    Response,
};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

/// Archive requests a node's agent runs at once, all users together.
pub const MAX_AT_ONCE: usize = 4;
/// Archive requests one uid may have running or waiting at once.
pub const MAX_PER_USER: usize = 2;
/// How long a request waits for one of the [`MAX_AT_ONCE`] places before it is refused.
pub const QUEUE_WAIT: Duration = Duration::from_secs(120);
/// Longest a listing may take.
pub const LIST_LIMIT: Duration = Duration::from_secs(600);
/// Longest a verify or restore may take (they read the whole checkpoint).
pub const READ_LIMIT: Duration = Duration::from_secs(12 * 3600);
/// Most checkpoints one listing returns (the newest; the answer must fit one frame).
const MAX_LISTED: usize = 2000;
/// Most damaged files one verify names (the answer must fit one frame).
const MAX_DAMAGED: usize = 1000;
/// `TAG` meaning the newest intact checkpoint.
const LATEST: &str = "latest";

/// Archive requests of users, as the agent serves them: with the site's configuration (its store
/// credentials, its allow rules), through the node's places ([`Gate`]).
pub(crate) struct ArchiveAccess {
    cfg: Arc<Config>,
    gate: Gate,
}

/// The places of [`MAX_AT_ONCE`] and who holds how many: the agent's, so the node's.
struct Gate {
    running: Semaphore,
    per_uid: Mutex<HashMap<u32, usize>>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            running: Semaphore::new(MAX_AT_ONCE),
            per_uid: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one more request of `peer`'s uid, or refuses it when that uid has [`MAX_PER_USER`]
    /// already (root never is): one user cannot take the node's places from the others.
    fn admit(&self, peer: Peer, node: &str) -> Result<Held<'_>, ErrorReply> {
        let mut m = lock(&self.per_uid);
        let n = m.entry(peer.uid).or_insert(0);
        if !peer.is_root() && *n >= MAX_PER_USER {
            return Err(refuse(
                ErrorCode::Forbidden,
                format!(
                    "you already have {MAX_PER_USER} archive requests running on the sluice agent of node {node}; wait for them to finish"
                ),
            ));
        }
        *n += 1;
        Ok(Held {
            gate: self,
            uid: peer.uid,
        })
    }
}

/// A uid's count in [`Gate::per_uid`], given back when dropped.
struct Held<'a> {
    gate: &'a Gate,
    uid: u32,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut m = lock(&self.gate.per_uid);
        if let Some(n) = m.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.uid);
            }
        }
    }
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, message)
}

impl ArchiveAccess {
    pub(crate) fn new(cfg: Arc<Config>) -> ArchiveAccess {
        ArchiveAccess {
            cfg,
            gate: Gate::new(),
        }
    }

    /// Answers an archive request ([`Request::ArchiveList`], `ArchiveVerify`, `ArchiveRestore`) of
    /// `peer`; `dir` is the descriptor the client passed with it (a restore's directory).
    pub(crate) async fn handle(
        &self,
        peer: Peer,
        request: Request,
        dir: Option<OwnedFd>,
    ) -> Response {
        match self.serve(peer, request, dir).await {
            Ok(r) => r,
            Err(e) => Response::Error(e),
        }
    }

    async fn serve(
        &self,
        peer: Peer,
        request: Request,
        dir: Option<OwnedFd>,
    ) -> Result<Response, ErrorReply> {
        let node = self.cfg.node.clone();
        let _held = self.gate.admit(peer, &node)?;
        let _place = tokio::time::timeout(QUEUE_WAIT, self.gate.running.acquire())
        .await
        .map_err(|_| {
            refuse(
                ErrorCode::Timeout,
                format!(
                    "the sluice agent of node {node} is busy with {MAX_AT_ONCE} archive requests; retry in a few minutes"
                ),
            )
        })?
        .map_err(|_| refuse(ErrorCode::Internal, "the agent is stopping"))?;
        let caller = Caller::of(peer).await?;
        let (url, limit) = match &request {
            Request::ArchiveList { url } => (url.clone(), LIST_LIMIT),
            Request::ArchiveVerify { url, .. } | Request::ArchiveRestore { url, .. } => {
                (url.clone(), READ_LIMIT)
            }
            _ => return Err(refuse(ErrorCode::BadRequest, "not an archive request")),
        };
        if let Some(who) = &caller.requester {
            Policy::new(&self.cfg)
                .check_archive_read(who, &url)
                .map_err(|e| not_allowed(&url, e))?;
        }
        let archiver = open(&self.cfg, &url).await?;
        let work = async {
            match request {
                Request::ArchiveList { .. } => {
                    list(&archiver, &caller).await.map(Response::Archive)
                }
                Request::ArchiveVerify { tag, .. } => verify(&archiver, &caller, &tag)
                    .await
                    .map(Response::Verified),
                Request::ArchiveRestore {
                    tag, dry_run: true, ..
                } => plan(&archiver, &caller, &tag).await.map(Response::Restored),
                Request::ArchiveRestore { tag, .. } => {
                    let dir = dir.ok_or_else(|| {
                    refuse(
                        ErrorCode::BadRequest,
                        "a restore through the agent needs its destination directory passed open with the request (use the sluice CLI of this release)",
                    )
                })?;
                    let dir = Arc::new(dir);
                    check_dest(dir.clone(), caller.owner.uid).await?;
                    restore(&archiver, &caller, &tag, dir)
                        .await
                        .map(Response::Restored)
                }
                _ => unreachable!("checked above"),
            }
        };
        match tokio::time::timeout(limit, work).await {
            Ok(r) => r,
            Err(_) => Err(refuse(
                ErrorCode::Timeout,
                format!(
                    "the request on {url} did not finish within {} (the agent's limit for it); a restore's directory holds a partial restore to remove",
                    humantime::format_duration(limit)
                ),
            )),
        }
    }
}

/// Who asks: root sees everything; a user their own checkpoints, under the allow rules.
struct Caller {
    /// `None` for root.
    requester: Option<Requester>,
    owner: Owner,
}

impl Caller {
    async fn of(peer: Peer) -> Result<Caller, ErrorReply> {
        let owner = Owner {
            uid: peer.uid,
            gid: peer.gid,
        };
        if peer.is_root() {
            return Ok(Caller {
                requester: None,
                owner,
            });
        }
        // NSS may ask a directory server.
        let who = blocking(move || {
            let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(peer.uid))
                .ok()
                .flatten()?;
            Some(Requester::user(&user.name, user.gid.as_raw()))
        })
        .await;
        let who = who.ok_or_else(|| {
            refuse(
                ErrorCode::Forbidden,
                format!("uid {} has no user name on this node", peer.uid),
            )
        })?;
        Ok(Caller {
            requester: Some(who),
            owner,
        })
    }

    /// Whether the checkpoint's MANIFEST (its job's user) makes it the caller's.
    fn owns(&self, job_user: Option<&str>) -> bool {
        match &self.requester {
            None => true,
            Some(who) => job_user == Some(who.user.as_str()),
        }
    }
}

fn not_allowed(url: &str, e: PolicyError) -> ErrorReply {
    let message = match e {
        PolicyError::ArchiveNotAllowed { allowed, .. } => format!(
            "{url} is not an archive location the site's policy ([[ckpt.allow]]) gives you; yours: {allowed}"
        ),
        PolicyError::NoArchiveRule { .. } => format!(
            "{url}: this site allows no archive location ([[ckpt.allow]]), so the agent reads no archive for users"
        ),
        other => other.to_string(),
    };
    refuse(ErrorCode::Forbidden, message)
}

/// Opens `url` for reading. A `file://` archive must exist: the opener would create it (as root).
async fn open(cfg: &Arc<Config>, url: &str) -> Result<Archiver, ErrorReply> {
    let bad = |e: ArchiveError| refuse(ErrorCode::BadRequest, e.to_string());
    let loc = parse_archive_url(url).map_err(bad)?;
    if let ArchiveStore::Local(path) = &loc.store {
        let p = path.clone();
        if blocking(move || std::fs::symlink_metadata(&p))
            .await
            .is_err()
        {
            return Err(refuse(
                ErrorCode::NotFound,
                format!("{loc}: nothing is archived there"),
            ));
        }
    }
    let cfg = cfg.clone();
    let url = url.to_string();
    blocking(move || open_archive(&cfg, &url))
        .await
        .map_err(bad)
}

/// An archive error, as the user reads it.
fn failed(e: ArchiveError) -> ErrorReply {
    let code = match &e {
        ArchiveError::NotArchived { .. } => ErrorCode::NotFound,
        _ => ErrorCode::Internal,
    };
    refuse(code, e.to_string())
}

/// The tags of complete checkpoints that are not the caller's (what `latest` must pass over).
async fn foreign_tags(a: &Archiver, caller: &Caller) -> Result<Vec<String>, ErrorReply> {
    if caller.requester.is_none() {
        return Ok(Vec::new());
    }
    let all = a.list().await.map_err(failed)?;
    Ok(all
        .into_iter()
        .filter(|i| !caller.owns(i.job.as_ref().map(|j| j.user.as_str())))
        .map(|i| i.tag)
        .collect())
}

/// `tag` of the caller's, `latest` resolved among theirs (passing over those in `skip`). Another
/// user's tag reads as a missing one.
async fn resolve(
    a: &Archiver,
    caller: &Caller,
    tag: &str,
    skip: &[String],
) -> Result<String, ErrorReply> {
    let none = |what: &str| {
        refuse(
            ErrorCode::NotFound,
            format!("{}: no {what} of yours", a.url()),
        )
    };
    if tag == LATEST {
        let mut exclude = foreign_tags(a, caller).await?;
        exclude.extend(skip.iter().cloned());
        let found = a.latest(&exclude).await.map_err(failed)?;
        return found.ok_or_else(|| {
            none(if skip.is_empty() {
                "complete checkpoint"
            } else {
                "other complete checkpoint"
            })
        });
    }
    check_name("checkpoint tag", tag).map_err(|e| refuse(ErrorCode::BadRequest, e.to_string()))?;
    match a.manifest(tag).await {
        Ok(m) if caller.owns(Some(&m.job.user)) => Ok(tag.to_string()),
        Ok(_) | Err(ArchiveError::NotArchived { .. }) => {
            Err(none(&format!("archived checkpoint {tag}")))
        }
        Err(e) => Err(failed(e)),
    }
}

async fn list(a: &Archiver, caller: &Caller) -> Result<ArchiveListing, ErrorReply> {
    let all = a.list().await.map_err(failed)?;
    Ok(listing(a.url(), all, caller))
}

/// The caller's checkpoints of a listing (oldest first), the newest [`MAX_LISTED`] of them. A
/// partial or invalid checkpoint has no owner to show it to, so only root sees those.
fn listing(url: &str, all: Vec<CheckpointInfo>, caller: &Caller) -> ArchiveListing {
    let mut ckpts: Vec<ArchivedCkpt> = all
        .into_iter()
        .filter(|i| caller.owns(i.job.as_ref().map(|j| j.user.as_str())))
        .map(wire)
        .collect();
    let left_out = ckpts.len().saturating_sub(MAX_LISTED);
    ckpts.drain(..left_out);
    ArchiveListing {
        url: url.to_string(),
        ckpts,
        left_out: left_out as u64,
    }
}

fn wire(i: CheckpointInfo) -> ArchivedCkpt {
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
    }
}

async fn verify(a: &Archiver, caller: &Caller, tag: &str) -> Result<ArchiveVerified, ErrorReply> {
    let tag = resolve(a, caller, tag, &[]).await?;
    let m = a.manifest(&tag).await.map_err(failed)?;
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
    match a.verify(&tag).await {
        Ok(_) => Ok(out),
        Err(ArchiveError::Corrupt { damaged, .. }) => {
            out.ok = false;
            let n = damaged.len();
            out.damaged = damaged
                .into_iter()
                .take(MAX_DAMAGED)
                .map(|d| (d.path, d.detail))
                .collect();
            if n > MAX_DAMAGED {
                out.damaged.push((
                    format!("({} more)", n - MAX_DAMAGED),
                    "not named: too many to list".into(),
                ));
            }
            Ok(out)
        }
        Err(e) => Err(failed(e)),
    }
}

/// `--dry-run`: the checkpoint a restore would take now, and its size; nothing is written.
async fn plan(a: &Archiver, caller: &Caller, tag: &str) -> Result<ArchiveRestored, ErrorReply> {
    let resolved = resolve(a, caller, tag, &[]).await?;
    let m = a.manifest(&resolved).await.map_err(failed)?;
    if tag != LATEST {
        a.check_objects(&m).await.map_err(failed)?;
    }
    Ok(ArchiveRestored {
        url: a.url().to_string(),
        tag: resolved,
        files: m.files.len() as u64,
        raw_bytes: m.raw_bytes,
        stored_bytes: m.stored_bytes,
        skipped: Vec::new(),
    })
}

/// Why a passed directory is refused, in the words of the CLI's own check.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DestRefusal {
    NotDir,
    Theirs(u32),
    NotEmpty,
    Special,
}

impl DestRefusal {
    fn text(&self) -> String {
        let again = "give the path of a new or empty directory";
        match self {
            DestRefusal::NotDir => format!("the destination is not a directory; {again}"),
            DestRefusal::Theirs(uid) => format!(
                "the destination belongs to uid {uid}; restore into a directory of your own"
            ),
            DestRefusal::NotEmpty => format!("the destination is not empty; {again}"),
            DestRefusal::Special => {
                format!("the destination is on a kernel file system (proc, sys, cgroup); {again}")
            }
        }
    }
}

/// The checks on a restore's directory, on the open descriptor itself (no path is looked at): a
/// directory, owned by `uid`, empty, not on a kernel pseudo file system.
pub(crate) fn dest_refusal(dir: &OwnedFd, uid: u32) -> Result<Option<DestRefusal>, nix::Error> {
    use nix::sys::statfs::{
        BPF_FS_MAGIC, CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, DEBUGFS_MAGIC, PROC_SUPER_MAGIC,
        SECURITYFS_MAGIC, SYSFS_MAGIC, TRACEFS_MAGIC, fstatfs,
    };
    let st = nix::sys::stat::fstat(dir)?;
    if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFDIR {
        return Ok(Some(DestRefusal::NotDir));
    }
    if st.st_uid != uid {
        return Ok(Some(DestRefusal::Theirs(st.st_uid)));
    }
    let fs = fstatfs(dir)?.filesystem_type();
    let special = [
        PROC_SUPER_MAGIC,
        SYSFS_MAGIC,
        CGROUP_SUPER_MAGIC,
        CGROUP2_SUPER_MAGIC,
        BPF_FS_MAGIC,
        DEBUGFS_MAGIC,
        SECURITYFS_MAGIC,
        TRACEFS_MAGIC,
    ];
    if special.contains(&fs) {
        return Ok(Some(DestRefusal::Special));
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

async fn check_dest(dir: Arc<OwnedFd>, uid: u32) -> Result<(), ErrorReply> {
    match blocking(move || dest_refusal(&dir, uid)).await {
        Ok(None) => Ok(()),
        Ok(Some(r)) => Err(refuse(ErrorCode::Forbidden, r.text())),
        Err(e) => Err(refuse(
            ErrorCode::BadRequest,
            format!("the destination passed cannot be checked: {e}"),
        )),
    }
}

/// Removes everything of the caller's (or root's) below `dir` (a failed restore's partial files),
/// fd-relative, never following a link; another user's entries moved in there stay. Says what is
/// left, if anything.
async fn clear(dir: Arc<OwnedFd>, who: safefs::RemoveAs) -> Option<String> {
    blocking(move || safefs::clear_dir(&dir, who)).await.err()
}

/// Restores the caller's `tag` (`latest`: their newest intact one, passing over damaged ones) into
/// `dir`, every file owned by them. A failed restore leaves `dir` empty again.
async fn restore(
    a: &Archiver,
    caller: &Caller,
    tag: &str,
    dir: Arc<OwnedFd>,
) -> Result<ArchiveRestored, ErrorReply> {
    let mut skipped: Vec<String> = Vec::new();
    let fail = |e: ErrorReply, left: Option<String>| match left {
        None => e,
        Some(left) => ErrorReply::new(
            e.code,
            format!(
                "{}; the destination holds a partial restore ({left}): remove it",
                e.message
            ),
        ),
    };
    loop {
        let t = resolve(a, caller, tag, &skipped).await?;
        let restored = a
            .restore(&t, dir.clone(), caller.owner, &ArchiveProgress::default())
            .await;
        match restored {
            // The MANIFEST the restore used may have been replaced since `resolve` read it.
            Ok(m) if caller.owns(Some(&m.job.user)) => {
                tracing::info!(
                    uid = caller.owner.uid,
                    tag = t,
                    url = a.url(),
                    "checkpoint restored for a user"
                );
                return Ok(ArchiveRestored {
                    url: a.url().to_string(),
                    tag: t,
                    files: m.files.len() as u64,
                    raw_bytes: m.raw_bytes,
                    stored_bytes: m.stored_bytes,
                    skipped,
                });
            }
            Ok(_) => {
                let left = clear(dir.clone(), caller.owner.into()).await;
                let e = refuse(
                    ErrorCode::NotFound,
                    format!("{}: no archived checkpoint {t} of yours", a.url()),
                );
                return Err(fail(e, left));
            }
            Err(e) if tag == LATEST && e.is_corrupt() => {
                if let Some(left) = clear(dir.clone(), caller.owner.into()).await {
                    return Err(fail(failed(e), Some(left)));
                }
                skipped.push(t);
            }
            Err(e) => {
                let left = clear(dir.clone(), caller.owner.into()).await;
                return Err(fail(failed(e), left));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_archive::JobMeta;

    fn user(name: &str) -> Caller {
        Caller {
            requester: Some(Requester {
                user: name.into(),
                groups: Vec::new(),
                job_id: 0,
                job_name: String::new(),
            }),
            owner: Owner {
                uid: 1000,
                gid: 1000,
            },
        }
    }

    fn info(tag: &str, owner: Option<&str>, state: CheckpointState) -> CheckpointInfo {
        CheckpointInfo {
            tag: tag.into(),
            state,
            files: 2,
            raw_bytes: 10,
            stored_bytes: 5,
            ratio: Some(2.0),
            created_unix_ms: 1,
            job: owner.map(|u| JobMeta {
                job_id: 7,
                user: u.into(),
                job_name: "train".into(),
            }),
            nodes: vec!["n1".into()],
            data_classes: Vec::new(),
        }
    }

    #[test]
    fn a_user_lists_only_their_own_checkpoints() {
        let all = || {
            vec![
                info("a1", Some("alice"), CheckpointState::Complete),
                info("b1", Some("bob"), CheckpointState::Complete),
                info("p", None, CheckpointState::Partial),
                info(
                    "x",
                    None,
                    CheckpointState::Invalid {
                        reason: "bad".into(),
                    },
                ),
                info("a2", Some("alice"), CheckpointState::Complete),
            ]
        };
        let tags = |l: ArchiveListing| l.ckpts.into_iter().map(|c| c.tag).collect::<Vec<_>>();
        assert_eq!(tags(listing("u", all(), &user("alice"))), ["a1", "a2"]);
        assert_eq!(tags(listing("u", all(), &user("bob"))), ["b1"]);
        assert!(tags(listing("u", all(), &user("carol"))).is_empty());
        let root = Caller {
            requester: None,
            owner: Owner { uid: 0, gid: 0 },
        };
        assert_eq!(
            tags(listing("u", all(), &root)),
            ["a1", "b1", "p", "x", "a2"]
        );
        let l = listing("u", all(), &user("alice"));
        let c = &l.ckpts[0];
        assert_eq!(
            (c.state.as_str(), c.user.as_deref(), c.job_id, c.files),
            ("complete", Some("alice"), Some(7), 2)
        );
        assert_eq!(l.left_out, 0);
    }

    /// An in-memory archive in which alice published `a1` and then `a2`, bob `b1` in between.
    async fn shared_archive() -> Archiver {
        let a = Archiver::new(
            Arc::new(object_store::memory::InMemory::new()),
            "shared/run",
            sluice_archive::ArchiveConfig::default(),
        )
        .unwrap();
        let me = nix::unistd::geteuid().as_raw();
        for (tag, user) in [("a1", "alice"), ("b1", "bob"), ("a2", "alice")] {
            let src = tempfile::tempdir().unwrap();
            std::fs::create_dir(src.path().join("sub")).unwrap();
            std::fs::write(src.path().join("sub/model.bin"), format!("{tag} of {user}")).unwrap();
            let fd = Arc::new(safefs::open_root_dir(src.path()).unwrap());
            a.upload_part(tag, "n1", fd, me, &ArchiveProgress::default())
                .await
                .unwrap();
            let job = JobMeta {
                job_id: 7,
                user: user.into(),
                job_name: "train".into(),
            };
            a.try_publish(tag, &["n1".to_string()], job).await.unwrap();
            // MANIFEST times are in milliseconds: keep the order unambiguous.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        a
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_users_checkpoint_reads_as_a_missing_one() {
        let a = shared_archive().await;
        let (alice, bob) = (user("alice"), user("bob"));
        let missing = resolve(&a, &bob, "zz", &[]).await.unwrap_err();
        let foreign = resolve(&a, &bob, "a1", &[]).await.unwrap_err();
        assert_eq!(foreign.code, ErrorCode::NotFound);
        assert_eq!(
            foreign.message.replace("a1", "TAG"),
            missing.message.replace("zz", "TAG"),
            "a foreign tag must be answered as a missing one"
        );
        assert!(
            foreign
                .message
                .contains("no archived checkpoint a1 of yours")
        );
        // `latest` is the newest of the caller's own, not the archive's newest.
        assert_eq!(resolve(&a, &bob, LATEST, &[]).await.unwrap(), "b1");
        assert_eq!(resolve(&a, &alice, LATEST, &[]).await.unwrap(), "a2");
        assert!(resolve(&a, &user("carol"), LATEST, &[]).await.is_err());
        assert!(verify(&a, &bob, "a1").await.is_err());
        let v = verify(&a, &alice, "a1").await.unwrap();
        assert!(v.ok && v.files == 1, "{v:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restore_gives_only_the_callers_own_files_owned_by_them() {
        let a = shared_archive().await;
        let dest = tempfile::tempdir().unwrap();
        let open = || Arc::new(safefs::open_root_dir(dest.path()).unwrap());
        let me = Owner {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let as_me = |name: &str| Caller {
            owner: me,
            ..user(name)
        };
        // Bob asks for alice's checkpoint: refused, nothing written.
        let e = restore(&a, &as_me("bob"), "a1", open()).await.unwrap_err();
        assert!(e.message.contains("of yours"), "{e:?}");
        assert_eq!(std::fs::read_dir(dest.path()).unwrap().count(), 0);
        // Alice's `latest`: her a2, in place, hers.
        let r = restore(&a, &as_me("alice"), LATEST, open()).await.unwrap();
        assert_eq!((r.tag.as_str(), r.files), ("a2", 1));
        let f = dest.path().join("sub/model.bin");
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "a2 of alice");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&f).unwrap().uid(), me.uid);
    }

    /// Two requests of one user at a time on a node; a third is refused with what to do, another
    /// user still gets in, and a finished request gives its place back. Root is never counted out.
    #[test]
    fn one_user_cannot_take_the_nodes_archive_places_from_another() {
        let gate = Gate::new();
        let (alice, bob, root) = (
            Peer {
                uid: 1000,
                gid: 1000,
            },
            Peer {
                uid: 1001,
                gid: 1001,
            },
            Peer { uid: 0, gid: 0 },
        );
        let first = gate.admit(alice, "n1").unwrap();
        let _second = gate.admit(alice, "n1").unwrap();
        let Err(refused) = gate.admit(alice, "n1") else {
            panic!("a third request of alice was admitted");
        };
        assert_eq!(refused.code, ErrorCode::Forbidden);
        assert!(
            refused
                .message
                .contains("you already have 2 archive requests running"),
            "{refused:?}"
        );
        let _bob = gate
            .admit(bob, "n1")
            .expect("alice's requests keep bob out");
        drop(first);
        let _third = gate
            .admit(alice, "n1")
            .expect("a finished request gives its place back");
        let _roots: Vec<_> = (0..MAX_PER_USER + 1)
            .map(|_| gate.admit(root, "n1").unwrap())
            .collect();
    }

    #[test]
    fn a_long_listing_keeps_the_newest() {
        let all: Vec<_> = (0..MAX_LISTED + 3)
            .map(|i| info(&format!("t{i}"), Some("alice"), CheckpointState::Complete))
            .collect();
        let l = listing("u", all, &user("alice"));
        assert_eq!((l.ckpts.len(), l.left_out), (MAX_LISTED, 3));
        assert_eq!(l.ckpts[0].tag, "t3");
    }

    #[test]
    fn the_destination_must_be_the_callers_own_empty_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let open = |p: &std::path::Path| safefs::open_root_dir(p).unwrap();
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(dest_refusal(&open(&empty), me).unwrap(), None);
        // Someone else's (the fd is checked, whatever path led to it).
        assert_eq!(
            dest_refusal(&open(&empty), me + 1).unwrap(),
            Some(DestRefusal::Theirs(me))
        );
        let full = tmp.path().join("full");
        std::fs::create_dir(&full).unwrap();
        std::fs::write(full.join(".hidden"), b"x").unwrap();
        assert_eq!(
            dest_refusal(&open(&full), me).unwrap(),
            Some(DestRefusal::NotEmpty)
        );
        let file: OwnedFd = std::fs::File::create(tmp.path().join("f")).unwrap().into();
        assert_eq!(dest_refusal(&file, me).unwrap(), Some(DestRefusal::NotDir));
        // A kernel file system the caller owns a directory of.
        let mine = std::path::PathBuf::from(format!("/proc/{}", std::process::id()));
        let proc_self = safefs::open_root_dir(&mine).unwrap();
        assert!(matches!(
            dest_refusal(&proc_self, me).unwrap(),
            Some(DestRefusal::Special | DestRefusal::NotEmpty)
        ));
        assert!(DestRefusal::Theirs(5).text().contains("belongs to uid 5"));
    }
}
