//! End to end: the `sluice` binary against a fake agent that speaks the real framing
//! (`sluice_proto::wire`) on a temp socket and answers one request with a canned response.
//! The real agent is tested in its own crate; this proves the CLI's side of the socket.

#[path = "../src/fixtures.rs"]
mod fixtures;

use sluice_proto::msg::{ErrorCode, ErrorReply, JobStatus, NodeStatus, Request, Response};
use sluice_proto::wire;
use std::os::unix::net::UnixListener;
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

/// Runs `sluice` with a clean environment as far as sluice is concerned, plus `env`.
fn sluice(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.args(args)
        .env_remove("SLUICE_SOCKET")
        .env_remove("SLURMD_NODENAME");
    cmd.envs(env.iter().copied());
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

struct Dir {
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

fn temp_socket() -> Dir {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    Dir { _dir: dir, socket }
}

#[test]
fn status_shows_the_node_and_its_jobs() {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, Response::Status(fixtures::node_status()));
    let out = sluice(&["--socket", d.socket.to_str().unwrap(), "status"], &[]);
    assert_eq!(agent.join().unwrap(), Request::Status);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.starts_with("node      gpu07\n"), "{stdout}");
    assert!(
        stdout.contains("\nJOBID  USER   STATE    DATASETS  "),
        "{stdout}"
    );
    assert!(
        stdout.contains("\n4250   bob    failed   corpus  "),
        "{stdout}"
    );
    assert!(out.stderr.is_empty());
}

#[test]
fn status_json_is_the_agents_answer() {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, Response::Status(fixtures::node_status()));
    let out = sluice(
        &["status", "--json", "--socket", d.socket.to_str().unwrap()],
        &[],
    );
    agent.join().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let parsed: NodeStatus = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(parsed, fixtures::node_status());
}

#[test]
fn job_shows_every_dataset() {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, Response::Job(fixtures::staging_job()));
    let out = sluice(
        &["--socket", d.socket.to_str().unwrap(), "job", "4242"],
        &[],
    );
    assert_eq!(agent.join().unwrap(), Request::Job { job_id: 4242 });
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with("job 4242  staging\n  user       alice (uid 1000)\n"),
        "{stdout}"
    );
    assert!(stdout.contains("  imagenet  copying\n    source   s3://datasets/imagenet\n    files    812/1000 (81%)\n"), "{stdout}");
    assert!(
        stdout.contains("  weights  listing\n    source   /lustre/models/llama-8b\n"),
        "{stdout}"
    );
}

#[test]
fn job_json_round_trips() {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, Response::Job(fixtures::failed_job()));
    let out = sluice(
        &[
            "--socket",
            d.socket.to_str().unwrap(),
            "job",
            "4250",
            "--json",
        ],
        &[],
    );
    assert_eq!(agent.join().unwrap(), Request::Job { job_id: 4250 });
    assert!(out.status.success(), "{}", text(&out.stderr));
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
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn agent_errors_are_printed_as_the_agent_wrote_them() {
    let d = temp_socket();
    let message =
        "job 7 is not on this node; run `sluice job` on one of its nodes (squeue -j 7 -o %N)";
    let agent = fake_agent(
        &d.socket,
        Response::Error(ErrorReply::new(ErrorCode::NotFound, message)),
    );
    let out = sluice(&["--socket", d.socket.to_str().unwrap(), "job", "7"], &[]);
    agent.join().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr), format!("sluice: {message}\n"));
    assert!(out.stdout.is_empty());
}

#[test]
fn unreachable_agent_names_the_socket_and_what_to_check() {
    let d = temp_socket();
    let out = sluice(
        &["status"],
        &[("SLUICE_SOCKET", d.socket.to_str().unwrap())],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let want = format!(
        "sluice: cannot reach the sluice agent at {} (from $SLUICE_SOCKET): ",
        d.socket.display()
    );
    assert!(stderr.starts_with(&want), "{stderr}");
    assert!(
        stderr.contains("check that sluiced runs on this node") && stderr.contains("--socket PATH"),
        "{stderr}"
    );
}

#[test]
fn a_silent_agent_times_out() {
    let d = temp_socket();
    let listener = UnixListener::bind(&d.socket).unwrap();
    // Reads the request, then waits for the client to hang up: no sleeps, no answer.
    let agent = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        wire::read_frame(&mut stream).unwrap();
        assert!(wire::read_frame(&mut stream).is_err());
    });
    let out = sluice(
        &[
            "--socket",
            d.socket.to_str().unwrap(),
            "--timeout",
            "0.2",
            "status",
        ],
        &[],
    );
    agent.join().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("did not answer within 200ms") && stderr.contains("--timeout"),
        "{stderr}"
    );
}

#[test]
fn an_agent_answering_the_wrong_thing_is_reported() {
    let d = temp_socket();
    let agent = fake_agent(&d.socket, Response::Ok);
    let out = sluice(&["--socket", d.socket.to_str().unwrap(), "status"], &[]);
    agent.join().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("answered a status request with 'ok'"),
        "{stderr}"
    );
}

#[test]
fn an_agent_hanging_up_is_reported() {
    let d = temp_socket();
    let listener = UnixListener::bind(&d.socket).unwrap();
    let agent = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        wire::read_frame(&mut stream).unwrap();
    });
    let out = sluice(&["--socket", d.socket.to_str().unwrap(), "job", "1"], &[]);
    agent.join().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("closed the connection without answering"),
        "{stderr}"
    );
}
