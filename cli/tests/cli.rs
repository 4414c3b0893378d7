//! End to end: the `sluice` binary against a fake agent that speaks the real framing
//! (`sluice_proto::wire`) on a temp socket and answers one request with a canned response.
//! The real agent is tested in its own crate; this proves the CLI's side of the socket.
//!
//! `sluice ckpt list|verify|restore URL` need no agent: they are tested against a real `file://`
//! archive written by the agent's archive engine in the test itself.

#[path = "../src/fixtures.rs"]
#[allow(dead_code)] // the archive listings are for the unit tests
mod fixtures;

use sluice_proto::msg::{
    CacheEvicted, CacheListing, CacheStats, CacheWarmed, CkptStatus, ErrorCode, ErrorReply,
    JobStatus, NodeStatus, Request, Response,
};
use sluice_proto::wire;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread::JoinHandle;

/// Listens on `path`, answers one request with `response`, and returns the request it got.
fn fake_agent(path: &Path, response: Response) -> JoinHandle<Request> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let request = wire::decode_request(&wire::read_frame(&mut stream).unwrap()).unwrap();
        wire::write_frame(&mut stream, &response).unwrap();
        request
    })
}

/// Listens on `path`, answers one request after the other with `responses` (one connection each,
/// as the CLI makes them), and returns the requests it got.
fn fake_agent_seq(path: &Path, responses: Vec<Response>) -> JoinHandle<Vec<Request>> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        responses
            .into_iter()
            .map(|response| {
                let (mut stream, _) = listener.accept().unwrap();
                let request =
                    wire::decode_request(&wire::read_frame(&mut stream).unwrap()).unwrap();
                wire::write_frame(&mut stream, &response).unwrap();
                request
            })
            .collect()
    })
}

/// Runs `sluice` with a clean environment as far as sluice is concerned, plus `env`.
fn sluice(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(args)
        .env_remove("SLUICE_SOCKET")
        .env_remove("SLURMD_NODENAME")
        .env_remove("SLURM_JOB_ID");
    cmd.envs(env.iter().copied());
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The stdout of a run that must have succeeded (else the assertion shows both streams).
fn succeeded(out: &Output) -> String {
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    stdout
}

/// Asserts that `text` holds `part`, showing all of `text` when it does not.
#[track_caller]
fn assert_has(text: &str, part: &str) {
    assert!(text.contains(part), "{part:?} is not in:\n{text}");
}

/// Asserts that `text` starts with `start`, showing all of `text` when it does not.
#[track_caller]
fn assert_starts(text: &str, start: &str) {
    assert!(text.starts_with(start), "{start:?} does not start:\n{text}");
}

/// The stderr of a run that must have failed with exit status 1 (a refusal, not a usage error).
fn failed(out: &Output) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}{stderr}", text(&out.stdout));
    stderr
}

struct Dir {
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Dir {
    fn socket(&self) -> &str {
        self.socket.to_str().unwrap()
    }

    /// `sluice --socket SOCKET ARGS...` with `env`.
    fn sluice(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut all = vec!["--socket", self.socket()];
        all.extend_from_slice(args);
        sluice(&all, env)
    }
}

fn temp_socket() -> Dir {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    Dir { _dir: dir, socket }
}

/// Runs `sluice --socket SOCKET ARGS...` with `env` against a fake agent answering `response`;
/// returns the request the agent got and what sluice printed.
fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root: a user's cache command is refused before the agent is asked"
    );
}

fn ask(response: Response, args: &[&str], env: &[(&str, &str)]) -> (Request, Output) {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, response);
    let out = d.sluice(args, env);
    (agent.join().unwrap(), out)
}

/// [`ask`], asserting that the CLI asked the agent `want`; the CLI's output.
#[track_caller]
fn asked(response: Response, args: &[&str], env: &[(&str, &str)], want: Request) -> Output {
    let (request, out) = ask(response, args, env);
    assert_eq!(request, want, "what sluice {args:?} asked the agent");
    out
}

/// `stdout` starts with `start` and holds every one of `parts`.
#[track_caller]
fn assert_shows(stdout: &str, start: &str, parts: &[&str]) {
    assert_starts(stdout, start);
    for part in parts {
        assert_has(stdout, part);
    }
}

#[test]
fn status_shows_the_node_and_its_jobs() {
    let (request, out) = ask(Response::Status(fixtures::node_status()), &["status"], &[]);
    assert_eq!(request, Request::Status);
    let stdout = succeeded(&out);
    assert_starts(&stdout, "node      gpu07\n");
    assert_has(&stdout, "\nJOBID  USER   STATE    DATASETS  ");
    assert_has(&stdout, "\n4250   bob    failed   corpus  ");
    // The agent's workers, the stuck one with its error.
    assert_has(&stdout, "\n\nWORKER         STATE      FOR");
    assert_has(&stdout, "\nckpt job 4242  archiving  ");
    assert_has(
        &stdout,
        "  61     step-900: the archive store is unreachable; retrying (connecting to s3.example.org:443 timed out)\n",
    );
    assert!(out.stderr.is_empty());
}

#[test]
fn status_json_is_the_agents_answer() {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, Response::Status(fixtures::node_status()));
    // --socket after the subcommand works as well as before it.
    let out = sluice(&["status", "--json", "--socket", d.socket()], &[]);
    agent.join().unwrap();
    succeeded(&out);
    let parsed: NodeStatus = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, fixtures::node_status());
}

#[test]
fn job_shows_every_dataset() {
    let job = Response::Job(fixtures::staging_job());
    let out = asked(job, &["job", "4242"], &[], Request::Job { job_id: 4242 });
    assert_shows(
        &succeeded(&out),
        "job 4242  staging\n  user       alice (uid 1000)\n",
        &[
            "  imagenet  copying\n    source   s3://datasets/imagenet\n    files    812/1000 (81%)\n",
            "  weights  listing\n    source   /lustre/models/llama-8b\n",
        ],
    );
}

#[test]
fn job_json_round_trips() {
    let response = Response::Job(fixtures::failed_job());
    let (request, out) = ask(response, &["job", "4250", "--json"], &[]);
    assert_eq!(request, Request::Job { job_id: 4250 });
    succeeded(&out);
    let parsed: JobStatus = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, fixtures::failed_job());
}

#[test]
fn socket_comes_from_env_with_node_name_expanded() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(
        &dir.path().join("n7.sock"),
        Response::Job(fixtures::staging_job()),
    );
    let template = dir.path().join("%n.sock");
    let out = sluice(
        &["job", "4242"],
        &[
            ("SLUICE_SOCKET", template.to_str().unwrap()),
            ("SLURMD_NODENAME", "n7"),
        ],
    );
    assert_eq!(agent.join().unwrap(), Request::Job { job_id: 4242 });
    succeeded(&out);
}

#[test]
fn agent_errors_are_printed_as_the_agent_wrote_them() {
    let message =
        "job 7 is not on this node; run `sluice job` on one of its nodes (squeue -j 7 -o %N)";
    let response = Response::Error(ErrorReply::new(ErrorCode::NotFound, message));
    let (request, out) = ask(response, &["job", "7"], &[]);
    assert_eq!(request, Request::Job { job_id: 7 });
    assert_eq!(failed(&out), format!("sluice: {message}\n"));
    assert!(out.stdout.is_empty());
}

