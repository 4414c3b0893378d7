//! Users reach their own archives without root: `sluice ckpt list|verify|restore|poison URL` from a user
//! who cannot read the agent's configuration (it holds the site's store credentials) comes here
//! over the socket, and the agent reads the archive for them with the one archive-access
//! implementation ([`sluice_archive::access`]), which the CLI uses directly as root.
//!
//! What the agent adds on top (docs/SECURITY.md, "Archives for users outside jobs"):
//! - the URL must be one a job of the caller's could archive to under `[[ckpt.allow]]`
//!   ([`Policy::check_archive_read`]); root may name any;
//! - the caller is a [`Reader`] by their user name (NSS, from `SO_PEERCRED`): they see, verify and
//!   restore only checkpoints whose MANIFEST names them; another user's reads as a missing one;
//! - a restore writes only into the directory the caller passed open over the socket, checked as
//!   theirs ([`Destination::check`]), never a path the agent resolves (root must not write where a
//!   path a user names leads);
//! - a poison marks only a checkpoint the caller owns by the same rule (its MANIFEST names them),
//!   or, from inside the job that committed it, a tag not archived yet ([`ArchiveAccess::poison_job`]);
//!   the mark records the caller's user name and uid from the socket.
//!
//! What one request may cost is bounded: at most [`MAX_AT_ONCE`] run on a node at once (the rest
//! wait up to [`QUEUE_WAIT`]), one user holds at most [`MAX_PER_USER`] of them, and each has a
//! deadline ([`LIST_LIMIT`], [`READ_LIMIT`]); an answer fits one frame ([`MAX_LISTED`],
//! [`MAX_DAMAGED`]). The server cancels a request whose client hangs up. Those places are the
//! agent's own ([`ArchiveAccess`]): two agents in one process (the tests') share none.

use crate::identity::Peer;
use crate::job::Job;
use crate::policy::{Policy, PolicyError, Requester};
use sluice_archive::access::{self, Destination, Reader, Unwatched};
use sluice_archive::{Archiver, CheckpointInfo};
use sluice_core::config::Config;
use sluice_core::rt::{blocking, lock};
use sluice_core::safefs::Owner;
use sluice_proto::msg::{
    ArchiveListing, ArchiveRestored, ArchiveVerified, ArchivedCkpt, CkptPoisoned, ErrorCode,
    ErrorReply, PoisonMark, Request, Response,
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

    /// Marks `tag` of `job` bad at the job's archive, for `peer` (the job's user or root, checked
    /// by the caller): a tag the job committed even before its MANIFEST is there (the mark waits
    /// beside it), else one of the job user's archived checkpoints.
    pub(crate) async fn poison_job(
        &self,
        peer: Peer,
        job: &Job,
        tag: &str,
        reason: &str,
    ) -> Result<CkptPoisoned, ErrorReply> {
        let node = self.cfg.node.clone();
        let (_held, _place) = self.admit(peer, &node).await?;
        let url = job.archive_url().ok_or_else(|| {
            refuse(
                ErrorCode::BadRequest,
                format!(
                    "job {} has no archive (no --ckpt-archive, and the site sets no default): there is nothing to poison",
                    job.start.job_id
                ),
            )
        })?;
        let archiver = open(&self.cfg, url).await?;
        let reader = if peer.is_root() {
            Reader::Anyone
        } else {
            Reader::User(job.start.user.clone())
        };
        let user = if peer.is_root() {
            "root".to_string()
        } else {
            job.start.user.clone()
        };
        let committed_here = job.ckpts.get(tag).is_some();
        let work = access::poison(
            &archiver,
            &reader,
            tag,
            mark(user, peer.uid, reason),
            committed_here,
        );
        let poisoned = tokio::time::timeout(LIST_LIMIT, work)
            .await
            .map_err(|_| timed_out(url, LIST_LIMIT))??;
        tracing::info!(uid = peer.uid, tag, url, "checkpoint poisoned");
        Ok(poisoned)
    }

    /// A place for one request of `peer`: counted for its uid, then one of the node's.
    async fn admit(
        &self,
        peer: Peer,
        node: &str,
    ) -> Result<(Held<'_>, tokio::sync::SemaphorePermit<'_>), ErrorReply> {
        let held = self.gate.admit(peer, node)?;
        let place = tokio::time::timeout(QUEUE_WAIT, self.gate.running.acquire())
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
        Ok((held, place))
    }

    async fn serve(
        &self,
        peer: Peer,
        request: Request,
        dir: Option<OwnedFd>,
    ) -> Result<Response, ErrorReply> {
        let node = self.cfg.node.clone();
        let (_held, _place) = self.admit(peer, &node).await?;
        let caller = Caller::of(peer).await?;
        let (url, limit) = match &request {
            Request::ArchiveList { url } | Request::ArchivePoison { url, .. } => {
                (url.clone(), LIST_LIMIT)
            }
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
                    tag,
                    dry_run: true,
                    force,
                    ..
                } => access::plan(&archiver, &caller.reader(), &tag, force)
                    .await
                    .map(Response::Restored)
                    .map_err(ErrorReply::from),
                Request::ArchivePoison { tag, reason, .. } => {
                    let user = caller.name();
                    let mark = mark(user, peer.uid, &reason);
                    // Root may mark a tag before its MANIFEST; a user, outside the job that
                    // committed it, only one whose MANIFEST names them.
                    access::poison(&archiver, &caller.reader(), &tag, mark, peer.is_root())
                        .await
                        .map(|p| {
                            tracing::info!(
                                uid = peer.uid,
                                tag,
                                url = archiver.url(),
                                "checkpoint poisoned"
                            );
                            Response::Poisoned(p)
                        })
                        .map_err(ErrorReply::from)
                }
                Request::ArchiveRestore { tag, force, .. } => {
                    let dir = dir.ok_or_else(|| {
                    refuse(
                        ErrorCode::BadRequest,
                        "a restore through the agent needs its destination directory passed open with the request (use the sluice CLI of this release)",
                    )
                })?;
                    restore(&archiver, &caller, &tag, force, Arc::new(dir))
                        .await
                        .map(Response::Restored)
                }
                _ => unreachable!("checked above"),
            }
        };
        match tokio::time::timeout(limit, work).await {
            Ok(r) => r,
            Err(_) => Err(timed_out(&url, limit)),
        }
    }
}

