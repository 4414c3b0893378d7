//! The peer server: serves the units this node owns to the other agents of the job, over HTTP/1.1
//! (hyper), one registration per job.
//!
//! Admission, in order, before anything of a job is touched: `GET` only; the path names a job
//! (`/v1/jobs/{job}/units`); the request carries node, time and MAC headers (else 401); the job is
//! registered (else 404, or 410 once it ended here); the MAC verifies under the job's key (else
//! 401: another secret or another node list); the node is one of the job's (else 403); the clock
//! skew is within bounds (else 401); the query names one unit no larger than the largest unit
//! (else 400). None of these answers carries data, and each closes the connection. From here on
//! the request is an agent of the job, and every answer carries a MAC (see `auth`).
//!
//! A unit the owner has not read yet is **waited for** (pipelining: a peer asks for unit k while
//! the owner is still reading unit k−5), up to the long-poll window; then the answer is `503
//! pending` and the client asks again, so a silent peer is told apart from a busy one by the
//! client's read timeout. Budgets: at most `concurrency` unit responses hold data at once (a
//! semaphore taken before the source is asked for the bytes, released when the body is sent or
//! dropped). A source that streams ([`UnitSource::unit_stream`], the stager's, reading its staged
//! copy as the body goes out) holds about one slice per response; one that answers with the whole
//! unit ([`UnitSource::unit`]) holds up to `max_unit`, sent in 1 MiB slices of the one buffer. At
//! most `max_connections` connections, and one that sends no request headers within
//! `idle_timeout` is closed (an idle keep-alive connection too).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{CONNECTION, CONTENT_LENGTH, HeaderMap};
use hyper::{Method, Request, Response, StatusCode};
use sluice_archive::config::PeerConfig;
use sluice_archive::rt::{lock, now_secs};
use sluice_proto::msg::JobId;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::auth::{
    ClusterSecret, HASH_HEADER, JobKey, MAC_HEADER, NODE_HEADER, TIME_HEADER, parse_hash,
};
use super::{LONG_POLL, MAX_SKEW, Unit};
use crate::worker::{StatusCell, Worker};

/// A unit's bytes and their BLAKE3 hash, as this node read them from the origin.
#[derive(Debug, Clone)]
pub struct UnitData {
    pub bytes: Bytes,
    pub hash: blake3::Hash,
}

/// A unit's bytes as slices produced while its response goes out, with its length and the BLAKE3
/// hash of what this node read from the origin. A slice that cannot be produced ends the stream
/// early: the response is then shorter than its length, the connection is cut, and the requester
/// reads the unit elsewhere.
pub struct UnitStream {
    pub len: u64,
    pub hash: blake3::Hash,
    pub body: futures::stream::BoxStream<'static, Bytes>,
}

impl From<UnitData> for UnitStream {
    fn from(d: UnitData) -> UnitStream {
        let len = d.bytes.len() as u64;
        // The one buffer, in slices of CHUNK (no second copy on the write path).
        let slices = futures::stream::unfold(d.bytes, |mut rest| async move {
            if rest.is_empty() {
                return None;
            }
            let chunk = rest.split_to(rest.len().min(CHUNK));
            Some((chunk, rest))
        });
        UnitStream {
            len,
            hash: d.hash,
            body: Box::pin(slices),
        }
    }
}

/// Why a node cannot serve a unit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// This node does not own the unit (the nodes disagree on the job's node list or unit size).
    #[error("this node does not own the unit")]
    NotOwner,
    /// This node could not read the unit from the origin; the message says why.
    #[error("{0}")]
    Failed(String),
    /// The job's staging ended on this node.
    #[error("the job's staging ended on this node")]
    Gone,
}