#[test]
fn unreachable_agent_names_the_socket_and_what_to_check() {
    let d = temp_socket();
    let out = sluice(&["status"], &[("SLUICE_SOCKET", d.socket())]);
    let stderr = failed(&out);
    let want = format!(
        "sluice: cannot reach the sluice agent at {} (from $SLUICE_SOCKET): ",
        d.socket.display()
    );
    assert_starts(&stderr, &want);
    assert!(
        stderr.contains("check that sluiced runs on this node") && stderr.contains("--socket PATH"),
        "{stderr}"
    );
}

/// Runs `sluice --socket SOCKET ARGS...` against an agent that does `behave` with the one
/// connection it accepts, and returns the stderr of the failure that must follow.
fn against_a_broken_agent(
    args: &[&str],
    behave: impl FnOnce(UnixStream) + Send + 'static,
) -> String {
    let d = temp_socket();
    let listener = UnixListener::bind(&d.socket).unwrap();
    let agent = std::thread::spawn(move || behave(listener.accept().unwrap().0));
    let out = d.sluice(args, &[]);
    agent.join().unwrap();
    failed(&out)
}

#[test]
fn a_silent_agent_times_out() {
    // Reads the request, then waits for the client to hang up: no sleeps, no answer.
    let stderr = against_a_broken_agent(&["--timeout", "0.2", "status"], |mut stream| {
        wire::read_frame(&mut stream).unwrap();
        assert!(wire::read_frame(&mut stream).is_err());
    });
    assert!(
        stderr.contains("did not answer within 200ms") && stderr.contains("--timeout"),
        "{stderr}"
    );
}

#[test]
fn an_agent_answering_the_wrong_thing_is_reported() {
    let stderr = against_a_broken_agent(&["status"], |mut stream| {
        wire::read_frame(&mut stream).unwrap();
        wire::write_frame(&mut stream, &Response::Ok).unwrap();
    });
    assert_has(&stderr, "answered a status request with 'ok'");
}

#[test]
fn an_agent_hanging_up_is_reported() {
    let stderr = against_a_broken_agent(&["job", "1"], |mut stream| {
        wire::read_frame(&mut stream).unwrap();
    });
    assert_has(&stderr, "closed the connection without answering");
}

// ------------------------------------------------------------------------------------ ckpt, agent

fn ckpts() -> Response {
    Response::Ckpts {
        ckpts: fixtures::job_ckpts(),
    }
}

#[test]
fn commit_inside_a_job_uses_slurm_job_id_and_says_where_it_goes() {
    let d = temp_socket();
    let agent = fake_agent_seq(&d.socket, vec![Response::Ok, ckpts()]);
    let out = d.sluice(
        &["ckpt", "commit", "step200"],
        &[("SLURM_JOB_ID", "4242"), ("SLURMD_NODENAME", "gpu07")],
    );
    let stdout = succeeded(&out);
    assert_eq!(
        agent.join().unwrap(),
        vec![
            Request::CkptCommit {
                job_id: 4242,
                tag: "step200".into()
            },
            Request::CkptList { job_id: 4242 }
        ]
    );
    assert_eq!(
        stdout,
        "committed step200 (job 4242, node gpu07); archiving to s3://ckpt/alice/train\n"
    );
    assert!(out.stderr.is_empty());
}

#[test]
fn commit_with_job_and_local_flags() {
    let d = temp_socket();
    // The agent knows no archive URL for the tag: the commit still stands.
    let agent = fake_agent_seq(
        &d.socket,
        vec![Response::Ok, Response::Ckpts { ckpts: Vec::new() }],
    );
    let out = sluice(
        &[
            "ckpt",
            "commit",
            "--job",
            "7",
            "--local",
            "step100",
            "--socket",
            d.socket(),
        ],
        &[("SLURM_JOB_ID", "4242"), ("SLURMD_NODENAME", "n3")],
    );
    let stdout = succeeded(&out);
    assert_eq!(
        agent.join().unwrap()[0],
        Request::CkptCommit {
            job_id: 7,
            tag: "step100".into()
        }
    );
    assert_eq!(stdout, "committed step100 (job 7, node n3)\n");
}

#[test]
fn commit_outside_a_job_fails_before_asking_the_agent() {
    let d = temp_socket();
    // Nobody listens: an attempt to connect would be a different error.
    let out = d.sluice(&["ckpt", "commit", "step1"], &[]);
    let stderr = failed(&out);
    assert!(
        stderr.starts_with("sluice: not inside a Slurm job ($SLURM_JOB_ID is not set)")
            && stderr.contains("pass --job JOBID"),
        "{stderr}"
    );
    // A bad tag is refused here too, with what a tag may hold.
    let out = d.sluice(&["ckpt", "commit", "a/b"], &[("SLURM_JOB_ID", "1")]);
    let stderr = failed(&out);
    assert_has(&stderr, "checkpoint tag 'a/b' may only hold");
}

#[test]
fn commit_errors_from_the_agent_are_printed_as_they_come() {
    let d = temp_socket();
    let message = "there is no checkpoint directory $SLUICE_CKPT_DIR/step9 on this node";
    let agent = fake_agent_seq(
        &d.socket,
        vec![Response::Error(ErrorReply::new(
            ErrorCode::BadRequest,
            message,
        ))],
    );
    let out = d.sluice(&["ckpt", "commit", "step9"], &[("SLURM_JOB_ID", "4242")]);
    assert_eq!(agent.join().unwrap().len(), 1);
    assert_eq!(failed(&out), format!("sluice: {message}\n"));
    assert!(out.stdout.is_empty());
}

#[test]
fn list_shows_the_jobs_checkpoints() {
    let env = [("SLURM_JOB_ID", "4242")];
    let out = asked(
        ckpts(),
        &["ckpt", "list"],
        &env,
        Request::CkptList { job_id: 4242 },
    );
    assert_shows(
        &succeeded(&out),
        "job 4242 on this node; archive s3://ckpt/alice/train\n\nTAG      STATE              WHERE           REPLICAS   SIZE     STORED   RATIO  COMMITTED             ARCHIVED              ERROR\n",
        &[
            "\nstep100  archived           -               -          3.0 GiB  2.0 GiB  1.46x  ",
            "\nstep500  archiving          ram+nvme+gpu08  protected  ",
        ],
    );
}

#[test]
fn list_json_with_an_explicit_job() {
    let (request, out) = ask(
        ckpts(),
        &["ckpt", "list", "--job", "17", "--json"],
        &[("SLURM_JOB_ID", "4242")],
    );
    assert_eq!(request, Request::CkptList { job_id: 17 });
    succeeded(&out);
    let parsed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed["job_id"], 17);
    let ckpts: Vec<CkptStatus> = serde_json::from_value(parsed["ckpts"].clone()).unwrap();
    assert_eq!(ckpts, fixtures::job_ckpts());
}

