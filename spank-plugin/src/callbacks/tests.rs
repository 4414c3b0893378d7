//! The callbacks against a fake SPANK handle and a fake agent.

use super::*;
use crate::api::SpankError;
use sluice_proto::msg::{ErrorCode, ErrorReply, JobDirs};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Report,
    Error,
    Info,
    Verbose,
    Debug,
}

/// A SPANK handle that answers from its fields and records what the callbacks did.
struct Fake {
    context: Context,
    /// Options the job used, as spank_option_getopt would return them.
    used: HashMap<String, String>,
    job_id: Result<u32, SpankError>,
    step_id: Result<u32, SpankError>,
    uid: Result<u32, SpankError>,
    gid: Result<u32, SpankError>,
    job_env: HashMap<String, String>,
    process_env: HashMap<String, String>,
    hostname: Option<String>,
    register_error: Option<SpankError>,
    setenv_error: Option<SpankError>,
    control_error: Option<SpankError>,
    registered: Vec<OptionSpec>,
    env_set: Vec<(String, String, bool)>,
    control_set: Vec<(String, String, bool)>,
    logs: RefCell<Vec<(Level, String)>>,
}

impl Fake {
    fn new(context: Context) -> Fake {
        Fake {
            context,
            used: HashMap::new(),
            job_id: Err(SpankError::NotAvail),
            step_id: Err(SpankError::NotAvail),
            uid: Err(SpankError::NotAvail),
            gid: Err(SpankError::NotAvail),
            job_env: HashMap::new(),
            process_env: HashMap::new(),
            hostname: Some("host.example.org".into()),
            register_error: None,
            setenv_error: None,
            control_error: None,
            registered: Vec::new(),
            env_set: Vec::new(),
            control_set: Vec::new(),
            logs: RefCell::default(),
        }
    }

    /// job_prolog/job_epilog as slurmd runs them for job 42 of alice on n2 of n[1-3].
    fn job_script(options: &[(&str, &str)]) -> Fake {
        let mut fake = Fake::new(Context::JobScript);
        fake.job_id = Ok(42);
        fake.uid = Ok(1000);
        fake.gid = Ok(1000);
        for (k, v) in [
            ("SLURM_JOB_ID", "42"),
            ("SLURM_JOB_UID", "1001"),
            ("SLURM_JOB_GID", "1002"),
            ("SLURM_JOB_USER", "alice"),
            ("SLURMD_NODENAME", "n2"),
            ("SLURM_NODELIST", "n[1-3]"),
            ("SLURM_SCRIPT_CONTEXT", "prolog_slurmd"),
        ]
        .into_iter()
        .chain(options.iter().copied())
        {
            fake.process_env.insert(k.into(), v.into());
        }
        fake
    }

    /// A task of job 42 on n2, in slurmstepd, that used `options` (name, value).
    fn task(options: &[(&str, &str)]) -> Fake {
        let mut fake = Fake::new(Context::Remote);
        fake.job_id = Ok(42);
        fake.process_env
            .insert("SLURMD_NODENAME".into(), "n2".into());
        fake.used = options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        fake
    }

    fn lines(&self, level: Level) -> Vec<String> {
        self.logs
            .borrow()
            .iter()
            .filter(|(l, _)| *l == level)
            .map(|(_, m)| m.clone())
            .collect()
    }

    fn errors(&self) -> Vec<String> {
        self.lines(Level::Error)
    }

    /// The first error line, which must be there.
    #[track_caller]
    fn first_error(&self) -> String {
        let errors = self.errors();
        assert!(
            !errors.is_empty(),
            "no error logged: {:?}",
            self.logs.borrow()
        );
        errors[0].clone()
    }

    /// Asserts that the first error line holds `part` (showing every error line when not).
    #[track_caller]
    fn assert_first_error_has(&self, part: &str) {
        let first = self.first_error();
        assert!(
            first.contains(part),
            "{part:?} is not in {:?}",
            self.errors()
        );
    }

    fn log(&self, level: Level, msg: &str) {
        self.logs.borrow_mut().push((level, msg.to_string()));
    }
}

impl Log for Fake {
    fn report(&self, msg: &str) {
        self.log(Level::Report, msg)
    }
    fn error(&self, msg: &str) {
        self.log(Level::Error, msg)
    }
    fn info(&self, msg: &str) {
        self.log(Level::Info, msg)
    }
    fn verbose(&self, msg: &str) {
        self.log(Level::Verbose, msg)
    }
    fn debug(&self, msg: &str) {
        self.log(Level::Debug, msg)
    }
}

impl SpankApi for Fake {
    fn context(&self) -> Context {
        self.context
    }
    fn register_option(&mut self, opt: &OptionSpec) -> Result<(), SpankError> {
        self.registered.push(opt.clone());
        self.register_error.map_or(Ok(()), Err)
    }
    fn getopt(&self, name: &str) -> Result<Option<String>, SpankError> {
        match self.context {
            // As observed on 22.05: getopt fails in job_prolog/job_epilog.
            Context::JobScript => Err(SpankError::Error),
            _ => Ok(self.used.get(name).cloned()),
        }
    }
    fn job_id(&self) -> Result<u32, SpankError> {
        self.job_id
    }
    fn step_id(&self) -> Result<u32, SpankError> {
        self.step_id
    }
    fn job_uid(&self) -> Result<u32, SpankError> {
        self.uid
    }
    fn job_gid(&self) -> Result<u32, SpankError> {
        self.gid
    }
    fn getenv(&self, name: &str) -> Result<Option<String>, SpankError> {
        match self.context {
            Context::Remote => Ok(self.job_env.get(name).cloned()),
            _ => Err(SpankError::NotRemote),
        }
    }
    fn setenv(&mut self, name: &str, value: &str, overwrite: bool) -> Result<(), SpankError> {
        if let Some(e) = self.setenv_error {
            return Err(e);
        }
        self.env_set.push((name.into(), value.into(), overwrite));
        Ok(())
    }
    fn job_control_setenv(
        &mut self,
        name: &str,
        value: &str,
        overwrite: bool,
    ) -> Result<(), SpankError> {
        if let Some(e) = self.control_error {
            return Err(e);
        }
        self.control_set
            .push((name.into(), value.into(), overwrite));
        Ok(())
    }
    fn process_env(&self, name: &str) -> Option<String> {
        self.process_env.get(name).cloned()
    }
    fn hostname(&self) -> Option<String> {
        self.hostname.clone()
    }
}