/// What the stager gives the server for one job: the units this node owns, as they arrive.
///
/// The [`Unit`] asked for comes off the network: from an agent of the job (the request was
/// authenticated), but its `file`, `offset` and `len` are still only a request. Look the unit up
/// among the job's own units and answer [`UnitError::NotOwner`] for anything else; never use
/// `file` as a path.
#[async_trait::async_trait]
pub trait UnitSource: Send + Sync + 'static {
    /// Returns once this node holds `unit` (read from the origin, checksummed), or why it never
    /// will. May wait as long as the origin read takes. Must be cancel-safe: the server drops this
    /// future when its long-poll window ends, when the job is unregistered, or when the agent
    /// stops, and dropping it must not stop the owner's own read. The default is always ready.
    async fn ready(&self, unit: &Unit) -> Result<(), UnitError> {
        let _ = unit;
        Ok(())
    }

    /// The unit's bytes (exactly `unit.len` of them) and their hash. Called after
    /// [`ready`](Self::ready) returned, while the server holds one of its response slots, so what
    /// it allocates (e.g. a read of the staged file) is bounded by the server's budget; it should
    /// not wait for the origin.
    async fn unit(&self, unit: &Unit) -> Result<UnitData, UnitError>;

    /// The unit as a stream of slices, what the server sends: by default [`unit`](Self::unit) in
    /// slices of its one buffer. A source that can read the unit piece by piece (the stager, from
    /// its staged copy) overrides it, so a response holds a slice rather than the whole unit.
    async fn unit_stream(&self, unit: &Unit) -> Result<UnitStream, UnitError> {
        self.unit(unit).await.map(UnitStream::from)
    }
}

/// How the server runs; [`ServerConfig::from_config`] takes it from `[peer]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Unit responses holding data at once, over all jobs.
    pub concurrency: usize,
    /// The largest unit a request may ask for (the configured unit size).
    pub max_unit: u64,
    /// Requests whose timestamp is further than this from the server's clock are refused.
    pub max_skew: Duration,
    /// How long a request waits for a unit the owner has not read yet before `503 pending`.
    pub poll: Duration,
    pub max_connections: usize,
    /// A connection that sends no request headers for this long is closed.
    pub idle_timeout: Duration,
}

impl ServerConfig {
    pub fn from_config(cfg: &PeerConfig) -> ServerConfig {
        ServerConfig {
            concurrency: cfg.concurrency,
            max_unit: cfg.unit_size,
            max_skew: MAX_SKEW,
            poll: LONG_POLL,
            max_connections: 1024,
            idle_timeout: Duration::from_secs(15),
        }
    }
}

/// Why the peer server cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PeerServerError {
    #[error("cannot listen for peers on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// This node's peer server: the jobs it serves units for. Cheap to clone; clones share the jobs.
#[derive(Clone)]
pub struct PeerServer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PeerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServer")
            .field("jobs", &lock(&self.inner.jobs).len())
            .field("responses_free", &self.inner.responses.available_permits())
            .finish()
    }
}

struct Inner {
    secret: ClusterSecret,
    cfg: ServerConfig,
    jobs: Mutex<HashMap<JobId, Arc<JobEntry>>>,
    /// Jobs unregistered lately, so their late requests get 410 rather than 404.
    ended: Mutex<VecDeque<JobId>>,
    responses: Arc<Semaphore>,
}

struct JobEntry {
    key: JobKey,
    source: Arc<dyn UnitSource>,
    /// Cancelled at unregister: waiting requests answer 410 at once.
    ended: CancellationToken,
}

/// How many unregistered job ids are remembered for 410 answers.
const ENDED_KEPT: usize = 4096;
/// Bodies are handed to hyper in slices of this size, so the write path holds no second copy.
const CHUNK: usize = 1 << 20;

type Body = UnsyncBoxBody<Bytes, Infallible>;

impl PeerServer {
    pub fn new(secret: ClusterSecret, cfg: ServerConfig) -> PeerServer {
        let responses = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
        PeerServer {
            inner: Arc::new(Inner {
                secret,
                cfg,
                jobs: Mutex::new(HashMap::new()),
                ended: Mutex::new(VecDeque::new()),
                responses,
            }),
        }
    }

    /// The server `[peer]` configures, with its listener bound. `secret` is the cluster secret
    /// the agent loaded with [`ClusterSecret::load`], which refuses a file others could read: the
    /// server never starts without it.
    pub async fn bind(
        cfg: &PeerConfig,
        secret: ClusterSecret,
    ) -> Result<(PeerServer, TcpListener), PeerServerError> {
        let listener =
            crate::bind_tcp(&cfg.listen)
                .await
                .map_err(|source| PeerServerError::Listen {
                    addr: cfg.listen.clone(),
                    source,
                })?;
        Ok((
            PeerServer::new(secret, ServerConfig::from_config(cfg)),
            listener,
        ))
    }

