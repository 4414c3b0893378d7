//! The client half of the replica resource (`crate::replica`): push this node's part of a
//! checkpoint to a holder, seal it, read a holder's index and free room, fetch a file of any
//! node's part back, free this node's part. Each is one request, signed and answered as any
//! request of the peer port (`PeerClient::signed`, `send`, `take_data`, `take_reason`); an answer
//! counts only when its MAC verifies for the request, and a fetched file only when its bytes hash
//! to the hash the part was sealed with. A request whose answer is a short MAC'd text
//! ([`PeerClient::exchange`]) is how commit notices are sent as well (`client/events.rs`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::header::CONTENT_LENGTH;
use hyper::{Method, StatusCode};
use sluice_core::rt::lock;
use tokio::time::Instant;

use super::{BoxError, PeerClient, PeerError, REASON_MAX, ReqBody, UnitSink, empty};
use crate::JobKey;
use crate::auth::{HASH_HEADER, parse_hash};
use crate::replica::{
    self, MAX_SEAL_BODY, PartKey, ReplicaFile, ReplicaPart, ReplicaSeal, Room, RoomLeft,
    check_node, check_seal, check_tag,
};

/// The longest index read (each part's list is at most a seal body).
const INDEX_MAX: usize = 64 << 20;

/// How far a push's body got: when it last gave bytes (the answer is waited for that long after
/// it), and why it stopped if it could not give the file's bytes.
pub(super) struct Progress {
    last: Mutex<Instant>,
    failed: Mutex<Option<String>>,
}

impl Progress {
    pub(super) fn last(&self) -> Instant {
        *lock(&self.last)
    }
}

/// A request about a replica (or a commit notice), as the client sends it and names it in errors.
pub(super) struct Ask<'a> {
    pub addr: &'a str,
    pub job: &'a JobKey,
    pub method: Method,
    pub pq: String,
    /// What the answers are MAC'd over.
    pub unit: crate::Unit,
    /// What it is about, for a log reader: "replica s1/model.pt of n2", "replica part s1 of n2".
    pub what: String,
}

impl PeerClient {
    /// Pushes `file` of this node's part of checkpoint `tag` to the agent at `addr`, its bytes
    /// from `body` as they are read (`file.size` of them, else the push is cut and the holder
    /// keeps nothing). `Ok` once the holder stored exactly those bytes with that hash; the part
    /// is not in its index until [`seal_replica`](Self::seal_replica).
    pub async fn push_replica<S>(
        &self,
        addr: &str,
        job: &JobKey,
        tag: &str,
        file: &ReplicaFile,
        body: S,
    ) -> Result<(), PeerError>
    where
        S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    {
        let ask = Ask {
            addr,
            job,
            method: Method::PUT,
            pq: pq(
                job,
                "replicas/file",
                &[
                    ("tag", tag),
                    ("file", &file.path),
                    ("size", &file.size.to_string()),
                    ("blake3", &file.blake3),
                ],
            ),
            unit: replica::file_unit(&self.node, tag, &file.path, file.size),
            what: format!("replica {tag}/{} of {}", file.path, self.node),
        };
        let progress = Arc::new(Progress {
            last: Mutex::new(Instant::now()),
            failed: Mutex::new(None),
        });
        let mut body = Box::pin(body);
        // No byte of an empty file goes out, so its source is asked here whether it is empty.
        let not_empty = match file.size {
            0 => past_the_end(&mut body, 0).await,
            _ => None,
        };
        if let Some(why) = not_empty {
            return Err(PeerError::PushSource {
                addr: addr.into(),
                what: ask.what,
                source: why.into(),
            });
        }
        let sent = counted(body, file.size, progress.clone());
        let answer = self
            .exchange(&ask, sent, Some(file.size), Some(&progress), REASON_MAX)
            .await;
        if let Some(why) = lock(&progress.failed).take() {
            return Err(PeerError::PushSource {
                addr: addr.into(),
                what: ask.what,
                source: why.into(),
            });
        }
        expect(&ask, answer?, StatusCode::CREATED).map(drop)
    }