fn poisoned(already: bool) -> Response {
    Response::Poisoned(sluice_proto::msg::CkptPoisoned {
        url: fixtures::CKPT_URL.into(),
        tag: "step200".into(),
        mark: sluice_proto::msg::PoisonMark {
            user: "alice".into(),
            uid: 1000,
            at_unix_ms: 1_700_000_000_000,
            reason: "loss is NaN".into(),
        },
        already,
        unpublished: !already,
    })
}

#[test]
fn poison_inside_a_job_asks_the_agent_for_the_jobs_checkpoint() {
    let want = Request::CkptPoison {
        job_id: 4242,
        tag: "step200".into(),
        reason: "loss is NaN".into(),
    };
    let args = ["ckpt", "poison", "step200", "--reason", " loss is NaN"];
    let job = [("SLURM_JOB_ID", "4242")];
    let stdout = succeeded(&asked(poisoned(false), &args, &job, want.clone()));
    assert_eq!(
        stdout,
        format!(
            "poisoned step200 in {url}: marked bad by alice (uid 1000) at 2023-11-14T22:13:20Z: loss is NaN\n  \
             it is not archived yet: the mark waits beside its MANIFEST, and no restore can take it before\n  \
             --ckpt-restore=latest passes over it; to restore it anyway: --ckpt-restore=step200! or sluice ckpt restore --force\n",
            url = fixtures::CKPT_URL
        )
    );
    let stdout = succeeded(&asked(poisoned(true), &args, &job, want));
    assert_eq!(
        stdout,
        format!(
            "checkpoint step200 in {} is poisoned already (marked bad by alice (uid 1000) at 2023-11-14T22:13:20Z: loss is NaN); the first mark stays\n",
            fixtures::CKPT_URL
        )
    );
    // Outside a job, without a URL: what to give instead, and the agent is not asked.
    let stderr = failed(&sluice(
        &["ckpt", "poison", "step200", "--reason", "x"],
        &[],
    ));
    assert_has(&stderr, "pass --job JOBID or give the archive URL");
    // The agent's refusal (another user's job) is printed as it comes.
    let refused = Response::Error(ErrorReply::new(
        ErrorCode::Forbidden,
        "job 4242 belongs to another user",
    ));
    let (_, out) = ask(refused, &args, &job);
    assert_has(&failed(&out), "job 4242 belongs to another user");
}

