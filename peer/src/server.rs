//! The peer server: serves the units this node owns to the other agents of the job, over HTTP/1.1
//! (hyper), one registration per job.
//!
//! Admission, in order, before anything of a job is touched, the same for every resource of a job
//! (units, cached ranges, replicas, commit notices: `Inner::answer`): the path names a job and a
//! resource (`/v1/jobs/{job}/units`, else 404/400); the method is one the resource answers (`GET`
//! for units and cached ranges, `POST` for commit notices, else 405); the request carries node,
//! time and MAC headers (else 401); the job is registered (else 404, or 410 once it ended here);
//! the MAC verifies under the job's key (else 401: another secret or another node list); the node
//! is one of the job's (else 403); the clock skew is within bounds (else 401); then the resource's
//! own checks, for units a query that names one unit no larger than the largest unit (else 400);
//! replicas: `server/replicas.rs`; commit notices: `server/events.rs`. None of these answers
//! carries data, and each closes the connection. From here on the request is an agent of the job,
//! and every answer carries a MAC (see `auth`).
//!
//! The one refusal that is MAC'd is `410` for a job that ended here, when the request's MAC
//! verifies under the ended job's key (kept, without its node list, for the last [`ENDED_KEPT`]
//! jobs): "the job ended on this node" decides that a node is gone for the shared tier's takeover
//! (`stage::shared`), so the requester believes it only signed. Anyone can send requests, so
//! refusals are logged at a bounded rate, a line per [`crate::http::LOG_EVERY`] at most, with
//! the count of those not logged.
//!
//! A unit the owner has not read yet is **waited for** (pipelining: a peer asks for unit k while
//! the owner is still reading unit k−5), up to the long-poll window; then the answer is `503
//! pending` and the client asks again, so a silent peer is told apart from a busy one by the
//! client's read timeout. Budgets: at most `concurrency` unit responses hold data at once (a
//! semaphore taken before the source is asked for the bytes, released when the body is sent or
//! dropped). A source that streams ([`UnitSource::unit_stream`], the stager's, reading its staged
//! copy as the body goes out) holds about one slice per response; one that answers with the whole
//! unit ([`UnitSource::unit`]) holds up to `max_unit`, sent in 1 MiB slices of the one buffer. At
//! most `max_connections` connections, `max_per_source` of them from one address (so that a
//! flood from one node cannot keep the job's other agents out), and one that sends no request
//! headers within `idle_timeout` is closed (an idle keep-alive connection too).

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
use sluice_core::config::PeerConfig;
use sluice_core::rt::{lock, now_secs};
use sluice_proto::msg::JobId;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::auth::{
    ClusterSecret, HASH_HEADER, JobKey, MAC_HEADER, NODE_HEADER, READ_BACK_HEADER, READ_BACK_MARK,
    RequestKey, TIME_HEADER, parse_hash,
};
use super::listing::{self, PageRequest};
use super::{LONG_POLL, MAX_SKEW, Unit};
use sluice_core::worker::{StatusCell, Worker};

mod events;
mod replicas;

/// What a unit's hash was computed from, and so what its bytes may be trusted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashFrom {
    /// The bytes as they came from the origin (on whichever node read them), or from a node's
    /// cross-job cache, which holds only such bytes (`sluice_stage::cache`).
    Origin,
    /// A read-back of a staged copy the job user can write (a node whose agent restarted serves
    /// the files it kept so, `sluice_stage::resume`). Good for the job's own copies, which their
    /// user may change anyway; never for the node's cross-job cache, which other users' jobs read.
    ReadBack,
}

/// A unit's bytes and their BLAKE3 hash, as this node read them from the origin.
#[derive(Debug, Clone)]
pub struct UnitData {
    pub bytes: Bytes,
    pub hash: blake3::Hash,
    pub from: HashFrom,
}

/// A unit's bytes as slices produced while its response goes out, with its length and the BLAKE3
/// hash of what this node read from the origin. A slice that cannot be produced ends the stream
/// early: the response is then shorter than its length, the connection is cut, and the requester
/// reads the unit elsewhere.
pub struct UnitStream {
    pub len: u64,
    pub hash: blake3::Hash,
    pub from: HashFrom,
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
            from: d.from,
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

    /// The page of this node's listing of a dataset that `asked` names, once this
    /// node has listed that far; may wait as long as the origin's listing takes, and must be
    /// cancel-safe like [`ready`](Self::ready). `NotOwner` when this node does not list that
    /// dataset from that source for the job (the default: it lists nothing for others).
    async fn listing_page(&self, asked: &PageRequest) -> Result<Bytes, UnitError> {
        let _ = asked;
        Err(UnitError::NotOwner)
    }

