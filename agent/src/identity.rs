//! Who the agent acts for, derived once, from what the kernel and Slurm say — never from a field of a
//! request (issue 24).
//!
//! The agent runs as root and acts for users: it stages with a user's permissions, archives under
//! a user's prefix, restores a user's checkpoints. Who that user is comes from two places only:
//!
//! - [`Peer`]: the process at the other end of the socket, from `SO_PEERCRED` (the kernel's word).
//! - [`JobIdentity`]: the user a job runs as — uid, primary gid and user name — taken from
//!   [`JobStart`] **only when root sent it** (slurmd's prolog: `SLURM_JOB_UID`/`GID`/`USER`, or the
//!   agent's own journal, which only root writes), or, for a job the agent learns of from one of
//!   its steps, from Slurm's controller (`squeue`: the job RUNNING on this node as the asking uid)
//!   with the name from NSS.
//!
//! A user's socket frame may carry a [`JobStart`] (a step's options travel in one), but its `uid`,
//! `gid`, `user` and `job_name` are never read: [`JobIdentity::stamp`] overwrites them before the
//! start goes anywhere, so the site policy (`[[stage.allow]]`, `[[ckpt.allow]]`, evaluated in
//! [`crate::policy`] on a [`crate::policy::Requester`] built from a `JobIdentity`), the copy
//! helper's `initgroups`/`setresgid`/`setresuid` and the owner of every file all follow the
//! verified identity.

use sluice_proto::msg::{JobId, JobStart};
use std::path::Path;
use std::time::Duration;

/// Who is on the other end of the socket, from `SO_PEERCRED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
}

impl Peer {
    pub fn is_root(self) -> bool {
        self.uid == 0
    }
}

/// The user a job runs as, as root or Slurm said. The fields are private: a value exists only
/// through the constructors below, each of which names its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobIdentity {
    uid: u32,
    gid: u32,
    user: String,
    job_name: String,
    job_id: JobId,
    /// The job's nodes.
    nodes: Vec<String>,
}

impl JobIdentity {
    /// The identity in a [`JobStart`] that root sent (the prolog), or that the agent's own journal
    /// holds. Never call it on a start that came from a user's frame.
    pub fn announced_by_root(start: &JobStart) -> JobIdentity {
        JobIdentity {
            uid: start.uid,
            gid: start.gid,
            user: start.user.clone(),
            job_name: start.job_name.clone(),
            job_id: start.job_id,
            nodes: start.nodes.clone(),
        }
    }

    /// The job's identity as Slurm's controller reports it, for a job the agent has no record of
    /// (no prolog called it): the job must be RUNNING, on `node`, as `peer`'s uid. The user name
    /// comes from NSS for that uid (blocking parts run off the runtime).
    pub async fn confirmed_by_slurm(
        squeue: &Path,
        job_id: JobId,
        node: &str,
        peer: Peer,
    ) -> Result<JobIdentity, String> {
        let job = SlurmJob::query(squeue, job_id).await.ok_or_else(|| {
            format!("Slurm does not know job {job_id} (or squeue could not be run)")
        })?;
        if job.uid != peer.uid {
            return Err(format!(
                "Slurm does not run job {job_id} as uid {}",
                peer.uid
            ));
        }
        if job.state != "RUNNING" {
            return Err(format!(
                "job {job_id} is {} — sluice stages for a step of a running job only",
                job.state
            ));
        }
        if !job.nodes.iter().any(|n| n == node) {
            return Err(format!("job {job_id} does not run on node {node}"));
        }
        let uid = job.uid;
        let user = sluice_core::rt::blocking(move || {
            nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                .ok()
                .flatten()
                .map(|u| u.name)
        })
        .await
        .ok_or_else(|| format!("uid {uid} has no user name on this node"))?;
        Ok(JobIdentity {
            uid,
            gid: job.gid,
            user,
            job_name: job.name,
            job_id,
            nodes: job.nodes,
        })
    }

    pub fn uid(&self) -> u32 {
        self.uid
    }

