//! The server half of the replica resource (`crate::replica`): what an authenticated agent of
//! the job may ask of this node's [`ReplicaStore`], once `Inner::answer` admitted it as for any
//! resource of the job.
//!
//! The part a push, seal or free is about is always the requesting node's own (`from` is the
//! authenticated `x-sluice-node`); only a fetch names `from`, since any node of the job may read
//! any part. Every answer from here on is MAC'd (a query that does not parse has nothing to name
//! and gets a bare `400`, as a unit request does). Budgets: at most `concurrency` pushes stored
//! at once (waited for up to [`PUSH_SLOT_WAIT`], then `503 busy`); a fetch takes a response slot
//! as a cached range does; a seal body is read up to [`MAX_SEAL_BODY`]; a push body no longer
//! than its `content-length`, which must be its announced `size`, and never silent for longer
//! than the idle timeout. An answer given before the store read the whole body (a refusal, no
//! room) first reads and drops the rest of it when that is at most [`DRAIN_MAX`] bytes, so that
//! the sender, still writing, gets the answer rather than a reset connection; a longer rest is
//! not read, and the connection closes after the answer (the sender may then see the connection
//! reset instead: [`crate::PeerError::Dropped`]).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, HeaderMap};
use hyper::{Method, Response, StatusCode};

use super::{Body, Inner, JobEntry, Signer, UnitError, query_fields, query_number, query_text};
use crate::Unit;
use crate::http::{BodyError, next_data, read_bounded};
use crate::replica::{
    self, MAX_SEAL_BODY, PartKey, ReplicaFile, ReplicaRefusal, ReplicaSeal, ReplicaStore, Room,
    RoomLeft, check_path, check_seal, check_tag,
};

/// The replica resources, by path (each answers the methods `Resource::serves` lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReplicaPath {
    /// `/replicas`: the index (GET), freeing a part (DELETE).
    Part,
    /// `/replicas/file`: a push (PUT), a fetch (GET).
    File,
    /// `/replicas/seal` (POST).
    Seal,
    /// `/replicas/room`: the free room (GET).
    Room,
}

/// How long a push waits for one of the `concurrency` push slots before `503 busy`.
const PUSH_SLOT_WAIT: Duration = Duration::from_secs(2);
/// How much of a body an early answer reads and drops before it is sent (see the header).
const DRAIN_MAX: u64 = 8 << 20;

/// A replica request, its query checked: the tag, path and hash a client sent are checked here
/// ([`check_tag`], [`check_path`]) before the store sees them.
#[derive(Debug)]
pub(super) enum ReplicaRequest {
    Push {
        tag: String,
        file: ReplicaFile,
    },
    Seal {
        tag: String,
    },
    Index,
    Room,
    Fetch {
        from: String,
        tag: String,
        path: String,
    },
    Free {
        tag: String,
    },
}

impl ReplicaRequest {
    pub(super) fn parse(path: ReplicaPath, method: &Method, query: &str) -> Result<Self, String> {
        let tag = |fields: &std::collections::HashMap<String, String>| -> Result<String, String> {
            let tag = query_text(fields, "tag")?;
            check_tag(tag).map_err(|e| e.to_string())?;
            Ok(tag.to_string())
        };
        let file = |fields: &std::collections::HashMap<String, String>| -> Result<String, String> {
            let path = query_text(fields, "file")?;
            check_path(path).map_err(|e| e.to_string())?;
            Ok(path.to_string())
        };
        match (path, method.clone()) {
            (ReplicaPath::File, Method::PUT) => {
                let f = query_fields(query, &["tag", "file", "size", "blake3"])?;
                let blake3 = query_text(&f, "blake3")?;
                blake3::Hash::from_hex(blake3)
                    .map_err(|_| format!("'{blake3}' is not a BLAKE3 hash in hex"))?;
                Ok(ReplicaRequest::Push {
                    tag: tag(&f)?,
                    file: ReplicaFile {
                        path: file(&f)?,
                        size: query_number(&f, "size")?,
                        blake3: blake3.to_string(),
                    },
                })
            }
            (ReplicaPath::File, _) => {
                let f = query_fields(query, &["from", "tag", "file"])?;
                Ok(ReplicaRequest::Fetch {
                    from: query_text(&f, "from")?.to_string(),
                    tag: tag(&f)?,
                    path: file(&f)?,
                })
            }
            (ReplicaPath::Seal, _) => Ok(ReplicaRequest::Seal {
                tag: tag(&query_fields(query, &["tag"])?)?,
            }),
            (ReplicaPath::Part, Method::DELETE) => Ok(ReplicaRequest::Free {
                tag: tag(&query_fields(query, &["tag"])?)?,
            }),
            (ReplicaPath::Part, _) => {
                query_fields(query, &[])?;
                Ok(ReplicaRequest::Index)
            }
            (ReplicaPath::Room, _) => {
                query_fields(query, &[])?;
                Ok(ReplicaRequest::Room)
            }
        }
    }