fn timed_out(url: &str, limit: Duration) -> ErrorReply {
    refuse(
        ErrorCode::Timeout,
        format!(
            "the request on {url} did not finish within {} (the agent's limit for it); a restore's directory holds a partial restore to remove",
            humantime::format_duration(limit)
        ),
    )
}

/// The poison mark of `user` (`uid`, from the socket) now, for `reason`.
fn mark(user: String, uid: u32, reason: &str) -> PoisonMark {
    PoisonMark {
        user,
        uid,
        at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        reason: reason.trim().to_string(),
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

    /// The caller's user name, as a poison mark records it.
    fn name(&self) -> String {
        match &self.requester {
            None => "root".into(),
            Some(who) => who.user.clone(),
        }
    }

    /// Whose checkpoints the caller may see.
    fn reader(&self) -> Reader {
        match &self.requester {
            None => Reader::Anyone,
            Some(who) => Reader::User(who.user.clone()),
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

/// Opens `url` for reading ([`access::open`]: a missing `file://` archive is not created).
async fn open(cfg: &Arc<Config>, url: &str) -> Result<Archiver, ErrorReply> {
    let (cfg, url) = (cfg.clone(), url.to_string());
    Ok(blocking(move || access::open(&cfg, &url)).await?)
}

async fn list(a: &Archiver, caller: &Caller) -> Result<ArchiveListing, ErrorReply> {
    let all = a
        .list()
        .await
        .map_err(|e| ErrorReply::from(access::AccessError::from(e)))?;
    Ok(listing(a.url(), all, caller))
}

/// The caller's checkpoints of a listing (oldest first), the newest [`MAX_LISTED`] of them. A
/// partial or invalid checkpoint has no owner to show it to, so only root sees those.
fn listing(url: &str, all: Vec<CheckpointInfo>, caller: &Caller) -> ArchiveListing {
    let mut ckpts: Vec<ArchivedCkpt> = caller
        .reader()
        .visible(all)
        .into_iter()
        .map(ArchivedCkpt::from)
        .collect();
    let left_out = ckpts.len().saturating_sub(MAX_LISTED);
    ckpts.drain(..left_out);
    ArchiveListing {
        url: url.to_string(),
        ckpts,
        left_out: left_out as u64,
    }
}

/// [`access::verify`] for the caller, naming at most [`MAX_DAMAGED`] damaged files.
async fn verify(a: &Archiver, caller: &Caller, tag: &str) -> Result<ArchiveVerified, ErrorReply> {
    let mut out = access::verify(a, &caller.reader(), tag, &mut Unwatched).await?;
    let n = out.damaged.len();
    if n > MAX_DAMAGED {
        out.damaged.truncate(MAX_DAMAGED);
        out.damaged.push((
            format!("({} more)", n - MAX_DAMAGED),
            "not named: too many to list".into(),
        ));
    }
    Ok(out)
}

/// Restores the caller's `tag` (`latest`: their newest intact one, passing over damaged ones) into
/// `dir`, once it is checked as theirs, every file owned by them. A failed restore leaves `dir`
/// empty again.
async fn restore(
    a: &Archiver,
    caller: &Caller,
    tag: &str,
    force: bool,
    dir: Arc<OwnedFd>,
) -> Result<ArchiveRestored, ErrorReply> {
    let owner = caller.owner;
    let dest = blocking(move || Destination::check(dir, owner, "the destination")).await?;
    let restored = access::restore(a, &caller.reader(), tag, force, &dest, &mut Unwatched).await?;
    tracing::info!(
        uid = owner.uid,
        tag = restored.tag,
        url = a.url(),
        "checkpoint restored for a user"
    );
    Ok(restored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_archive::access::LATEST;
    use sluice_archive::{ArchiveProgress, CheckpointState, JobMeta};
    use sluice_core::safefs;

    /// `tag` of the caller's, `latest` resolved among theirs (passing over those in `skip`), as
    /// the agent answers it: another user's tag reads as a missing one.
    async fn resolve(
        a: &Archiver,
        caller: &Caller,
        tag: &str,
        skip: &[String],
    ) -> Result<String, ErrorReply> {
        Ok(access::resolve(a, &caller.reader(), tag, skip).await?)
    }

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
            poison: None,
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
            a.upload_part(tag, "n1", fd, me, &ArchiveProgress::default(), None)
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
        let e = restore(&a, &as_me("bob"), "a1", false, open())
            .await
            .unwrap_err();
        assert!(e.message.contains("of yours"), "{e:?}");
        assert_eq!(std::fs::read_dir(dest.path()).unwrap().count(), 0);
        // Alice's `latest`: her a2, in place, hers.
        let r = restore(&a, &as_me("alice"), LATEST, false, open())
            .await
            .unwrap();
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
}