    pub fn gid(&self) -> u32 {
        self.gid
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    pub fn job_name(&self) -> &str {
        &self.job_name
    }

    /// A step of the job runs on some of the job's nodes: `Err` names one it does not.
    pub fn check_step_nodes(&self, step_nodes: &[String]) -> Result<(), String> {
        match step_nodes.iter().find(|n| !self.nodes.contains(n)) {
            Some(n) => Err(format!(
                "the step names node {n}, which is not one of job {}'s nodes",
                self.job_id
            )),
            None => Ok(()),
        }
    }

    /// `start` with this identity in place of whatever its `uid`, `gid`, `user` and `job_name`
    /// said: what a start from a user's frame becomes before anything uses it.
    pub fn stamp(&self, mut start: JobStart) -> JobStart {
        start.uid = self.uid;
        start.gid = self.gid;
        start.user = self.user.clone();
        start.job_name = self.job_name.clone();
        start
    }
}

/// One job as `squeue` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlurmJob {
    uid: u32,
    gid: u32,
    state: String,
    nodes: Vec<String>,
    name: String,
}

/// The fields [`SlurmJob::parse`] reads, `|`-separated; the job name last (it may hold `|`).
const SQUEUE_FORMAT: &str = "%U|%G|%T|%N|%j";

impl SlurmJob {
    async fn query(squeue: &Path, job_id: JobId) -> Option<SlurmJob> {
        let out = squeue_job(squeue, job_id, SQUEUE_FORMAT).await?;
        if !out.status.success() {
            return None;
        }
        SlurmJob::parse(&String::from_utf8_lossy(&out.stdout))
    }

    fn parse(line: &str) -> Option<SlurmJob> {
        let mut f = line.trim_end_matches('\n').splitn(5, '|');
        let uid = f.next()?.trim().parse().ok()?;
        let gid = f.next()?.trim().parse().ok()?;
        let state = f.next()?.trim().to_string();
        let nodes = f.next()?.trim();
        let nodes = if nodes.is_empty() || nodes == "(null)" {
            Vec::new()
        } else {
            sluice_proto::hostlist::expand(nodes).ok()?
        };
        let name = f.next()?.to_string();
        Some(SlurmJob {
            uid,
            gid,
            state,
            nodes,
            name,
        })
    }
}

/// `squeue --noheader --jobs JOB --format FORMAT`, within 15 s; `None` when it could not run.
pub(crate) async fn squeue_job(
    squeue: &Path,
    job_id: JobId,
    format: &str,
) -> Option<std::process::Output> {
    let run = tokio::process::Command::new(squeue)
        .args([
            "--noheader",
            "--jobs",
            &job_id.to_string(),
            "--format",
            format,
        ])
        .stdin(std::process::Stdio::null())
        .output();
    tokio::time::timeout(Duration::from_secs(15), run)
        .await
        .ok()?
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_lines_are_read_field_by_field() {
        let j = SlurmJob::parse("1001|1001|RUNNING|n[1-3]|my|job\n").unwrap();
        assert_eq!(
            j,
            SlurmJob {
                uid: 1001,
                gid: 1001,
                state: "RUNNING".into(),
                nodes: vec!["n1".into(), "n2".into(), "n3".into()],
                name: "my|job".into(),
            }
        );
        let pending = SlurmJob::parse("1001|1001|PENDING|(null)|x").unwrap();
        assert!(pending.nodes.is_empty());
        assert_eq!(SlurmJob::parse(""), None);
        assert_eq!(SlurmJob::parse("x|1|RUNNING|n1|j"), None);
    }

    #[test]
    fn a_stamped_start_keeps_nothing_of_the_claimed_identity() {
        let root_sent = JobStart {
            job_id: 7,
            uid: 1001,
            gid: 1001,
            user: "alice".into(),
            node: "n1".into(),
            nodes: vec!["n1".into()],
            job_name: "train".into(),
            options: vec![],
        };
        let id = JobIdentity::announced_by_root(&root_sent);
        let claimed = JobStart {
            uid: 1001,
            gid: 0,
            user: "bob".into(),
            job_name: "forged".into(),
            options: vec![("stage-in".into(), "/data".into())],
            ..root_sent.clone()
        };
        let stamped = id.stamp(claimed);
        assert_eq!(
            (stamped.uid, stamped.gid, stamped.user.as_str()),
            (1001, 1001, "alice")
        );
        assert_eq!(stamped.job_name, "train");
        assert_eq!(stamped.options, vec![("stage-in".into(), "/data".into())]);
    }
}