#[test]
fn list_outside_a_job_and_conflicting_arguments() {
    let out = sluice(&["--socket", "/nonexistent.sock", "ckpt", "list"], &[]);
    let stderr = failed(&out);
    assert!(
        stderr.contains("not inside a Slurm job")
            && stderr.contains("pass --job JOBID or give an archive URL"),
        "{stderr}"
    );
    // --job and a URL are two different questions; --config goes with a URL only.
    let out = sluice(&["ckpt", "list", "--job", "1", "file:///x"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = sluice(&["ckpt", "list", "--config", "/c.toml"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = sluice(&["ckpt", "list", "--job", "x"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

// ------------------------------------------------------------------------------------ cache

#[test]
fn status_shows_the_cache_when_the_node_has_one() {
    let mut status = fixtures::node_status();
    status.cache = Some(fixtures::cache_stats());
    let (_, out) = ask(Response::Status(status.clone()), &["status"], &[]);
    let stdout = succeeded(&out);
    assert_has(
        &stdout,
        "\ncache     /var/lib/sluice/gpu07/hot/cache\n  used    33.0 GiB of 100.0 GiB (33%), 3 entries\n  \
         hits    87.5% of 8 lookups (7 hits, 1 miss)\n  \
         served  56.0 GiB from the cache (not read from the origin again)\n  \
         evicted 2 entries, 12.0 GiB\n\nJOBID  ",
    );
    let (_, out) = ask(Response::Status(status.clone()), &["status", "--json"], &[]);
    let parsed: NodeStatus = serde_json::from_slice(succeeded(&out).as_bytes()).unwrap();
    assert_eq!(parsed, status);
}

#[test]
#[ignore = "needs root: cache commands are root's and a user is refused before the agent is asked; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn cache_list_asks_for_the_entries_under_the_prefix() {
    require_root();
    let list = |args: &[&str], prefix: Option<&str>| {
        let listing = Response::Cache(fixtures::cache_listing());
        let prefix = prefix.map(String::from);
        asked(
            listing,
            args,
            &[],
            Request::CacheList {
                prefix,
                entries: true,
            },
        )
    };
    let out = list(&["cache", "list", "s3://datasets/"], Some("s3://datasets/"));
    let stdout = succeeded(&out);
    assert_starts(
        &stdout,
        "cache on gpu07 (/var/lib/sluice/gpu07/hot/cache): 33.0 GiB of 100.0 GiB (33%), 3 \
             entries; hit ratio 87.5%\n\nURL                                     SIZE      LAST USE              IN USE\n\
             s3://datasets/corpus/v1.tar             2.0 GiB   2026-05-01T10:05:00Z  no\n",
    );
    // Without a prefix, all of them; --json is the agent's answer.
    let out = list(&["cache", "list", "--json"], None);
    let parsed: CacheListing = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, fixtures::cache_listing());
    assert!(out.stderr.is_empty());
}

#[test]
#[ignore = "needs root: cache commands are root's and a user is refused before the agent is asked; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn cache_stats_asks_for_the_counters_only() {
    require_root();
    let mut listing = fixtures::cache_listing();
    listing.entries.clear();
    let (request, out) = ask(Response::Cache(listing.clone()), &["cache", "stats"], &[]);
    assert_eq!(
        request,
        Request::CacheList {
            prefix: None,
            entries: false
        }
    );
    let stdout = succeeded(&out);
    assert_starts(
        &stdout,
        "cache on gpu07\n  root        /var/lib/sluice/gpu07/hot/cache\n  capacity    100.0 GiB\n",
    );
    assert_has(&stdout, "\n  hit ratio   87.5%\n");
    assert_has(
        &stdout,
        "\n  from cache  56.0 GiB placed into jobs: bytes the origin did not serve again\n",
    );
    let (_, out) = ask(Response::Cache(listing), &["cache", "stats", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["node"], "gpu07");
    assert_eq!(v["hit_ratio"], 0.875);
    let stats: CacheStats = serde_json::from_value(v["stats"].clone()).unwrap();
    assert_eq!(stats, fixtures::cache_stats());
}

#[test]
#[ignore = "needs root: cache commands are root's and a user is refused before the agent is asked; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn cache_warm_says_what_it_cached_and_fails_on_an_error() {
    require_root();
    let url = "s3://datasets/imagenet/";
    let (request, out) = ask(
        Response::CacheWarmed(fixtures::cache_warmed()),
        &["cache", "warm", url],
        &[],
    );
    assert_eq!(request, Request::CacheWarm { url: url.into() });
    let stdout = succeeded(&out);
    assert_starts(
        &stdout,
        "warmed s3://datasets/imagenet/ on gpu07: 1000 object(s), 10.0 GiB\n  \
             cached before  500 object(s), 4.0 GiB (nothing read)\n",
    );
    assert_has(
        &stdout,
        "\n    s3://datasets/imagenet/all.tar: 120.0 GiB is larger than the cache (100.0 GiB)\n",
    );
    let (_, out) = ask(
        Response::CacheWarmed(fixtures::cache_warmed()),
        &["cache", "warm", url, "--json"],
        &[],
    );
    let parsed: CacheWarmed = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, fixtures::cache_warmed());

    let message = "dataset s3://datasets/nothing/ not found — check the path";
    let (_, out) = ask(
        Response::Error(ErrorReply::new(ErrorCode::NotFound, message)),
        &["cache", "warm", "s3://datasets/nothing/"],
        &[],
    );
    assert_eq!(failed(&out), format!("sluice: {message}\n"));
    assert!(out.stdout.is_empty());
}

/// `--nodes gpu[07-09]`: the agent is asked for the three nodes, expanded; one row each, the node
/// that failed with its error in its row, and the exit status 1; `--json` has the same rows.
#[test]
#[ignore = "needs root: cache commands are root's and a user is refused before the agent is asked; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn cache_warm_on_a_node_list_has_one_row_per_node_and_fails_if_one_did() {
    require_root();
    let url = "s3://datasets/imagenet/";
    let warmed = |node: &str, fresh: bool| {
        let mut w = fixtures::cache_warmed();
        w.node = node.into();
        if !fresh {
            (w.cached_files, w.cached_bytes) = (w.files, w.bytes);
            (w.filled_files, w.filled_bytes) = (0, 0);
            w.skipped.clear();
        }
        w
    };
    let rows = vec![
        sluice_proto::msg::NodeWarmed {
            node: "gpu07".into(),
            warmed: Some(warmed("gpu07", true)),
            error: None,
        },
        sluice_proto::msg::NodeWarmed {
            node: "gpu08".into(),
            warmed: Some(warmed("gpu08", false)),
            error: None,
        },
        sluice_proto::msg::NodeWarmed {
            node: "gpu09".into(),
            warmed: None,
            error: Some("the agent of gpu09: peer 10.0.0.9:7070 is unreachable".into()),
        },
    ];
    let answer = Response::CacheWarmedNodes {
        nodes: rows.clone(),
    };
    let (request, out) = ask(
        answer.clone(),
        &["cache", "warm", url, "--nodes", "gpu[07-09]"],
        &[],
    );
    assert_eq!(
        request,
        Request::CacheWarmNodes {
            url: url.into(),
            nodes: vec!["gpu07".into(), "gpu08".into(), "gpu09".into()],
        }
    );
    let stderr = failed(&out);
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with(
            "warmed s3://datasets/imagenet/ on 3 node(s)\n\
             NODE   OBJECTS  BYTES     FROM ORIGIN  CACHED BEFORE  SKIPPED  ERROR\n\
             gpu07  1000     10.0 GiB  6.0 GiB      4.0 GiB        1\n\
             gpu08  1000     10.0 GiB  0 B          10.0 GiB       0\n\
             gpu09  -        -         -            -              -        the agent of gpu09: peer 10.0.0.9:7070 is unreachable\n"
        ),
        "{stdout}{stderr}"
    );
    assert_has(
        &stdout,
        "\nskipped on gpu07 (jobs read them from the origin):\n  s3://datasets/imagenet/all.tar: 120.0 GiB is larger than the cache (100.0 GiB)\n",
    );
    assert_has(&stdout, "\n1 of 3 node(s) not warmed: see ERROR\n");

    let (_, out) = ask(
        answer,
        &["cache", "warm", url, "--nodes", "gpu[07-09]", "--json"],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["url"], url);
    let parsed: Vec<sluice_proto::msg::NodeWarmed> =
        serde_json::from_value(v["nodes"].clone()).unwrap();
    assert_eq!(parsed, rows);
    assert!(v["nodes"][2].get("warmed").is_none());

    // Every node warmed: exit status 0.
    let all_ok = Response::CacheWarmedNodes {
        nodes: rows[..2].to_vec(),
    };
    let (_, out) = ask(
        all_ok,
        &["cache", "warm", url, "--nodes", "gpu[07-08]"],
        &[],
    );
    succeeded(&out);

    // An agent that predates --nodes is named as such.
    let old = ErrorReply::new(
        ErrorCode::BadRequest,
        "bad request: unknown variant `cache_warm_nodes`, expected one of `job_start`, ...",
    );
    let (_, out) = ask(
        Response::Error(old),
        &["cache", "warm", url, "--nodes", "gpu[07-08]"],
        &[],
    );
    assert_has(
        &failed(&out),
        "is older than this CLI and cannot warm other nodes (--nodes); update sluiced on this node",
    );
}

#[test]
#[ignore = "needs root: cache commands are root's and a user is refused before the agent is asked; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn cache_evict_by_prefix_all_and_dry_run() {
    require_root();
    let (request, out) = ask(
        Response::CacheEvicted(fixtures::cache_evicted(false)),
        &["cache", "evict", "s3://datasets/"],
        &[],
    );
    assert_eq!(
        request,
        Request::CacheEvict {
            prefix: "s3://datasets/".into(),
            dry_run: false
        }
    );
    assert_eq!(
        succeeded(&out),
        "evicted 2 entries (32.0 GiB) under s3://datasets/ from the cache on gpu07\n  \
         1 more entry matches and stays: a job is reading or filling it (evict again once the \
         job is done)\n"
    );
    let (request, out) = ask(
        Response::CacheEvicted(fixtures::cache_evicted(true)),
        &["cache", "evict", "--all", "--dry-run", "--json"],
        &[],
    );
    assert_eq!(
        request,
        Request::CacheEvict {
            prefix: String::new(),
            dry_run: true
        }
    );
    let parsed: CacheEvicted = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, fixtures::cache_evicted(true));

    // What to evict must be said, once: a usage error; an empty PREFIX is refused before the
    // agent is asked (nobody listens on this socket).
    let d = temp_socket();
    for args in [
        &["cache", "evict"][..],
        &["cache", "evict", "--all", "s3://d/"],
    ] {
        let out = d.sluice(args, &[]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let stderr = failed(&d.sluice(&["cache", "evict", ""], &[]));
    assert_eq!(
        stderr,
        "sluice: the PREFIX is empty; to evict every entry, say --all\n"
    );
}

/// A user who is not root is told the cache is for admins, before anything is asked of the
/// agent (nobody listens on the socket: asking would fail otherwise).
#[test]
fn cache_commands_are_for_admins() {
    use std::os::unix::process::CommandExt;
    let d = temp_socket();
    for args in [
        &["cache", "list"][..],
        &["cache", "stats"],
        &["cache", "warm", "s3://datasets/imagenet/"],
        &["cache", "evict", "--all"],
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.arg("--socket").arg(&d.socket).args(args);
        if nix::unistd::geteuid().is_root() {
            cmd.uid(65534).gid(65534);
        }
        let out = cmd.output().unwrap();
        let stderr = failed(&out);
        assert!(
            stderr.starts_with("sluice: sluice cache commands are for admins: ")
                && stderr.contains("sudo sluice cache"),
            "{args:?}: {stderr}"
        );
    }
}

/// An agent from before the cache answers the request as one it cannot parse.
#[test]
#[ignore = "needs root: cache commands are root's and a user is refused before the agent is asked; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn an_agent_without_a_cache_is_named_as_too_old() {
    require_root();
    // The agent sends the decode error as `bad_request` (`server.rs:serve`): serde's words for
    // an op it does not know, as this build says them of one it does not know either.
    let body = br#"{"version":1,"request":{"op":"cache_frobnicate"}}"#;
    let message = wire::decode_request(body).unwrap_err().to_string();
    let (_, out) = ask(
        Response::Error(ErrorReply::new(ErrorCode::BadRequest, message)),
        &["cache", "stats"],
        &[],
    );
    let stderr = failed(&out);
    assert!(
        stderr.contains("is older than this CLI and has no cache; update sluiced"),
        "{stderr}"
    );
}