    /// The key of `job` on `nodes` under this server's secret, for this node's own fetches.
    pub fn job_key(&self, job: JobId, nodes: &[String]) -> JobKey {
        self.inner.secret.job_key(job, nodes)
    }

    /// Serves `job`'s units from `source` to the agents of `nodes` (the job's whole node list).
    /// A second registration of the job replaces the first; requests waiting on the first answer
    /// 410 (gone), and their requesters read those units elsewhere.
    pub fn register(&self, job: JobId, nodes: &[String], source: Arc<dyn UnitSource>) {
        let entry = Arc::new(JobEntry {
            key: self.inner.secret.job_key(job, nodes),
            source,
            ended: CancellationToken::new(),
        });
        lock(&self.inner.ended).retain(|j| *j != job);
        if let Some(old) = lock(&self.inner.jobs).insert(job, entry) {
            old.ended.cancel();
        }
    }

    /// Stops serving `job` (its end): requests waiting for one of its units answer 410 now, later
    /// ones 410 as well.
    pub fn unregister(&self, job: JobId) {
        if let Some(old) = lock(&self.inner.jobs).remove(&job) {
            old.ended.cancel();
        }
        let mut ended = lock(&self.inner.ended);
        ended.retain(|j| *j != job);
        ended.push_back(job);
        if ended.len() > ENDED_KEPT {
            ended.pop_front();
        }
    }

    /// Unit responses holding data right now.
    pub fn responses_in_flight(&self) -> usize {
        self.inner.cfg.concurrency.max(1) - self.inner.responses.available_permits()
    }

    /// Accepts peer connections on `listener` until `cancel` is cancelled, then waits for the
    /// connections it started (each is cut short by the same token).
    pub async fn serve(&self, listener: TcpListener, cancel: CancellationToken) {
        let limits = crate::http::Limits {
            max_connections: self.inner.cfg.max_connections,
            header_timeout: self.inner.cfg.idle_timeout,
            max_buf_size: 64 << 10,
        };
        let inner = self.inner.clone();
        crate::http::serve(
            "peer server",
            listener,
            cancel,
            limits,
            move |req, remote| {
                let inner = inner.clone();
                async move { inner.answer(req, remote).await }
            },
        )
        .await;
    }
}

/// The peer server as one of the agent's background loops.
pub struct PeerService {
    pub server: PeerServer,
    pub listener: TcpListener,
}

impl Worker for PeerService {
    fn name(&self) -> String {
        match self.listener.local_addr() {
            Ok(a) => format!("peer server {a}"),
            Err(_) => "peer server".to_string(),
        }
    }

    async fn run(self, cancel: CancellationToken, status: Arc<StatusCell>) {
        status.set("serving");
        self.server.serve(self.listener, cancel).await;
    }
}

/// A refusal before the request was authenticated: no MAC (there is no key to trust yet), no
/// data, and the connection closes.
fn refuse(status: StatusCode, reason: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(reason)).boxed_unsync());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
    r
}

/// An answer to an authenticated request, MAC'd for it.
struct Signer<'a> {
    key: &'a JobKey,
    unit: &'a Unit,
    request: blake3::Hash,
}

impl Signer<'_> {
    fn status(&self, status: StatusCode, reason: &str) -> Response<Body> {
        let mac = self.key.response_mac(
            status.as_u16(),
            self.unit,
            None,
            reason.as_bytes(),
            &self.request,
        );
        let mut r =
            Response::new(Full::new(Bytes::copy_from_slice(reason.as_bytes())).boxed_unsync());
        *r.status_mut() = status;
        insert_hex(r.headers_mut(), MAC_HEADER, &mac);
        r
    }

    fn error(&self, e: &UnitError) -> Response<Body> {
        let status = match e {
            UnitError::NotOwner => StatusCode::CONFLICT,
            UnitError::Failed(_) => StatusCode::BAD_GATEWAY,
            UnitError::Gone => StatusCode::GONE,
        };
        self.status(status, &e.to_string())
    }

    fn data(&self, data: UnitStream, permit: OwnedSemaphorePermit) -> Response<Body> {
        use futures::StreamExt;
        let mac = self
            .key
            .response_mac(200, self.unit, Some(&data.hash), b"", &self.request);
        let len = data.len;
        // The permit lives in the body: released once the last slice is handed over (or the
        // client hangs up and the body is dropped).
        let slices =
            futures::stream::unfold((data.body, Some(permit)), |(mut body, permit)| async move {
                match body.next().await {
                    Some(chunk) => Some((Ok::<_, Infallible>(Frame::data(chunk)), (body, permit))),
                    None => {
                        drop(permit);
                        None
                    }
                }
            });
        let mut r = Response::new(StreamBody::new(slices).boxed_unsync());
        let h = r.headers_mut();
        h.insert(CONTENT_LENGTH, len.into());
        insert_hex(h, HASH_HEADER, &data.hash);
        insert_hex(h, MAC_HEADER, &mac);
        r
    }
}