    /// Seals this node's part of checkpoint `tag` on the agent at `addr` with `seal`: the list of
    /// its files (empty for a node that holds none of the tag), each of which must have been
    /// pushed, and the job's nodes and commit time a restore reads back from the index.
    pub async fn seal_replica(
        &self,
        addr: &str,
        job: &JobKey,
        tag: &str,
        seal: &ReplicaSeal,
    ) -> Result<(), PeerError> {
        let ask = Ask {
            addr,
            job,
            method: Method::POST,
            pq: pq(job, "replicas/seal", &[("tag", tag)]),
            unit: replica::part_unit(&self.node, tag),
            what: format!("replica part {tag} of {}", self.node),
        };
        let list = Bytes::from(serde_json::to_vec(seal).expect("a seal serialises"));
        if list.len() > MAX_SEAL_BODY {
            return Err(PeerError::TooLarge {
                unit: ask.what,
                len: list.len() as u64,
                max: MAX_SEAL_BODY as u64,
            });
        }
        let len = list.len() as u64;
        let body = Full::new(list)
            .map_err(|never| match never {})
            .boxed_unsync();
        let answer = self
            .exchange(&ask, body, Some(len), None, REASON_MAX)
            .await?;
        expect(&ask, answer, StatusCode::OK).map(drop)
    }

    /// The sealed parts of `job` the agent at `addr` holds, each checked as a part's (sender, tag,
    /// paths, hashes, node list: [`check_seal`]) before it is returned.
    pub async fn replica_index(
        &self,
        addr: &str,
        job: &JobKey,
    ) -> Result<Vec<ReplicaPart>, PeerError> {
        let ask = Ask {
            addr,
            job,
            method: Method::GET,
            pq: pq(job, "replicas", &[]),
            unit: replica::index_unit(),
            what: "the replica index".into(),
        };
        let answer = self.exchange(&ask, empty(), None, None, INDEX_MAX).await?;
        let body = expect(&ask, answer, StatusCode::OK)?;
        let parts: Vec<ReplicaPart> = serde_json::from_slice(&body)
            .map_err(|e| corrupt(&ask, format!("the index does not parse: {e}")))?;
        for part in &parts {
            let checked = check_node(&part.from)
                .and_then(|()| check_tag(&part.tag))
                .and_then(|()| check_seal(&part.from, &part.files, &part.nodes));
            if let Err(why) = checked {
                return Err(corrupt(&ask, format!("the index lists {why}")));
            }
        }
        Ok(parts)
    }

    /// The room the agent at `addr` has for replicas: `(free, room)` in bytes, the free room
    /// for every job together, as it stands now (a push may still find less).
    pub async fn replica_room(&self, addr: &str, job: &JobKey) -> Result<(u64, u64), PeerError> {
        let ask = Ask {
            addr,
            job,
            method: Method::GET,
            pq: pq(job, "replicas/room", &[]),
            unit: replica::room_unit(),
            what: "the replica room".into(),
        };
        let answer = self.exchange(&ask, empty(), None, None, REASON_MAX).await?;
        let body = expect(&ask, answer, StatusCode::OK)?;
        let RoomLeft { free, room } = serde_json::from_slice(&body)
            .map_err(|e| corrupt(&ask, format!("the room does not parse: {e}")))?;
        Ok((free, room))
    }

