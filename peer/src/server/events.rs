//! The server half of job events (`crate::events`): a commit notice of an authenticated agent of
//! the job, once `Inner::answer` admitted it as for any resource of the job, handed to this
//! node's [`JobEvents`](crate::events::JobEvents).

use hyper::body::{Body as _, Incoming};
use hyper::{Response, StatusCode};

use super::{Body, Inner, JobEntry, Signer, query_fields, query_text};
use crate::events::commit_unit;
use crate::replica::check_tag;

/// The tag of a commit notice's query `tag={t}`, checked ([`check_tag`]); nothing else.
pub(super) fn parse_commit(query: &str) -> Result<String, String> {
    let fields = query_fields(query, &["tag"])?;
    let tag = query_text(&fields, "tag")?;
    check_tag(tag).map_err(|e| e.to_string())?;
    Ok(tag.to_string())
}

impl Inner {
    /// A commit notice of `node`, an authenticated agent of the job: `202` once the node's
    /// events have it.
    pub(super) async fn answer_commit(
        &self,
        entry: &JobEntry,
        query: &str,
        node: &str,
        mac: blake3::Hash,
        body: &Incoming,
    ) -> Response<Body> {
        let tag = match parse_commit(query) {
            Ok(tag) => tag,
            Err(why) => return super::refuse(StatusCode::BAD_REQUEST, why),
        };
        let unit = commit_unit(node, &tag);
        let signer = Signer {
            key: &entry.key,
            unit: &unit,
            request: mac,
        };
        // Nothing of a body is read: a notice that carries one is not one of ours.
        if body.size_hint().exact() != Some(0) {
            return signer.status(StatusCode::BAD_REQUEST, "a commit notice has no body");
        }
        let Some(events) = self.events.get() else {
            return signer.status(StatusCode::NOT_IMPLEMENTED, "this node takes no job events");
        };
        events.committed(entry.key.job(), node, &tag).await;
        signer.status(StatusCode::ACCEPTED, "queued")
    }
}
