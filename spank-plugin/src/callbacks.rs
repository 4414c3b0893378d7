//! What the plugin does in each SPANK callback, written against [`SpankApi`] and [`Agent`] only, so
//! that all of it is unit-tested with a fake handle.
//!
//! The life of a job, and what may fail where (spank(8); the end-to-end tests in tests/tests/ see it
//! on a real Slurm):
//!
//! | callback | context | does | may fail the... |
//! | --- | --- | --- | --- |
//! | `init` | all | registers the options (sbatch ignores a static table) | nothing: always 0 |
//! | option callback | sbatch/srun/salloc | validates a value | submission |
//! | `init_post_opt` | sbatch/srun/salloc | validates all `--stage-in`, forwards them joined | submission |
//! | `job_prolog` | job_script, root | "job J starts here" → agent | nothing: always 0 (≠0 drains the node) |
//! | `task_init` | remote, job user | waits until staged, exports `SLUICE_*` | job, not the node |
//! | `exit` | remote (batch step), root | prints the job's summary from the agent | nothing: always 0 |
//! | `job_epilog` | job_script, root | "job J ended" → agent | nothing: always 0 |
//!
//! A job that uses no sluice option never reaches the agent: it runs exactly as without the plugin.

use crate::api::{Agent, Context, Log, OptionSpec, SpankApi};
use crate::args::Args;
use sluice_proto::client::ClientError;
use sluice_proto::hostlist;
use sluice_proto::msg::{ErrorCode, JobId, JobStart, Request, Response, StepStart};
use sluice_proto::options::{self, names};
use sluice_proto::summary;
use sluice_proto::wire::FrameError;
use std::io;
use std::time::{Duration, Instant};

/// Success, for every callback.
pub const OK: i32 = 0;
/// Failure: refuses a submission (allocator/local) or fails the job (task_init).
pub const FAIL: i32 = -1;

/// Set in the allocator with `spank_job_control_setenv`; job_prolog sees it as `SPANK_SLUICE_STAGE_IN`.
/// Slurm itself forwards only the last value of a repeated option, so this carries all of them.
pub const STAGE_IN_JOB_VAR: &str = "SLUICE_STAGE_IN";
/// Exported to the tasks.
pub const STAGE_DIR_VAR: &str = "SLUICE_STAGE_DIR";
pub const CKPT_DIR_VAR: &str = "SLUICE_CKPT_DIR";
/// The checkpoint `--ckpt-restore` placed in `$SLUICE_CKPT_DIR`.
pub const RESTORED_TAG_VAR: &str = "SLUICE_RESTORED_TAG";

/// The `spank_option_register` arguments of every sluice option; `val` is the index in
/// [`names::ALL`], which is how the option callback tells them apart.
pub fn option_specs() -> Vec<OptionSpec> {
    names::ALL
        .iter()
        .enumerate()
        .map(|(val, &name)| {
            let (arginfo, usage) = match name {
                names::STAGE_IN => (
                    "[NAME=]SRC",
                    "sluice: stage SRC into $SLUICE_STAGE_DIR/NAME before the job starts. SRC: s3://bucket/prefix, \
                     az://container/prefix, gs://bucket/prefix, file:///path or /path. Repeatable or comma-separated; \
                     NAME defaults to the last path component",
                ),
                names::STAGE_TIER => (
                    "local|shared",
                    "sluice: where staged data lands: local (node-local NVMe, default) or shared (the site's shared \
                     fast tier)",
                ),
                names::STAGE_MODE => (
                    "replicate|shard",
                    "sluice: replicate (default): every node gets the whole dataset; shard: each node gets its \
                     share of the files plus $SLUICE_STAGE_DIR/NAME.shard.json (file -> node, size) and \
                     SLUICE_SHARD_INDEX/SLUICE_SHARD_COUNT; either way the origin is read once per job",
                ),
                names::CKPT_ARCHIVE => (
                    "URL",
                    "sluice: archive committed checkpoints under URL: s3://bucket/prefix, az://container/prefix, \
                     gs://bucket/prefix or file:///path",
                ),
                names::CKPT_KEEP => {
                    ("N", "sluice: committed checkpoints kept on the hot tier once archived (1-1000)")
                }
                names::CKPT_RESTORE => (
                    "latest|TAG",
                    "sluice: before the first step, place checkpoint TAG (or the latest not poisoned) in $SLUICE_CKPT_DIR; \
                     TAG! restores a poisoned one",
                ),
                names::CKPT_TIER => (
                    "local|ram",
                    "sluice: where $SLUICE_CKPT_DIR lives: local (the node's NVMe hot tier, default) or ram (the \
                     site's RAM tier: saves at memory speed; committed checkpoints are flushed to NVMe, then archived)",
                ),
                names::CKPT_REPLICAS => (
                    "N",
                    "sluice: with --ckpt-tier=ram, how many other nodes of the job hold a copy of each node's \
                     part of a committed checkpoint until it is archived (0-3, within the site's bound; default: \
                     the site's)",
                ),
                other => unreachable!("option --{other} has no usage text"),
            };
            OptionSpec { name, arginfo, usage, val: val as i32 }
        })
        .collect()
}