fn insert_hex(h: &mut HeaderMap, name: &'static str, v: &blake3::Hash) {
    h.insert(
        name,
        hyper::header::HeaderValue::from_str(v.to_hex().as_str()).expect("hex is a header value"),
    );
}

/// The job id of `/v1/jobs/{job}/units`.
fn parse_path(path: &str) -> Option<Result<JobId, ()>> {
    let rest = path.strip_prefix("/v1/jobs/")?;
    let job = rest.strip_suffix("/units")?;
    Some(
        if !job.is_empty() && job.bytes().all(|b| b.is_ascii_digit()) {
            job.parse().map_err(|_| ())
        } else {
            Err(())
        },
    )
}

/// The unit of `file=..&offset=..&len=..`: each exactly once, nothing else.
pub(crate) fn parse_query(query: &str) -> Result<Unit, String> {
    let (mut file, mut offset, mut len) = (None, None, None);
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        let slot = match &*k {
            "file" => &mut file,
            "offset" => &mut offset,
            "len" => &mut len,
            other => return Err(format!("unknown query parameter '{other}'")),
        };
        if slot.replace(v.into_owned()).is_some() {
            return Err(format!("query parameter '{k}' given twice"));
        }
    }
    let number = |what: &str, v: Option<String>| -> Result<u64, String> {
        let v = v.ok_or_else(|| format!("query parameter '{what}' is missing"))?;
        v.parse()
            .map_err(|_| format!("query parameter '{what}' is not a number: '{v}'"))
    };
    let file = file.ok_or("query parameter 'file' is missing")?;
    if file.is_empty() {
        return Err("query parameter 'file' is empty".into());
    }
    Ok(Unit {
        file,
        offset: number("offset", offset)?,
        len: number("len", len)?,
    })
}

/// The query that names `unit`, percent-encoded.
pub(crate) fn unit_query(unit: &Unit) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair("file", &unit.file)
        .append_pair("offset", &unit.offset.to_string())
        .append_pair("len", &unit.len.to_string())
        .finish()
}

impl Inner {
    fn job(&self, job: JobId) -> Result<Arc<JobEntry>, StatusCode> {
        if let Some(e) = lock(&self.jobs).get(&job) {
            return Ok(e.clone());
        }
        if lock(&self.ended).contains(&job) {
            Err(StatusCode::GONE)
        } else {
            Err(StatusCode::NOT_FOUND)
        }
    }