// ------------------------------------------------------------------------------------ ckpt, URL

mod archive {
    use super::{assert_has, assert_starts, failed, sluice, succeeded, text};
    use sluice_archive::synth::{bf16_weights, fp32_values};
    use sluice_archive::{ArchiveConfig, ArchiveProgress, JobMeta, open_archive_with};
    use sluice_core::config::Config;
    use sluice_core::safefs;
    use std::os::unix::fs::MetadataExt;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    fn files() -> Vec<(&'static str, Vec<u8>)> {
        vec![
            ("model/weights.bf16", bf16_weights(600_000, 1)),
            ("optim/state.fp32", fp32_values(75_000, 2)),
            ("latest", b"step100\n".to_vec()),
            ("empty", Vec::new()),
        ]
    }

    struct Fixture {
        tmp: tempfile::TempDir,
        url: String,
        config: PathBuf,
    }

    impl Fixture {
        fn archive_dir(&self) -> PathBuf {
            self.tmp.path().join("archive")
        }

        /// `sluice ckpt ARGS... --config CFG`.
        fn run(&self, args: &[&str]) -> std::process::Output {
            let mut all = vec!["ckpt"];
            all.extend_from_slice(args);
            all.extend_from_slice(&["--config", self.config.to_str().unwrap()]);
            sluice(&all, &[])
        }

        /// `sluice ckpt restore URL TAG DEST FLAGS... --config CFG`.
        fn restore(&self, tag: &str, dest: &Path, flags: &[&str]) -> std::process::Output {
            let mut args = vec!["restore", &self.url, tag, dest.to_str().unwrap()];
            args.extend_from_slice(flags);
            self.run(&args)
        }

        /// Flips one byte in the middle of step100's `model/weights.bf16` data object.
        fn damage(&self) {
            let object = self.archive_dir().join("step100/data/model/weights.bf16");
            let mut bytes = std::fs::read(&object).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            std::fs::write(&object, &bytes).unwrap();
        }

        /// What a restore of step100 into `dest` prints on stdout.
        fn restored_step100(&self, dest: &Path) -> String {
            format!(
                "restored step100 from {} into {}: 4 file(s), 1.4 MiB, checksums verified\n",
                self.url,
                dest.display()
            )
        }
    }