    /// What the answers to this request from `node` are MAC'd over (a fetch's data answer: with
    /// the copy's length, see [`replica::file_unit`]).
    pub(super) fn unit(&self, node: &str) -> Unit {
        match self {
            ReplicaRequest::Push { tag, file } => {
                replica::file_unit(node, tag, &file.path, file.size)
            }
            ReplicaRequest::Fetch { from, tag, path } => replica::file_unit(from, tag, path, 0),
            ReplicaRequest::Seal { tag } | ReplicaRequest::Free { tag } => {
                replica::part_unit(node, tag)
            }
            ReplicaRequest::Index => replica::index_unit(),
            ReplicaRequest::Room => replica::room_unit(),
        }
    }
}

/// What `Inner::answer` admitted: the request of an authenticated node of the job.
pub(super) struct Asked<'a> {
    pub path: ReplicaPath,
    pub method: &'a Method,
    pub query: &'a str,
    pub headers: &'a HeaderMap,
    /// The authenticated node: whose part a push, seal or free is.
    pub node: &'a str,
    pub mac: blake3::Hash,
}

/// A request body that the store reads as a stream and the server drains after it: shared, so
/// that what the store left unread is still the server's.
struct SharedBody {
    body: Arc<tokio::sync::Mutex<Incoming>>,
    /// Its `content-length`.
    announced: Option<u64>,
    /// The longest silence within the body.
    stall: Duration,
}

