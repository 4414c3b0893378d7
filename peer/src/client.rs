//! The peer client: fetches one unit of a job from the node that owns it, and trusts nothing it
//! has not checked.
//!
//! Every request is MAC'd with the job's key (see `auth`). An answer counts only when its MAC
//! verifies for this very request: a unit's data then has to match the MAC'd length and BLAKE3
//! hash before [`PeerClient::fetch`] returns it. A user process that bound the peer port, or a
//! relay that changed a byte, therefore yields [`PeerError::Corrupt`], never wrong data; answers it
//! could forge without the key (401, 403, 404, an unsigned 410) only ever make the caller read the
//! origin itself.
//!
//! **What proves an agent gone** ([`PeerError::proves_gone`], the shared tier's takeover): no
//! connection at all, no answer within the wait, or a `410 job gone` MAC'd for the request. Not an
//! unsigned answer of any kind (anyone who can reach the port can send one), and not a connection
//! accepted then closed without an answer ([`PeerError::Dropped`]): that is what an agent over its
//! connection limits does (`http`), so a flood at a live agent never reads as its death.
//!
//! `fetch` waits for a unit the owner is still reading (the server's long polls, each bounded
//! by the poll window plus the read timeout, so a silent owner is told apart from a busy one), and
//! for a peer that does not know the job yet (its prolog may run a little later) up to the join
//! grace. Budget: at most `concurrency` fetches at once, and as many requests to peers' caches
//! ([`PeerClient::fetch_cached_into`], one request each, never a long poll). [`PeerClient::fetch`] holds each unit
//! (`max_unit` bytes at most) in one buffer of the unit's length; [`PeerClient::fetch_into`]
//! hands the body to a [`UnitSink`] as it arrives (the stager writes it through its own budget's
//! buffers), so a fetch holds no more than the sink does. Either way a body is refused from its
//! `Content-Length` before anything is read if that is not the unit's length.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::header::CONTENT_LENGTH;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use sluice_core::config::PeerConfig;
use sluice_core::rt::{blocking, now_secs};
use sluice_proto::msg::JobId;
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout};

use super::auth::{
    AdminKey, HASH_HEADER, JobKey, MAC_HEADER, NODE_HEADER, READ_BACK_HEADER, READ_BACK_MARK,
    RequestKey, TIME_HEADER, parse_hash,
};
use super::listing::{self, PageRequest};
use super::server::{ADMIN_WARM_PATH, NO_SUCH_RESOURCE, cached_query, cached_unit, unit_query};
use super::{CachedObject, HashFrom, LONG_POLL, Unit};
use crate::http::BodyError;

mod events;
mod replicas;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What every request carries as its body: nothing, a small JSON, or a replica's bytes as they
/// are read.
type ReqBody = UnsyncBoxBody<Bytes, BoxError>;

/// The empty body of a request that sends none.
fn empty() -> ReqBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// An answer that carries no data, as [`PeerClient::take_reason`] read it.
struct Reason {
    status: StatusCode,
    /// MAC'd for the request by an agent of the job.
    signed: bool,
    body: Bytes,
    /// `body`, as text.
    text: String,
    /// The body was longer than the caller reads (then empty, and not signed).
    too_long: bool,
}

/// The longest pause before asking again a peer that does not know the job yet. Its prolog runs
/// about when this node's did, and every fetch slot waiting for it waits this long at worst past
/// its join: a 404 costs the peer less than the fetches it holds up.
const JOIN_POLL: Duration = Duration::from_millis(250);