    /// The checkpoint `tag` in `sluice ckpt list --json`'s document.
    fn listed<'a>(list: &'a serde_json::Value, tag: &str) -> &'a serde_json::Value {
        list["ckpts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["tag"] == tag)
            .unwrap_or_else(|| panic!("no {tag} in {list:#}"))
    }

    /// A `file://` archive holding `step100` (complete, one node) and `step200` (only one of its
    /// two nodes' parts: partial), written with the agent's engine as the agent would.
    fn archive() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let config = tmp.path().join("sluice.toml");
        let toml = "[agent]\nsocket = '/run/sluice/%n.sock'\nstate_dir = '/var/lib/sluice/%n/state'\n\
                    [hot_tier]\nroot = '/var/lib/sluice/%n/hot'\n";
        std::fs::write(&config, toml).unwrap();
        let cfg = Config::parse(toml, "n1", sluice_archive::upload_memory).unwrap();
        let url = format!("file://{}", tmp.path().join("archive").display());
        // Small chunks and parts, so the big file is several chunks and a multipart upload.
        let acfg = ArchiveConfig {
            part_size: 256 << 10,
            concurrency: 4,
            zstd_level: 1,
            chunk_size: 64 << 10,
            compress_threads: 2,
            bandwidth_limit: None,
        };
        let archiver = open_archive_with(&cfg, &url, acfg).unwrap();
        let src = tmp.path().join("src");
        for (rel, data) in files() {
            let p = src.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, data).unwrap();
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for (tag, nodes) in [("step100", &["n1"][..]), ("step200", &["n1", "n2"])] {
                let published = publish(&archiver, &src, tag, nodes, "alice").await;
                assert_eq!(published, tag == "step100");
            }
        });
        Fixture { tmp, url, config }
    }

    /// Uploads `src` as node n1's part of `tag` and publishes it for `nodes` as `user`'s job 4242;
    /// whether it is published (every node of `nodes` wrote its part).
    async fn publish(
        archiver: &sluice_archive::Archiver,
        src: &Path,
        tag: &str,
        nodes: &[&str],
        user: &str,
    ) -> bool {
        let (user, job_name) = (user.to_string(), "train".to_string());
        let job = JobMeta {
            job_id: 4242,
            user,
            job_name,
        };
        let me = nix::unistd::geteuid().as_raw();
        let fd = Arc::new(safefs::open_root_dir(src).unwrap());
        let counters = ArchiveProgress::default();
        let part = archiver.upload_part(tag, "n1", fd, me, &counters, None);
        part.await.unwrap();
        let nodes: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
        let published = archiver.try_publish(tag, &nodes, job).await.unwrap();
        published.into_manifest().is_some()
    }

    fn assert_restored(dest: &Path) {
        let me = nix::unistd::geteuid().as_raw();
        for (rel, data) in files() {
            let p = dest.join(rel);
            let got = std::fs::read(&p).unwrap_or_else(|e| panic!("{rel}: {e}"));
            assert!(got == data, "{rel} differs after restore");
            assert_eq!(p.metadata().unwrap().uid(), me, "owner of {rel}");
        }
        assert_eq!(dest.metadata().unwrap().uid(), me);
    }

    #[test]
    fn list_verify_restore_and_damage() {
        let f = archive();
        let url = f.url.as_str();

        // list: step100 complete with a ratio, step200 partial.
        let out = f.run(&["list", url]);
        let stdout = succeeded(&out);
        assert_starts(
            &stdout,
            &format!("archive {url}\n\nTAG      STATE     FILES  "),
        );
        let line = stdout
            .lines()
            .find(|l| l.starts_with("step100 "))
            .unwrap_or_else(|| panic!("{stdout}"));
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&cells[1..3], ["complete", "4"], "{line}");
        let ratio: f64 = cells[7].strip_suffix('x').unwrap().parse().unwrap();
        assert!(ratio > 1.1, "{line}");
        // A file:// archive has no storage classes: its data is in the "default" one.
        assert_eq!(cells[8], "default", "{line}");
        assert_eq!(&cells[cells.len() - 2..], ["4242", "n1"], "{line}");
        assert!(
            stdout.lines().any(|l| l.starts_with("step200  partial ")),
            "{stdout}"
        );
        assert!(out.stderr.is_empty(), "{}", text(&out.stderr));

        let out = f.run(&["list", url, "--json"]);
        succeeded(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["url"], url);
        let step100 = listed(&v, "step100");
        assert_eq!(step100["state"], "complete");
        assert_eq!(step100["files"], 4);
        assert_eq!(step100["data_classes"], serde_json::json!(["default"]));
        assert_eq!(step100["raw_bytes"], 1_500_008);
        assert_eq!(step100["job"]["job_id"], 4242);
        assert!(step100["ratio"].as_f64().unwrap() > 1.1);

        // verify: OK.
        let out = f.run(&["verify", url, "step100"]);
        let stdout = succeeded(&out);
        assert_starts(
            &stdout,
            &format!("checkpoint step100 at {url}: OK\n  4 file(s), "),
        );
        // A partial checkpoint cannot be verified: it has no MANIFEST.
        let stderr = failed(&f.run(&["verify", url, "step200"]));
        assert_has(&stderr, "has no MANIFEST");

        // restore: identical bytes, owned by the caller, into a new directory and via `latest`.
        let dest = f.tmp.path().join("restored");
        let stdout = succeeded(&f.restore("step100", &dest, &[]));
        assert_eq!(stdout, f.restored_step100(&dest));
        assert_restored(&dest);
        let empty = f.tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let out = f.restore("latest", &empty, &["--json"]);
        let v: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
        assert_eq!(
            (v["tag"].as_str(), v["files"].as_u64()),
            (Some("step100"), Some(4))
        );
        assert_restored(&empty);
        // Not into a directory that holds something.
        let stderr = failed(&f.restore("step100", &dest, &[]));
        assert_has(&stderr, "is not empty");
        assert_restored(&dest);

        // Damage: one byte flipped in the middle of a data object.
        f.damage();

        let out = f.run(&["verify", url, "step100"]);
        failed(&out);
        let stdout = text(&out.stdout);
        assert_starts(
            &stdout,
            &format!(
                "checkpoint step100 at {url}: DAMAGED, 1 of 4 file(s)\n  model/weights.bf16: "
            ),
        );
        let out = f.run(&["verify", url, "step100", "--json"]);
        failed(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["ok"], false);
        assert_eq!(v["damaged"][0]["path"], "model/weights.bf16");

        // A damaged checkpoint is not restored, and nothing is left behind.
        let dest2 = f.tmp.path().join("restored2");
        let stderr = failed(&f.restore("step100", &dest2, &[]));
        assert!(
            stderr.contains("is damaged: 'model/weights.bf16'")
                && stderr.ends_with("was removed again\n"),
            "{stderr}"
        );
        assert!(!dest2.exists());
        // `latest` says it skips the damaged one, and finds no other.
        let stderr = failed(&f.restore("latest", &dest2, &[]));
        assert!(
            stderr.contains("checkpoint step100 cannot be restored")
                && stderr.contains("falling back to the next newest")
                && stderr.contains("no other complete checkpoint to use as 'latest'"),
            "{stderr}"
        );
        assert!(!dest2.exists());
    }

    /// A minimal agent configuration in `dir`, with `more` after it; its path.
    fn config_in(dir: &Path, more: &str) -> String {
        let config = dir.join("sluice.toml");
        let text = format!("[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n{more}");
        std::fs::write(&config, text).unwrap();
        config.to_str().unwrap().to_string()
    }

    #[test]
    fn urls_that_do_not_lead_to_an_archive() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = &config_in(tmp.path(), "");
        let missing = format!("file://{}/nothing", tmp.path().display());
        let stderr = failed(&sluice(&["ckpt", "list", &missing, "--config", cfg], &[]));
        assert!(
            stderr.ends_with("does not exist; nothing is archived there\n"),
            "{stderr}"
        );
        assert!(!tmp.path().join("nothing").exists());
        let stderr = failed(&sluice(
            &["ckpt", "verify", "ftp://x/y", "t", "--config", cfg],
            &[],
        ));
        assert_has(&stderr, "unknown scheme");
        // An empty archive lists as empty.
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let url = format!("file://{}", empty.display());
        let stdout = succeeded(&sluice(&["ckpt", "list", &url, "--config", cfg], &[]));
        assert_eq!(stdout, format!("archive {url}\n\nNo checkpoints there.\n"));
    }

    /// A node without CA certificates (a minimal image) cannot build any store client, even for an
    /// http:// endpoint: the message says so and what to install, not only "builder error".
    #[test]
    fn a_node_without_ca_certificates_is_told_to_install_them() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = &config_in(
            tmp.path(),
            "[[store]]\nprefix='s3://'\nendpoint='http://127.0.0.1:9'\nregion='r'\n\
             access_key_id='k'\nsecret_access_key='s'\nallow_http=true\n",
        );
        // The system's roots, as rustls-native-certs finds them: here, none.
        let no_roots = [
            ("SSL_CERT_FILE", "/dev/null"),
            ("SSL_CERT_DIR", "/nonexistent"),
        ];
        let stderr = failed(&sluice(
            &["ckpt", "list", "s3://b/x", "--config", cfg],
            &no_roots,
        ));
        assert_has(&stderr, "this node has no CA certificates");
        assert_has(&stderr, "apt-get install ca-certificates");
    }

    /// The progress lines of `label` in `stderr`, checked: plain text (no escape codes), every line
    /// about `label`, the last one the final line with `counts` (`1.4 MiB of 1.4 MiB, 4 of 4 files`),
    /// a rate and `done in`/`stopped after` with the time. Returns the lines.
    #[track_caller]
    fn assert_progress(stderr: &str, label: &str, counts: &str, how: &str) -> Vec<String> {
        assert!(
            !stderr.contains('\x1b'),
            "escape codes off a terminal: {stderr:?}"
        );
        let lines: Vec<String> = stderr
            .lines()
            .filter(|l| l.starts_with(&format!("{label}: ")))
            .map(String::from)
            .collect();
        let last = lines
            .last()
            .unwrap_or_else(|| panic!("no progress line for {label} in:\n{stderr}"));
        assert!(
            last.starts_with(&format!("{label}: {counts}")),
            "{last:?} is not the final line of {label}: {counts}"
        );
        let (counted, time) = last
            .split_once(&format!(", {how} "))
            .unwrap_or_else(|| panic!("{last:?} does not say '{how}'"));
        let rate = counted.rsplit(", ").next().unwrap();
        assert!(rate.ends_with("B/s"), "{last:?}: rate {rate:?}");
        assert!(
            time.ends_with('s') && time.len() > 2,
            "{last:?}: time {time:?}"
        );
        lines
    }

    /// Off a terminal (stderr is a pipe here), restore and verify print plain progress lines on
    /// stderr, at least the final one; `--quiet` prints none; stdout, text or `--json`, holds the
    /// result alone, as before.
    #[test]
    fn progress_off_a_terminal_and_with_quiet() {
        let f = archive();
        let url = f.url.as_str();
        let all = "1.4 MiB of 1.4 MiB, 4 of 4 files";

        let dest = f.tmp.path().join("restored");
        let out = f.restore("step100", &dest, &[]);
        let stdout = succeeded(&out);
        assert_eq!(stdout, f.restored_step100(&dest));
        let stderr = text(&out.stderr);
        let lines = assert_progress(&stderr, "restore step100", all, "done in");
        assert_eq!(lines.len(), stderr.lines().count(), "{stderr}");
        assert_restored(&dest);

        let quiet = f.tmp.path().join("quiet");
        let out = f.restore("step100", &quiet, &["--quiet"]);
        assert!(succeeded(&out).starts_with("restored step100 from "));
        assert_eq!(text(&out.stderr), "");
        assert_restored(&quiet);

        // --json: the same document on stdout (no progress in it), the progress on stderr.
        let json_dest = f.tmp.path().join("json");
        let out = f.restore("latest", &json_dest, &["--json"]);
        let v: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "dest",
                "files",
                "raw_bytes",
                "skipped",
                "stored_bytes",
                "tag",
                "url"
            ]
        );
        assert_eq!(
            (
                v["tag"].as_str(),
                v["files"].as_u64(),
                v["raw_bytes"].as_u64()
            ),
            (Some("step100"), Some(4), Some(1_500_008))
        );
        assert_eq!(v["dest"], json_dest.to_str().unwrap());
        assert_progress(&text(&out.stderr), "restore step100", all, "done in");
        let quiet_json = f.tmp.path().join("quiet-json");
        let out = f.restore("latest", &quiet_json, &["--json", "-q"]);
        let mut q: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
        assert_eq!(text(&out.stderr), "");
        q["dest"] = v["dest"].clone();
        assert_eq!(q, v);

        // verify: the same, its result alone on stdout.
        let out = f.run(&["verify", url, "step100"]);
        assert!(succeeded(&out).starts_with(&format!("checkpoint step100 at {url}: OK\n")));
        assert_progress(&text(&out.stderr), "verify step100", all, "done in");
        let out = f.run(&["verify", url, "step100", "--json", "--quiet"]);
        let v: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
        assert_eq!(
            (v["ok"].as_bool(), v["files"].as_u64()),
            (Some(true), Some(4))
        );
        assert_eq!(text(&out.stderr), "");

        // Damaged: verify reads everything and counts the intact files; a restore says where it
        // stopped, before its error.
        f.damage();
        let out = f.run(&["verify", url, "step100"]);
        let stderr = failed(&out);
        let counts = "of 1.4 MiB, 3 of 4 files";
        let last = assert_progress(&stderr, "verify step100", "", "done in")
            .pop()
            .unwrap();
        assert_has(&last, counts);
        let broken = f.tmp.path().join("broken");
        let stderr = failed(&f.restore("step100", &broken, &[]));
        let last = assert_progress(&stderr, "restore step100", "", "stopped after").pop();
        assert_has(&last.unwrap(), " of 1.4 MiB, ");
        assert!(stderr.ends_with("was removed again\n"), "{stderr}");
        assert!(!broken.exists());
    }

    /// Every path below `dir` with its size and modification time: what a run that writes nothing
    /// leaves as it was.
    fn tree(dir: &Path) -> Vec<(PathBuf, u64, i64)> {
        let mut all = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let m = p.symlink_metadata().unwrap();
                if m.is_dir() {
                    todo.push(p.clone());
                }
                all.push((p, m.len(), m.mtime_nsec() + m.mtime() * 1_000_000_000));
            }
        }
        all.sort();
        all
    }

    /// `restore --dry-run` says which checkpoint, how many files and bytes, and what it would make
    /// of DEST; it writes nothing (DEST is not created) and shows no progress; it exits 1 when DEST
    /// would be refused, with the restore's own words.
    #[test]
    fn restore_dry_run_writes_nothing() {
        let f = archive();
        let url = f.url.as_str();
        let list: serde_json::Value =
            serde_json::from_slice(&f.run(&["list", url, "--json"]).stdout).unwrap();
        let step100 = listed(&list, "step100");
        let stored = step100["stored_bytes"].as_u64().unwrap();
        let before = tree(f.tmp.path());

        let dest = f.tmp.path().join("new");
        let out = f.restore("latest", &dest, &["--dry-run"]);
        let shown = dest.display();
        assert_eq!(
            succeeded(&out),
            format!(
                "dry run: would restore step100 from {url} into {shown}\n  \
                   4 file(s), 1.4 MiB ({} to download)\n  \
                   {shown} does not exist: the restore would create it\n\
                 Nothing was written; checksums are checked as a restore reads the data.\n",
                sluice_proto::summary::bytes(stored)
            )
        );
        assert_eq!(text(&out.stderr), "", "no progress for a dry run");
        assert!(!dest.exists(), "a dry run created {shown}");

        let out = f.restore("step100", &dest, &["--dry-run", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
        assert_eq!(v["dry_run"], true);
        assert_eq!(v["tag"], "step100");
        assert_eq!(v["dest"], dest.to_str().unwrap());
        assert_eq!(v["dest_state"], "create");
        assert_eq!(
            (
                v["files"].as_u64(),
                v["raw_bytes"].as_u64(),
                v["stored_bytes"].as_u64()
            ),
            (Some(4), Some(1_500_008), Some(stored))
        );
        assert_eq!(v["url"], url);
        assert!(!dest.exists());
        assert_eq!(tree(f.tmp.path()), before, "a dry run changed something");

        // An empty directory would be filled, and stays empty.
        let empty = f.tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let stdout = succeeded(&f.restore("step100", &empty, &["--dry-run"]));
        assert_has(
            &stdout,
            &format!(
                "\n  {} is an empty directory of yours: the restore would fill it\n",
                empty.display()
            ),
        );
        assert!(std::fs::read_dir(&empty).unwrap().next().is_none());

        // Refused, as the restore would refuse it, and left alone: not empty, a missing parent.
        std::fs::write(empty.join("keep"), b"mine").unwrap();
        let out = f.restore("step100", &empty, &["--dry-run"]);
        failed(&out);
        let why = format!(
            "{} is not empty; give the path of a new or empty directory",
            empty.display()
        );
        assert_has(
            &text(&out.stdout),
            &format!("\n  the restore would be refused: {why}\n"),
        );
        assert_eq!(std::fs::read(empty.join("keep")).unwrap(), b"mine");
        let real = failed(&f.restore("step100", &empty, &[]));
        assert_has(&real, &why);
        let out = f.restore("step100", &empty, &["--dry-run", "--json"]);
        failed(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (v["dest_state"].as_str(), v["reason"].as_str()),
            (Some("refused"), Some(why.as_str()))
        );
        let orphan = f.tmp.path().join("no/such/dir");
        let out = f.restore("step100", &orphan, &["--dry-run"]);
        failed(&out);
        assert_has(&text(&out.stdout), "create its parent directory first\n");
        assert!(!f.tmp.path().join("no").exists());

        // A checkpoint that cannot be restored is an error, as for the restore.
        let stderr = failed(&f.restore("step200", &dest, &["--dry-run"]));
        assert_has(&stderr, "has no MANIFEST");
        assert!(!dest.exists());
    }

    /// Issue 25: the CLI (root, reading the archive itself) refuses what the agent refuses: a
    /// destination on proc, sys or a cgroup file system, existing or to be made there, saying
    /// what to do, and creates nothing; the dry run says the same.
    #[test]
    fn kernel_file_systems_are_refused_as_destinations() {
        let f = archive();
        let kernel =
            "is on a kernel file system (proc, sys, cgroup); restore into a directory on a disk";
        // The test's own /proc/PID (the CLI's is gone by the time anyone looks) and a new
        // directory below it.
        let proc_dir = PathBuf::from(format!("/proc/{}", std::process::id()));
        for dest in [proc_dir.clone(), proc_dir.join("sluice-restore")] {
            let stderr = failed(&f.restore("step100", &dest, &[]));
            assert_has(&stderr, &format!("{} {kernel}", dest.display()));
            let out = f.restore("latest", &dest, &["--dry-run"]);
            failed(&out);
            assert_has(
                &text(&out.stdout),
                &format!("the restore would be refused: {} {kernel}", dest.display()),
            );
        }
        assert!(!proc_dir.join("sluice-restore").exists());
        // A cgroup file system wherever it is mounted (under a tmpfs with cgroup v1).
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let cgroup = mounts
            .lines()
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .find(|f| f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2"))
            .map(|f| PathBuf::from(f[1]));
        if let Some(cgroup) = cgroup {
            // Root making a directory there would make a cgroup.
            let made = cgroup.join("sluice-restore-test");
            let stderr = failed(&f.restore("step100", &made, &[]));
            let created = made.exists();
            if created {
                let _ = std::fs::remove_dir(&made);
            }
            assert!(!created, "a cgroup was created");
            assert_has(&stderr, &format!("{} {kernel}", made.display()));
            let stderr = failed(&f.restore("step100", &cgroup, &[]));
            assert_has(&stderr, &format!("{} {kernel}", cgroup.display()));
        }
    }

    /// Publishes `tags` (the fixture's files) in the fixture's archive as this process's user's,
    /// one after the other, so that whoever runs the tests owns them.
    fn publish_mine(f: &Fixture, tags: &[&str]) {
        let toml = std::fs::read_to_string(&f.config).unwrap();
        let cfg = Config::parse(&toml, "n1", sluice_archive::upload_memory).unwrap();
        let archiver = sluice_archive::open_archive(&cfg, &f.url).unwrap();
        let uid = nix::unistd::geteuid();
        let me = nix::unistd::User::from_uid(uid).unwrap().unwrap().name;
        let src = f.tmp.path().join("src");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for tag in tags {
                assert!(publish(&archiver, &src, tag, &["n1"], &me).await);
                // MANIFEST times are in milliseconds: keep the order unambiguous.
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
    }

    /// `sluice ckpt poison URL TAG`: the mark is written once (the second run says so and keeps
    /// the first reason), `list` shows it, `restore latest` passes over it saying why, a named
    /// restore is refused (nothing written) unless --force.
    #[test]
    fn poison_marks_once_list_shows_it_and_restore_needs_force() {
        let f = archive();
        publish_mine(&f, &["mine-1", "mine-2"]);
        let url = f.url.as_str();
        let out = f.run(&["poison", url, "mine-2", "--reason", "loss is NaN at step 3"]);
        let stdout = succeeded(&out);
        assert_starts(
            &stdout,
            &format!("poisoned mine-2 in {url}: marked bad by "),
        );
        assert_has(&stdout, ": loss is NaN at step 3\n");
        assert_has(
            &stdout,
            "--ckpt-restore=mine-2! or sluice ckpt restore --force",
        );
        let mark = f.archive_dir().join("mine-2/POISON");
        let first = std::fs::read(&mark).unwrap();
        let again = succeeded(&f.run(&["poison", url, "mine-2", "--reason", "other"]));
        assert_starts(
            &again,
            &format!("checkpoint mine-2 in {url} is poisoned already ("),
        );
        assert_has(&again, "loss is NaN at step 3); the first mark stays");
        assert_eq!(
            std::fs::read(&mark).unwrap(),
            first,
            "the mark was rewritten"
        );

        // list: the state says it, a note says why; --json carries the mark.
        let listed = succeeded(&f.run(&["list", url]));
        let line = listed.lines().find(|l| l.starts_with("mine-2 ")).unwrap();
        assert_eq!(line.split_whitespace().nth(1), Some("poisoned"), "{listed}");
        assert_has(&listed, "mine-2: poisoned (marked bad by ");
        let doc: serde_json::Value =
            serde_json::from_slice(&f.run(&["list", url, "--json"]).stdout).unwrap();
        assert_eq!(
            listed_json(&doc, "mine-2")["poison"]["reason"],
            "loss is NaN at step 3"
        );
        assert!(
            listed_json(&doc, "mine-1").get("poison").is_none(),
            "{doc:#}"
        );

        // restore: latest is mine-1 (said on stderr); mine-2 refused, then forced.
        let dest = f.tmp.path().join("latest");
        let out = f.restore("latest", &dest, &["--quiet"]);
        assert_starts(&succeeded(&out), "restored mine-1 from ");
        assert_has(&text(&out.stderr), "checkpoint mine-2 in ");
        assert_has(
            &text(&out.stderr),
            "loss is NaN at step 3); skipped it for the next newest",
        );
        let dest = f.tmp.path().join("named");
        let stderr = failed(&f.restore("mine-2", &dest, &["--quiet"]));
        assert_has(&stderr, "checkpoint mine-2 is poisoned (marked bad by ");
        assert_has(
            &stderr,
            "sluice ckpt restore --force, or --ckpt-restore=mine-2!",
        );
        assert!(!dest.exists(), "a refused restore left {}", dest.display());
        let out = f.restore("mine-2", &dest, &["--quiet", "--force"]);
        assert_starts(&succeeded(&out), "restored mine-2 from ");
        assert_has(&text(&out.stderr), "restored anyway, as forced");
        assert_restored(&dest);
    }

    /// Bad input is refused before anything is written: no reason, an empty one, `latest`.
    #[test]
    fn poison_needs_a_tag_and_a_reason() {
        let f = archive();
        let url = f.url.as_str();
        let out = f.run(&["poison", url, "step100"]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert_has(&text(&out.stderr), "--reason <TEXT>");
        let stderr = failed(&f.run(&["poison", url, "step100", "--reason", " "]));
        assert_has(&stderr, "give a reason");
        let stderr = failed(&f.run(&["poison", url, "latest", "--reason", "x"]));
        assert_has(&stderr, "name the checkpoint to poison");
        assert!(!f.archive_dir().join("step100/POISON").exists());
    }

    fn listed_json<'a>(list: &'a serde_json::Value, tag: &str) -> &'a serde_json::Value {
        listed(list, tag)
    }
}