/// `slurm_spank_init`, every context. Always 0: in the remote context of a batch job a failure here
/// would drain the node.
pub fn init(sp: &mut impl SpankApi, argv: &[String]) -> i32 {
    for spec in option_specs() {
        if let Err(e) = sp.register_option(&spec) {
            sp.error(&format!("cannot register option --{}: {e}", spec.name));
        }
    }
    if sp.context() == Context::Slurmd {
        // slurmd's start is the admin's best chance to see a misconfigured plugstack.conf line.
        parse_args(sp, argv);
    }
    OK
}

/// The option callback. `remote` is 0 in sbatch/srun/salloc, where a bad value must refuse the
/// submission with a clear message; 1 in slurmstepd, where a non-zero return would silently drop the
/// option (Slurm then marks it unset), so it always succeeds there: the agent re-validates as root.
pub fn on_option(
    log: &impl Log,
    stage_in: &mut Vec<String>,
    val: i32,
    value: Option<&str>,
    remote: bool,
) -> i32 {
    if remote {
        return OK;
    }
    let Some(&name) = usize::try_from(val).ok().and_then(|i| names::ALL.get(i)) else {
        log.error(&format!(
            "internal error: option callback for unknown option number {val}"
        ));
        return FAIL;
    };
    let value = value.unwrap_or("");
    if let Err(e) = options::validate_option(name, value) {
        log.error(&e.to_string());
        return FAIL;
    }
    if name == names::STAGE_IN {
        stage_in.push(value.to_string());
    }
    OK
}

/// `slurm_spank_init_post_opt`. In sbatch/srun/salloc: checks all `--stage-in` values together (a
/// NAME used twice across repeated options, the total size) exactly as the agent will see them, and
/// hands them to job_prolog. Elsewhere: nothing (and 0, since remote failures drain nodes).
pub fn init_post_opt(sp: &mut impl SpankApi, stage_in: &[String]) -> i32 {
    if !matches!(sp.context(), Context::Allocator | Context::Local) || stage_in.is_empty() {
        return OK;
    }
    let joined = stage_in.join(",");
    if let Err(e) = options::parse_stage_in([joined.as_str()]) {
        sp.error(&e.to_string());
        return FAIL;
    }
    if let Err(e) = sp.job_control_setenv(STAGE_IN_JOB_VAR, &joined, true) {
        sp.error(&format!(
            "cannot pass --{} to the job: {e}",
            names::STAGE_IN
        ));
        return FAIL;
    }
    OK
}

/// Slurm's name for an option in environments: `_SLURM_SPANK_OPTION_<plugin>_<option>`, with
/// non-alphanumerics turned into '_' (`_SLURM_SPANK_OPTION_sluice_stage_in`).
fn slurm_option_var(option: &str) -> String {
    let canonical = |s: &str| {
        s.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
    };
    format!(
        "_SLURM_SPANK_OPTION_{}_{}",
        canonical(crate::PLUGIN_NAME),
        canonical(option)
    )
}

/// The environment variable under which job_prolog/job_epilog find an option: Slurm's variable with
/// the `SPANK_` prefix it gives every job-control variable in those scripts.
pub fn option_env_var(option: &str) -> String {
    format!("SPANK_{}", slurm_option_var(option))
}

