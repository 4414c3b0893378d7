//! `--ckpt-restore`: before a job's first task, place a checkpoint in its `$SLUICE_CKPT_DIR` —
//! from this node's hot tier when an ended job of the same user left a copy that verifies against
//! the archive's MANIFEST, else from the archive — verified either way.
//!
//! Only the job user's own checkpoints are restored (F2 in docs/SECURITY.md): an allow rule without
//! `{user}` lets several users archive under one prefix, and the URL alone must not hand B what A
//! archived, nor make A's `latest` pick what B published there. The owner is the user name the
//! MANIFEST records (`job.user`, written by the agent from slurmd's `SLURM_JOB_USER`). It is checked
//! before anything is fetched and again on the MANIFEST the restore used, in case it was replaced
//! meanwhile. `latest` skips other users' checkpoints and says so; an explicit tag of another user
//! fails the job.
//!
//! A poisoned checkpoint (`sluice ckpt poison`, `sluice_archive::poison`) is never `latest`: the
//! job's output names each one passed over, with who marked it bad and why. Named, it fails the
//! job unless forced (`--ckpt-restore=TAG!`).

use super::replica_restore::FromReplicas;
use super::{CkptCtx, CkptEntry};
use crate::job::Job;
use sluice_archive::{self as archive, ArchiveError, ArchiveProgress, Archiver, JobMeta, Manifest};
use sluice_core::rt::{blocking, now_secs};
use sluice_core::safefs::{self, Owner, SafeFsError};
use sluice_proto::msg::CkptState;
use sluice_proto::options::Restore;
use sluice_stage::JobPeers;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// Why a restore failed; the message is what the job's output shows, and the job does not start.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("--ckpt-restore needs --ckpt-archive (or an admin default archive) to restore from")]
    NoArchive,
    #[error("--ckpt-restore: archive {url}: {source}")]
    Open {
        url: String,
        #[source]
        source: Box<ArchiveError>,
    },
    #[error("--ckpt-restore: listing {url}: {source}")]
    List {
        url: String,
        #[source]
        source: Box<ArchiveError>,
    },
    #[error(
        "--ckpt-restore=latest: no checkpoint of yours in {url} ({note}); archive under a prefix of your own, or submit without --ckpt-restore"
    )]
    NoneOfYours { url: String, note: String },
    #[error("--ckpt-restore=latest: no intact checkpoint left in {url} ({notes})")]
    NoneIntact { url: String, notes: String },
    #[error(
        "--ckpt-restore={tag}: checkpoint {tag} in {url} was archived by user {owner}, not by {user}; sluice restores only your own checkpoints. Restore one of yours, or archive under a prefix of your own (ask your admin for a --ckpt-archive rule with {{user}})"
    )]
    Foreign {
        tag: String,
        url: String,
        owner: String,
        user: String,
    },
    #[error(
        "--ckpt-restore={tag}: checkpoint {tag} in {url} is poisoned ({why}); restore another one (--ckpt-restore=latest passes over poisoned ones), or force this one with --ckpt-restore={tag}!"
    )]
    Poisoned {
        tag: String,
        url: String,
        why: String,
    },
    #[error("--ckpt-restore: creating $SLUICE_CKPT_DIR/{tag}: {source}")]
    CreateDir {
        tag: String,
        #[source]
        source: SafeFsError,
    },
    #[error("--ckpt-restore={tag}: {source}")]
    Restore {
        tag: String,
        #[source]
        source: Box<ArchiveError>,
    },
    /// The replicas of the job's nodes did not give the checkpoint (`replicas` says why), and
    /// the archive did not either.
    #[error("{source} (the job's replicas did not give it either: {replicas})")]
    NotFromReplicas {
        replicas: String,
        #[source]
        source: Box<RestoreError>,
    },
}

