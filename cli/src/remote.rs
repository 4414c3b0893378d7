//! `sluice ckpt list|verify|restore URL` through this node's agent, for a user who cannot read the
//! agent's configuration (it holds the site's store credentials, so it is root's). The agent reads
//! the archive with them and shows the user only their own checkpoints (docs/SECURITY.md).
//!
//! A restore never hands the agent a path: this process (the user) opens, or creates, the
//! destination directory itself and passes the open descriptor with the request; the agent checks
//! that descriptor (a directory of the caller's, empty) and writes below it only. The answers are
//! turned into the same values the direct mode prints, so the output is the same either way.

use crate::agent::Agent;
use crate::ckpt::{self, ArchiveListing, Dest, RestorePlan, Restored, Verified};
use anyhow::anyhow;
use sluice_archive::CheckpointInfo;
use sluice_proto::msg::{CkptPoisoned, ErrorCode, ErrorReply, Request, Response};
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
    agent
        .call_with(request, fd, wait)
        .map_err(explain_too_old(agent))
}

/// An error that says so when the agent is too old to know the request.
pub(crate) fn explain_too_old(agent: &Agent) -> impl Fn(anyhow::Error) -> anyhow::Error + '_ {
    move |e| {
        if too_old(&e) {
            anyhow!(
                "the sluice agent at {} is older than this CLI and does not know this request; \
                 ask your admin to update sluiced on this node (root can read the archive directly)",
                agent.socket
            )
        } else {
            e
        }
    }
}

/// Marks the caller's archived checkpoint `tag` bad.
pub fn poison(agent: &Agent, url: &str, tag: &str, reason: &str) -> anyhow::Result<CkptPoisoned> {
    let request = Request::ArchivePoison {
        url: url.into(),
        tag: tag.into(),
        reason: reason.into(),
    };
    match call(agent, request, None, LIST_WAIT)? {
        Response::Poisoned(p) => Ok(p),
        other => Err(agent.unexpected("archive poison", &other)),
    }
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
                ckpts: l.ckpts.into_iter().map(CheckpointInfo::from).collect(),
            })
        }
        other => Err(agent.unexpected("archive list", &other)),
    }
}

/// Verifies the caller's checkpoint `tag` (or `latest`); the agent reads it all.
pub fn verify(agent: &Agent, url: &str, tag: &str) -> anyhow::Result<Verified> {
    let request = Request::ArchiveVerify {
        url: url.into(),
        tag: tag.into(),
    };
    match call(agent, request, None, READ_WAIT)? {
        Response::Verified(v) => Ok(Verified::from(v)),
        other => Err(agent.unexpected("archive verify", &other)),
    }
}

/// `--dry-run`: the agent says which checkpoint and how much; DEST is checked here, as the user.
pub fn plan_restore(
    agent: &Agent,
    url: &str,
    (tag, force): (&str, bool),
    dest: &Path,
    uid: u32,
) -> anyhow::Result<RestorePlan> {
    let dest_check = ckpt::check_dest(dest, uid);
    let request = Request::ArchiveRestore {
        url: url.into(),
        tag: tag.into(),
        dry_run: true,
        force,
    };
    match call(agent, request, None, LIST_WAIT)? {
        Response::Restored(r) => Ok(RestorePlan::new(r, dest, dest_check)),
        other => Err(agent.unexpected("archive restore", &other)),
    }
}

/// Restores the caller's checkpoint `tag` (or `latest`) into `dest`, which this process opened
/// (or created) as the user: the agent gets its descriptor, never its path. On failure `dest` is
/// left as it was found (see [`ckpt::fail`]).
pub fn restore(
    agent: &Agent,
    url: &str,
    (tag, force): (&str, bool),
    dest: &Dest,
) -> anyhow::Result<Restored> {
    let request = Request::ArchiveRestore {
        url: url.into(),
        tag: tag.into(),
        dry_run: false,
        force,
    };
    match call(agent, request, Some(dest.fd()), READ_WAIT) {
        Ok(Response::Restored(r)) => {
            for t in &r.skipped {
                eprintln!(
                    "sluice: checkpoint {t} cannot be restored (damaged); fell back to the next newest"
                );
            }
            for n in &r.notes {
                eprintln!("sluice: {n}");
            }
            Ok(Restored::new(r, &dest.path))
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
}