/// The copy of an option that sbatch and salloc leave in the job's environment for the job's own
/// sruns (`SLURM_SPANK__SLURM_SPANK_OPTION_sluice_stage_in`).
pub fn job_env_option_var(option: &str) -> String {
    format!("SLURM_SPANK_{}", slurm_option_var(option))
}

/// The job's sluice options as job_prolog/job_epilog see them, raw, in the order of [`names::ALL`].
/// `--stage-in` comes from `SPANK_SLUICE_STAGE_IN` (every value) when set.
pub fn options_from_env(env: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    let nonempty = |v: &String| !v.is_empty();
    names::ALL
        .iter()
        .filter_map(|&name| {
            let value = match name {
                names::STAGE_IN => env(&format!("SPANK_{STAGE_IN_JOB_VAR}"))
                    .filter(nonempty)
                    .or_else(|| env(&option_env_var(name))),
                _ => env(&option_env_var(name)),
            };
            value.filter(nonempty).map(|v| (name.to_string(), v))
        })
        .collect()
}

/// `slurm_spank_job_prolog`: tells this node's agent that the job starts, so staging begins while
/// Slurm finishes launching. Always 0 — a non-zero return would drain the node. If the agent cannot
/// be told, the job fails later, in task_init, with the reason.
pub fn job_prolog(sp: &impl SpankApi, agent: &impl Agent, argv: &[String]) -> i32 {
    let options = options_from_env(|name| sp.process_env(name));
    if options.is_empty() {
        return OK;
    }
    let args = parse_args(sp, argv);
    let start = match job_start(sp, options) {
        Ok(start) => start,
        Err(e) => {
            sp.error(&format!("job_prolog: {e}; the job's tasks will fail"));
            return OK;
        }
    };
    let socket = args.socket_path(&start.node);
    let (job_id, node) = (start.job_id, start.node.clone());
    match agent.call(&socket, Request::JobStart(start), args.connect_timeout) {
        Ok(Response::Ok) => sp.verbose(&format!("job {job_id}: handed to the agent on {node}")),
        Ok(other) => sp.error(&format!(
            "job {job_id}: job_prolog got an unexpected reply from the agent at {}: {other:?}; the job's tasks will fail",
            socket.display()
        )),
        Err(e) => sp.error(&format!(
            "job {job_id}: job_prolog could not hand the job to the agent: {}; the job's tasks will fail",
            describe(&e, args.connect_timeout)
        )),
    }
    OK
}

fn job_start(sp: &impl SpankApi, options: Vec<(String, String)>) -> Result<JobStart, String> {
    let job_id = job_id(sp)?;
    let uid = env_u32(sp, "SLURM_JOB_UID")
        .or_else(|| sp.job_uid().ok())
        .ok_or_else(|| format!("job {job_id}: cannot tell the job's uid (SLURM_JOB_UID)"))?;
    let gid = env_u32(sp, "SLURM_JOB_GID")
        .or_else(|| sp.job_gid().ok())
        .ok_or_else(|| format!("job {job_id}: cannot tell the job's gid (SLURM_JOB_GID)"))?;
    let user = sp
        .process_env("SLURM_JOB_USER")
        .filter(|u| !u.is_empty())
        .ok_or_else(|| format!("job {job_id}: SLURM_JOB_USER is not set"))?;
    let node =
        node_name(sp).ok_or_else(|| format!("job {job_id}: cannot tell this node's name"))?;
    let nodes = match ["SLURM_NODELIST", "SLURM_JOB_NODELIST"]
        .iter()
        .find_map(|v| sp.process_env(v))
    {
        Some(list) if !list.trim().is_empty() => hostlist::expand(&list)
            .map_err(|e| format!("job {job_id}: cannot expand the job's node list: {e}"))?,
        _ => {
            sp.verbose(&format!(
                "job {job_id}: no SLURM_NODELIST; assuming a single-node job on {node}"
            ));
            vec![node.clone()]
        }
    };
    Ok(JobStart {
        job_id,
        uid,
        gid,
        user,
        node,
        nodes,
        job_name: sp.process_env("SLURM_JOB_NAME").unwrap_or_default(),
        options,
    })
}