    /// Fetches `file` of `part` from the agent at `addr` into `sink`: `Ok` with its length once
    /// the sink took exactly `file.size` bytes that hash to `file.blake3` and the holder's answer
    /// is MAC'd for the request. On an error, what the sink took is not to be trusted
    /// ([`UnitSink`]).
    pub async fn fetch_replica_into(
        &self,
        addr: &str,
        job: &JobKey,
        part: &PartKey,
        file: &ReplicaFile,
        sink: &mut dyn UnitSink,
    ) -> Result<u64, PeerError> {
        let ask = Ask {
            addr,
            job,
            method: Method::GET,
            pq: pq(
                job,
                "replicas/file",
                &[
                    ("from", &part.from),
                    ("tag", &part.tag),
                    ("file", &file.path),
                ],
            ),
            unit: replica::file_unit(&part.from, &part.tag, &file.path, 0),
            what: format!("replica {}/{} of {}", part.tag, file.path, part.from),
        };
        let want = blake3::Hash::from_hex(&file.blake3)
            .map_err(|_| corrupt(&ask, format!("'{}' is not a BLAKE3 hash", file.blake3)))?;
        let _slot = self
            .fetches
            .acquire()
            .await
            .expect("the fetch semaphore is never closed");
        let (req, mac) = self
            .signed(job, Method::GET, addr, &ask.pq, empty())
            .map_err(|e| unreachable(addr, Box::new(e)))?;
        let res = self.send(addr, req, self.replica_wait(), None).await?;
        if res.status() != StatusCode::OK {
            let reason = self
                .take_reason(addr, job, res, &ask.unit, &mac, REASON_MAX)
                .await?;
            return Err(refusal(&ask, reason));
        }
        let named = parse_hash(res.headers().get(HASH_HEADER));
        if named.is_some_and(|h| h != want) {
            return Err(corrupt(
                &ask,
                format!(
                    "the holder's copy hashes to {}, the part was sealed with {want}",
                    named.unwrap_or(want)
                ),
            ));
        }
        let unit = replica::file_unit(&part.from, &part.tag, &file.path, file.size);
        let (_, got) = self.take_data(addr, job, res, &unit, &mac, sink).await?;
        if got != want {
            return Err(corrupt(
                &ask,
                format!("its BLAKE3 hash is {got}, not {want}"),
            ));
        }
        Ok(file.size)
    }

    /// Frees this node's part of checkpoint `tag` on the agent at `addr` (no error if it held
    /// none).
    pub async fn free_replica(&self, addr: &str, job: &JobKey, tag: &str) -> Result<(), PeerError> {
        let ask = Ask {
            addr,
            job,
            method: Method::DELETE,
            pq: pq(job, "replicas", &[("tag", tag)]),
            unit: replica::part_unit(&self.node, tag),
            what: format!("replica part {tag} of {}", self.node),
        };
        let answer = self.exchange(&ask, empty(), None, None, REASON_MAX).await?;
        expect(&ask, answer, StatusCode::OK).map(drop)
    }

    /// How long a replica request waits for its answer (after the last bytes of a push).
    fn replica_wait(&self) -> Duration {
        self.cfg.poll + self.cfg.read_timeout
    }

    /// Sends `ask` with `body` (`len` bytes, when it has any) and reads its answer, at most
    /// `max` bytes of it: `Ok` with the status and body when MAC'd 2xx, the error it says
    /// otherwise.
    pub(super) async fn exchange(
        &self,
        ask: &Ask<'_>,
        body: ReqBody,
        len: Option<u64>,
        progress: Option<&Progress>,
        max: usize,
    ) -> Result<(StatusCode, Bytes), PeerError> {
        let (mut req, mac) = self
            .signed(ask.job, ask.method.clone(), ask.addr, &ask.pq, body)
            .map_err(|e| unreachable(ask.addr, Box::new(e)))?;
        if let Some(len) = len {
            req.headers_mut().insert(CONTENT_LENGTH, len.into());
        }
        let res = self
            .send(ask.addr, req, self.replica_wait(), progress)
            .await?;
        let reason = self
            .take_reason(ask.addr, ask.job, res, &ask.unit, &mac, max)
            .await?;
        if reason.too_long {
            return Err(corrupt(
                ask,
                format!("the answer is longer than {max} bytes"),
            ));
        }
        if reason.signed && reason.status.is_success() {
            return Ok((reason.status, reason.body));
        }
        Err(refusal(ask, reason))
    }
}

/// The path and query of a request about `resource` of `job`.
pub(super) fn pq(job: &JobKey, resource: &str, params: &[(&str, &str)]) -> String {
    let mut pq = format!("/v1/jobs/{}/{resource}", job.job());
    if !params.is_empty() {
        pq.push('?');
        pq.push_str(
            &url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(params)
                .finish(),
        );
    }
    pq
}

