//! The agent's two small HTTP/1.1 servers, the Prometheus endpoint and the peer port, share one
//! accept loop: hyper speaks the protocol; this bounds the connections held at once, in all and
//! per source address (one over either bound is closed at once, never queued), times out slow
//! request headers, caps the header buffer, and on cancellation cuts every connection short and
//! waits for them.
//!
//! The per-source bound is what keeps one address (a user's processes on one node) from taking
//! every slot: the agents of the job's other nodes still get theirs. A connection closed for being
//! over a bound is one a client sees accepted and then closed without an answer, which the peer
//! client tells apart from an agent that is gone (no connection at all, or no answer in time): a
//! full server is a live one. Such closures are logged at a bounded rate ([`LogLimit`]).

use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What one server allows.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections served at once from one source address.
    pub max_per_source: usize,
    /// How long a client may take to send a request's headers (also the idle timeout between
    /// requests of a kept-alive connection).
    pub header_timeout: Duration,
    /// The largest buffer hyper keeps for a request's head.
    pub max_buf_size: usize,
}

/// A log line that anyone on the network can cause (a refused request, a connection over a
/// bound) is written at most once per period; the ones held back in between are counted into
/// the next, so a flood costs a line per period, not one per request.
pub(crate) struct LogLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    pub(crate) fn new(every: Duration) -> LogLimit {
        LogLimit {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held)`: write the line now, saying that `held` like it were held back since the last
    /// one; `None`: this one is held back (and counted).
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut st = sluice_core::rt::lock(&self.state);
        let (last, held) = &mut *st;
        if last.is_some_and(|t| now.duration_since(t) < self.every) {
            *held += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held))
    }
}

/// How often a line the network can cause is written at most.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);

/// The text that says how many lines were held back before this one ("" for none).
pub(crate) fn held_back(held: u64) -> String {
    if held == 0 {
        String::new()
    } else {
        format!(
            " ({held} more like it in the last {}s not logged)",
            LOG_EVERY.as_secs()
        )
    }
}

/// The next data of a body arriving (other frames, trailers, are passed over), `None` at its end;
/// an error when a frame fails or none comes within `wait`. What both sides of the peer port read
/// bodies with, so that a silent sender never holds a reader for longer than `wait`.
pub(crate) async fn next_data(
    body: &mut Incoming,
    wait: Duration,
) -> Result<Option<bytes::Bytes>, Box<dyn std::error::Error + Send + Sync>> {
    use http_body_util::BodyExt;
    loop {
        let frame = tokio::time::timeout(wait, body.frame())
            .await
            .map_err(|_| format!("the body stalled for {wait:?}"))?;
        let Some(frame) = frame else {
            return Ok(None);
        };
        if let Ok(data) = frame?.into_data() {
            return Ok(Some(data));
        }
    }
}

/// Why a bounded body was not read whole.
pub(crate) enum BodyError {
    Io(Box<dyn std::error::Error + Send + Sync>),
    TooLong,
}

/// A whole body of at most `max` bytes, none of it silent for longer than `wait`; refused as
/// soon as it passes `max` (nothing more is read or held).
pub(crate) async fn read_bounded(
    body: &mut Incoming,
    max: usize,
    wait: Duration,
) -> Result<bytes::Bytes, BodyError> {
    let mut buf = bytes::BytesMut::new();
    while let Some(data) = next_data(body, wait).await.map_err(BodyError::Io)? {
        if buf.len() + data.len() > max {
            return Err(BodyError::TooLong);
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// Binds a TCP listener (the metrics and peer ports). An agent restarted right after a crash may
/// find its port still held by the dying process for a moment: it tries again for up to 5 s
/// before the address counts as taken.
pub async fn bind_tcp(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut tries = 0;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            bound => return bound,
        }
    }
}

/// The connections of each source address being served; a [`SourceSlot`] gives one back.
#[derive(Default)]
struct Sources(Mutex<HashMap<IpAddr, usize>>);

struct SourceSlot {
    sources: Arc<Sources>,
    ip: IpAddr,
}

impl Sources {
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<SourceSlot> {
        let mut held = sluice_core::rt::lock(&self.0);
        let n = held.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(SourceSlot {
            sources: self.clone(),
            ip,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut held = sluice_core::rt::lock(&self.sources.0);
        if let Some(n) = held.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// Serves `listener` until `cancel`: each request of a connection is answered by `answer(request,
/// remote address)`. `what` names the server in the log.
pub async fn serve<F, Fut, B>(
    what: &'static str,
    listener: TcpListener,
    cancel: CancellationToken,
    limits: Limits,
    answer: F,
) where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let conns = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let sources = Arc::new(Sources::default());
    let over = LogLimit::new(LOG_EVERY);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = cancel.cancelled() => break,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, or a connection reset before accept: pause, go on.
                tracing::warn!("{what}: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(source) = sources.take(remote.ip(), limits.max_per_source.max(1)) else {
            if let Some(held) = over.admit() {
                tracing::warn!(
                    "{what}: connection from {remote} closed: {} connections from {} are being served already, the most one address may hold{}",
                    limits.max_per_source,
                    remote.ip(),
                    held_back(held)
                );
            }
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Some(held) = over.admit() {
                tracing::warn!(
                    "{what}: connection from {remote} closed: all {} connection slots in use{}",
                    limits.max_connections,
                    held_back(held)
                );
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (answer, cancel) = (answer.clone(), cancel.clone());
        conns.spawn(async move {
            let _slots = (slot, source);
            let svc = hyper::service::service_fn(move |req| {
                let answer = answer.clone();
                async move { Ok::<_, Infallible>(answer(req, remote).await) }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(limits.max_buf_size);
            let conn = http.serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!("{what}: connection from {remote}: {e}");
                },
                _ = cancel.cancelled() => {}
            }
        });
    }
    conns.close();
    conns.wait().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_limited_log_writes_one_line_per_period_and_counts_the_rest() {
        let log = LogLimit::new(Duration::from_secs(10));
        assert_eq!(log.admit(), Some(0), "the first line is written");
        for _ in 0..999 {
            assert_eq!(log.admit(), None);
        }
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(log.admit(), None, "still within the period");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            log.admit(),
            Some(1000),
            "the next line counts the held-back ones"
        );
        assert_eq!(log.admit(), None);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(log.admit(), Some(1));
        assert!(held_back(1000).contains("1000 more like it"));
        assert_eq!(held_back(0), "");
    }
}