    /// Whether this node has a cross-job cache its job peers may ask at all; without one, a
    /// request for a cached range is answered `501` and the requester asks no more. The default
    /// has none.
    fn has_cache(&self) -> bool {
        false
    }

    /// `len` bytes at `offset` of `object` from this node's cross-job cache, hashed from the
    /// cache's copy, or `None` when this node holds no complete entry for it (or will not serve it
    /// to this job). `len == 0` asks only whether the entry is here. Must answer at once: it never
    /// waits for staging (so no node can wait on another through it), only for the disk. The
    /// `object` comes off the network like a [`Unit`]: look it up, never use it as a path. The
    /// default holds nothing.
    async fn cached_range(
        &self,
        object: &CachedObject,
        offset: u64,
        len: u64,
    ) -> Option<UnitStream> {
        let _ = (object, offset, len);
        None
    }
}

/// What a signed request carries (see [`super::auth`]): the requesting node, its clock and the
/// MAC, and the path and query the MAC covers, exactly as sent.
struct Signed<'a> {
    node: &'a str,
    time: u64,
    mac: blake3::Hash,
    pq: &'a str,
}

/// The signature of `req`, or the refusal's reason when a header is missing or malformed
/// (`what` names the request in it).
fn signature<'a, B>(req: &'a Request<B>, what: &str) -> Result<Signed<'a>, String> {
    let headers = req.headers();
    let node = headers.get(NODE_HEADER).and_then(|v| v.to_str().ok());
    let time = headers
        .get(TIME_HEADER)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let mac = parse_hash(headers.get(MAC_HEADER));
    let (Some(node), Some(time), Some(mac)) = (node, time, mac) else {
        return Err(format!(
            "unauthenticated: {what} carries {NODE_HEADER}, {TIME_HEADER} and {MAC_HEADER}"
        ));
    };
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
    Ok(Signed {
        node,
        time,
        mac,
        pq,
    })
}

/// What an agent does for another agent's admin request (`sluice cache warm --nodes`): warm this
/// node's cache with the dataset at `url`, as `sluice cache warm` on this node would. May take as
/// long as staging the dataset; an `Err` says why it could not.
#[async_trait::async_trait]
pub trait AdminSource: Send + Sync + 'static {
    async fn warm(&self, url: &str) -> Result<sluice_proto::msg::CacheWarmed, String>;
}

/// The path of the admin warm request.
pub(crate) const ADMIN_WARM_PATH: &str = "/v1/admin/cache/warm";