impl SharedBody {
    /// The body's data as the store reads it.
    fn stream(&self) -> replica::Incoming {
        let stall = self.stall;
        futures::stream::unfold(Some(self.body.clone()), move |body| async move {
            let shared = body?;
            let next = next_data(&mut *shared.lock().await, stall).await;
            match next {
                Ok(Some(data)) => Some((Ok(data), Some(shared))),
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed()
    }

    /// Reads and drops what is left of the body if its length says that is at most
    /// [`DRAIN_MAX`] bytes; a longer one (or one of unknown length) is left, and the connection
    /// closes after the answer.
    async fn drain(&self) {
        use hyper::body::Body as _;
        let mut body = self.body.lock().await;
        if body.size_hint().upper().is_none_or(|left| left > DRAIN_MAX) {
            return;
        }
        while let Ok(Some(_)) = next_data(&mut body, self.stall).await {}
    }
}

impl Signer<'_> {
    /// The answer to a replica request the store refused.
    fn refusal(&self, r: &ReplicaRefusal) -> Response<Body> {
        match r {
            ReplicaRefusal::NoRoom { need, free } => {
                let room = serde_json::to_string(&Room {
                    need: *need,
                    free: *free,
                })
                .expect("two numbers serialise");
                self.status(StatusCode::INSUFFICIENT_STORAGE, &room)
            }
            ReplicaRefusal::Mismatch(why) => self.status(StatusCode::CONFLICT, why),
            ReplicaRefusal::Invalid(why) => self.status(StatusCode::BAD_REQUEST, why),
            ReplicaRefusal::Failed(why) => self.status(StatusCode::INTERNAL_SERVER_ERROR, why),
        }
    }
}

impl Inner {
    /// A replica request of an authenticated agent of the job (see the module header).
    pub(super) async fn answer_replica(
        &self,
        entry: &JobEntry,
        asked: Asked<'_>,
        body: Incoming,
    ) -> Response<Body> {
        let body = SharedBody {
            body: Arc::new(tokio::sync::Mutex::new(body)),
            announced: asked
                .headers
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok()),
            stall: self.cfg.idle_timeout,
        };
        let request = match ReplicaRequest::parse(asked.path, asked.method, asked.query) {
            Ok(r) => r,
            Err(why) => {
                body.drain().await;
                return super::refuse(StatusCode::BAD_REQUEST, why);
            }
        };
        let unit = request.unit(asked.node);
        let signer = Signer {
            key: &entry.key,
            unit: &unit,
            request: asked.mac,
        };
        let Some(store) = self.replicas.get() else {
            body.drain().await;
            return signer.status(StatusCode::NOT_IMPLEMENTED, "this node keeps no replicas");
        };
        let job = entry.key.job();
        let part = |from: &str, tag: &str| PartKey {
            job,
            from: from.to_string(),
            tag: tag.to_string(),
        };
        let answer = match &request {
            ReplicaRequest::Push { tag, file } => {
                let part = part(asked.node, tag);
                self.push(store.as_ref(), entry, &signer, &part, file, &body)
                    .await
            }
            ReplicaRequest::Seal { tag } => {
                self.seal(
                    store.as_ref(),
                    entry,
                    &signer,
                    &part(asked.node, tag),
                    &body,
                )
                .await
            }
            ReplicaRequest::Index => {
                let index =
                    serde_json::to_string(&store.index(job).await).expect("an index serialises");
                signer.status(StatusCode::OK, &index)
            }
            ReplicaRequest::Room => {
                let (free, room) = store.room();
                let left = serde_json::to_string(&RoomLeft { free, room }).expect("two numbers");
                signer.status(StatusCode::OK, &left)
            }
            ReplicaRequest::Free { tag } => {
                store.free(&part(asked.node, tag)).await;
                signer.status(StatusCode::OK, "freed")
            }
            // `from` of a fetch comes off the network: a node of the job, or nothing to ask the
            // store about.
            ReplicaRequest::Fetch { from, .. } if !entry.key.has_node(from) => signer.status(
                StatusCode::BAD_REQUEST,
                &format!("'{}' is not a node of job {job}", from.escape_debug()),
            ),
            ReplicaRequest::Fetch { from, tag, path } => {
                self.fetch(store.as_ref(), entry, &signer, &part(from, tag), path)
                    .await
            }
        };
        body.drain().await;
        answer
    }

    /// Stores one pushed file of `part` (the requester's own), announced as `file`.
    async fn push(
        &self,
        store: &dyn ReplicaStore,
        entry: &JobEntry,
        signer: &Signer<'_>,
        part: &PartKey,
        file: &ReplicaFile,
        body: &SharedBody,
    ) -> Response<Body> {
        let len = body.announced;
        if len != Some(file.size) {
            return signer.status(
                StatusCode::BAD_REQUEST,
                &format!(
                    "a push of {} bytes carries content-length {len:?}: it must be the file's size",
                    file.size
                ),
            );
        }
        let permit = tokio::select! {
            p = tokio::time::timeout(PUSH_SLOT_WAIT, self.pushes.clone().acquire_owned()) => p,
            _ = entry.ended.cancelled() => return signer.error(&UnitError::Gone),
        };
        let Ok(_permit) = permit else {
            return signer.status(StatusCode::SERVICE_UNAVAILABLE, "busy");
        };
        match store.put_file(part, file, body.stream()).await {
            Ok(()) => signer.status(StatusCode::CREATED, "stored"),
            Err(r) => signer.refusal(&r),
        }
    }

    /// Seals `part` (the requester's own) with the [`ReplicaSeal`] in the body: its files and
    /// nodes checked ([`check_seal`]), every node one of the job's.
    async fn seal(
        &self,
        store: &dyn ReplicaStore,
        entry: &JobEntry,
        signer: &Signer<'_>,
        part: &PartKey,
        body: &SharedBody,
    ) -> Response<Body> {
        let invalid = |why: String| signer.status(StatusCode::BAD_REQUEST, &why);
        let too_long = || invalid(format!("a seal is at most {MAX_SEAL_BODY} bytes of JSON"));
        if body.announced.is_some_and(|n| n > MAX_SEAL_BODY as u64) {
            return too_long();
        }
        let read = read_bounded(&mut *body.body.lock().await, MAX_SEAL_BODY, body.stall).await;
        let bytes = match read {
            Ok(b) => b,
            Err(BodyError::TooLong) => return too_long(),
            Err(BodyError::Io(e)) => return invalid(format!("the seal did not arrive: {e}")),
        };
        let seal: ReplicaSeal = match serde_json::from_slice(&bytes) {
            Ok(s) => s,
            Err(e) => return invalid(format!("the seal does not parse: {e}")),
        };
        if let Err(r) = check_seal(&part.from, &seal.files, &seal.nodes) {
            return signer.refusal(&r);
        }
        // The list comes off the network too: the job's nodes, as the job key has them.
        if let Some(n) = seal.nodes.iter().find(|n| !entry.key.has_node(n)) {
            return invalid(format!("'{n}' is not a node of job {}", part.job));
        }
        match store.seal(part, &seal).await {
            Ok(()) => signer.status(StatusCode::OK, "sealed"),
            Err(r) => signer.refusal(&r),
        }
    }

    /// A file of a sealed part, from a response slot, as a cached range is served.
    async fn fetch(
        &self,
        store: &dyn ReplicaStore,
        entry: &JobEntry,
        signer: &Signer<'_>,
        part: &PartKey,
        path: &str,
    ) -> Response<Body> {
        let permit = tokio::select! {
            p = tokio::time::timeout(super::CACHED_SLOT_WAIT, self.responses.clone().acquire_owned()) => p,
            _ = entry.ended.cancelled() => return signer.error(&UnitError::Gone),
        };
        let Ok(permit) = permit else {
            return signer.status(StatusCode::SERVICE_UNAVAILABLE, "busy");
        };
        let permit = permit.expect("the response semaphore is never closed");
        match store.file(part, path).await {
            Some(data) => {
                let unit = replica::file_unit(&part.from, &part.tag, path, data.len);
                Signer {
                    unit: &unit,
                    ..*signer
                }
                .data(data, permit)
            }
            None => signer.status(StatusCode::NOT_FOUND, "not held here"),
        }
    }
}
