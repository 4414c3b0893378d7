//! `sluice ckpt list|verify|restore URL` through this node's agent, for a user who cannot read the
//! agent's configuration (it holds the site's store credentials, so it is root's). The agent reads
//! the archive with them and shows the user only their own checkpoints (docs/SECURITY.md).
//!
//! A restore never hands the agent a path: this process (the user) opens, or creates, the
//! destination directory itself and passes the open descriptor with the request; the agent checks
//! that descriptor (a directory of the caller's, empty) and writes below it only. The answers are
//! turned into the same values the direct mode prints, so the output is the same either way.

use crate::agent::Agent;
use crate::ckpt::{self, ArchiveListing, DamagedFile, Dest, RestorePlan, Restored, Verified};
use anyhow::anyhow;
use sluice_archive::manifest::ratio;
use sluice_archive::{CheckpointInfo, CheckpointState, JobMeta};
use sluice_proto::msg::{ArchivedCkpt, ErrorCode, ErrorReply, Request, Response};
use std::path::Path;
use std::time::Duration;

/// How long a listing's answer is awaited (the agent gives it 10 minutes).
const LIST_WAIT: Duration = Duration::from_secs(11 * 60);
/// How long a verify's or restore's answer is awaited (the agent gives them 12 hours; a hang-up
/// cancels them there).
const READ_WAIT: Duration = Duration::from_secs(12 * 3600 + 60);

/// Sends one archive request, saying clearly when the agent is too old to know it.
fn call(
    agent: &Agent,
    request: Request,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
    wait: Duration,
) -> anyhow::Result<Response> {
    agent.call_with(request, fd, wait).map_err(|e| {
        if too_old(&e) {
            anyhow!(
                "the sluice agent at {} is older than this CLI and cannot read archives for users; \
                 ask your admin to update sluiced on this node (root can read the archive directly)",
                agent.socket
            )
        } else {
            e
        }
    })
}

/// Whether the agent refused the request for not knowing it: an agent before these requests
/// answers any unknown one as a malformed frame.
pub(crate) fn too_old(e: &anyhow::Error) -> bool {
    e.downcast_ref::<ErrorReply>()
        .is_some_and(|r| r.code == ErrorCode::BadRequest && r.message.contains("unknown variant"))
}

/// The caller's checkpoints in the archive at `url`.
pub fn list(agent: &Agent, url: &str) -> anyhow::Result<ArchiveListing> {
    let request = Request::ArchiveList { url: url.into() };
    match call(agent, request, None, LIST_WAIT)? {
        Response::Archive(l) => {
            if l.left_out > 0 {
                eprintln!(
                    "sluice: {} older checkpoints of yours are not shown (one answer holds the newest {})",
                    l.left_out,
                    l.ckpts.len()
                );
            }
            Ok(ArchiveListing {
                url: l.url,
                ckpts: l.ckpts.into_iter().map(info).collect(),
            })
        }
        other => Err(agent.unexpected("archive list", &other)),
    }
}

/// A checkpoint as the agent sent it, as the archive engine describes it to the renderers.
fn info(c: ArchivedCkpt) -> CheckpointInfo {
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
        ratio: (state == CheckpointState::Complete).then(|| ratio(c.raw_bytes, c.stored_bytes)),
        tag: c.tag,
        state,
        files: c.files,
        raw_bytes: c.raw_bytes,
        stored_bytes: c.stored_bytes,
        created_unix_ms: c.created_unix_ms,
        job,
        nodes: c.nodes,
        data_classes: c.data_classes,
    }
}

/// Verifies the caller's checkpoint `tag` (or `latest`); the agent reads it all.
pub fn verify(agent: &Agent, url: &str, tag: &str) -> anyhow::Result<Verified> {
    let request = Request::ArchiveVerify {
        url: url.into(),
        tag: tag.into(),
    };
    match call(agent, request, None, READ_WAIT)? {
        Response::Verified(v) => Ok(Verified {
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
        }),
        other => Err(agent.unexpected("archive verify", &other)),
    }
}

