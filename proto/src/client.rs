//! A blocking client for the agent socket, with a deadline on every step.
//!
//! Used by the SPANK plugin inside slurmd/slurmstepd (where threads and async runtimes are not
//! allowed) and by the CLI.

use crate::msg::{ErrorReply, Request, Response};
use crate::wire::{self, Envelope, FrameError};
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
    stream.set_read_timeout(Some(timeout)).map_err(io_err)?;
    wire::write_frame(&mut stream, &Envelope::new(request)).map_err(frame_err)?;
    let body = wire::read_frame(&mut stream).map_err(frame_err)?;
    match wire::decode_response(&body).map_err(frame_err)? {
        Response::Error(e) => Err(ClientError::Agent(e)),
        other => Ok(other),
    }
}