/// Why a unit did not come from a peer, and so what the caller does next.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// No connection, no answer within the timeouts, or the connection broke mid-body (the peer's
    /// agent died or hangs): route around it, read the unit from the origin.
    #[error("peer {addr} is unreachable: {source}")]
    Unreachable {
        addr: String,
        #[source]
        source: BoxError,
    },
    /// The connection was accepted, then closed or reset before any answer: the agent is over its
    /// connection limits (a flood from this node's address or from many), or something else took
    /// its port. No evidence that the agent is gone; for a unit, read it elsewhere.
    #[error("peer {addr} closed the connection without an answer (busy?): {source}")]
    Dropped {
        addr: String,
        #[source]
        source: BoxError,
    },
    /// The peer refused the request (401, 403, 400, ...): this node is not an agent of the job in
    /// the peer's eyes — another cluster secret, another node list, a clock off by more than the
    /// allowed skew. A configuration error on one side; read the origin and tell the admin.
    #[error("peer {addr} refused the request for job {job} ({status}): {reason}")]
    Refused {
        addr: String,
        job: JobId,
        status: u16,
        reason: String,
    },
    /// The peer does not know the job, even after the join grace (its prolog never registered it,
    /// or its agent restarted and lost it).
    #[error("peer {addr} does not know job {job}")]
    UnknownJob { addr: String, job: JobId },
    /// The job ended on the peer: its answer said so, MAC'd for the request (an unsigned 410 is
    /// [`PeerError::Refused`]).
    #[error("job {job} has ended on peer {addr}")]
    Gone { addr: String, job: JobId },
    /// The peer says it does not own the unit: the nodes disagree on the node list or unit size.
    #[error("peer {addr} does not own unit {unit} of job {job}")]
    NotOwner {
        addr: String,
        job: JobId,
        unit: String,
    },
    /// The owner could not read the unit from the origin.
    #[error("peer {addr} could not read unit {unit} from the origin: {reason}")]
    Failed {
        addr: String,
        unit: String,
        reason: String,
    },
    /// What arrived is not what the owner read (a bad or missing MAC, a wrong length or hash): a
    /// forged server or a tampering relay. Nothing of it is returned; fetch again, or read the
    /// origin.
    #[error("unit {unit} from peer {addr} is corrupt: {what}")]
    Corrupt {
        addr: String,
        unit: String,
        what: String,
    },
    /// The owner was still reading the unit after `max_wait`.
    #[error("peer {addr} did not have unit {unit} after {waited:?}")]
    TimedOut {
        addr: String,
        unit: String,
        waited: Duration,
    },
    /// The caller asked for a unit larger than the client's budget allows.
    #[error("unit {unit} of {len} bytes is larger than the peer unit limit of {max} bytes")]
    TooLarge { unit: String, len: u64, max: u64 },
    /// The holder of replicas has no room for this one: its replica area cannot take `need` more
    /// bytes (`free` are left). Push the part to another node, or free older checkpoints.
    #[error(
        "peer {addr} has no room for {what}: {need} bytes asked, {free} free in its replica area"
    )]
    NoRoom {
        addr: String,
        what: String,
        need: u64,
        free: u64,
    },
    /// The holder of replicas refused a request about one, MAC'd, with its reason: `409` the
    /// bytes were not what was announced (size or BLAKE3) or a sealed file was not pushed, `400`
    /// not a checkpoint's tag, path or file list, `500` it could not write or read its copy,
    /// `503` busy with other pushes. It keeps nothing of a refused push.
    #[error("peer {addr} refused the request about {what} ({status}): {reason}")]
    ReplicaRefused {
        addr: String,
        what: String,
        status: u16,
        reason: String,
    },
    /// The agent does not hold the replica asked for (never pushed, not sealed, or freed).
    #[error("peer {addr} does not hold {what}")]
    NotHeld { addr: String, what: String },
    /// A replica to push could not be read here, or was not the size announced (the file changed
    /// under the push?): the push was cut, and the holder keeps nothing of it.
    #[error("{what} could not be pushed to peer {addr}: {source}")]
    PushSource {
        addr: String,
        what: String,
        #[source]
        source: BoxError,
    },
    /// The [`UnitSink`] could not take the bytes (e.g. the hot tier is full); the sink knows why.
    #[error("unit {unit}: {source}")]
    Sink {
        unit: String,
        #[source]
        source: BoxError,
    },
}

impl PeerError {
    /// Whether this error is evidence that the peer's agent is gone for the job (the shared
    /// tier's liveness, see the module header): it could not be reached at all or in time, or it
    /// said, under the job's key, that the job ended there. Nothing a process without the key can
    /// send is.
    pub fn proves_gone(&self) -> bool {
        matches!(self, PeerError::Unreachable { .. } | PeerError::Gone { .. })
    }
}

/// Where [`PeerClient::fetch_into`] puts a unit's bytes as they arrive.
///
/// The bytes are the peer's until the fetch returns `Ok`: a fetch that fails after some bytes
/// arrived (the peer died mid-body, the hash does not match) leaves what the sink took unverified,
/// and the caller must write the unit again from elsewhere before anyone reads it.
#[async_trait::async_trait]
pub trait UnitSink: Send {
    /// The next bytes of the unit, in order, at most the unit's length in all.
    async fn write(&mut self, bytes: Bytes) -> Result<(), BoxError>;
    /// Every byte of the unit was written: their BLAKE3 hash, which the fetch compares with the
    /// owner's. (Hashing belongs to the sink so that it can run where the bytes are written, on a
    /// blocking thread, never on the runtime's workers.)
    async fn finish(&mut self) -> Result<blake3::Hash, BoxError>;
}