/// An object of a job's dataset as the origin listed it (the cache's key, less the endpoint, which
/// each node takes from its own `[[store]]`): what one node asks another's cache for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedObject {
    /// `s3://bucket/key`.
    pub url: String,
    pub etag: Option<String>,
    pub version: Option<String>,
    pub size: u64,
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
    /// Connections at once from one source address: one node's agent opens at most
    /// `2 × concurrency` (fetches and cache requests) and its liveness probes.
    pub max_per_source: usize,
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
            max_per_source: 2 * cfg.concurrency + 16,
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
    /// Derived once from `secret`.
    admin_key: super::AdminKey,
    /// What admin requests are answered with; none until the agent says (404 until then).
    admin: std::sync::OnceLock<Arc<dyn AdminSource>>,
    /// Where the replicas job peers push here are kept; none until the agent says (501 until
    /// then).
    replicas: std::sync::OnceLock<Arc<dyn crate::ReplicaStore>>,
    /// What the job peers' commit notices are handed to; none until the agent says (501 until
    /// then).
    events: std::sync::OnceLock<Arc<dyn crate::JobEvents>>,
    /// Replica pushes being stored at once (see `replicas`).
    pushes: Arc<Semaphore>,
    cfg: ServerConfig,
    jobs: Mutex<HashMap<JobId, Arc<JobEntry>>>,
    /// Jobs unregistered lately, with their keys (no node lists), so that their late requests
    /// get a 410 MAC'd for them rather than a 404.
    ended: Mutex<VecDeque<(JobId, JobKey)>>,
    responses: Arc<Semaphore>,
    /// Refusals of requests not (yet) authenticated: anyone can cause them.
    refusals: crate::http::LogLimit,
    /// The releases the job peers' requests said (logged once per peer of another release).
    releases: crate::release::Releases,
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
                admin_key: secret.admin_key(),
                admin: std::sync::OnceLock::new(),
                replicas: std::sync::OnceLock::new(),
                events: std::sync::OnceLock::new(),
                pushes: Arc::new(Semaphore::new(cfg.concurrency.max(1))),
                secret,
                cfg,
                jobs: Mutex::new(HashMap::new()),
                ended: Mutex::new(VecDeque::new()),
                responses,
                refusals: crate::http::LogLimit::new(crate::http::LOG_EVERY),
                releases: Default::default(),
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
            crate::http::bind_tcp(&cfg.listen)
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

    /// The admin key under this server's secret, for this node's own admin requests.
    pub fn admin_key(&self) -> super::AdminKey {
        self.inner.admin_key.clone()
    }

    /// Answers other agents' admin requests with `source` from now on (once; later calls are
    /// ignored).
    pub fn serve_admin(&self, source: Arc<dyn AdminSource>) {
        let _ = self.inner.admin.set(source);
    }

    /// Keeps the replicas the job peers push here in `store`, and serves them back, from now on
    /// (once; later calls are ignored). Until then replica requests answer `501`.
    pub fn serve_replicas(&self, store: Arc<dyn crate::ReplicaStore>) {
        let _ = self.inner.replicas.set(store);
    }

    /// Hands the job peers' commit notices to `events` from now on (once; later calls are
    /// ignored). Until then commit notices answer `501`.
    pub fn serve_events(&self, events: Arc<dyn crate::JobEvents>) {
        let _ = self.inner.events.set(events);
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
        lock(&self.inner.ended).retain(|(j, _)| *j != job);
        if let Some(old) = lock(&self.inner.jobs).insert(job, entry) {
            old.ended.cancel();
        }
    }

    /// Stops serving `job` (its end): requests waiting for one of its units answer 410 now, later
    /// ones 410 as well.
    pub fn unregister(&self, job: JobId) {
        let Some(old) = lock(&self.inner.jobs).remove(&job) else {
            return;
        };
        old.ended.cancel();
        let mut ended = lock(&self.inner.ended);
        ended.retain(|(j, _)| *j != job);
        ended.push_back((job, old.key.without_nodes()));
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
            max_per_source: self.inner.cfg.max_per_source,
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

/// How often an agent whose peer port was taken tries to bind it again.
pub const REBIND_EVERY: Duration = Duration::from_secs(10);

/// The peer server of an agent that could not bind its peer port at start — most likely a
/// process (a user's: the port is 1024 or above) bound it first. The agent does not give peers up
/// for its life: it says so loudly, with what to do, and binds the port as soon as it is free,
/// every [`REBIND_EVERY`]. Until then the job's other nodes cannot reach this node (their fetches
/// read the origin instead, and on the shared tier they may take this node's share over, which
/// this node then honours, see `stage::shared`); this node's own fetches work. Its worker status
/// says `port taken, retrying`, with the bind error.
pub struct PeerRebind {
    pub server: PeerServer,
    pub listen: String,
    /// Why the first bind failed.
    pub error: PeerServerError,
    /// How often it tries again ([`REBIND_EVERY`]).
    pub every: Duration,
}

impl Worker for PeerRebind {
    fn name(&self) -> String {
        format!("peer server {}", self.listen)
    }

    async fn run(self, cancel: CancellationToken, status: Arc<StatusCell>) {
        let mut error = self.error.to_string();
        let log = crate::http::LogLimit::new(Duration::from_secs(300));
        loop {
            status.set("port taken, retrying");
            status.turn(Some(error.clone()));
            if let Some(held) = log.admit() {
                tracing::error!(
                    "{error}: the job's other nodes cannot reach this node's agent for peer transfers until it can; trying again every {}s{}. If another process holds the port, stop it, and set [peer] listen/addr to a port below 1024, which no user process can take",
                    self.every.as_secs_f32(),
                    if held > 0 {
                        format!(" ({held} tries since the last line)")
                    } else {
                        String::new()
                    }
                );
            }
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = cancel.cancelled() => return,
            }
            match tokio::net::TcpListener::bind(&self.listen).await {
                Ok(listener) => {
                    tracing::warn!(
                        "peer server: bound {} at last; peer transfers on",
                        self.listen
                    );
                    status.set("serving");
                    status.turn(None);
                    self.server.serve(listener, cancel).await;
                    return;
                }
                Err(source) => {
                    error = PeerServerError::Listen {
                        addr: self.listen.clone(),
                        source,
                    }
                    .to_string();
                }
            }
        }
    }
}

/// The peer server as the agent starts it: serving, or waiting for its port.
pub enum PeerWorker {
    Serving(PeerService),
    Rebinding(PeerRebind),
}

impl Worker for PeerWorker {
    fn name(&self) -> String {
        match self {
            PeerWorker::Serving(s) => s.name(),
            PeerWorker::Rebinding(r) => r.name(),
        }
    }

    async fn run(self, cancel: CancellationToken, status: Arc<StatusCell>) {
        match self {
            PeerWorker::Serving(s) => s.run(cancel, status).await,
            PeerWorker::Rebinding(r) => r.run(cancel, status).await,
        }
    }
}