type Reply = Box<dyn Fn(&Request) -> Result<Response, ClientError>>;

/// An agent that records every call and answers with `reply`.
struct FakeAgent {
    calls: RefCell<Vec<(PathBuf, Request, Duration)>>,
    reply: Reply,
}

impl FakeAgent {
    fn answering(reply: impl Fn(&Request) -> Result<Response, ClientError> + 'static) -> FakeAgent {
        FakeAgent {
            calls: RefCell::default(),
            reply: Box::new(reply),
        }
    }

    fn ok() -> FakeAgent {
        FakeAgent::answering(|_| Ok(Response::Ok))
    }

    fn ready() -> FakeAgent {
        FakeAgent::answering(|_| Ok(ready()))
    }

    fn failing(code: ErrorCode, message: &'static str) -> FakeAgent {
        FakeAgent::answering(move |_| Err(ClientError::Agent(ErrorReply::new(code, message))))
    }

    fn unreachable() -> FakeAgent {
        FakeAgent::answering(|_| Err(cannot_connect(io::ErrorKind::NotFound)))
    }

    fn calls(&self) -> Vec<(PathBuf, Request, Duration)> {
        self.calls.borrow().clone()
    }
}

impl Agent for FakeAgent {
    fn call(
        &self,
        socket: &Path,
        request: Request,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let reply = (self.reply)(&request);
        self.calls
            .borrow_mut()
            .push((socket.to_path_buf(), request, timeout));
        reply
    }
}

/// The agent's answer to a task whose data is staged: job 42's directories on n2.
fn ready() -> Response {
    Response::Ready(JobDirs {
        stage_dir: "/nvme/sluice/n2/jobs/42/stage".into(),
        ckpt_dir: "/nvme/sluice/n2/jobs/42/ckpt".into(),
        restored_tag: None,
        notes: Vec::new(),
        env: Vec::new(),
    })
}

/// Connecting to n2's agent failed with `kind`.
fn cannot_connect(kind: io::ErrorKind) -> ClientError {
    ClientError::Connect {
        path: "/run/sluice/n2.sock".into(),
        source: io::Error::from(kind),
    }
}

/// The connection to n2's agent broke off (or timed out) with `kind`.
fn broken_off(kind: io::ErrorKind) -> ClientError {
    ClientError::Frame {
        path: "/run/sluice/n2.sock".into(),
        source: FrameError::Io(io::Error::from(kind)),
    }
}