/// The sink of [`PeerClient::fetch`]: one buffer of the unit's length.
struct MemorySink {
    buf: BytesMut,
}

#[async_trait::async_trait]
impl UnitSink for MemorySink {
    async fn write(&mut self, bytes: Bytes) -> Result<(), BoxError> {
        self.buf.extend_from_slice(&bytes);
        Ok(())
    }

    async fn finish(&mut self) -> Result<blake3::Hash, BoxError> {
        let body = std::mem::take(&mut self.buf);
        let (body, hash) = if body.len() >= 64 << 10 {
            blocking(move || {
                let h = blake3::hash(&body);
                (body, h)
            })
            .await
        } else {
            let h = blake3::hash(&body);
            (body, h)
        };
        self.buf = body;
        Ok(hash)
    }
}

/// How the client runs; [`ClientConfig::from_config`] takes it from `[peer]`.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Fetches in flight at once.
    pub concurrency: usize,
    /// The largest unit fetched (the configured unit size).
    pub max_unit: u64,
    pub connect_timeout: Duration,
    /// The longest silence while a body arrives, and the margin over the poll window while
    /// waiting for an answer.
    pub read_timeout: Duration,
    /// The server's long-poll window (the same `[peer]` on every node).
    pub poll: Duration,
    /// How long a peer that does not know the job yet is asked again (every [`JOIN_POLL`] at
    /// most).
    pub join_grace: Duration,
    /// The longest a fetch waits for an owner still reading the unit.
    pub max_wait: Duration,
}

impl ClientConfig {
    /// `max_wait` is the stage timeout: a fetch never outlives the staging it serves.
    pub fn from_config(cfg: &PeerConfig, max_wait: Duration) -> ClientConfig {
        ClientConfig {
            concurrency: cfg.concurrency,
            max_unit: cfg.unit_size,
            connect_timeout: cfg.connect_timeout,
            read_timeout: cfg.read_timeout,
            poll: LONG_POLL,
            join_grace: Duration::from_secs(60),
            max_wait,
        }
    }
}

/// Fetches units from the other agents of a job. One per node; cheap to share behind an `Arc`.
pub struct PeerClient {
    http: Client<HttpConnector, ReqBody>,
    /// This node's name, as the job's node list spells it.
    node: String,
    cfg: ClientConfig,
    fetches: Arc<Semaphore>,
    /// Requests to peers' caches at once: slots of their own, since a unit fetch may hold its
    /// slot while it waits for the owner, and the owner's staging may wait for a cache probe.
    cached: Arc<Semaphore>,
}

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient")
            .field("node", &self.node)
            .field("fetches_free", &self.fetches.available_permits())
            .finish()
    }
}

/// One answer of the peer to one request.
enum Answer {
    /// The unit went into the sink, whole and verified against a hash computed from this.
    Delivered(HashFrom),
    Pending,
    UnknownJob,
    /// A signed `404`: the peer's cache holds no such object (the `cached` resource only).
    NotCached,
}

