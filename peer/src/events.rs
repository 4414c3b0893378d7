//! Job events over the peer port: what one agent of a job tells the others' agents of the job's
//! progress, so that a node does not learn it only through the archive.
//!
//! The one event is a **commit notice**: node `from` committed checkpoint `tag` of the job. With
//! the archive out (no commit notes in the store), the other nodes then still commit, flush and
//! replicate their own parts of that checkpoint. On the wire (admitted as every resource of a job:
//! the job key's MAC, the node in the job, the clock; `from` is the authenticated node, never a
//! parameter, so a node can speak only for itself):
//!
//! ```text
//! POST /v1/jobs/{job}/commits?tag={t}          no body (a content-length other than 0: 400)
//!      202 queued   501 this node takes no job events   410 the job ended here
//!      400 bare: a query that does not parse (a tag check_tag refuses, a parameter unknown,
//!      missing or twice)
//! ```
//!
//! Every answer to an admitted notice is MAC'd over `Unit { file: "commit\0{from}\0{tag}", 0, 0 }`
//! (`commit_unit`). The server hands a notice to the node's [`JobEvents`] and answers at once:
//! what the agent does with it (queue the commit of its own part) never holds the connection.

use sluice_proto::msg::JobId;

/// What this node does with the events the other agents of its jobs send (the agent's, set once
/// with [`crate::PeerServer::serve_events`]). Called for authenticated agents of a registered job
/// only, the tag checked ([`crate::replica::check_tag`]).
#[async_trait::async_trait]
pub trait JobEvents: Send + Sync + 'static {
    /// Node `from` of `job` (authenticated) committed checkpoint `tag`. Returns at once (the agent
    /// queues it).
    async fn committed(&self, job: JobId, from: &str, tag: &str);
}

/// What the answers to a commit notice of `from` for `tag` are MAC'd over.
pub(crate) fn commit_unit(from: &str, tag: &str) -> crate::Unit {
    crate::Unit::new(format!("commit\0{from}\0{tag}"), 0, 0)
}