    async fn answer(&self, req: Request<Incoming>, remote: SocketAddr) -> Response<Body> {
        let refused = |status: StatusCode, reason: String| {
            warn!("peer request from {remote} refused ({status}): {reason}");
            refuse(status, reason)
        };
        if req.method() != Method::GET {
            return refused(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {} is not served", req.method()),
            );
        }
        let job = match parse_path(req.uri().path()) {
            None => return refused(StatusCode::NOT_FOUND, "no such resource".into()),
            Some(Err(())) => return refused(StatusCode::BAD_REQUEST, "bad job id".into()),
            Some(Ok(job)) => job,
        };
        let headers = req.headers();
        let node = headers.get(NODE_HEADER).and_then(|v| v.to_str().ok());
        let time = headers
            .get(TIME_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mac = parse_hash(headers.get(MAC_HEADER));
        let (Some(node), Some(time), Some(mac)) = (node, time, mac) else {
            return refused(
                StatusCode::UNAUTHORIZED,
                format!(
                    "unauthenticated: a peer request carries {NODE_HEADER}, {TIME_HEADER} and {MAC_HEADER}"
                ),
            );
        };
        let entry = match self.job(job) {
            Ok(e) => e,
            Err(StatusCode::GONE) => {
                return refuse(
                    StatusCode::GONE,
                    format!("job {job} has ended on this node"),
                );
            }
            Err(status) => {
                debug!("peer request from {remote} (node {node}) for unknown job {job}");
                return refuse(status, format!("job {job} is not known on this node"));
            }
        };
        let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
        // blake3::Hash's equality is constant-time.
        if entry.key.request_mac("GET", pq, node, time) != mac {
            return refused(
                StatusCode::UNAUTHORIZED,
                format!(
                    "the MAC does not verify for job {job}: not an agent of this job (another cluster secret or node list)"
                ),
            );
        }
        if !entry.key.has_node(node) {
            return refused(
                StatusCode::FORBIDDEN,
                format!("node {node} is not a node of job {job}"),
            );
        }
        let skew = now_secs().abs_diff(time);
        if skew > self.cfg.max_skew.as_secs() {
            return refused(
                StatusCode::UNAUTHORIZED,
                format!(
                    "the request's clock is {skew}s off this node's (at most {}s): check NTP on both nodes",
                    self.cfg.max_skew.as_secs()
                ),
            );
        }
        let unit = match parse_query(req.uri().query().unwrap_or_default()) {
            Ok(u) if u.len > self.cfg.max_unit => {
                return refused(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "a unit of {} bytes is larger than this node's {} (peer.unit_size differs between nodes?)",
                        u.len, self.cfg.max_unit
                    ),
                );
            }
            Ok(u) => u,
            Err(e) => return refused(StatusCode::BAD_REQUEST, e),
        };
        let signer = Signer {
            key: &entry.key,
            unit: &unit,
            request: mac,
        };
        // Wait for the owner's read and a response slot, within the long-poll window.
        let waited = tokio::select! {
            r = tokio::time::timeout(self.cfg.poll, async {
                entry.source.ready(&unit).await?;
                Ok::<_, UnitError>(
                    self.responses
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the response semaphore is never closed"),
                )
            }) => r,
            _ = entry.ended.cancelled() => Ok(Err(UnitError::Gone)),
        };
        let permit = match waited {
            Err(_) => return signer.status(StatusCode::SERVICE_UNAVAILABLE, "pending"),
            Ok(Err(e)) => return signer.error(&e),
            Ok(Ok(p)) => p,
        };
        match entry.source.unit_stream(&unit).await {
            Ok(data) if data.len == unit.len => signer.data(data, permit),
            Ok(data) => signer.error(&UnitError::Failed(format!(
                "the owner holds {} bytes of a {}-byte unit",
                data.len, unit.len
            ))),
            Err(e) => signer.error(&e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_round_trip_any_file_name() {
        for file in [
            "a.bin",
            "dir with space/ü+%&=?#.tar",
            "a@1",
            "/lead",
            "100%",
        ] {
            let u = Unit {
                file: file.into(),
                offset: 1 << 40,
                len: 7,
            };
            let q = unit_query(&u);
            assert!(q.bytes().all(|b| b.is_ascii_graphic() && b != b'#'), "{q}");
            assert_eq!(parse_query(&q), Ok(u));
        }
    }

    #[test]
    fn malformed_queries_and_paths_are_refused() {
        for (q, want) in [
            ("file=a&offset=0", "'len' is missing"),
            ("file=a&offset=0&len=1&len=2", "given twice"),
            ("file=a&offset=x&len=1", "not a number"),
            ("file=&offset=0&len=1", "empty"),
            ("file=a&offset=0&len=1&x=1", "unknown query parameter"),
        ] {
            let e = parse_query(q).unwrap_err();
            assert!(e.contains(want), "{q}: {e}");
        }
        assert_eq!(parse_path("/v1/jobs/42/units"), Some(Ok(42)));
        assert_eq!(parse_path("/v1/jobs/4x/units"), Some(Err(())));
        assert_eq!(parse_path("/v1/jobs/99999999999/units"), Some(Err(())));
        assert_eq!(parse_path("/v1/jobs//units"), Some(Err(())));
        assert_eq!(parse_path("/v2/jobs/42/units"), None);
    }
}