impl PeerClient {
    /// The client of node `node` (its name in the jobs' node lists).
    pub fn new(node: impl Into<String>, cfg: ClientConfig) -> PeerClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.connect_timeout));
        connector.set_nodelay(true);
        // Idle connections go before the server's idle timeout closes them under a new request.
        let http = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(cfg.concurrency.max(1))
            .build(connector);
        PeerClient {
            http,
            node: node.into(),
            fetches: Arc::new(Semaphore::new(cfg.concurrency.max(1))),
            cached: Arc::new(Semaphore::new(cfg.concurrency.max(1))),
            cfg,
        }
    }

    /// Fetches `unit` of `job` from the agent at `addr` (`host:port`, from
    /// [`PeerConfig::addr_of`]), waiting while the owner still reads it, and returns its bytes
    /// once their length and BLAKE3 hash match what the owner MAC'd. Dropping the future cancels
    /// the fetch.
    pub async fn fetch(&self, addr: &str, job: &JobKey, unit: &Unit) -> Result<Bytes, PeerError> {
        if unit.len > self.cfg.max_unit {
            return Err(self.too_large(unit));
        }
        let mut sink = MemorySink {
            buf: BytesMut::with_capacity(unit.len as usize),
        };
        self.fetch_into(addr, job, unit, &mut sink).await?;
        Ok(sink.buf.freeze())
    }

    /// [`fetch`](Self::fetch), with the body handed to `sink` as it arrives instead of held in
    /// memory. `Ok` means the sink took exactly the unit's bytes and its hash is the owner's, and
    /// says what the owner computed that hash from (an origin read, or a read-back of its staged
    /// copy: then the bytes are for the job's copy only, [`HashFrom`]); on an error after bytes
    /// arrived, what the sink took is not to be trusted (see [`UnitSink`]).
    pub async fn fetch_into(
        &self,
        addr: &str,
        job: &JobKey,
        unit: &Unit,
        sink: &mut dyn UnitSink,
    ) -> Result<HashFrom, PeerError> {
        if unit.len > self.cfg.max_unit {
            return Err(self.too_large(unit));
        }
        let _slot = self
            .fetches
            .acquire()
            .await
            .expect("the fetch semaphore is never closed");
        let pq = format!("/v1/jobs/{}/units?{}", job.job(), unit_query(unit));
        self.polled(addr, job, &pq, unit, None, sink).await
    }

    /// The page of a dataset's listing `asked` names, from the agent at `addr` ([`crate::listing`]),
    /// waited for while that node lists the origin as [`fetch_into`](Self::fetch_into) waits for
    /// a unit; its length (at most [`listing::MAX_PAGE`]), hash and MAC checked. Not from one of
    /// the fetch slots: those can all be waiting for units whose owners wait for this listing to
    /// know them (a node has at most one listing request in flight per dataset).
    pub async fn fetch_listing(
        &self,
        addr: &str,
        job: &JobKey,
        asked: &PageRequest,
    ) -> Result<Bytes, PeerError> {
        let pq = format!("/v1/jobs/{}/listing?{}", job.job(), asked.query());
        let mut sink = MemorySink {
            buf: BytesMut::new(),
        };
        let unit = asked.unit(0);
        self.polled(addr, job, &pq, &unit, Some(listing::MAX_PAGE), &mut sink)
            .await?;
        Ok(sink.buf.freeze())
    }

    /// The request `pq` for `unit` (of at most `up_to` bytes when its length is the answer's,
    /// else exactly `unit.len`) asked again while the node answers `pending` (up to the stage
    /// timeout) or does not know the job yet (up to the join grace).
    async fn polled(
        &self,
        addr: &str,
        job: &JobKey,
        pq: &str,
        unit: &Unit,
        up_to: Option<u64>,
        sink: &mut dyn UnitSink,
    ) -> Result<HashFrom, PeerError> {
        let start = Instant::now();
        let mut pause = Duration::from_millis(50);
        let wait = self.cfg.poll + self.cfg.read_timeout;
        loop {
            match self
                .once(addr, job, Ask { pq, unit, up_to }, wait, sink)
                .await?
            {
                Answer::Delivered(from) => return Ok(from),
                Answer::NotCached => {
                    return Err(PeerError::Corrupt {
                        addr: addr.into(),
                        unit: unit.name(),
                        what: "a 'not cached' answer to a request for a unit".into(),
                    });
                }
                Answer::Pending if start.elapsed() < self.cfg.max_wait => {}
                Answer::Pending => {
                    return Err(PeerError::TimedOut {
                        addr: addr.into(),
                        unit: unit.name(),
                        waited: start.elapsed(),
                    });
                }
                Answer::UnknownJob if start.elapsed() + pause <= self.cfg.join_grace => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(JOIN_POLL);
                }
                Answer::UnknownJob => {
                    return Err(PeerError::UnknownJob {
                        addr: addr.into(),
                        job: job.job(),
                    });
                }
            }
        }
    }

    fn too_large(&self, unit: &Unit) -> PeerError {
        PeerError::TooLarge {
            unit: unit.name(),
            len: unit.len,
            max: self.cfg.max_unit,
        }
    }

    /// Takes `range` of `object` from the cross-job cache of the agent at `addr`
    /// into `sink`: `Ok(true)` once they are there, whole, their hash the one the peer took from
    /// its cache copy; `Ok(false)` when the peer's cache does not hold the object, its agent
    /// predates cached ranges, or it is busy. An empty range only asks whether the object is
    /// there.
    /// One request, never a long poll: it waits for headers at most `wait` (plus the connect
    /// timeout), so that a slow peer costs a bounded delay before the caller reads the origin.
    /// As with [`fetch_into`](Self::fetch_into), on an error the sink's bytes are not to be
    /// trusted.
    pub async fn fetch_cached_into(
        &self,
        addr: &str,
        job: &JobKey,
        object: &CachedObject,
        range: std::ops::Range<u64>,
        wait: Duration,
        sink: &mut dyn UnitSink,
    ) -> Result<bool, PeerError> {
        let (offset, len) = (range.start, range.end.saturating_sub(range.start));
        let unit = cached_unit(object, offset, len);
        if len > self.cfg.max_unit {
            return Err(self.too_large(&unit));
        }
        let _slot = self
            .cached
            .acquire()
            .await
            .expect("the cache request semaphore is never closed");
        let pq = format!(
            "/v1/jobs/{}/cached?{}",
            job.job(),
            cached_query(object, offset, len)
        );
        let ask = Ask {
            pq: &pq,
            unit: &unit,
            up_to: None,
        };
        match self.once(addr, job, ask, wait, sink).await? {
            // A cache holds origin bytes only; a marked answer is not one of its.
            Answer::Delivered(HashFrom::Origin) => Ok(true),
            Answer::Delivered(HashFrom::ReadBack) => Err(PeerError::Corrupt {
                addr: addr.into(),
                unit: unit.name(),
                what: "a cached range marked as read back from a staged copy".into(),
            }),
            Answer::NotCached | Answer::Pending => Ok(false),
            Answer::UnknownJob => Err(PeerError::UnknownJob {
                addr: addr.into(),
                job: job.job(),
            }),
        }
    }

    /// Asks the agent at `addr` to warm its cache with the dataset at `url` (an admin request,
    /// MAC'd with `key`), waiting up to `wait` for its report. `Err(PeerError::Failed)` carries
    /// the agent's own reason (no cache, dataset not found, ...).
    pub async fn admin_warm(
        &self,
        addr: &str,
        key: &AdminKey,
        url: &str,
        wait: Duration,
    ) -> Result<sluice_proto::msg::CacheWarmed, PeerError> {
        let unreachable = |source: BoxError| PeerError::Unreachable {
            addr: addr.into(),
            source,
        };
        let what = format!("warm of {url}");
        let corrupt = |what_went_wrong: String| PeerError::Corrupt {
            addr: addr.into(),
            unit: what.clone(),
            what: what_went_wrong,
        };
        let pq = format!(
            "{ADMIN_WARM_PATH}?{}",
            url::form_urlencoded::Serializer::new(String::new())
                .append_pair("url", url)
                .finish()
        );
        let (req, mac) = self
            .signed(key, Method::POST, addr, &pq, empty())
            .map_err(|e| unreachable(Box::new(e)))?;
        let res: Response<Incoming> = timeout(wait, self.http.request(req))
            .await
            .map_err(|_| unreachable(format!("no answer within {wait:?}").into()))?
            .map_err(|e| unreachable(Box::new(e)))?;
        let status = res.status();
        let their_mac = parse_hash(res.headers().get(MAC_HEADER));
        let body = match self.read_body(res, ADMIN_BODY_MAX).await {
            Ok(b) => b,
            Err(BodyError::TooLong) => return Err(corrupt("the answer is too long".into())),
            Err(BodyError::Io(source)) => return Err(unreachable(source)),
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        let signed = their_mac == Some(key.response_mac(status.as_u16(), &body, &mac));
        match (signed, status) {
            (true, StatusCode::OK) => serde_json::from_slice(&body)
                .map_err(|e| corrupt(format!("the report does not parse: {e}"))),
            (true, StatusCode::BAD_GATEWAY) => Err(PeerError::Failed {
                addr: addr.into(),
                unit: what,
                reason: text,
            }),
            (false, s) if s.is_client_error() => Err(PeerError::Refused {
                addr: addr.into(),
                job: 0,
                status: s.as_u16(),
                reason: text,
            }),
            (signed, s) => Err(corrupt(format!(
                "an unexpected {}answer {s}: {text}",
                if signed { "" } else { "unauthenticated " }
            ))),
        }
    }

    /// Whether the cross-job cache of the agent at `addr` holds `object` (see
    /// [`fetch_cached_into`](Self::fetch_cached_into) with `len == 0`).
    pub async fn probe_cached(
        &self,
        addr: &str,
        job: &JobKey,
        object: &CachedObject,
        wait: Duration,
    ) -> Result<bool, PeerError> {
        let mut sink = MemorySink {
            buf: BytesMut::new(),
        };
        self.fetch_cached_into(addr, job, object, 0..0, wait, &mut sink)
            .await
    }

    /// Whether the agent at `addr` is up and serving `job`: one request for the unit
    /// [`ALIVE_PROBE`], which no job has, headers awaited at most `wait` (plus the connect
    /// timeout). `Ok` when the agent answered for the job under its key, whatever it said (an
    /// agent answers `409 not owner`; one still busy answers `503`); otherwise why not:
    /// [`PeerError::Unreachable`] (no connection, no answer in time: its agent is down or hangs),
    /// [`PeerError::Gone`] (the job ended there, MAC'd), [`PeerError::Dropped`] (accepted and
    /// closed: over its limits), [`PeerError::UnknownJob`], [`PeerError::Refused`] (an unsigned
    /// refusal, 410 included). Only [`PeerError::proves_gone`] errors say the agent is gone.
    /// It takes no fetch slot: a probe never waits behind transfers.
    pub async fn probe_alive(
        &self,
        addr: &str,
        job: &JobKey,
        wait: Duration,
    ) -> Result<(), PeerError> {
        let unit = Unit::new(ALIVE_PROBE, 0, 0);
        let mut sink = MemorySink {
            buf: BytesMut::new(),
        };
        let pq = format!("/v1/jobs/{}/units?{}", job.job(), unit_query(&unit));
        let ask = Ask {
            pq: &pq,
            unit: &unit,
            up_to: None,
        };
        match self.once(addr, job, ask, wait, &mut sink).await {
            Ok(Answer::UnknownJob) => Err(PeerError::UnknownJob {
                addr: addr.into(),
                job: job.job(),
            }),
            Ok(_) | Err(PeerError::NotOwner { .. } | PeerError::Failed { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The request `method` `pq` to `addr` with `body`, signed by this node now with `key`, and
    /// its MAC (which the answer's MAC covers).
    fn signed(
        &self,
        key: &impl RequestKey,
        method: Method,
        addr: &str,
        pq: &str,
        body: ReqBody,
    ) -> Result<(Request<ReqBody>, blake3::Hash), hyper::http::Error> {
        let time = now_secs();
        let mac = key.request_mac(method.as_str(), pq, &self.node, time);
        let req = Request::builder()
            .method(method)
            .uri(format!("http://{addr}{pq}"))
            .header(NODE_HEADER, self.node.as_str())
            .header(TIME_HEADER, time)
            .header(MAC_HEADER, mac.to_hex().as_str())
            .header(crate::release::VERSION_HEADER, crate::release::RELEASE)
            .body(body)?;
        Ok((req, mac))
    }

    /// Sends `req` to `addr` and waits for the answer's headers: at most `wait`, or, with
    /// `progress` (a body being sent), at most `wait` after the last bytes the body gave.
    async fn send(
        &self,
        addr: &str,
        req: Request<ReqBody>,
        wait: Duration,
        progress: Option<&replicas::Progress>,
    ) -> Result<Response<Incoming>, PeerError> {
        let unreachable = |source: BoxError| PeerError::Unreachable {
            addr: addr.into(),
            source,
        };
        let answer = self.http.request(req);
        tokio::pin!(answer);
        let answered = loop {
            let since = progress.map_or(Instant::now(), replicas::Progress::last);
            tokio::select! {
                r = &mut answer => break r,
                _ = tokio::time::sleep_until(since + wait) => {
                    if progress.is_none_or(|p| p.last() == since) {
                        return Err(unreachable(format!("no answer within {wait:?}").into()));
                    }
                }
            }
        };
        answered.map_err(|e| {
            if e.is_connect() {
                unreachable(Box::new(e))
            } else {
                // Connected, then closed before an answer: a full server, not a dead one.
                PeerError::Dropped {
                    addr: addr.into(),
                    source: Box::new(e),
                }
            }
        })
    }

    /// One request for `ask.pq` and its answer, MAC'd over `ask.unit`; headers awaited at most
    /// `wait`.
    async fn once(
        &self,
        addr: &str,
        job: &JobKey,
        ask: Ask<'_>,
        wait: Duration,
        sink: &mut dyn UnitSink,
    ) -> Result<Answer, PeerError> {
        let Ask { pq, unit, up_to } = ask;
        let (req, mac) = self
            .signed(job, Method::GET, addr, pq, empty())
            .map_err(|e| PeerError::Unreachable {
                addr: addr.into(),
                source: Box::new(e),
            })?;
        let res = self.send(addr, req, wait, None).await?;
        if res.status() == StatusCode::OK {
            let sized;
            let unit = match up_to {
                None => unit,
                Some(max) => {
                    let said = content_length(&res);
                    let Some(len) = said.filter(|len| *len <= max) else {
                        return Err(PeerError::Corrupt {
                            addr: addr.into(),
                            unit: unit.name(),
                            what: format!("an answer of {said:?} bytes, over the {max} asked for"),
                        });
                    };
                    sized = Unit {
                        len,
                        ..unit.clone()
                    };
                    &sized
                }
            };
            let (from, _) = self.take_data(addr, job, res, unit, &mac, sink).await?;
            return Ok(Answer::Delivered(from));
        }
        let Reason {
            status,
            signed,
            text,
            ..
        } = self
            .take_reason(addr, job, res, unit, &mac, REASON_MAX)
            .await?;
        let corrupt = |what: String| PeerError::Corrupt {
            addr: addr.into(),
            unit: unit.name(),
            what,
        };
        let (addr, job_id) = (addr.to_string(), job.job());
        match (signed, status) {
            (true, StatusCode::SERVICE_UNAVAILABLE) => Ok(Answer::Pending),
            (true, StatusCode::NOT_FOUND) => Ok(Answer::NotCached),
            (true, StatusCode::NOT_IMPLEMENTED) => Err(PeerError::Refused {
                addr,
                job: job_id,
                status: status.as_u16(),
                reason: text,
            }),
            (true, StatusCode::CONFLICT) => Err(PeerError::NotOwner {
                addr,
                job: job_id,
                unit: unit.name(),
            }),
            (true, StatusCode::BAD_GATEWAY) => Err(PeerError::Failed {
                addr,
                unit: unit.name(),
                reason: text,
            }),
            (true, StatusCode::GONE) => Err(PeerError::Gone { addr, job: job_id }),
            // An agent that predates the resource (a rolling upgrade): no use asking again.
            (false, StatusCode::NOT_FOUND) if text == NO_SUCH_RESOURCE => Err(PeerError::Refused {
                addr,
                job: job_id,
                status: status.as_u16(),
                reason: text,
            }),
            (false, StatusCode::NOT_FOUND) => Ok(Answer::UnknownJob),
            (false, s) if s.is_client_error() => Err(PeerError::Refused {
                addr,
                job: job_id,
                status: s.as_u16(),
                reason: text,
            }),
            (signed, s) => Err(corrupt(format!(
                "an unexpected {}answer {s}: {text}",
                if signed { "" } else { "unauthenticated " }
            ))),
        }
    }

    /// A data answer (`200`) to the request whose MAC was `mac`, into `sink`: its MAC over
    /// `unit` and the hash it names, its length (`unit.len`, from `Content-Length` before anything
    /// is read, then on the bytes) and the sink's hash of the bytes. Returns what the hash was
    /// computed from and the hash.
    async fn take_data(
        &self,
        addr: &str,
        job: &JobKey,
        res: Response<Incoming>,
        unit: &Unit,
        mac: &blake3::Hash,
        sink: &mut dyn UnitSink,
    ) -> Result<(HashFrom, blake3::Hash), PeerError> {
        let corrupt = |what: String| PeerError::Corrupt {
            addr: addr.into(),
            unit: unit.name(),
            what,
        };
        let their_mac = parse_hash(res.headers().get(MAC_HEADER));
        let hash = parse_hash(res.headers().get(HASH_HEADER))
            .ok_or_else(|| corrupt("the answer has no unit hash".into()))?;
        let from = if res.headers().contains_key(READ_BACK_HEADER) {
            HashFrom::ReadBack
        } else {
            HashFrom::Origin
        };
        let mark = match from {
            HashFrom::ReadBack => READ_BACK_MARK,
            HashFrom::Origin => b"",
        };
        if their_mac != Some(job.response_mac(200, unit, Some(&hash), mark, mac)) {
            return Err(corrupt(
                "the answer's MAC does not verify: not an agent of this job, or changed on the way"
                    .into(),
            ));
        }
        let len = content_length(&res);
        if len != Some(unit.len) {
            return Err(corrupt(format!(
                "the answer's length is {len:?}, the unit's {}",
                unit.len
            )));
        }
        let got = self
            .stream_body(res, unit, sink)
            .await
            .map_err(|e| match e {
                StreamError::Io(source) => PeerError::Unreachable {
                    addr: addr.into(),
                    source,
                },
                StreamError::TooLong => corrupt("the body is longer than the unit".into()),
                StreamError::Sink(source) => PeerError::Sink {
                    unit: unit.name(),
                    source,
                },
            })?;
        if got.0 != unit.len {
            return Err(corrupt(format!(
                "the body has {} bytes, the unit {}",
                got.0, unit.len
            )));
        }
        if got.1 != hash {
            return Err(corrupt(format!(
                "its BLAKE3 hash is {}, the owner read {hash}",
                got.1
            )));
        }
        Ok((from, hash))
    }

    /// An answer that carries no data (an error, or a short report such as a replica index): its
    /// body of at most `max` bytes, and whether it is MAC'd over `unit` for the request whose MAC
    /// was `mac`.
    async fn take_reason(
        &self,
        addr: &str,
        job: &JobKey,
        res: Response<Incoming>,
        unit: &Unit,
        mac: &blake3::Hash,
        max: usize,
    ) -> Result<Reason, PeerError> {
        let status = res.status();
        let their_mac = parse_hash(res.headers().get(MAC_HEADER));
        let (body, too_long) = match self.read_body(res, max).await {
            Ok(b) => (b, false),
            Err(BodyError::TooLong) => (Bytes::new(), true),
            Err(BodyError::Io(source)) => {
                return Err(PeerError::Unreachable {
                    addr: addr.into(),
                    source,
                });
            }
        };
        let signed = !too_long
            && their_mac == Some(job.response_mac(status.as_u16(), unit, None, &body, mac));
        Ok(Reason {
            status,
            signed,
            text: String::from_utf8_lossy(&body).into_owned(),
            body,
            too_long,
        })
    }

    /// Hands a data body to `sink` frame by frame, none silent for longer than the read timeout
    /// (the sink's own time does not count), refusing more than the unit's length; returns the
    /// bytes received and the sink's hash of them.
    async fn stream_body(
        &self,
        res: Response<Incoming>,
        unit: &Unit,
        sink: &mut dyn UnitSink,
    ) -> Result<(u64, blake3::Hash), StreamError> {
        let mut body = res.into_body();
        let mut got = 0u64;
        while let Some(data) = self.next_data(&mut body).await.map_err(StreamError::Io)? {
            got += data.len() as u64;
            if got > unit.len {
                return Err(StreamError::TooLong);
            }
            if !data.is_empty() {
                sink.write(data).await.map_err(StreamError::Sink)?;
            }
        }
        let hash = sink.finish().await.map_err(StreamError::Sink)?;
        Ok((got, hash))
    }

    /// Reads a body of at most `max` bytes, none silent for longer than the read timeout.
    async fn read_body(&self, res: Response<Incoming>, max: usize) -> Result<Bytes, BodyError> {
        crate::http::read_bounded(&mut res.into_body(), max, self.cfg.read_timeout).await
    }

    /// The body's next data, `None` at its end; an error when a frame fails or none comes within
    /// the read timeout.
    async fn next_data(&self, body: &mut Incoming) -> Result<Option<Bytes>, BoxError> {
        crate::http::next_data(body, self.cfg.read_timeout).await
    }
}

/// What [`PeerClient::once`] asks: the request's path and query, the unit its answers are MAC'd
/// over, and, for an answer whose length only the answer can tell (a listing page), the most it
/// may be (`None`: exactly the unit's length).
#[derive(Clone, Copy)]
struct Ask<'a> {
    pq: &'a str,
    unit: &'a Unit,
    up_to: Option<u64>,
}

/// The length an answer's `Content-Length` gives, if it gives one.
fn content_length(res: &Response<Incoming>) -> Option<u64> {
    res.headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The file of the unit a liveness probe asks for ([`PeerClient::probe_alive`]): no unit of any
/// job has it (a unit's file starts with a dataset name, which holds no NUL), so an agent that
/// knows the job answers `not owner` at once.
pub const ALIVE_PROBE: &str = "\0alive";

/// The longest error reason read.
const REASON_MAX: usize = 4096;
/// The longest admin answer read (a warm's report lists the objects it skipped).
const ADMIN_BODY_MAX: usize = 4 << 20;

enum StreamError {
    Io(BoxError),
    TooLong,
    Sink(BoxError),
}