/// `slurm_spank_task_init`, in each task as the job user, just before exec: waits until this node
/// staged the job, then exports its directories. A failure here fails the job without draining the
/// node, and its message lands in the job's output — where the user will look.
pub fn task_init(sp: &mut impl SpankApi, agent: &impl Agent, argv: &[String]) -> i32 {
    if !job_uses_sluice(sp) {
        return OK;
    }
    let args = parse_args(sp, argv);
    let job_id = match sp.job_id() {
        Ok(id) => id,
        Err(e) => {
            sp.error(&format!("cannot read the job id: {e}"));
            return FAIL;
        }
    };
    let Some(node) = node_name(sp) else {
        sp.error(&format!(
            "job {job_id}: cannot tell this node's name, so cannot find the sluice agent"
        ));
        return FAIL;
    };
    let socket = args.socket_path(&node);
    // The agent answers by the deadline; each socket waits a little longer so that its answer (a
    // clear "timed out" message) wins over a bare socket timeout. An agent that restarts meanwhile
    // resumes the job from its journal, so the task reconnects and keeps waiting.
    let wait = args.stage_timeout + args.connect_timeout;
    let deadline = Instant::now() + args.stage_timeout;
    // A step of its own (srun in an allocation, not the batch script) may add datasets.
    let step = step_start(sp, job_id, &node).map(Box::new);
    let answer = call_until(agent, &socket, deadline, args.connect_timeout, |left| {
        Request::WaitStaged {
            job_id,
            timeout_ms: left.as_millis() as u64,
            step: step.clone(),
        }
    });
    let dirs = match answer {
        Ok(Response::Ready(dirs)) => dirs,
        Ok(other) => {
            sp.error(&format!(
                "job {job_id}: unexpected reply from the sluice agent at {}: {other:?}",
                socket.display()
            ));
            return FAIL;
        }
        Err(e) => {
            sp.error(&describe(&e, wait));
            return FAIL;
        }
    };
    for (var, value) in [
        (STAGE_DIR_VAR, &dirs.stage_dir),
        (CKPT_DIR_VAR, &dirs.ckpt_dir),
    ] {
        if let Err(e) = sp.setenv(var, value, true) {
            sp.error(&format!(
                "job {job_id}: cannot set {var}={value} for the task: {e}"
            ));
            return FAIL;
        }
    }
    // The agent's extra variables (`SLUICE_SHARD_INDEX`, ...): sluice's own names only, so an
    // agent can never override a task's PATH or LD_PRELOAD.
    for (var, value) in dirs.env.iter().filter(|(v, _)| v.starts_with("SLUICE_")) {
        if let Err(e) = sp.setenv(var, value, true) {
            sp.error(&format!(
                "job {job_id}: cannot set {var}={value} for the task: {e}"
            ));
            return FAIL;
        }
    }
    if let Some(tag) = &dirs.restored_tag
        && let Err(e) = sp.setenv(RESTORED_TAG_VAR, tag, true)
    {
        sp.error(&format!(
            "job {job_id}: cannot set {RESTORED_TAG_VAR}={tag} for the task: {e}"
        ));
        return FAIL;
    }
    // Notes (e.g. a restore that fell back to an older checkpoint) go to the job output once per
    // node: from the node's first task only.
    if matches!(sp.getenv("SLURM_LOCALID"), Ok(Some(id)) if id == "0") {
        for note in &dirs.notes {
            sp.error(&format!("note: {note}"));
        }
        // What was staged, once per job: from the batch step (a failure to ask costs nothing but
        // the line).
        if sp.step_id() == Ok(BATCH_STEP)
            && let Ok(Response::Job(status)) =
                agent.call(&socket, Request::Job { job_id }, args.connect_timeout)
        {
            for line in summary::job_start(&status) {
                sp.report(&line);
            }
        }
    }
    OK
}