/// `body` as a request body of exactly `size` bytes: one more, or a short end, or a read error
/// cuts the request (and is noted in `progress`); each chunk notes the time. The chunk that
/// reaches `size` goes out only once `body` has ended: the server answers as soon as it has
/// `size` bytes, and a file that grew while it was pushed must not be taken for the one announced.
fn counted<S>(body: S, size: u64, progress: Arc<Progress>) -> ReqBody
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let fail = |progress: &Progress, why: String| -> BoxError {
        *lock(&progress.failed) = Some(why.clone());
        why.into()
    };
    let chunks = futures::stream::unfold(
        Some((Box::pin(body), 0u64, progress)),
        move |state| async move {
            let (mut body, sent, progress) = state?;
            let item = match body.next().await {
                Some(Ok(bytes)) if sent + bytes.len() as u64 > size => Err(fail(
                    &progress,
                    format!("it gave more than its {size} bytes"),
                )),
                Some(Ok(bytes)) => {
                    *lock(&progress.last) = Instant::now();
                    let sent = sent + bytes.len() as u64;
                    if sent == size
                        && let Some(why) = past_the_end(&mut body, size).await
                    {
                        return Some((Err(fail(&progress, why)), None));
                    }
                    return Some((Ok(Frame::data(bytes)), Some((body, sent, progress))));
                }
                Some(Err(e)) => Err(fail(&progress, format!("reading it failed: {e}"))),
                None if sent < size => Err(fail(
                    &progress,
                    format!("it ended after {sent} of its {size} bytes"),
                )),
                None => return None,
            };
            Some((item, None))
        },
    );
    StreamBody::new(chunks).boxed_unsync()
}

/// Why `body`, which gave its `size` bytes, is not at its end, if it is not.
async fn past_the_end<S>(body: &mut S, size: u64) -> Option<String>
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Unpin,
{
    while let Some(item) = body.next().await {
        match item {
            Ok(more) if more.is_empty() => {}
            Ok(_) => return Some(format!("it gave more than its {size} bytes")),
            Err(e) => return Some(format!("reading it failed: {e}")),
        }
    }
    None
}

/// The body of `answer` when its status is `want`; any other success is not one of the
/// protocol's.
pub(super) fn expect(
    ask: &Ask<'_>,
    (status, body): (StatusCode, Bytes),
    want: StatusCode,
) -> Result<Bytes, PeerError> {
    if status == want {
        return Ok(body);
    }
    Err(corrupt(ask, format!("an unexpected answer {status}")))
}

/// What a replica answer other than a MAC'd success says.
fn refusal(ask: &Ask<'_>, reason: super::Reason) -> PeerError {
    let addr = ask.addr.to_string();
    let super::Reason {
        status,
        signed,
        body,
        text,
        ..
    } = reason;
    match (signed, status) {
        (true, StatusCode::INSUFFICIENT_STORAGE) => match serde_json::from_slice::<Room>(&body) {
            Ok(Room { need, free }) => PeerError::NoRoom {
                addr,
                what: ask.what.clone(),
                need,
                free,
            },
            Err(_) => corrupt(ask, format!("a 507 that does not say the room: {text}")),
        },
        (true, StatusCode::NOT_FOUND) => PeerError::NotHeld {
            addr,
            what: ask.what.clone(),
        },
        (true, StatusCode::GONE) => PeerError::Gone {
            addr,
            job: ask.job.job(),
        },
        (true, StatusCode::NOT_IMPLEMENTED) => PeerError::Refused {
            addr,
            job: ask.job.job(),
            status: status.as_u16(),
            reason: text,
        },
        (true, s) if s.is_client_error() || s.is_server_error() => PeerError::ReplicaRefused {
            addr,
            what: ask.what.clone(),
            status: s.as_u16(),
            reason: text,
        },
        (false, StatusCode::NOT_FOUND) => PeerError::UnknownJob {
            addr,
            job: ask.job.job(),
        },
        (false, s) if s.is_client_error() => PeerError::Refused {
            addr,
            job: ask.job.job(),
            status: s.as_u16(),
            reason: text,
        },
        (signed, s) => corrupt(
            ask,
            format!(
                "an unexpected {}answer {s}: {text}",
                if signed { "" } else { "unauthenticated " }
            ),
        ),
    }
}

fn corrupt(ask: &Ask<'_>, what: String) -> PeerError {
    PeerError::Corrupt {
        addr: ask.addr.into(),
        unit: ask.what.clone(),
        what,
    }
}

fn unreachable(addr: &str, source: BoxError) -> PeerError {
    PeerError::Unreachable {
        addr: addr.into(),
        source,
    }
}
