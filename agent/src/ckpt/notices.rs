//! Commit notices over the peer port: a node that commits a checkpoint tells the job's other nodes
//! at once, so that they commit their files of it (flush, replicate, archive) even while the
//! archive — the other way commits travel (`Archiver::announce_commit`) — is unreachable.
//!
//! The sender is the node whose job committed (a request or a framework's signal), never a node
//! that adopted the commit from another: one notice per node per commit. A notice not delivered
//! is tried again a few times (the other node's set-up may not have registered the job yet); the
//! archive's note remains for nodes it never reaches.

use super::CkptCtx;
use crate::job::Job;
use std::sync::Arc;
use std::time::Duration;

/// Attempts per node, and the pause before the first retry (doubling).
const ATTEMPTS: u32 = 5;
const FIRST_PAUSE: Duration = Duration::from_millis(500);

/// What tells the job's other nodes that this node committed `tag`, for the caller to run in the
/// background (the commit's reply does not wait for it). Nothing for a job without replicas (the
/// archive carries its commits, as before), or without peers.
pub(crate) fn announce(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    tag: &str,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let peers = ctx.peers.get()?.clone();
    if job.replicas_wanted() == 0 {
        return None;
    }
    let (job, tag) = (job.clone(), tag.to_string());
    Some(async move {
        let key = peers.job_key(job.start.job_id, &job.start.nodes);
        let others = job.start.nodes.iter().filter(|n| **n != job.start.node);
        let sends = others.map(|node| {
            let (peers, key, tag, job_id) = (&peers, &key, &tag, job.start.job_id);
            async move {
                let addr = peers.addr_of(node);
                let mut pause = FIRST_PAUSE;
                for attempt in 1..=ATTEMPTS {
                    match peers.client().notify_commit(&addr, key, tag).await {
                        Ok(()) => return,
                        Err(e) if attempt == ATTEMPTS => tracing::warn!(
                            job_id,
                            tag,
                            "{node} was not told of the commit ({}); it learns of it from the archive",
                            sluice_stage::error_chain(&e)
                        ),
                        Err(_) => {
                            tokio::time::sleep(pause).await;
                            pause *= 2;
                        }
                    }
                }
            }
        });
        futures::future::join_all(sends).await;
    })
}

/// What the peer server hands over when another node of a job commits: the tag is queued on the
/// job here (if it runs here) for its checkpoint worker, which commits its own files of it.
pub(crate) struct CommitNotices {
    pub(crate) jobs: Arc<crate::job_table::JobTable>,
}

#[async_trait::async_trait]
impl sluice_peer::JobEvents for CommitNotices {
    async fn committed(&self, job_id: sluice_proto::msg::JobId, from: &str, tag: &str) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if job.has_ended() {
            return;
        }
        tracing::debug!(job_id, tag, "{from} committed");
        job.ckpts.committed_elsewhere(tag);
    }
}
