//! Talking to this node's agent: one request, one answer, and errors that say what to do next.
//!
//! The agent's own error replies already tell the user what to do, so they are printed as they
//! are; the CLI adds advice only where the agent could not speak (unreachable, silent).

use crate::socket::{Origin, Socket};
use anyhow::anyhow;
use sluice_proto::client::{self, ClientError};
use sluice_proto::msg::{
    CkptPoisoned, CkptStatus, JobId, JobStatus, NodeStatus, Request, Response,
};
use sluice_proto::wire::FrameError;
use std::io::ErrorKind;
use std::os::fd::BorrowedFd;
use std::time::Duration;

pub struct Agent {
    pub socket: Socket,
    pub timeout: Duration,
}

impl Agent {
    pub fn status(&self) -> anyhow::Result<NodeStatus> {
        match self.call(Request::Status)? {
            Response::Status(status) => Ok(status),
            other => Err(self.unexpected("status", &other)),
        }
    }

    pub fn job(&self, job_id: JobId) -> anyhow::Result<JobStatus> {
        match self.call(Request::Job { job_id })? {
            Response::Job(job) => Ok(job),
            other => Err(self.unexpected("job", &other)),
        }
    }

    /// Commits checkpoint `$SLUICE_CKPT_DIR/TAG` of the job on this node.
    pub fn ckpt_commit(&self, job_id: JobId, tag: &str) -> anyhow::Result<()> {
        let request = Request::CkptCommit {
            job_id,
            tag: tag.to_string(),
        };
        match self.call(request)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("checkpoint commit", &other)),
        }
    }

    /// Marks checkpoint TAG of the job bad at the job's archive.
    pub fn ckpt_poison(
        &self,
        job_id: JobId,
        tag: &str,
        reason: &str,
    ) -> anyhow::Result<CkptPoisoned> {
        let request = Request::CkptPoison {
            job_id,
            tag: tag.to_string(),
            reason: reason.to_string(),
        };
        match self
            .call(request)
            .map_err(crate::remote::explain_too_old(self))?
        {
            Response::Poisoned(p) => Ok(p),
            other => Err(self.unexpected("checkpoint poison", &other)),
        }
    }

    /// The job's committed checkpoints on this node.
    pub fn ckpt_list(&self, job_id: JobId) -> anyhow::Result<Vec<CkptStatus>> {
        match self.call(Request::CkptList { job_id })? {
            Response::Ckpts { ckpts } => Ok(ckpts),
            other => Err(self.unexpected("checkpoint list", &other)),
        }
    }

    fn call(&self, request: Request) -> anyhow::Result<Response> {
        client::call(&self.socket.path, request, self.timeout).map_err(|e| self.explain(e))
    }

    /// One request with the descriptor `fd` passed along (see [`client::call_with`]), its answer
    /// awaited up to `answer` (connect and send keep `--timeout`).
    pub fn call_with(
        &self,
        request: Request,
        fd: Option<BorrowedFd<'_>>,
        answer: Duration,
    ) -> anyhow::Result<Response> {
        client::call_with(&self.socket.path, request, fd, self.timeout, answer)
            .map_err(|e| self.explain(e))
    }

    fn explain(&self, error: ClientError) -> anyhow::Error {
        let socket = &self.socket;
        let hint = match socket.origin {
            Origin::Flag => {
                "check that sluiced runs on this node and that --socket names its socket"
            }
            Origin::Env | Origin::Default => {
                "check that sluiced runs on this node (systemctl status sluiced), or pass --socket PATH"
            }
        };
        match error {
            ClientError::Agent(reply) => anyhow::Error::new(reply),
            ClientError::Connect { source, .. } => {
                anyhow!("cannot reach the sluice agent at {socket}: {source}; {hint}")
            }
            ClientError::Frame {
                source: FrameError::Io(e),
                ..
            } if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                anyhow!(
                    "the sluice agent at {socket} did not answer within {}; it may be busy: retry, or raise --timeout",
                    humantime::format_duration(self.timeout)
                )
            }
            ClientError::Frame {
                source: FrameError::Io(e),
                ..
            } if e.kind() == ErrorKind::UnexpectedEof => {
                anyhow!(
                    "the sluice agent at {socket} closed the connection without answering; see its log (journalctl -u sluiced)"
                )
            }
            other => anyhow::Error::new(other),
        }
    }

    pub fn unexpected(&self, asked: &str, got: &Response) -> anyhow::Error {
        let got = match got {
            Response::Ok => "ok",
            Response::Ready(_) => "ready",
            Response::Status(_) => "status",
            Response::Job(_) => "job",
            Response::Ckpts { .. } => "checkpoints",
            Response::Archive(_) => "archive listing",
            Response::Verified(_) => "verify report",
            Response::Restored(_) => "restore report",
            Response::Cache(_) => "cache listing",
            Response::CacheWarmed(_) => "cache warm report",
            Response::CacheWarmedNodes { .. } => "cache warm report of nodes",
            Response::CacheEvicted(_) => "cache evict report",
            Response::Poisoned(_) => "poison report",
            Response::Error(_) => "error",
        };
        anyhow!(
            "the sluice agent at {} answered a {asked} request with '{got}'; install matching sluice versions of the agent and CLI",
            self.socket
        )
    }
}