impl RestoreError {
    /// A stable word for this error, for the `sluice_failures_total{operation="restore",code}`
    /// label ([`crate::metrics`]): an archive error's own code ([`ArchiveError::code`]). Dashboards
    /// and alerts query these words: keep them.
    pub fn code(&self) -> &'static str {
        match self {
            RestoreError::NoArchive => "no_archive",
            RestoreError::Open { source, .. }
            | RestoreError::List { source, .. }
            | RestoreError::Restore { source, .. } => source.code(),
            RestoreError::NoneOfYours { .. } => "none_of_yours",
            RestoreError::NoneIntact { .. } => "none_intact",
            RestoreError::Foreign { .. } => "foreign",
            RestoreError::Poisoned { .. } => "poisoned",
            RestoreError::CreateDir { .. } => "create_dir",
            RestoreError::NotFromReplicas { source, .. } => source.code(),
        }
    }
}

/// Why a local copy of a checkpoint is not the archived one.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VerifyError {
    #[error("the local copy does not hold exactly the archived files (a multi-node checkpoint?)")]
    Files,
    #[error("{0} differs from the archived file")]
    Differs(String),
    #[error(transparent)]
    Fs(#[from] SafeFsError),
    #[error(transparent)]
    Walk(Box<archive::walk::WalkError>),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl From<archive::walk::WalkError> for VerifyError {
    fn from(e: archive::walk::WalkError) -> VerifyError {
        VerifyError::Walk(Box::new(e))
    }
}

/// What became of a hot-tier copy that was moved into the new job to be verified.
enum HotCopy {
    /// It verified: the new job holds it.
    Taken,
    /// It did not verify and went back to the old job's directory.
    PutBack(VerifyError),
    /// It did not verify and could not be put back: it was removed.
    Lost,
}

/// Restores `which` into `ckpt_dir`: from the replicas of the job's nodes when they hold it whole
/// (`ckpt::replica_restore`), else from the job's archive `url`. Returns the restored tag and
/// notes for the job's output (why the replicas did not give it, checkpoints `latest` passed
/// over, and why). `latest` on an archive that holds no checkpoint yet restores nothing (`None`)
/// and says so: the first run of a job that always asks for `latest` (a `--requeue` job) starts
/// fresh. A named tag that is not there fails.
pub(crate) async fn restore(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    url: &str,
    which: &Restore,
    ckpt_dir: Arc<OwnedFd>,
    peers: Option<Arc<JobPeers>>,
) -> Result<(Option<String>, Vec<String>), RestoreError> {
    // With the job's other nodes, the first checkpoint tried is restored together (each file
    // read from the archive by one node); a fallback one, by each node alone.
    let shared = peers.map(super::shared_restore::Done);
    // The nearest copies first: the job's nodes' own parts and replicas (`[fast_tier] replicas`).
    // Restored so, this node offers nothing of the archive's to the job's other nodes: `shared`
    // goes now, as after an archive restore.
    // This node's parts of older checkpoints that only replicas hold (a replaced node) come back
    // either way (`recovered`).
    let (from_replicas, recovered) =
        super::replica_restore::restore(ctx, job, which, ckpt_dir.clone()).await;
    let from_replicas = match from_replicas {
        FromReplicas::Restored { tag, note } => {
            drop(shared);
            return Ok((Some(tag), std::iter::once(note).chain(recovered).collect()));
        }
        FromReplicas::Not(why) => why,
    };
    match from_archive(ctx, job, url, which, ckpt_dir, shared).await {
        Ok((tag, mut notes)) => {
            notes.splice(0..0, from_replicas.into_iter().chain(recovered));
            Ok((tag, notes))
        }
        Err(source) => match from_replicas {
            Some(replicas) => Err(RestoreError::NotFromReplicas {
                replicas,
                source: Box::new(source),
            }),
            None => Err(source),
        },
    }
}

/// Restores `which` from the job's archive `url` (see [`restore`]).
async fn from_archive(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    url: &str,
    which: &Restore,
    ckpt_dir: Arc<OwnedFd>,
    mut shared: Option<super::shared_restore::Done>,
) -> Result<(Option<String>, Vec<String>), RestoreError> {
    let archiver = archive::open_archive(&ctx.cfg, url).map_err(|e| RestoreError::Open {
        url: url.into(),
        source: Box::new(e),
    })?;
    let owner = Owner {
        uid: job.start.uid,
        gid: job.start.gid,
    };
    let list_error = |e| RestoreError::List {
        url: url.into(),
        source: Box::new(e),
    };
    let mut notes = Vec::new();
    let mut exclude: Vec<String> = Vec::new();
    // Other users' checkpoints `latest` passed over: all of them up front (one listing), and any
    // that turn up later.
    let mut foreign: Vec<String> = Vec::new();
    if *which == Restore::Latest {
        let list = archiver.list().await.map_err(list_error)?;
        foreign = list
            .into_iter()
            .filter(|i| i.job.as_ref().is_some_and(|m| m.user != job.start.user))
            .map(|i| i.tag)
            .collect();
        exclude.clone_from(&foreign);
    }
    let done = |tag: String, mut notes: Vec<String>, foreign: &[String]| {
        if !foreign.is_empty() {
            notes.insert(0, foreign_note(url, foreign));
        }
        Ok((Some(tag), notes))
    };
    loop {
        let tag = match which {
            Restore::Tag(t) | Restore::Forced(t) => t.clone(),
            Restore::Latest => match latest(&archiver, url, &exclude, &mut notes)
                .await
                .map_err(list_error)?
            {
                Some(t) => t,
                None if exclude.is_empty() && notes.is_empty() => {
                    notes.push(format!(
                        "--ckpt-restore=latest: {url} holds no checkpoint yet; the job starts fresh"
                    ));
                    return Ok((None, notes));
                }
                None if notes.is_empty() => {
                    return Err(RestoreError::NoneOfYours {
                        url: url.into(),
                        note: foreign_note(url, &foreign),
                    });
                }
                None => {
                    if !foreign.is_empty() {
                        notes.insert(0, foreign_note(url, &foreign));
                    }
                    return Err(RestoreError::NoneIntact {
                        url: url.into(),
                        notes: notes.join("; "),
                    });
                }
            },
        };
        // Before anything is fetched or moved. A missing or unreadable MANIFEST is left to the
        // restore below, which reports it (and the owner is checked again after).
        if let Ok(m) = archiver.manifest(&tag).await {
            if m.job.user != job.start.user {
                refuse_foreign(job, url, &tag, &m.job, which)?;
                exclude.push(tag.clone());
                foreign.push(tag);
                continue;
            }
            // `latest` passed over the poisoned ones already.
            if *which != Restore::Latest
                && let Some(mark) = archiver.poisoned(&m).await.map_err(list_error)?
            {
                if !matches!(which, Restore::Forced(_)) {
                    return Err(RestoreError::Poisoned {
                        tag,
                        url: url.into(),
                        why: archive::poison::describe(&mark),
                    });
                }
                notes.push(archive::poison::forced_note(url, &tag, &mark));
            }
        }
        if let Some(note) = from_hot_tier(ctx, job, url, &tag, &archiver, ckpt_dir.clone()).await {
            notes.push(note);
            // This node has the whole checkpoint: it serves its share to the job's other nodes.
            if let Some(share) = shared.take() {
                let (dir, t) = (ckpt_dir.clone(), tag.clone());
                let opened = blocking(move || safefs::open_dir(&*dir, &t)).await;
                if let (Ok(dir), Ok(m)) = (opened, archiver.manifest(&tag).await) {
                    super::shared_restore::offer(&m, &Arc::new(dir), owner, share).await;
                }
            }
            return done(tag, notes, &foreign);
        }
        let (dir, t) = (ckpt_dir.clone(), tag.clone());
        let dest = blocking(move || {
            safefs::remove_tree(&*dir, &t, owner.into())?.all_gone(&t)?;
            safefs::create_dir(&*dir, &t, Some(owner), 0o755)
        })
        .await
        .map_err(|source| RestoreError::CreateDir {
            tag: tag.clone(),
            source,
        })?;
        let progress = ArchiveProgress::default();
        let dest = Arc::new(dest);
        let restored = match shared.take() {
            Some(done) => {
                let r =
                    super::shared_restore::restore(&archiver, &tag, dest, owner, done, &progress)
                        .await;
                r.map(|(m, sources)| {
                    if sources.peers > 0 {
                        notes.push(super::shared_restore::note(&tag, sources));
                    }
                    m
                })
            }
            None => archiver.restore(&tag, dest, owner, &progress).await,
        };
        // The MANIFEST the restore used may have been replaced since the check above.
        let other_owner = restored
            .as_ref()
            .ok()
            .filter(|m| m.job.user != job.start.user)
            .map(|m| m.job.clone());
        match restored {
            Ok(manifest) if other_owner.is_none() => {
                let entry = Arc::new(CkptEntry::new(&tag, now_secs()));
                entry.set_sizes(
                    manifest.files.len() as u64,
                    manifest.raw_bytes(),
                    manifest.stored_bytes(),
                );
                entry.set_archived(now_secs());
                job.ckpts.insert(entry);
                tracing::info!(job_id = job.start.job_id, tag, "checkpoint restored");
                return done(tag, notes, &foreign);
            }
            result => {
                let (dir, t) = (ckpt_dir.clone(), tag.clone());
                let _ = blocking(move || safefs::remove_tree(&*dir, &t, owner.into())).await;
                if let Some(other) = other_owner {
                    refuse_foreign(job, url, &tag, &other, which)?;
                    foreign.push(tag.clone());
                } else if let Err(source) = result {
                    match which {
                        Restore::Latest => notes.push(format!(
                            "checkpoint {tag} in {url} cannot be restored ({source}); falling back to the next newest"
                        )),
                        Restore::Tag(_) | Restore::Forced(_) => {
                            return Err(RestoreError::Restore {
                                tag,
                                source: Box::new(source),
                            });
                        }
                    }
                }
                exclude.push(tag);
            }
        }
    }
}

/// The newest intact checkpoint not in `exclude` that is not poisoned; a note for each poisoned
/// one passed over (once, however often the restore falls back).
async fn latest(
    archiver: &Archiver,
    url: &str,
    exclude: &[String],
    notes: &mut Vec<String>,
) -> Result<Option<String>, ArchiveError> {
    let found = archiver.latest_good(exclude).await?;
    for (tag, mark) in &found.poisoned {
        let note = archive::poison::skipped_note(url, tag, mark);
        if !notes.contains(&note) {
            notes.push(note);
        }
    }
    Ok(found.tag)
}

/// Takes `tag` from a checkpoint an ended job of the same user left on this node's hot tier (same
/// archive), if that copy is complete and verifies against the archive's MANIFEST (sizes and BLAKE3
/// of every file). The directory is moved, not copied. Returns the note for the job, or `None` when
/// there is no usable copy (then the caller restores from the archive).
async fn from_hot_tier(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    url: &str,
    tag: &str,
    archiver: &Archiver,
    ckpt_dir: Arc<OwnedFd>,
) -> Option<String> {
    let uid = job.start.uid;
    let (old_job, old_entry) = ctx.jobs.snapshot().into_iter().find_map(|j| {
        let same = j.has_ended() && j.start.uid == uid && j.start.job_id != job.start.job_id;
        let same = same && j.archive_url() == Some(url);
        let e = j
            .ckpts
            .get(tag)
            .filter(|e| same && e.on_hot() && e.state() == CkptState::Archived)?;
        Some((j, e))
    })?;
    let manifest = archiver.manifest(tag).await.ok()?;
    let (hot, old_id, t) = (ctx.hot.clone(), old_job.start.job_id, tag.to_string());
    let dest = ckpt_dir.clone();
    // Move first (the old job's directory is the user's: verifying in place and then moving would
    // leave a window to swap files), verify, and move back if the copy is not usable (e.g. only
    // this node's part of a multi-node checkpoint): it stays the old job's kept copy.
    let outcome = blocking(move || -> Result<HotCopy, SafeFsError> {
        let old_dir = hot.open_ckpt(old_id)?;
        nix::fcntl::renameat(&old_dir, t.as_str(), &*dest, t.as_str()).map_err(|errno| {
            SafeFsError::Sys {
                op: "renameat",
                path: t.clone(),
                errno,
            }
        })?;
        Ok(match verify_local(&dest, &t, uid, &manifest, None) {
            Ok(()) => HotCopy::Taken,
            Err(e) if nix::fcntl::renameat(&*dest, t.as_str(), &old_dir, t.as_str()).is_ok() => {
                HotCopy::PutBack(e)
            }
            Err(_) => {
                let _ = safefs::remove_tree(&*dest, &t, safefs::RemoveAs { uid });
                HotCopy::Lost
            }
        })
    })
    .await;
    let moved = matches!(outcome, Ok(HotCopy::Taken | HotCopy::Lost));
    let why = match outcome {
        Ok(HotCopy::Taken) => None,
        Ok(HotCopy::PutBack(e)) => Some(format!("{e} (left in place)")),
        Ok(HotCopy::Lost) => Some("the copy failed verification and could not be put back".into()),
        Err(e) => Some(e.to_string()),
    };
    if moved {
        old_entry.set_on_hot(false);
        ctx.jobs.persist(&old_job).await;
    }
    match why {
        None => {
            let entry = Arc::new(CkptEntry::new(tag, now_secs()));
            entry.set_archived(now_secs());
            job.ckpts.insert(entry);
            tracing::info!(
                job_id = job.start.job_id,
                tag,
                from_job = old_id,
                "checkpoint restored from the hot tier"
            );
            Some(format!(
                "checkpoint {tag} restored from this node's hot tier (left by job {old_id}, verified against {url})"
            ))
        }
        Some(e) => {
            tracing::info!(
                job_id = job.start.job_id,
                tag,
                "hot-tier copy unusable ({e}); restoring from the archive"
            );
            None
        }
    }
}

/// The note for checkpoints of other users that `--ckpt-restore=latest` passed over. Names the tags
/// (at most a few), not their owners.
fn foreign_note(url: &str, tags: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut shown = tags
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if tags.len() > SHOWN {
        shown.push_str(&format!(" and {} more", tags.len() - SHOWN));
    }
    format!(
        "skipped {} checkpoint(s) in {url} archived by other users ({shown}): sluice restores \
         only your own",
        tags.len()
    )
}

/// Checkpoint `tag` was archived by `owner`, not by the job's user: an explicit tag fails the job;
/// `latest` passes over it (`Ok`).
fn refuse_foreign(
    job: &Job,
    url: &str,
    tag: &str,
    owner: &JobMeta,
    which: &Restore,
) -> Result<(), RestoreError> {
    match which {
        Restore::Latest => Ok(()),
        Restore::Tag(_) | Restore::Forced(_) => Err(RestoreError::Foreign {
            tag: tag.into(),
            url: url.into(),
            owner: owner.user.clone(),
            user: job.start.user.clone(),
        }),
    }
}

/// Checks that the checkpoint directory `tag` below `dir` holds exactly the MANIFEST's files — those
/// of `node` only, when given (this node's part) — with their sizes and BLAKE3 content hashes (read
/// fd-relative, without following links).
pub(crate) fn verify_local(
    dir: &OwnedFd,
    tag: &str,
    uid: u32,
    manifest: &Manifest,
    node: Option<&str>,
) -> Result<(), VerifyError> {
    use std::io::Read;
    let root = safefs::open_dir(dir, tag)?;
    let tree = archive::walk::walk(&root, uid)?;
    let mut want: Vec<(&str, u64)> = manifest
        .files
        .iter()
        .filter(|f| node.is_none_or(|n| f.node == n))
        .map(|f| (f.path.as_str(), f.size))
        .collect();
    want.sort();
    let have: Vec<(&str, u64)> = tree
        .files
        .iter()
        .map(|f| (f.rel.as_str(), f.size))
        .collect();
    if want != have {
        return Err(VerifyError::Files);
    }
    for f in &tree.files {
        let (mut file, _) = archive::walk::open_file(&root, f, uid)?;
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        let expected = manifest
            .files
            .iter()
            .find(|m| m.path == f.rel)
            .map(|m| m.content_hash());
        if Some(hasher.finalize()) != expected {
            return Err(VerifyError::Differs(f.rel.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_restore_is_labelled_by_its_archive_error() {
        let full = ArchiveError::Write {
            tag: "t".into(),
            path: "p".into(),
            detail: "full".into(),
            errno: Some(nix::errno::Errno::ENOSPC as i32),
        };
        let e = RestoreError::Restore {
            tag: "t".into(),
            source: Box::new(full),
        };
        assert_eq!(e.code(), "no_space");
        assert_eq!(RestoreError::NoArchive.code(), "no_archive");
    }
}