/// The task's step with its own sluice options, for a step other than the batch script (whose
/// options are the job's): the agent stages what they add. `None` when the step's identity cannot
/// be read (the agent then stages the job's datasets only, as for the batch script).
fn step_start(sp: &impl SpankApi, job_id: JobId, node: &str) -> Option<StepStart> {
    let step_id = sp.step_id().ok().filter(|&s| s != BATCH_STEP)?;
    let env = |name: &str| sp.getenv(name).ok().flatten().filter(|v| !v.is_empty());
    let options: Vec<(String, String)> = names::ALL
        .iter()
        .filter_map(|&name| match sp.getopt(name) {
            Ok(Some(v)) if !v.is_empty() => Some((name.to_string(), v)),
            _ => env(&job_env_option_var(name)).map(|v| (name.to_string(), v)),
        })
        .collect();
    let nodes = env("SLURM_STEP_NODELIST")
        .or_else(|| env("SLURM_JOB_NODELIST"))
        .and_then(|list| hostlist::expand(&list).ok())
        .unwrap_or_else(|| vec![node.to_string()]);
    Some(StepStart {
        step_id,
        start: JobStart {
            job_id,
            uid: sp.job_uid().ok()?,
            gid: sp.job_gid().ok()?,
            user: env("SLURM_JOB_USER").or_else(|| env("USER"))?,
            node: node.to_string(),
            nodes,
            job_name: env("SLURM_JOB_NAME").unwrap_or_default(),
            options,
        },
    })
}

/// Whether the job of this task used a sluice option, without asking the agent (jobs without
/// options must not depend on it). Slurm hands a batch job's options to slurmstepd in the job's
/// environment as `_SLURM_SPANK_OPTION_*`, which spank_option_getopt reads — but
/// `sbatch --export=NONE` drops those (seen on 22.05: the batch step then found no option and did not
/// wait). The `SLURM_SPANK_*` copies that sbatch also exports survive `--export=NONE`, so they count.
fn job_uses_sluice(sp: &impl SpankApi) -> bool {
    names::ALL.iter().any(|name| {
        matches!(sp.getopt(name), Ok(Some(_)))
            || matches!(sp.getenv(&job_env_option_var(name)), Ok(Some(v)) if !v.is_empty())
    })
}

/// The step id of a batch script (`SLURM_BATCH_SCRIPT` in slurm.h; 4294967291 as seen on 22.05).
pub const BATCH_STEP: u32 = 0xFFFF_FFFB;

/// `slurm_spank_exit` in the batch step's slurmstepd, once the batch script ended and before the
/// epilog: prints the job's checkpoint summary from this node's agent into the job's output (the
/// epilog's output reaches no user), once per job. What is archived, what continues after the job,
/// and every checkpoint sluice refused or gave up with the reason. Always 0.
pub fn exit(sp: &impl SpankApi, agent: &impl Agent, argv: &[String]) -> i32 {
    if sp.context() != Context::Remote || !job_uses_sluice(sp) {
        return OK;
    }
    if sp.step_id() != Ok(BATCH_STEP) {
        return OK;
    }
    let args = parse_args(sp, argv);
    let (Ok(job_id), Some(node)) = (sp.job_id(), node_name(sp)) else {
        return OK;
    };
    let socket = args.socket_path(&node);
    match agent.call(&socket, Request::Job { job_id }, args.connect_timeout) {
        Ok(Response::Job(status)) => {
            for line in summary::job_end(&status) {
                sp.report(&line);
            }
        }
        // A job the agent never saw (it failed before reaching it) has nothing to sum up.
        Err(ClientError::Agent(e)) if e.code == ErrorCode::NotFound => {}
        Ok(other) => sp.report(&format!(
            "job {job_id}: no checkpoint summary: unexpected reply from the agent at {}: {other:?}",
            socket.display()
        )),
        Err(e) => sp.report(&format!(
            "job {job_id}: no checkpoint summary (are the checkpoints archived? ask `sluice ckpt \
             list` later): {}",
            describe(&e, args.connect_timeout)
        )),
    }
    OK
}

