//! The agent's Unix socket: accepts connections, reads one framed request each, authorises it from
//! the peer credentials and answers.
//!
//! A request runs in a task of its own, so a client that disconnects mid-request (an epilog that hit
//! its timeout, a killed task) never cancels half-done work; the answer is simply dropped.

use crate::agent::{Agent, Peer};
use sluice_proto::msg::{ErrorCode, ErrorReply, Response};
use sluice_proto::wire;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 1024;

/// Serves `listener` until `shutdown` is cancelled.
pub async fn run(agent: Arc<Agent>, listener: UnixListener, shutdown: CancellationToken) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
            _ = shutdown.cancelled() => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let agent = agent.clone();
        agent.tracker.clone().spawn(async move {
            serve(agent, stream).await;
            drop(permit);
        });
    }
}

async fn serve(agent: Arc<Agent>, mut stream: UnixStream) {
    let peer = match stream.peer_cred() {
        Ok(c) => Peer {
            uid: c.uid(),
            gid: c.gid(),
        },
        Err(e) => {
            tracing::warn!("no peer credentials: {e}");
            return;
        }
    };
    let request = match tokio::time::timeout(READ_TIMEOUT, read_request(&mut stream)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let _ = write_response(
                &mut stream,
                &Response::Error(ErrorReply::new(ErrorCode::BadRequest, e.to_string())),
            )
            .await;
            return;
        }
        Err(_) => return,
    };
    tracing::debug!(uid = peer.uid, ?request, "request");
    let work = {
        let agent = agent.clone();
        agent
            .tracker
            .clone()
            .spawn(async move { agent.handle(peer, request).await })
    };
    // Answer when the work is done; stop waiting if the client goes away (it sends nothing more, so
    // any readable event is its hang-up).
    let (mut rd, mut wr) = stream.into_split();
    let mut probe = [0u8; 1];
    tokio::select! {
        r = work => {
            let response = r.unwrap_or_else(|e| Response::Error(ErrorReply::new(ErrorCode::Internal, format!("request failed: {e}"))));
            let frame = match wire::encode(&response) {
                Ok(f) => f,
                Err(e) => wire::encode(&Response::Error(ErrorReply::new(ErrorCode::Internal, e.to_string()))).expect("small frame"),
            };
            let _ = wr.write_all(&frame).await;
        }
        _ = rd.read(&mut probe) => {}
    }
}

async fn read_request(
    stream: &mut UnixStream,
) -> Result<sluice_proto::msg::Request, wire::FrameError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await?;
    let len = wire::frame_len(header)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    wire::decode_request(&body)
}

async fn write_response(
    stream: &mut UnixStream,
    response: &Response,
) -> Result<(), wire::FrameError> {
    stream.write_all(&wire::encode(response)?).await?;
    Ok(())
}