/// A refusal before the request was authenticated: no MAC (there is no key to trust yet), no
/// data, and the connection closes.
/// The reason of the `404` for a path that names no resource (every release says it so), which
/// tells a requester that the agent predates the resource rather than that it does not know the job.
pub(crate) const NO_SUCH_RESOURCE: &str = "no such resource";

fn refuse(status: StatusCode, reason: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(reason)).boxed_unsync());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
    r
}

/// An answer to an authenticated request, MAC'd for it.
#[derive(Clone, Copy)]
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
        let read_back = data.from == HashFrom::ReadBack;
        let mark = if read_back { READ_BACK_MARK } else { b"" };
        let mac = self
            .key
            .response_mac(200, self.unit, Some(&data.hash), mark, &self.request);
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
        if read_back {
            h.insert(
                READ_BACK_HEADER,
                hyper::header::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

/// What a long poll ended with, other than what it waited for.
enum NotYet {
    /// The window ended first: ask again.
    Pending,
    Failed(UnitError),
}

impl NotYet {
    /// The answer that says so, MAC'd by `signer`.
    fn of(&self, signer: &Signer<'_>) -> Response<Body> {
        match self {
            NotYet::Pending => signer.status(StatusCode::SERVICE_UNAVAILABLE, "pending"),
            NotYet::Failed(e) => signer.error(e),
        }
    }
}

fn insert_hex(h: &mut HeaderMap, name: &'static str, v: &blake3::Hash) {
    h.insert(
        name,
        hyper::header::HeaderValue::from_str(v.to_hex().as_str()).expect("hex is a header value"),
    );
}

/// What a request asks for: a unit of the job's staged datasets, a range of an object in the
/// node's cache, the replicas of the job's checkpoints this node holds (`crate::replica`), or
/// what it tells of the job (a commit notice, `crate::events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resource {
    Units,
    Cached,
    Replicas(replicas::ReplicaPath),
    Commits,
    Listing,
}

impl Resource {
    /// Whether `method` is one this resource answers (else `405`, before anything else).
    fn serves(self, method: &Method) -> bool {
        use replicas::ReplicaPath;
        match self {
            Resource::Units | Resource::Cached | Resource::Listing => method == Method::GET,
            Resource::Replicas(ReplicaPath::Part) => {
                method == Method::GET || method == Method::DELETE
            }
            Resource::Replicas(ReplicaPath::File) => method == Method::GET || method == Method::PUT,
            Resource::Replicas(ReplicaPath::Room) => method == Method::GET,
            Resource::Replicas(ReplicaPath::Seal) | Resource::Commits => method == Method::POST,
        }
    }
}

/// The job id and resource of
/// `/v1/jobs/{job}/{units|cached|replicas|replicas/file|replicas/seal|replicas/room|commits|listing}`.
fn parse_path(path: &str) -> Option<Result<(JobId, Resource), ()>> {
    use replicas::ReplicaPath;
    let rest = path.strip_prefix("/v1/jobs/")?;
    let (job, resource) = [
        ("/units", Resource::Units),
        ("/cached", Resource::Cached),
        ("/replicas", Resource::Replicas(ReplicaPath::Part)),
        ("/replicas/file", Resource::Replicas(ReplicaPath::File)),
        ("/replicas/seal", Resource::Replicas(ReplicaPath::Seal)),
        ("/replicas/room", Resource::Replicas(ReplicaPath::Room)),
        ("/commits", Resource::Commits),
        ("/listing", Resource::Listing),
    ]
    .into_iter()
    .find_map(|(suffix, resource)| Some((rest.strip_suffix(suffix)?, resource)))?;
    Some(
        if !job.is_empty() && job.bytes().all(|b| b.is_ascii_digit()) {
            job.parse().map(|j| (j, resource)).map_err(|_| ())
        } else {
            Err(())
        },
    )
}

/// The parameters of `query`: each at most once, each one of `known`.
pub(crate) fn query_fields(query: &str, known: &[&str]) -> Result<HashMap<String, String>, String> {
    let mut fields = HashMap::new();
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        if !known.contains(&&*k) {
            return Err(format!("unknown query parameter '{k}'"));
        }
        if fields.insert(k.to_string(), v.into_owned()).is_some() {
            return Err(format!("query parameter '{k}' given twice"));
        }
    }
    Ok(fields)
}

/// The parameter `what` of `fields` as a number.
pub(crate) fn query_number(fields: &HashMap<String, String>, what: &str) -> Result<u64, String> {
    let v = query_text(fields, what)?;
    v.parse()
        .map_err(|_| format!("query parameter '{what}' is not a number: '{v}'"))
}

