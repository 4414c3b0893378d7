//! The agent's two small HTTP/1.1 servers, the Prometheus endpoint and the peer port, share one
//! accept loop: hyper speaks the protocol; this bounds the connections held at once (one over the
//! bound is closed at once, never queued), times out slow request headers, caps the header buffer,
//! and on cancellation cuts every connection short and waits for them.

use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What one server allows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers (also the idle timeout between
    /// requests of a kept-alive connection).
    pub header_timeout: Duration,
    /// The largest buffer hyper keeps for a request's head.
    pub max_buf_size: usize,
}

/// Serves `listener` until `cancel`: each request of a connection is answered by `answer(request,
/// remote address)`. `what` names the server in the log.
pub(crate) async fn serve<F, Fut, B>(
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!("{what}: connection from {remote} closed: all slots in use");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (answer, cancel) = (answer.clone(), cancel.clone());
        conns.spawn(async move {
            let _slot = slot;
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
