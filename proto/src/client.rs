//! A blocking client for the agent socket, with a deadline on every step.
//!
//! Used by the SPANK plugin inside slurmd/slurmstepd (where threads and async runtimes are not
//! allowed) and by the CLI.

use crate::msg::{ErrorReply, Request, Response};
use crate::wire::{self, Envelope, FrameError};
use nix::sys::socket::{ControlMessage, MsgFlags, send, sendmsg};
use std::io::{IoSlice, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the sluice agent at {path}: {source} (is sluiced running on this node?)")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("talking to the sluice agent at {path}: {source}")]
    Frame { path: PathBuf, source: FrameError },
    #[error("{0}")]
    Agent(ErrorReply),
}

/// Sends one request and waits at most `timeout` for each of connect, write and read.
pub fn call(socket: &Path, request: Request, timeout: Duration) -> Result<Response, ClientError> {
    call_with(socket, request, None, timeout, timeout)
}

/// [`call`], with the open descriptor `fd` passed along with the request (`SCM_RIGHTS`, attached
/// to its first byte) when given, and `answer` as the longest wait for the answer (a restore the
/// agent runs may take hours; connect and send still have `timeout`).
pub fn call_with(
    socket: &Path,
    request: Request,
    fd: Option<BorrowedFd<'_>>,
    timeout: Duration,
    answer: Duration,
) -> Result<Response, ClientError> {
    let frame_err = |source| ClientError::Frame {
        path: socket.to_path_buf(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    let io_err = |e: std::io::Error| frame_err(FrameError::Io(e));
    stream.set_write_timeout(Some(timeout)).map_err(io_err)?;
    stream.set_read_timeout(Some(answer)).map_err(io_err)?;
    let frame = wire::encode(&Envelope::new(request)).map_err(frame_err)?;
    let mut sent = 0;
    if let Some(fd) = fd {
        let fds = [fd.as_raw_fd()];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        sent = sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(&frame)],
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(|e| io_err(e.into()))?;
    }
    NoSigPipe(&stream)
        .write_all(&frame[sent..])
        .map_err(io_err)?;
    let body = wire::read_frame(&mut stream).map_err(frame_err)?;
    match wire::decode_response(&body).map_err(frame_err)? {
        Response::Error(e) => Err(ClientError::Agent(e)),
        other => Ok(other),
    }
}

/// Writes with `MSG_NOSIGNAL`: an agent that closes the connection first (a refused over-cap
/// client) must give this process `EPIPE`, not `SIGPIPE` — inside slurmstepd the signal's default
/// action would kill the step daemon.
struct NoSigPipe<'a>(&'a UnixStream);

impl Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        send(self.0.as_raw_fd(), buf, MsgFlags::MSG_NOSIGNAL).map_err(std::io::Error::from)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_hung_up_gives_an_error_not_sigpipe() {
        let dir = std::env::temp_dir().join(format!("sluice-client-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("agent.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let stream = UnixStream::connect(&sock).unwrap();
        drop(listener.accept().unwrap());
        drop(listener);
        // The peer is gone: without MSG_NOSIGNAL this write would raise SIGPIPE. The test harness
        // ignores SIGPIPE, so restore the default action to make the test able to fail.
        // SAFETY: setting a signal disposition; no handler runs.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let big = vec![0u8; 1 << 20];
        let mut w = NoSigPipe(&stream);
        let mut err = None;
        for _ in 0..4 {
            if let Err(e) = w.write_all(&big) {
                err = Some(e);
                break;
            }
        }
        // SAFETY: as above.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let err = err.expect("writing to a closed peer fails");
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe, "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