/// The parameter `what` of `fields`, present and not empty.
pub(crate) fn query_text<'a>(
    fields: &'a HashMap<String, String>,
    what: &str,
) -> Result<&'a str, String> {
    match fields.get(what) {
        None => Err(format!("query parameter '{what}' is missing")),
        Some(v) if v.is_empty() => Err(format!("query parameter '{what}' is empty")),
        Some(v) => Ok(v),
    }
}

/// The unit of `file=..&offset=..&len=..`: each exactly once, nothing else.
pub(crate) fn parse_query(query: &str) -> Result<Unit, String> {
    let fields = query_fields(query, &["file", "offset", "len"])?;
    let (offset, len) = (
        query_number(&fields, "offset")?,
        query_number(&fields, "len")?,
    );
    Ok(Unit::new(query_text(&fields, "file")?, offset, len))
}

/// The query that names `unit`, percent-encoded.
pub(crate) fn unit_query(unit: &Unit) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair("file", &unit.file)
        .append_pair("offset", &unit.offset.to_string())
        .append_pair("len", &unit.len.to_string())
        .finish()
}

/// The range of `url=..&etag=..&version=..&size=..&offset=..&len=..` (etag and version optional):
/// each at most once, nothing else, the range within the object.
pub(crate) fn parse_cached_query(query: &str) -> Result<(CachedObject, u64, u64), String> {
    let fields = query_fields(query, &["url", "etag", "version", "size", "offset", "len"])?;
    let (size, offset, len) = (
        query_number(&fields, "size")?,
        query_number(&fields, "offset")?,
        query_number(&fields, "len")?,
    );
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(format!(
            "the range {offset}+{len} is not within the object's {size} bytes"
        ));
    }
    Ok((
        CachedObject {
            url: query_text(&fields, "url")?.to_string(),
            etag: fields.get("etag").cloned(),
            version: fields.get("version").cloned(),
            size,
        },
        offset,
        len,
    ))
}

/// The query that names `len` bytes at `offset` of `object`, percent-encoded.
pub(crate) fn cached_query(object: &CachedObject, offset: u64, len: u64) -> String {
    let mut q = url::form_urlencoded::Serializer::new(String::new());
    q.append_pair("url", &object.url);
    if let Some(etag) = &object.etag {
        q.append_pair("etag", etag);
    }
    if let Some(version) = &object.version {
        q.append_pair("version", version);
    }
    q.append_pair("size", &object.size.to_string())
        .append_pair("offset", &offset.to_string())
        .append_pair("len", &len.to_string())
        .finish()
}

/// The unit a cached range's answer is MAC'd over: the object's URL as its file.
pub(crate) fn cached_unit(object: &CachedObject, offset: u64, len: u64) -> Unit {
    Unit::new(object.url.clone(), offset, len)
}

/// How long a cached range waits for a response slot before it answers `503 busy` (the requester
/// then reads the origin: a cache is never worth a wait).
const CACHED_SLOT_WAIT: Duration = Duration::from_secs(2);

impl Inner {
    /// The registered job, or (`Err(Some(key))`) the key of a job that ended here, or `Err(None)`.
    fn job(&self, job: JobId) -> Result<Arc<JobEntry>, Option<JobKey>> {
        if let Some(e) = lock(&self.jobs).get(&job) {
            return Ok(e.clone());
        }
        Err(lock(&self.ended)
            .iter()
            .find(|(j, _)| *j == job)
            .map(|(_, k)| k.clone()))
    }

    /// Why a request sent at `time` is refused for its clock, if it is: more than `max_skew`
    /// off this node's.
    fn clock_off(&self, time: u64) -> Option<String> {
        let skew = now_secs().abs_diff(time);
        let max = self.cfg.max_skew.as_secs();
        (skew > max).then(|| {
            format!(
                "the request's clock is {skew}s off this node's (at most {max}s): check NTP on both nodes"
            )
        })
    }

    /// Logs a refusal, at most one line per period (see [`crate::http::LogLimit`]).
    fn log_refusal(&self, what: &str, remote: SocketAddr, status: StatusCode, reason: &str) {
        if let Some(held) = self.refusals.admit() {
            warn!(
                "{what} from {remote} refused ({status}): {reason}{}",
                crate::http::held_back(held)
            );
        }
    }