fn argv(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

const STAGE_IN_VAR: &str = "SPANK__SLURM_SPANK_OPTION_sluice_stage_in";

// ---- init and options -------------------------------------------------------------------------

#[test]
fn init_registers_all_seven_options_with_their_accepted_values() {
    let mut sp = Fake::new(Context::Allocator);
    assert_eq!(init(&mut sp, &[]), OK);
    let names: Vec<_> = sp.registered.iter().map(|o| o.name).collect();
    assert_eq!(names, names::ALL);
    for (i, opt) in sp.registered.iter().enumerate() {
        assert_eq!(
            opt.val, i as i32,
            "--{} must map back to its name in the callback",
            opt.name
        );
        assert!(opt.usage.starts_with("sluice: "), "{}", opt.usage);
    }
    let by_name = |n: &str| sp.registered.iter().find(|o| o.name == n).unwrap().clone();
    assert_eq!(by_name("stage-tier").arginfo, "local|shared");
    assert!(
        by_name("stage-tier").usage.contains("local")
            && by_name("stage-tier").usage.contains("shared")
    );
    assert_eq!(by_name("stage-mode").arginfo, "replicate|shard");
    assert_eq!(by_name("ckpt-tier").arginfo, "local|ram");
    assert_eq!(by_name("ckpt-restore").arginfo, "latest|TAG");
    assert!(
        by_name("stage-in").usage.contains("s3://") && by_name("stage-in").usage.contains("/path")
    );
    assert!(by_name("ckpt-keep").usage.contains("1-1000"));
    assert!(sp.errors().is_empty());
}

#[test]
fn init_never_fails_even_when_registration_does() {
    for context in [Context::Remote, Context::Allocator, Context::Slurmd] {
        let mut sp = Fake::new(context);
        sp.register_error = Some(SpankError::BadArg);
        assert_eq!(
            init(&mut sp, &[]),
            OK,
            "a failing init in {context:?} could drain the node"
        );
        assert_eq!(sp.errors().len(), names::ALL.len());
        sp.assert_first_error_has("cannot register option --stage-in");
    }
}

#[test]
fn slurmd_init_reports_a_misconfigured_plugstack_line_and_tasks_stay_quiet_about_it() {
    let mut sp = Fake::new(Context::Slurmd);
    init(&mut sp, &argv(&["sokcet=/x"]));
    assert_eq!(sp.errors().len(), 1);
    sp.assert_first_error_has("unknown plugin argument 'sokcet=/x'");
    let mut sp = Fake::new(Context::Allocator);
    init(&mut sp, &argv(&["sokcet=/x"]));
    assert!(
        sp.errors().is_empty(),
        "users of sbatch cannot fix plugstack.conf"
    );
}

fn val_of(name: &str) -> i32 {
    names::ALL.iter().position(|n| *n == name).unwrap() as i32
}

#[test]
fn bad_option_values_are_refused_at_submit_with_the_reason() {
    let log = Fake::new(Context::Allocator);
    let mut acc = Vec::new();
    for (name, value) in [
        ("stage-tier", Some("nvme")),
        (names::STAGE_IN, Some("data/x")),
        ("ckpt-keep", Some("0")),
        ("ckpt-keep", None),
    ] {
        let got = on_option(&log, &mut acc, val_of(name), value, false);
        assert_eq!(got, FAIL, "--{name} {value:?}");
    }
    let errors = log.errors();
    assert_eq!(errors.len(), 4);
    assert!(
        errors[0]
            .starts_with("--stage-tier: unknown tier 'nvme'; accepted: local (default), shared"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].starts_with("--stage-in: ") && errors[1].contains("relative path"),
        "{}",
        errors[1]
    );
    assert!(errors[2].contains("out of range"), "{}", errors[2]);
    assert!(acc.is_empty(), "refused values are not forwarded");
}

#[test]
fn good_values_pass_and_every_stage_in_is_kept() {
    let log = Fake::new(Context::Allocator);
    let mut acc = Vec::new();
    for (name, value) in [
        (names::STAGE_IN, "/lustre/a"),
        ("stage-tier", "shared"),
        (names::STAGE_IN, "w=s3://b/weights,/lustre/c"),
        ("ckpt-restore", "latest"),
    ] {
        let got = on_option(&log, &mut acc, val_of(name), Some(value), false);
        assert_eq!(got, OK, "--{name} {value}");
    }
    assert_eq!(acc, ["/lustre/a", "w=s3://b/weights,/lustre/c"]);
    assert!(log.errors().is_empty());
}

#[test]
fn on_the_remote_side_options_always_pass() {
    // A non-zero return in slurmstepd makes Slurm treat the option as unset: the job would then run
    // without waiting for its data. The agent re-validates as root instead.
    let log = Fake::new(Context::Remote);
    let mut acc = Vec::new();
    assert_eq!(
        on_option(&log, &mut acc, val_of("stage-tier"), Some("nvme"), true),
        OK
    );
    assert_eq!(on_option(&log, &mut acc, 99, Some("x"), true), OK);
    assert!(acc.is_empty() && log.errors().is_empty());
}

#[test]
fn an_unknown_option_number_is_refused() {
    let log = Fake::new(Context::Allocator);
    let past_the_last = names::ALL.len() as i32;
    assert_eq!(
        on_option(&log, &mut Vec::new(), past_the_last, Some("x"), false),
        FAIL
    );
    assert_eq!(on_option(&log, &mut Vec::new(), -1, Some("x"), false), FAIL);
    assert!(log.errors()[0].contains(&format!("unknown option number {past_the_last}")));
}

// ---- init_post_opt ----------------------------------------------------------------------------

#[test]
fn all_stage_in_values_reach_the_prolog_joined() {
    for context in [Context::Allocator, Context::Local] {
        let mut sp = Fake::new(context);
        assert_eq!(
            init_post_opt(&mut sp, &argv(&["/lustre/a", "w=s3://b/weights,/lustre/c"])),
            OK
        );
        assert_eq!(
            sp.control_set,
            [(
                "SLUICE_STAGE_IN".into(),
                "/lustre/a,w=s3://b/weights,/lustre/c".into(),
                true
            )]
        );
        assert!(sp.errors().is_empty());
    }
}

#[test]
fn a_name_used_twice_across_repeated_options_is_refused() {
    let mut sp = Fake::new(Context::Allocator);
    assert_eq!(
        init_post_opt(&mut sp, &argv(&["/lustre/a/data", "s3://b/data"])),
        FAIL
    );
    sp.assert_first_error_has("dataset NAME 'data' is used twice");
    assert!(sp.control_set.is_empty());
}

#[test]
fn values_too_long_together_are_refused_at_submit_not_by_the_agent() {
    let long = format!("/{}", "a".repeat(options::MAX_NAME_LEN - 1));
    let values: Vec<String> = (0..40).map(|i| format!("d{i}={long}")).collect();
    let mut sp = Fake::new(Context::Allocator);
    assert_eq!(init_post_opt(&mut sp, &values), FAIL);
    sp.assert_first_error_has("at most 4096");
}

#[test]
fn post_opt_does_nothing_without_stage_in_or_outside_the_submitting_command() {
    let mut sp = Fake::new(Context::Allocator);
    assert_eq!(init_post_opt(&mut sp, &[]), OK);
    assert!(sp.control_set.is_empty());
    for context in [Context::Remote, Context::Slurmd, Context::JobScript] {
        let mut sp = Fake::new(context);
        assert_eq!(init_post_opt(&mut sp, &argv(&["/a/x", "/b/x"])), OK);
        assert!(sp.control_set.is_empty() && sp.errors().is_empty());
    }
}

#[test]
fn post_opt_fails_the_submission_when_slurm_refuses_the_variable() {
    let mut sp = Fake::new(Context::Allocator);
    sp.control_error = Some(SpankError::BadArg);
    assert_eq!(init_post_opt(&mut sp, &argv(&["/a/x"])), FAIL);
    sp.assert_first_error_has("cannot pass --stage-in to the job");
}

// ---- reading options in job_script context ----------------------------------------------------

#[test]
fn option_variables_follow_slurms_naming() {
    assert_eq!(option_env_var("stage-in"), STAGE_IN_VAR);
    assert_eq!(
        option_env_var("ckpt-keep"),
        "SPANK__SLURM_SPANK_OPTION_sluice_ckpt_keep"
    );
}

#[test]
fn prolog_reads_every_stage_in_value_and_the_other_options() {
    let env: HashMap<String, String> = [
        ("SPANK_SLUICE_STAGE_IN", "/a/x,y=/b/y"),
        (STAGE_IN_VAR, "y=/b/y"),
        ("SPANK__SLURM_SPANK_OPTION_sluice_stage_tier", "shared"),
        ("SPANK__SLURM_SPANK_OPTION_sluice_ckpt_restore", "latest"),
        ("SPANK__SLURM_SPANK_OPTION_other_stage_mode", "shard"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let got = options_from_env(|n| env.get(n).cloned());
    let want = [
        ("stage-in", "/a/x,y=/b/y"),
        ("stage-tier", "shared"),
        ("ckpt-restore", "latest"),
    ];
    assert_eq!(got, want.map(|(k, v)| (k.to_string(), v.to_string())));

    // Without the joined variable (e.g. a job submitted through an interface that skipped
    // init_post_opt), Slurm's own variable still carries the last value.
    let got = options_from_env(|n| (n == STAGE_IN_VAR).then(|| "/c/z".to_string()));
    assert_eq!(got, [("stage-in".to_string(), "/c/z".to_string())]);
    assert!(options_from_env(|_| None).is_empty());
    assert!(options_from_env(|_| Some(String::new())).is_empty());
}

// ---- job_prolog -------------------------------------------------------------------------------

#[test]
fn a_job_without_sluice_options_never_reaches_the_agent() {
    let sp = Fake::job_script(&[]);
    let agent = FakeAgent::unreachable();
    assert_eq!(job_prolog(&sp, &agent, &argv(&["bogus"])), OK);
    assert_eq!(job_epilog(&sp, &agent, &argv(&["bogus"])), OK);
    let mut task = Fake::task(&[]);
    assert_eq!(task_init(&mut task, &agent, &argv(&["bogus"])), OK);
    assert!(agent.calls().is_empty());
    assert!(
        sp.logs.borrow().is_empty() && task.logs.borrow().is_empty(),
        "not even a log line"
    );
    assert!(task.env_set.is_empty());
}

#[test]
fn prolog_hands_the_whole_job_to_this_nodes_agent() {
    let sp = Fake::job_script(&[
        ("SPANK_SLUICE_STAGE_IN", "/lustre/a,w=s3://b/weights"),
        (STAGE_IN_VAR, "w=s3://b/weights"),
        ("SPANK__SLURM_SPANK_OPTION_sluice_ckpt_keep", "2"),
    ]);
    let agent = FakeAgent::ok();
    assert_eq!(
        job_prolog(
            &sp,
            &agent,
            &argv(&["socket=/tmp/s/%n.sock", "connect_timeout=4"])
        ),
        OK
    );
    let calls = agent.calls();
    assert_eq!(calls.len(), 1);
    let (socket, request, timeout) = &calls[0];
    assert_eq!(socket, &PathBuf::from("/tmp/s/n2.sock"));
    assert_eq!(*timeout, Duration::from_secs(4));
    let want = JobStart {
        job_id: 42,
        uid: 1001,
        gid: 1002,
        user: "alice".into(),
        node: "n2".into(),
        nodes: vec!["n1".into(), "n2".into(), "n3".into()],
        job_name: String::new(),
        options: vec![
            ("stage-in".into(), "/lustre/a,w=s3://b/weights".into()),
            ("ckpt-keep".into(), "2".into()),
        ],
    };
    assert_eq!(request, &Request::JobStart(want));
    assert!(sp.errors().is_empty(), "{:?}", sp.errors());
}

#[test]
fn prolog_forwards_even_invalid_values_for_the_agent_to_judge() {
    // The agent validates as root and fails the job with the reason; the prolog must not drop them.
    let sp = Fake::job_script(&[("SPANK__SLURM_SPANK_OPTION_sluice_stage_tier", "nvme")]);
    let agent = FakeAgent::ok();
    job_prolog(&sp, &agent, &[]);
    match &agent.calls()[0].1 {
        Request::JobStart(start) => assert_eq!(
            start.options,
            [("stage-tier".to_string(), "nvme".to_string())]
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn prolog_falls_back_to_spank_items_and_the_job_nodelist() {
    let mut sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
    for var in [
        "SLURM_JOB_ID",
        "SLURM_JOB_UID",
        "SLURM_JOB_GID",
        "SLURM_NODELIST",
    ] {
        sp.process_env.remove(var);
    }
    sp.process_env
        .insert("SLURM_JOB_NODELIST".into(), "gpu[01-02]".into());
    let agent = FakeAgent::ok();
    job_prolog(&sp, &agent, &[]);
    match &agent.calls()[0].1 {
        Request::JobStart(start) => {
            assert_eq!((start.job_id, start.uid, start.gid), (42, 1000, 1000));
            assert_eq!(start.nodes, ["gpu01", "gpu02"]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_single_node_job_without_a_nodelist_is_this_node() {
    let mut sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
    sp.process_env.remove("SLURM_NODELIST");
    let agent = FakeAgent::ok();
    job_prolog(&sp, &agent, &[]);
    match &agent.calls()[0].1 {
        Request::JobStart(start) => assert_eq!(start.nodes, ["n2"]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn prolog_failures_are_logged_and_never_drain_the_node() {
    let cases: Vec<(FakeAgent, &str)> = vec![
        (
            FakeAgent::unreachable(),
            "cannot reach the sluice agent at /run/sluice/n2.sock",
        ),
        (
            FakeAgent::failing(ErrorCode::Internal, "journal is not writable"),
            "journal is not writable",
        ),
        (
            FakeAgent::answering(|_| Ok(Response::Status(empty_status()))),
            "unexpected reply",
        ),
    ];
    for (agent, needle) in cases {
        let sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
        assert_eq!(job_prolog(&sp, &agent, &[]), OK);
        let errors = sp.errors();
        let [error] = &errors[..] else {
            panic!("one error line expected: {errors:?}")
        };
        assert!(
            error.starts_with("job 42: job_prolog")
                && error.contains(needle)
                && error.ends_with("the job's tasks will fail"),
            "{error}"
        );
    }
}

#[test]
fn prolog_does_not_guess_when_the_job_is_unclear() {
    type MakeUnclear = fn(&mut Fake);
    let cases: [(MakeUnclear, &str); 3] = [
        (
            |sp| {
                sp.process_env
                    .insert("SLURM_NODELIST".into(), "n[1-".into());
            },
            "cannot expand the job's node list",
        ),
        (
            |sp| {
                sp.process_env.remove("SLURM_JOB_USER");
            },
            "SLURM_JOB_USER is not set",
        ),
        (
            |sp| {
                sp.process_env.remove("SLURM_JOB_ID");
                sp.job_id = Err(SpankError::NotAvail);
            },
            "cannot tell the job id",
        ),
    ];
    for (make_unclear, reason) in cases {
        let mut sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
        make_unclear(&mut sp);
        let agent = FakeAgent::ok();
        assert_eq!(job_prolog(&sp, &agent, &[]), OK);
        assert!(agent.calls().is_empty(), "{reason}");
        sp.assert_first_error_has(reason);
    }
}

fn empty_status() -> sluice_proto::msg::NodeStatus {
    sluice_proto::msg::NodeStatus {
        node: "n2".into(),
        agent_version: "0".into(),
        hot_root: "/".into(),
        hot_total_bytes: 0,
        hot_free_bytes: 0,
        hot_used_bytes: 0,
        cache: None,
        workers: Vec::new(),
        jobs: vec![],
    }
}

// ---- task_init --------------------------------------------------------------------------------

#[test]
fn a_task_waits_for_staging_and_sees_its_directories() {
    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    let agent = FakeAgent::ready();
    assert_eq!(
        task_init(
            &mut sp,
            &agent,
            &argv(&["stage_timeout=600", "connect_timeout=5"])
        ),
        OK
    );
    let calls = agent.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, PathBuf::from("/run/sluice/n2.sock"));
    // The agent gets the time left of stage_timeout (a few ms may have passed).
    let Request::WaitStaged {
        job_id: 42,
        timeout_ms,
        ..
    } = calls[0].1
    else {
        panic!("{:?}", calls[0].1)
    };
    assert!((599_000..=600_000).contains(&timeout_ms), "{timeout_ms}");
    assert!(
        calls[0].2 > Duration::from_millis(timeout_ms) + Duration::from_secs(4),
        "the socket outwaits the agent's own deadline: {:?}",
        calls[0].2
    );
    assert_eq!(
        sp.env_set,
        [
            (
                "SLUICE_STAGE_DIR".into(),
                "/nvme/sluice/n2/jobs/42/stage".into(),
                true
            ),
            (
                "SLUICE_CKPT_DIR".into(),
                "/nvme/sluice/n2/jobs/42/ckpt".into(),
                true
            ),
        ]
    );
    assert!(sp.errors().is_empty());
}

#[test]
fn a_step_of_its_own_sends_its_options_and_nodes_and_the_batch_step_does_not() {
    let mut sp = Fake::task(&[("stage-in", "extra=s3://b/x")]);
    sp.step_id = Ok(3);
    sp.uid = Ok(1000);
    sp.gid = Ok(100);
    for (k, v) in [
        ("SLURM_STEP_NODELIST", "n[2-3]"),
        ("SLURM_JOB_USER", "alice"),
        ("SLURM_JOB_NAME", "train"),
    ] {
        sp.job_env.insert(k.into(), v.into());
    }
    let agent = FakeAgent::ready();
    assert_eq!(task_init(&mut sp, &agent, &[]), OK);
    let Request::WaitStaged {
        step: Some(step), ..
    } = &agent.calls()[0].1
    else {
        panic!("no step in {:?}", agent.calls()[0].1)
    };
    assert_eq!(step.step_id, 3);
    assert_eq!(
        (
            step.start.job_id,
            step.start.uid,
            step.start.gid,
            step.start.user.as_str()
        ),
        (42, 1000, 100, "alice")
    );
    assert_eq!(step.start.nodes, ["n2", "n3"]);
    assert_eq!(step.start.node, "n2");
    assert_eq!(
        step.start.options,
        [("stage-in".to_string(), "extra=s3://b/x".to_string())]
    );

    let mut batch = Fake::task(&[("stage-in", "s3://b/x")]);
    batch.step_id = Ok(BATCH_STEP);
    let agent = FakeAgent::ready();
    assert_eq!(task_init(&mut batch, &agent, &[]), OK);
    assert!(matches!(
        agent.calls()[0].1,
        Request::WaitStaged { step: None, .. }
    ));
}

#[test]
fn a_shard_jobs_tasks_get_the_agents_sluice_variables_and_no_others() {
    let mut sp = Fake::task(&[("stage-mode", "shard")]);
    let agent = FakeAgent::answering(|_| {
        let Response::Ready(mut dirs) = ready() else {
            unreachable!()
        };
        dirs.env = vec![
            ("SLUICE_SHARD_INDEX".into(), "1".into()),
            ("SLUICE_SHARD_COUNT".into(), "3".into()),
            ("LD_PRELOAD".into(), "/tmp/evil.so".into()),
        ];
        Ok(Response::Ready(dirs))
    });
    assert_eq!(task_init(&mut sp, &agent, &[]), OK);
    let set: Vec<&str> = sp.env_set.iter().map(|(k, _, _)| k.as_str()).collect();
    assert_eq!(
        set,
        [
            "SLUICE_STAGE_DIR",
            "SLUICE_CKPT_DIR",
            "SLUICE_SHARD_INDEX",
            "SLUICE_SHARD_COUNT"
        ]
    );
    assert_eq!(sp.env_set[2].1, "1");
}

#[test]
fn any_sluice_option_makes_a_task_wait() {
    for name in names::ALL {
        let mut sp = Fake::task(&[(name, "x")]);
        let agent = FakeAgent::ready();
        assert_eq!(task_init(&mut sp, &agent, &[]), OK);
        assert_eq!(agent.calls().len(), 1, "--{name}");
    }
}

#[test]
fn a_failed_stage_in_fails_the_job_with_the_agents_words() {
    let msg = "dataset s3://b/missing not found — check the path; the job was not started";
    let mut sp = Fake::task(&[("stage-in", "s3://b/missing")]);
    assert_eq!(
        task_init(
            &mut sp,
            &FakeAgent::failing(ErrorCode::StageFailed, msg),
            &[]
        ),
        FAIL
    );
    assert_eq!(sp.errors(), [msg]);
    assert!(sp.env_set.is_empty());
}

#[test]
fn task_init_fails_the_job_when_the_agent_is_missing_or_silent() {
    // An agent that stays unreachable (not merely restarting) fails the job at stage_timeout,
    // after the task kept trying to reconnect.
    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    let unreachable = FakeAgent::unreachable();
    assert_eq!(
        task_init(&mut sp, &unreachable, &argv(&["stage_timeout=2"])),
        FAIL
    );
    assert!(unreachable.calls().len() >= 2, "no reconnect attempt");
    sp.assert_first_error_has("cannot reach the sluice agent at /run/sluice/n2.sock");

    let silent = FakeAgent::answering(|_| Err(broken_off(io::ErrorKind::WouldBlock)));
    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    assert_eq!(
        task_init(
            &mut sp,
            &silent,
            &argv(&["stage_timeout=60", "connect_timeout=2"])
        ),
        FAIL
    );
    assert_eq!(
        sp.errors(),
        [
            "the sluice agent at /run/sluice/n2.sock did not answer within 62 s (is it overloaded or hung?)"
        ]
    );

    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    assert_eq!(task_init(&mut sp, &FakeAgent::ok(), &[]), FAIL);
    sp.assert_first_error_has("unexpected reply");
}

#[test]
fn task_init_fails_the_job_when_slurm_will_not_set_the_variables() {
    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    sp.setenv_error = Some(SpankError::NotRemote);
    assert_eq!(task_init(&mut sp, &FakeAgent::ready(), &[]), FAIL);
    assert!(
        sp.first_error()
            .starts_with("job 42: cannot set SLUICE_STAGE_DIR="),
        "{:?}",
        sp.errors()
    );

    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    sp.job_id = Err(SpankError::NotAvail);
    let agent = FakeAgent::ready();
    assert_eq!(task_init(&mut sp, &agent, &[]), FAIL);
    assert!(agent.calls().is_empty());
    sp.assert_first_error_has("cannot read the job id");
}

// ---- node names -------------------------------------------------------------------------------

#[test]
fn the_node_name_comes_from_slurm_first_and_the_host_name_last() {
    let mut sp = Fake::task(&[]);
    assert_eq!(node_name(&sp).as_deref(), Some("n2"));
    sp.process_env.clear();
    sp.job_env.insert("SLURMD_NODENAME".into(), "n3".into());
    assert_eq!(node_name(&sp).as_deref(), Some("n3"));
    sp.job_env
        .insert("SLURMD_NODENAME".into(), "../../tmp/evil".into());
    assert_eq!(
        node_name(&sp).as_deref(),
        Some("host"),
        "a name with '/' could point the socket elsewhere"
    );
    sp.job_env.clear();
    sp.hostname = None;
    assert_eq!(node_name(&sp), None);

    // The job's environment is only consulted in slurmstepd.
    let mut sp = Fake::job_script(&[]);
    sp.process_env.remove("SLURMD_NODENAME");
    assert_eq!(node_name(&sp).as_deref(), Some("host"));
}

#[test]
fn each_virtual_node_talks_to_its_own_agent() {
    for node in ["n1", "n2", "n3"] {
        let mut sp = Fake::task(&[("stage-in", "/a/x")]);
        sp.process_env.insert("SLURMD_NODENAME".into(), node.into());
        let agent = FakeAgent::ready();
        task_init(&mut sp, &agent, &argv(&["socket=/run/sluice/%n.sock"]));
        assert_eq!(
            agent.calls()[0].0,
            PathBuf::from(format!("/run/sluice/{node}.sock"))
        );
    }
}

#[test]
fn a_task_without_a_node_name_fails_the_job_not_the_node() {
    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    sp.process_env.clear();
    sp.hostname = None;
    assert_eq!(task_init(&mut sp, &FakeAgent::ready(), &[]), FAIL);
    sp.assert_first_error_has("cannot tell this node's name");
}

// ---- job_epilog -------------------------------------------------------------------------------

#[test]
fn epilog_reports_the_end_of_a_sluice_job() {
    let sp = Fake::job_script(&[(
        "SPANK__SLURM_SPANK_OPTION_sluice_ckpt_archive",
        "s3://ckpt/alice",
    )]);
    let agent = FakeAgent::ok();
    assert_eq!(job_epilog(&sp, &agent, &argv(&["epilog_timeout=12"])), OK);
    let calls = agent.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, PathBuf::from("/run/sluice/n2.sock"));
    assert_eq!(calls[0].1, Request::JobEnd { job_id: 42 });
    assert!(calls[0].2 <= Duration::from_secs(12) && calls[0].2 > Duration::from_secs(11));
    assert!(sp.errors().is_empty());
}

#[test]
fn epilog_failures_are_logged_and_never_drain_the_node() {
    let sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
    assert_eq!(
        job_epilog(&sp, &FakeAgent::unreachable(), &argv(&["epilog_timeout=1"])),
        OK
    );
    assert!(
        sp.first_error()
            .starts_with("job 42: job_epilog could not report the job's end: cannot reach"),
        "{:?}",
        sp.errors()
    );

    let sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
    assert_eq!(
        job_epilog(
            &sp,
            &FakeAgent::failing(ErrorCode::NotFound, "no job 42 on n2"),
            &[]
        ),
        OK
    );
    assert!(
        sp.first_error().ends_with("no job 42 on n2"),
        "{:?}",
        sp.errors()
    );
}

#[test]
fn bad_plugin_arguments_are_logged_and_the_defaults_used() {
    let sp = Fake::job_script(&[(STAGE_IN_VAR, "/a/x")]);
    let agent = FakeAgent::ok();
    job_prolog(&sp, &agent, &argv(&["connect_timeout=soon", "colour=blue"]));
    assert_eq!(agent.calls()[0].2, Duration::from_secs(10));
    let errors = sp.errors();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[1].contains("unknown plugin argument 'colour=blue'"));
    // Verbose success lines do not count as errors.
    assert_eq!(sp.lines(Level::Verbose).len(), 1);
    assert!(sp.lines(Level::Info).is_empty() && sp.lines(Level::Debug).is_empty());
}

// ---- sbatch --export=NONE ---------------------------------------------------------------------

#[test]
fn a_batch_job_submitted_with_export_none_still_waits_for_its_data() {
    // Slurm 22.05 drops the options from the batch step with --export=NONE (getopt finds nothing),
    // but the SLURM_SPANK_* copies sbatch exports survive.
    let mut sp = Fake::task(&[]);
    sp.job_env
        .insert(job_env_option_var("stage-in"), "/lustre/a".into());
    let agent = FakeAgent::ready();
    assert_eq!(task_init(&mut sp, &agent, &[]), OK);
    assert_eq!(agent.calls().len(), 1);
    assert_eq!(sp.env_set.len(), 2, "{:?}", sp.env_set);
}

#[test]
fn other_plugins_options_in_the_job_environment_do_not_count() {
    assert_eq!(
        job_env_option_var("ckpt-keep"),
        "SLURM_SPANK__SLURM_SPANK_OPTION_sluice_ckpt_keep"
    );
    let mut sp = Fake::task(&[]);
    sp.job_env.insert(
        "SLURM_SPANK__SLURM_SPANK_OPTION_other_stage_in".into(),
        "/x".into(),
    );
    sp.job_env
        .insert(job_env_option_var("stage-in"), String::new());
    let agent = FakeAgent::ready();
    assert_eq!(task_init(&mut sp, &agent, &[]), OK);
    assert!(agent.calls().is_empty());
}

#[test]
fn a_task_outlives_an_agent_restart() {
    // The agent is killed and restarted while the task waits: the first call breaks off, the next
    // is refused, then the restarted agent (which resumed the job from its journal) answers.
    let n = std::cell::Cell::new(0);
    let agent = FakeAgent::answering(move |_| {
        n.set(n.get() + 1);
        match n.get() {
            1 => Err(broken_off(io::ErrorKind::UnexpectedEof)),
            2 => Err(cannot_connect(io::ErrorKind::ConnectionRefused)),
            _ => Ok(ready()),
        }
    });
    let mut sp = Fake::task(&[("stage-in", "/a/x")]);
    assert_eq!(task_init(&mut sp, &agent, &argv(&["stage_timeout=30"])), OK);
    assert_eq!(agent.calls().len(), 3);
    assert!(sp.errors().is_empty(), "{:?}", sp.errors());
    assert_eq!(sp.env_set[0].1, "/nvme/sluice/n2/jobs/42/stage");
}

/// The batch step of job 42 on n2 as its script ended, with a sluice option.
fn batch_step_end() -> Fake {
    let mut sp = Fake::task(&[("ckpt-archive", "s3://ckpt/alice")]);
    sp.step_id = Ok(BATCH_STEP);
    sp
}

fn job_with_ckpts(ckpts: Vec<sluice_proto::msg::CkptStatus>) -> Response {
    use sluice_proto::msg::{JobState, JobStatus};
    let Response::Ready(dirs) = ready() else {
        unreachable!()
    };
    Response::Job(JobStatus {
        job_id: 42,
        user: "alice".into(),
        uid: 1001,
        node: "n2".into(),
        nodes: vec!["n2".into()],
        state: JobState::Ready,
        dirs,
        stages: Vec::new(),
        started_at: 0,
        error: None,
        ckpts,
    })
}

fn ckpt(tag: &str, state: sluice_proto::msg::CkptState) -> sluice_proto::msg::CkptStatus {
    sluice_proto::msg::CkptStatus {
        tag: tag.into(),
        state,
        on_hot_tier: true,
        in_ram: false,
        archive_url: "s3://ckpt/alice".into(),
        files: 1,
        raw_bytes: 2048,
        stored_bytes: 1024,
        bytes_done: 0,
        committed_at: 1,
        archived_at: None,
        error: None,
        action_needed: false,
        replicas: None,
    }
}

#[test]
fn the_batch_steps_end_prints_the_checkpoint_summary_without_error_prefixes() {
    use sluice_proto::msg::CkptState;
    let sp = batch_step_end();
    let mut refused = ckpt("s2", CkptState::Refused);
    refused.error = Some("the archive holds s2 with other content".into());
    refused.action_needed = true;
    let agent = FakeAgent::answering(move |_| {
        Ok(job_with_ckpts(vec![
            ckpt("s1", CkptState::Archived),
            refused.clone(),
        ]))
    });
    assert_eq!(exit(&sp, &agent, &[]), OK);
    assert_eq!(agent.calls()[0].1, Request::Job { job_id: 42 });
    assert_eq!(agent.calls()[0].0, PathBuf::from("/run/sluice/n2.sock"));
    let lines = sp.lines(Level::Report);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("job 42 on n2: 1 of 2 checkpoint(s) archived"));
    assert_eq!(
        lines[1],
        "checkpoint s2 is NOT archived: the archive holds s2 with other content"
    );
    assert!(sp.errors().is_empty());
}

#[test]
fn only_the_batch_step_of_a_sluice_job_prints_a_summary() {
    // An srun step, a job without sluice options, and the local (srun) side: no call at all.
    let mut step = batch_step_end();
    step.step_id = Ok(0);
    let mut plain = Fake::task(&[]);
    plain.step_id = Ok(BATCH_STEP);
    let mut local = batch_step_end();
    local.context = Context::Local;
    for sp in [step, plain, local] {
        let agent = FakeAgent::ok();
        assert_eq!(exit(&sp, &agent, &[]), OK);
        assert!(agent.calls().is_empty());
        assert!(sp.logs.borrow().is_empty());
    }
}

#[test]
fn a_summary_that_cannot_be_had_says_so_and_never_fails() {
    let sp = batch_step_end();
    assert_eq!(exit(&sp, &FakeAgent::unreachable(), &[]), OK);
    let lines = sp.lines(Level::Report);
    assert!(
        lines.len() == 1 && lines[0].starts_with("job 42: no checkpoint summary"),
        "{lines:?}"
    );
    // A job the agent does not know (it failed before it reached the agent): nothing to say.
    let sp = batch_step_end();
    let agent = FakeAgent::failing(ErrorCode::NotFound, "no job 42 on n2");
    assert_eq!(exit(&sp, &agent, &[]), OK);
    assert!(sp.logs.borrow().is_empty());
}

#[test]
fn the_batch_steps_first_task_prints_what_was_staged_once() {
    use sluice_proto::msg::{StageProgress, StageState};
    let staged = || {
        let Response::Job(mut status) = job_with_ckpts(Vec::new()) else {
            unreachable!()
        };
        status.stages = vec![StageProgress {
            name: "x".into(),
            source: "/a/x".into(),
            state: StageState::Done,
            files_done: 3,
            files_total: Some(3),
            bytes_done: 3 << 20,
            bytes_total: Some(3 << 20),
            origin_bytes: 3 << 20,
            peer_bytes: 0,
            cache_bytes: 0,
            resumed_bytes: 0,
            elapsed_ms: 1500,
            error: None,
        }];
        Response::Job(status)
    };
    let agent = || {
        FakeAgent::answering(move |r| match r {
            Request::Job { .. } => Ok(staged()),
            _ => Ok(ready()),
        })
    };
    let task = |step: u32, localid: &str| {
        let mut sp = Fake::task(&[("stage-in", "/a/x")]);
        sp.step_id = Ok(step);
        sp.job_env.insert("SLURM_LOCALID".into(), localid.into());
        sp
    };
    let mut sp = task(BATCH_STEP, "0");
    let a = agent();
    assert_eq!(task_init(&mut sp, &a, &[]), OK);
    assert_eq!(
        sp.lines(Level::Report),
        ["staged 1 dataset(s) on n2: 3.0 MiB, 3 file(s) in 1.5 s (2.0 MiB/s)"]
    );
    assert_eq!(a.calls()[1].1, Request::Job { job_id: 42 });
    // srun steps and the other tasks stay quiet: one summary per job.
    for (step, localid) in [(0, "0"), (BATCH_STEP, "1")] {
        let mut sp = task(step, localid);
        let a = agent();
        assert_eq!(task_init(&mut sp, &a, &[]), OK);
        assert!(sp.lines(Level::Report).is_empty());
        assert_eq!(a.calls().len(), 1, "only the wait");
    }
}
