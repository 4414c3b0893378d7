//! The small surface the callbacks see: Slurm's SPANK handle, the plugin process, and the agent.
//!
//! [`crate::handle::Spank`] implements [`SpankApi`] over the real C API; the unit tests implement it
//! with a fake that records what the callbacks did. Keeping this trait narrow is what lets the plugin's
//! behaviour be tested without Slurm.

use sluice_proto::client::{self, ClientError};
use sluice_proto::msg::{Request, Response};
use std::path::Path;
use std::time::Duration;

/// Where the plugin is running (`spank_context()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// srun.
    Local,
    /// slurmstepd, once per job step and node; `task_init` runs in the forked task as the job user.
    Remote,
    /// sbatch or salloc.
    Allocator,
    /// slurmd itself (init when slurmd starts).
    Slurmd,
    /// `job_prolog`/`job_epilog`: a fresh root process per call, with no SPANK job data but the
    /// process environment.
    JobScript,
    /// `spank_context()` failed, or returned a value this build does not know.
    Unknown,
}

/// An `ESPANK_*` code returned by a SPANK call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SpankError {
    #[error("generic SPANK error (ESPANK_ERROR)")]
    Error,
    #[error("bad argument (ESPANK_BAD_ARG)")]
    BadArg,
    #[error("not available in a task context (ESPANK_NOT_TASK)")]
    NotTask,
    #[error("environment variable exists and overwrite is not set (ESPANK_ENV_EXISTS)")]
    EnvExists,
    #[error("no such environment variable (ESPANK_ENV_NOEXIST)")]
    EnvNoExist,
    #[error("buffer too small (ESPANK_NOSPACE)")]
    NoSpace,
    #[error("only available in the remote context (ESPANK_NOT_REMOTE)")]
    NotRemote,
    #[error("id or pid not found (ESPANK_NOEXIST)")]
    NoExist,
    #[error("tasks not yet executed (ESPANK_NOT_EXECD)")]
    NotExecd,
    #[error("not available in this context (ESPANK_NOT_AVAIL)")]
    NotAvail,
    #[error("only available in the local or allocator context (ESPANK_NOT_LOCAL)")]
    NotLocal,
    #[error("SPANK error {0}")]
    Other(u32),
}

/// One option for `spank_option_register`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionSpec {
    /// The name after `--`.
    pub name: &'static str,
    /// One word shown after the option in `--help` (`local|shared`).
    pub arginfo: &'static str,
    pub usage: &'static str,
    /// Handed back to the option callback, which has no other way to tell options apart.
    pub val: i32,
}

/// Slurm's log (`slurm_error` & co). Where a line ends up depends on the context: the user's terminal
/// in sbatch/srun, the job's output from a task, slurmd's log in prolog and epilog.
pub trait Log {
    /// A line for the job's output without Slurm's `error:` prefix (`slurm_spank_log`): how the
    /// end-of-job summary speaks, in the batch step's slurmstepd.
    fn report(&self, msg: &str);
    fn error(&self, msg: &str);
    fn info(&self, msg: &str);
    fn verbose(&self, msg: &str);
    fn debug(&self, msg: &str);
}

/// What the callbacks may ask of Slurm and of the process that loaded the plugin.
pub trait SpankApi: Log {
    fn context(&self) -> Context;
    fn register_option(&mut self, opt: &OptionSpec) -> Result<(), SpankError>;
    /// The option's value when the job used it (`spank_option_getopt`); `None` when it did not.
    fn getopt(&self, name: &str) -> Result<Option<String>, SpankError>;
    fn job_id(&self) -> Result<u32, SpankError>;
    /// The step this slurmstepd runs (remote context): [`crate::callbacks::BATCH_STEP`] for the
    /// batch script.
    fn step_id(&self) -> Result<u32, SpankError>;
    fn job_uid(&self) -> Result<u32, SpankError>;
    fn job_gid(&self) -> Result<u32, SpankError>;
    /// A variable of the job's environment (remote context only); `None` when it is not set.
    fn getenv(&self, name: &str) -> Result<Option<String>, SpankError>;
    /// Sets a variable in the job's (or, from `task_init`, the task's) environment.
    fn setenv(&mut self, name: &str, value: &str, overwrite: bool) -> Result<(), SpankError>;
    /// Sets a variable that job_prolog/job_epilog will see as `SPANK_<name>` (allocator and local
    /// context).
    fn job_control_setenv(
        &mut self,
        name: &str,
        value: &str,
        overwrite: bool,
    ) -> Result<(), SpankError>;
    /// A variable of this process's own environment (how prolog and epilog learn about the job).
    fn process_env(&self, name: &str) -> Option<String>;
    /// This machine's host name.
    fn hostname(&self) -> Option<String>;
}

/// The sluice agent on this node.
pub trait Agent {
    /// Sends one request; `timeout` bounds each of connect, write and read.
    fn call(
        &self,
        socket: &Path,
        request: Request,
        timeout: Duration,
    ) -> Result<Response, ClientError>;
}

/// The real agent, over its Unix socket, with `sluice_proto`'s blocking client (no threads).
pub struct SocketAgent;

impl Agent for SocketAgent {
    fn call(
        &self,
        socket: &Path,
        request: Request,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        client::call(socket, request, timeout)
    }
}
