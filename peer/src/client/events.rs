//! The client half of job events (`crate::events`): tell the agent of another node of the job
//! that this node committed a checkpoint. One request, signed and answered as a replica request
//! is (`PeerClient::exchange`); it counts only when the answer is MAC'd for it.

use hyper::{Method, StatusCode};

use super::replicas::{Ask, expect, pq};
use super::{PeerClient, PeerError, REASON_MAX, empty};
use crate::JobKey;
use crate::events::commit_unit;

impl PeerClient {
    /// Tells the agent at `addr` that this node committed checkpoint `tag` of `job`. `Ok` once it
    /// took the notice (it acts on it later); [`PeerError::Refused`] with `501` from an agent that
    /// takes no job events.
    pub async fn notify_commit(
        &self,
        addr: &str,
        job: &JobKey,
        tag: &str,
    ) -> Result<(), PeerError> {
        let ask = Ask {
            addr,
            job,
            method: Method::POST,
            pq: pq(job, "commits", &[("tag", tag)]),
            unit: commit_unit(&self.node, tag),
            what: format!("the commit notice of {tag} from {}", self.node),
        };
        let answer = self
            .exchange(&ask, empty(), Some(0), None, REASON_MAX)
            .await?;
        expect(&ask, answer, StatusCode::ACCEPTED).map(drop)
    }
}