    /// `410` for a request of a job that ended here: MAC'd for it when its MAC verifies under the
    /// job's key (so an agent of the job may believe it), bare otherwise.
    async fn answer_ended(
        &self,
        key: &JobKey,
        resource: Resource,
        method: &Method,
        signed: &Signed<'_>,
    ) -> Response<Body> {
        let Signed {
            node,
            time,
            mac,
            pq,
        } = *signed;
        let job = key.job();
        let reason = format!("job {job} has ended on this node");
        let query = pq.split_once('?').map_or("", |(_, q)| q);
        let unit = match resource {
            Resource::Units => parse_query(query).ok(),
            Resource::Cached => parse_cached_query(query)
                .ok()
                .map(|(o, offset, len)| cached_unit(&o, offset, len)),
            Resource::Replicas(path) => replicas::ReplicaRequest::parse(path, method, query)
                .ok()
                .map(|r| r.unit(node)),
            Resource::Commits => events::parse_commit(query)
                .ok()
                .map(|tag| crate::events::commit_unit(node, &tag)),
            Resource::Listing => PageRequest::parse(query).ok().map(|p| p.unit(0)),
        };
        match unit {
            Some(unit) if key.request_mac(method.as_str(), pq, node, time) == mac => {
                let signer = Signer {
                    key,
                    unit: &unit,
                    request: mac,
                };
                // A node frees its replicas once the archive holds them, which may be after the
                // job ended here: the one request an ended job is still answered. The MAC under
                // the job's key is an agent of the job (the ended key keeps no node list), and
                // `from` is the requester, as always.
                if let Resource::Replicas(path) = resource
                    && let Ok(replicas::ReplicaRequest::Free { tag }) =
                        replicas::ReplicaRequest::parse(path, method, query)
                    && self.clock_off(time).is_none()
                    && let Some(store) = self.replicas.get()
                {
                    let part = crate::PartKey {
                        job,
                        from: node.to_string(),
                        tag,
                    };
                    store.free(&part).await;
                    return signer.status(StatusCode::OK, "freed");
                }
                signer.status(StatusCode::GONE, &reason)
            }
            _ => refuse(StatusCode::GONE, reason),
        }
    }