/// `--dry-run`: the agent says which checkpoint and how much; DEST is checked here, as the user.
pub fn plan_restore(
    agent: &Agent,
    url: &str,
    tag: &str,
    dest: &Path,
    uid: u32,
) -> anyhow::Result<RestorePlan> {
    let dest_check = ckpt::check_dest(dest, uid);
    let request = Request::ArchiveRestore {
        url: url.into(),
        tag: tag.into(),
        dry_run: true,
    };
    match call(agent, request, None, LIST_WAIT)? {
        Response::Restored(r) => Ok(RestorePlan {
            dry_run: true,
            url: r.url,
            tag: r.tag,
            dest: dest.to_path_buf(),
            dest_check,
            files: r.files,
            raw_bytes: r.raw_bytes,
            stored_bytes: r.stored_bytes,
        }),
        other => Err(agent.unexpected("archive restore", &other)),
    }
}

/// Restores the caller's checkpoint `tag` (or `latest`) into `dest`, which this process opened
/// (or created) as the user: the agent gets its descriptor, never its path. On failure `dest` is
/// left as it was found (see [`ckpt::fail`]).
pub fn restore(agent: &Agent, url: &str, tag: &str, dest: &Dest) -> anyhow::Result<Restored> {
    let request = Request::ArchiveRestore {
        url: url.into(),
        tag: tag.into(),
        dry_run: false,
    };
    match call(agent, request, Some(dest.fd()), READ_WAIT) {
        Ok(Response::Restored(r)) => {
            for t in &r.skipped {
                eprintln!(
                    "sluice: checkpoint {t} cannot be restored (damaged); fell back to the next newest"
                );
            }
            Ok(Restored {
                url: r.url,
                tag: r.tag,
                dest: dest.path.clone(),
                files: r.files,
                raw_bytes: r.raw_bytes,
                stored_bytes: r.stored_bytes,
                skipped: r.skipped,
            })
        }
        Ok(other) => Err(ckpt::fail(
            agent.unexpected("archive restore", &other),
            dest,
        )),
        Err(e) => Err(ckpt::fail(e, dest)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an agent that predates a request answers (`server.rs:serve` sends the decode error
    /// as `bad_request`), told apart from other refusals.
    #[test]
    fn an_agent_too_old_for_the_request_is_recognised() {
        let body = br#"{"version":1,"request":{"op":"archive_frobnicate","url":"s3://b/x"}}"#;
        let e = sluice_proto::wire::decode_request(body).unwrap_err();
        let old = anyhow::Error::new(ErrorReply::new(ErrorCode::BadRequest, e.to_string()));
        assert!(too_old(&old), "{old}");
        let refused = anyhow::Error::new(ErrorReply::new(
            ErrorCode::Forbidden,
            "s3://b/x is not an archive location the site's policy gives you",
        ));
        assert!(!too_old(&refused));
        assert!(!too_old(&anyhow!("cannot reach the sluice agent")));
    }

    #[test]
    fn the_agents_listing_reads_as_the_archive_engines() {
        let c = ArchivedCkpt {
            tag: "step1".into(),
            state: "complete".into(),
            reason: None,
            files: 3,
            raw_bytes: 300,
            stored_bytes: 100,
            created_unix_ms: 5,
            job_id: Some(7),
            user: Some("alice".into()),
            job_name: Some("train".into()),
            nodes: vec!["n1".into()],
            data_classes: vec!["default".into()],
        };
        let i = info(c.clone());
        assert_eq!(i.state, CheckpointState::Complete);
        assert_eq!(i.ratio, Some(3.0));
        assert_eq!(i.job.as_ref().map(|j| j.user.as_str()), Some("alice"));
        assert_eq!((i.files, i.nodes.len()), (3, 1));
        let bad = info(ArchivedCkpt {
            state: "invalid".into(),
            reason: Some("truncated".into()),
            job_id: None,
            ..c.clone()
        });
        assert_eq!(
            bad.state,
            CheckpointState::Invalid {
                reason: "truncated".into()
            }
        );
        assert!(bad.job.is_none() && bad.ratio.is_none());
        let future = info(ArchivedCkpt {
            state: "frozen".into(),
            ..c
        });
        assert!(
            matches!(future.state, CheckpointState::Invalid { reason } if reason.contains("frozen"))
        );
    }
}