/// `slurm_spank_job_epilog`: tells the agent the job ended, so it can archive and trim. Always 0.
pub fn job_epilog(sp: &impl SpankApi, agent: &impl Agent, argv: &[String]) -> i32 {
    if options_from_env(|name| sp.process_env(name)).is_empty() {
        return OK;
    }
    let args = parse_args(sp, argv);
    let job_id = match job_id(sp) {
        Ok(id) => id,
        Err(e) => {
            sp.error(&format!("job_epilog: {e}"));
            return OK;
        }
    };
    let Some(node) = node_name(sp) else {
        sp.error(&format!(
            "job {job_id}: job_epilog cannot tell this node's name"
        ));
        return OK;
    };
    let socket = args.socket_path(&node);
    let deadline = Instant::now() + args.epilog_timeout;
    match call_until(agent, &socket, deadline, Duration::ZERO, |_| {
        Request::JobEnd { job_id }
    }) {
        Ok(Response::Ok) => sp.verbose(&format!(
            "job {job_id}: end reported to the agent on {node}"
        )),
        Ok(other) => sp.error(&format!(
            "job {job_id}: job_epilog got an unexpected reply from the agent: {other:?}"
        )),
        Err(e) => sp.error(&format!(
            "job {job_id}: job_epilog could not report the job's end: {}",
            describe(&e, args.epilog_timeout)
        )),
    }
    OK
}

/// Parses the plugin arguments, logging (once per callback) what is wrong with them.
fn parse_args(log: &impl Log, argv: &[String]) -> Args {
    let (args, problems) = Args::parse(argv);
    for p in problems {
        log.error(&p);
    }
    args
}

fn env_u32(sp: &impl SpankApi, var: &str) -> Option<u32> {
    sp.process_env(var)?.trim().parse().ok()
}

/// The job id in job_prolog/job_epilog: `SLURM_JOB_ID`, else the SPANK item.
fn job_id(sp: &impl SpankApi) -> Result<JobId, String> {
    env_u32(sp, "SLURM_JOB_ID").map(Ok).unwrap_or_else(|| {
        sp.job_id()
            .map_err(|e| format!("cannot tell the job id (no SLURM_JOB_ID; spank: {e})"))
    })
}

/// This node's Slurm name, which keys the agent socket (several virtual nodes may share one host).
/// slurmd sets `SLURMD_NODENAME` in the environment of job_prolog/job_epilog and of slurmstepd; the
/// job's environment and the host name are fallbacks. A name that could steer the socket path
/// elsewhere ('/') is not used.
pub fn node_name(sp: &impl SpankApi) -> Option<String> {
    let usable = |n: &String| !n.is_empty() && !n.contains('/');
    sp.process_env("SLURMD_NODENAME")
        .filter(usable)
        .or_else(|| match sp.context() {
            Context::Remote => sp.getenv("SLURMD_NODENAME").ok().flatten().filter(usable),
            _ => None,
        })
        .or_else(|| {
            sp.hostname()
                .map(|h| h.split('.').next().unwrap_or_default().to_string())
                .filter(usable)
        })
}

/// A client error as one line for the user or admin: the agent's own message verbatim, a timeout
/// in words.
/// Pause between attempts to reach an agent that is not answering (restarting).
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Calls the agent, retrying transport failures (connection refused, reset or closed before the
/// answer: the agent is restarting) until `deadline`. `request` gets the time left. Each call waits
/// for its answer until the deadline plus `grace`.
fn call_until(
    agent: &impl Agent,
    socket: &std::path::Path,
    deadline: Instant,
    grace: Duration,
    request: impl Fn(Duration) -> Request,
) -> Result<Response, ClientError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let result = agent.call(
            socket,
            request(left),
            left.max(Duration::from_secs(1)) + grace,
        );
        let transport = match &result {
            Err(ClientError::Connect { .. }) => true,
            Err(ClientError::Frame {
                source: FrameError::Io(io),
                ..
            }) => !is_timeout(io),
            _ => false,
        };
        if !transport || Instant::now() + RETRY_PAUSE >= deadline {
            return result;
        }
        std::thread::sleep(RETRY_PAUSE);
    }
}

fn describe(e: &ClientError, waited: Duration) -> String {
    match e {
        ClientError::Agent(reply) => reply.message.clone(),
        ClientError::Frame {
            path,
            source: FrameError::Io(io),
        } if is_timeout(io) => format!(
            "the sluice agent at {} did not answer within {} s (is it overloaded or hung?)",
            path.display(),
            waited.as_secs()
        ),
        other => other.to_string(),
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests;