    /// Every request of the peer port: the admission of the module header, once for every
    /// resource of a job, then the resource's own answer.
    async fn answer(&self, req: Request<Incoming>, remote: SocketAddr) -> Response<Body> {
        let refused = |status: StatusCode, reason: String| {
            self.log_refusal("peer request", remote, status, &reason);
            refuse(status, reason)
        };
        if req.uri().path() == ADMIN_WARM_PATH {
            return self.answer_admin(req, remote).await;
        }
        let (job, resource) = match parse_path(req.uri().path()) {
            None => return refused(StatusCode::NOT_FOUND, NO_SUCH_RESOURCE.into()),
            Some(Err(())) => return refused(StatusCode::BAD_REQUEST, "bad job id".into()),
            Some(Ok(parsed)) => parsed,
        };
        if !resource.serves(req.method()) {
            return refused(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {} is not served here", req.method()),
            );
        }
        let (head, body) = req.into_parts();
        let head = Request::from_parts(head, ());
        let signed = match signature(&head, "a peer request") {
            Ok(signed) => signed,
            Err(why) => return refused(StatusCode::UNAUTHORIZED, why),
        };
        let Signed {
            node,
            time,
            mac,
            pq,
        } = signed;
        let method = head.method();
        let entry = match self.job(job) {
            Ok(e) => e,
            Err(Some(ended)) => {
                return self.answer_ended(&ended, resource, method, &signed).await;
            }
            Err(None) => {
                debug!("peer request from {remote} (node {node}) for unknown job {job}");
                return refuse(
                    StatusCode::NOT_FOUND,
                    format!("job {job} is not known on this node"),
                );
            }
        };
        // blake3::Hash's equality is constant-time.
        if entry.key.request_mac(method.as_str(), pq, node, time) != mac {
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
        if let Some(why) = self.clock_off(time) {
            return refused(StatusCode::UNAUTHORIZED, why);
        }
        // Authenticated: a node of the job (anyone else could fill the log).
        let version = head.headers().get(crate::release::VERSION_HEADER);
        self.releases
            .met(node, version.and_then(|v| v.to_str().ok()));
        let query = head.uri().query().unwrap_or_default();
        match resource {
            Resource::Units => self.answer_unit(&entry, query, mac, remote).await,
            Resource::Cached => self.answer_cached(&entry, query, mac).await,
            Resource::Replicas(path) => {
                let asked = replicas::Asked {
                    path,
                    method,
                    query,
                    headers: head.headers(),
                    node,
                    mac,
                };
                self.answer_replica(&entry, asked, body).await
            }
            Resource::Commits => self.answer_commit(&entry, query, node, mac, &body).await,
            Resource::Listing => self.answer_listing(&entry, query, mac, remote).await,
        }
    }

    /// A unit of the job's datasets, for an authenticated agent of the job: waited for while the
    /// owner reads it (the long poll), then sent from a response slot.
    async fn answer_unit(
        &self,
        entry: &JobEntry,
        query: &str,
        mac: blake3::Hash,
        remote: SocketAddr,
    ) -> Response<Body> {
        let refused = |status: StatusCode, reason: String| {
            self.log_refusal("peer request", remote, status, &reason);
            refuse(status, reason)
        };
        let unit = match parse_query(query) {
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
        let ((), permit) = match self.long_poll(entry, entry.source.ready(&unit)).await {
            Err(answer) => return answer.of(&signer),
            Ok(ready) => ready,
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

    /// Waits for `ready` (the owner's read of a unit, a page of a listing), then for a response
    /// slot, within the long-poll window and while the job lasts here.
    async fn long_poll<T>(
        &self,
        entry: &JobEntry,
        ready: impl std::future::Future<Output = Result<T, UnitError>>,
    ) -> Result<(T, OwnedSemaphorePermit), NotYet> {
        let waited = tokio::select! {
            r = tokio::time::timeout(self.cfg.poll, async {
                let got = ready.await?;
                let permit = self
                    .responses
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the response semaphore is never closed");
                Ok::<_, UnitError>((got, permit))
            }) => r,
            _ = entry.ended.cancelled() => Ok(Err(UnitError::Gone)),
        };
        match waited {
            Err(_) => Err(NotYet::Pending),
            Ok(Err(e)) => Err(NotYet::Failed(e)),
            Ok(Ok(got)) => Ok(got),
        }
    }

    /// A page of a dataset's listing, for an authenticated agent of the job: waited for while this
    /// node lists the origin (the long poll), then sent from a response slot, hashed and MAC'd
    /// like a unit ([`listing`]).
    async fn answer_listing(
        &self,
        entry: &JobEntry,
        query: &str,
        mac: blake3::Hash,
        remote: SocketAddr,
    ) -> Response<Body> {
        let asked = match PageRequest::parse(query) {
            Ok(a) => a,
            Err(e) => {
                self.log_refusal("peer request", remote, StatusCode::BAD_REQUEST, &e);
                return refuse(StatusCode::BAD_REQUEST, e);
            }
        };
        let unit = asked.unit(0);
        let signer = Signer {
            key: &entry.key,
            unit: &unit,
            request: mac,
        };
        let (page, permit) = match self
            .long_poll(entry, entry.source.listing_page(&asked))
            .await
        {
            Err(answer) => return answer.of(&signer),
            Ok(ready) => ready,
        };
        if page.len() as u64 > listing::MAX_PAGE {
            return signer.error(&UnitError::Failed(format!(
                "a listing page of {} bytes is over the {} a node takes",
                page.len(),
                listing::MAX_PAGE
            )));
        }
        let unit = asked.unit(page.len() as u64);
        let data = UnitData {
            hash: blake3::hash(&page),
            bytes: page,
            from: HashFrom::Origin,
        };
        Signer {
            unit: &unit,
            ..signer
        }
        .data(data.into(), permit)
    }

    /// An admin request (see the module header of `peer`): `POST`, the headers, the admin key's
    /// MAC over method, path and query, node and time, the clock within bounds, one `url`. Then
    /// the warm runs, as long as it takes; its report (or why it failed) is MAC'd for the request.
    async fn answer_admin(&self, req: Request<Incoming>, remote: SocketAddr) -> Response<Body> {
        let refused = |status: StatusCode, reason: String| {
            self.log_refusal("peer admin request", remote, status, &reason);
            refuse(status, reason)
        };
        if req.method() != Method::POST {
            return refused(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {} is not served here", req.method()),
            );
        }
        let Signed {
            node,
            time,
            mac,
            pq,
        } = match signature(&req, "an admin request") {
            Ok(signed) => signed,
            Err(why) => return refused(StatusCode::UNAUTHORIZED, why),
        };
        if self.admin_key.request_mac("POST", pq, node, time) != mac {
            return refused(
                StatusCode::UNAUTHORIZED,
                "the MAC does not verify: not an agent of this cluster (another cluster secret)"
                    .into(),
            );
        }
        if let Some(why) = self.clock_off(time) {
            return refused(StatusCode::UNAUTHORIZED, why);
        }
        let mut urls =
            url::form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes());
        let url = match (urls.next(), urls.next()) {
            (Some((k, v)), None) if k == "url" && !v.is_empty() => v.into_owned(),
            _ => {
                return refused(
                    StatusCode::BAD_REQUEST,
                    "an admin warm names exactly one url".into(),
                );
            }
        };
        let Some(admin) = self.admin.get() else {
            return refuse(
                StatusCode::NOT_FOUND,
                "this agent serves no admin requests".into(),
            );
        };
        tracing::info!("warming the cache with {url}, as node {node}'s agent asked");
        let (status, body) = match admin.warm(&url).await {
            Ok(warmed) => (
                StatusCode::OK,
                serde_json::to_vec(&warmed).expect("a report serialises"),
            ),
            Err(why) => (StatusCode::BAD_GATEWAY, why.into_bytes()),
        };
        let answer = self.admin_key.response_mac(status.as_u16(), &body, &mac);
        let mut r = Response::new(Full::new(Bytes::from(body)).boxed_unsync());
        *r.status_mut() = status;
        insert_hex(r.headers_mut(), MAC_HEADER, &answer);
        r
    }

    /// A range of an object in this node's cache, for an authenticated agent of the job: `200`
    /// with the bytes and their hash, `404 not cached` (MAC'd, unlike an unknown job's), or `503
    /// busy` when no response slot frees up within [`CACHED_SLOT_WAIT`]. Never waits for staging.
    async fn answer_cached(
        &self,
        entry: &JobEntry,
        query: &str,
        mac: blake3::Hash,
    ) -> Response<Body> {
        let (object, offset, len) = match parse_cached_query(query) {
            Ok((_, _, len)) if len > self.cfg.max_unit => {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "a range of {len} bytes is larger than this node's {} (peer.unit_size differs between nodes?)",
                        self.cfg.max_unit
                    ),
                );
            }
            Ok(parsed) => parsed,
            Err(e) => return refuse(StatusCode::BAD_REQUEST, e),
        };
        let unit = cached_unit(&object, offset, len);
        let signer = Signer {
            key: &entry.key,
            unit: &unit,
            request: mac,
        };
        if !entry.source.has_cache() {
            return signer.status(StatusCode::NOT_IMPLEMENTED, "no cache on this node");
        }
        let permit = tokio::select! {
            p = tokio::time::timeout(CACHED_SLOT_WAIT, self.responses.clone().acquire_owned()) => p,
            _ = entry.ended.cancelled() => return signer.error(&UnitError::Gone),
        };
        let Ok(permit) = permit else {
            return signer.status(StatusCode::SERVICE_UNAVAILABLE, "busy");
        };
        let permit = permit.expect("the response semaphore is never closed");
        match entry.source.cached_range(&object, offset, len).await {
            Some(data) if data.len == len => signer.data(data, permit),
            _ => signer.status(StatusCode::NOT_FOUND, "not cached"),
        }
    }
}

#[cfg(test)]
impl PeerServer {
    /// The peer releases this server noted (see [`crate::release`]).
    pub(crate) fn releases_noted(&self) -> Vec<(String, Option<String>)> {
        self.inner.releases.noted()
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
            let u = Unit::new(file, 1 << 40, 7);
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
        assert_eq!(
            parse_path("/v1/jobs/42/units"),
            Some(Ok((42, Resource::Units)))
        );
        assert_eq!(
            parse_path("/v1/jobs/42/cached"),
            Some(Ok((42, Resource::Cached)))
        );
        assert_eq!(
            parse_path("/v1/jobs/42/commits"),
            Some(Ok((42, Resource::Commits)))
        );
        assert_eq!(
            parse_path("/v1/jobs/42/replicas/room"),
            Some(Ok((42, Resource::Replicas(replicas::ReplicaPath::Room))))
        );
        assert_eq!(parse_path("/v1/jobs/42/other"), None);
        assert_eq!(parse_path("/v1/jobs/4x/units"), Some(Err(())));
        assert_eq!(parse_path("/v1/jobs/99999999999/units"), Some(Err(())));
        assert_eq!(parse_path("/v1/jobs//units"), Some(Err(())));
        assert_eq!(parse_path("/v2/jobs/42/units"), None);
    }

    #[test]
    fn cached_queries_round_trip_and_stay_within_the_object() {
        for (etag, version) in [
            (Some("\"e&t=ag\""), None),
            (None, Some("v 1")),
            (Some("x"), Some("y")),
        ] {
            let o = CachedObject {
                url: "s3://b/dir with space/ü+%&=?#.bin".into(),
                etag: etag.map(String::from),
                version: version.map(String::from),
                size: 100,
            };
            let q = cached_query(&o, 40, 60);
            assert!(q.bytes().all(|b| b.is_ascii_graphic() && b != b'#'), "{q}");
            assert_eq!(parse_cached_query(&q), Ok((o, 40, 60)));
        }
        let o = CachedObject {
            url: "s3://b/x".into(),
            etag: None,
            version: None,
            size: 100,
        };
        for (q, want) in [
            (cached_query(&o, 41, 60), "not within"),
            (cached_query(&o, u64::MAX, 2), "not within"),
            (format!("{}&len=1", cached_query(&o, 0, 1)), "given twice"),
            (format!("{}&file=a", cached_query(&o, 0, 1)), "unknown"),
            ("size=1&offset=0&len=0".to_string(), "'url' is missing"),
            ("url=a&offset=0&len=0".to_string(), "'size' is missing"),
        ] {
            let e = parse_cached_query(&q).unwrap_err();
            assert!(e.contains(want), "{q}: {e}");
        }
    }
}
