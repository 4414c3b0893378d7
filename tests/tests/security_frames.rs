//! Hostile frames on the agent socket (docs/SECURITY.md, "Input limits"): an unprivileged user sends
//! oversized, truncated, malformed and foreign-version frames straight to a node's agent. Each is
//! refused with a clear `bad_request` reply, the agent process survives (same pid, no panic in its
//! log), keeps answering, and a job on that node still stages and runs.

use crate::common::*;
use crate::security_support::*;
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

const JOB_TIMEOUT: Duration = Duration::from_secs(180);
const NODE: &str = "n2";
const MAX_FRAME: usize = sluice_proto::wire::MAX_FRAME;

/// How often `needle` occurs in the agent log of `node`.
fn in_agent_log(cluster: &Cluster, node: &str, needle: &str) -> usize {
    std::fs::read_to_string(cluster.agent_log(node))
        .unwrap_or_default()
        .matches(needle)
        .count()
}

/// No failure was recorded while `what` ran against the agent of NODE, and it is still the same
/// process (`pid`).
fn assert_agent_unhurt(cluster: &Cluster, failures: &[String], what: &str, pid: u32) {
    assert!(
        failures.is_empty(),
        "{what} on {}:\n{}\n{}",
        cluster.agent_socket(NODE).display(),
        failures.join("\n"),
        cluster.log_tails()
    );
    assert_eq!(
        cluster.agent_pid(NODE),
        pid,
        "the agent of {NODE} was restarted"
    );
}

/// (case, what the agent's bad_request message must say).
fn hostile_frames() -> Vec<(Value, &'static str)> {
    let nested = format!(
        r#"{{"version":1,"request":{{"op":"status"}},"x":{}}}"#,
        "[".repeat(100_000)
    );
    vec![
        (
            json!({"name": "header 0xFFFFFFFF", "header": u32::MAX, "body": "{}"}),
            "larger than the 1048576-byte limit",
        ),
        (
            json!({"name": "2 MiB body", "header": 2 * MAX_FRAME, "body_repeat": [97, 2 * MAX_FRAME]}),
            "larger than the 1048576-byte limit",
        ),
        (
            json!({"name": "1 byte over the limit", "header": MAX_FRAME + 1, "body": "{"}),
            "larger than the 1048576-byte limit",
        ),
        (
            json!({"name": "garbage JSON", "body": "this is not json {{{"}),
            "malformed frame",
        ),
        (
            json!({"name": "binary garbage", "body": "\u{ff}\u{fe}\u{0}\u{1}"}),
            "malformed frame",
        ),
        (
            json!({"name": "empty frame", "header": 0, "body": ""}),
            "malformed frame",
        ),
        (
            json!({"name": "deep nesting", "body": nested}),
            "malformed frame",
        ),
        (
            json!({"name": "unknown op", "body": r#"{"version":1,"request":{"op":"shutdown"}}"#}),
            "malformed frame",
        ),
        (
            json!({"name": "job id out of range", "body": r#"{"version":1,"request":{"op":"job","job_id":4294967296}}"#}),
            "malformed frame",
        ),
        (
            json!({"name": "wrong version", "version": 2, "request": {"op": "status"}}),
            "protocol version 2 is not supported",
        ),
        (
            json!({"name": "version 0", "version": 0, "request": {"op": "status"}}),
            "protocol version 0 is not supported",
        ),
        (
            json!({"name": "truncated body", "header": 100, "body": "{\"version\"", "shutdown": true}),
            "i/o",
        ),
    ]
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_oversized_and_malformed_frames_are_refused_and_the_agent_keeps_serving() {
    let cluster = Cluster::for_sluice();
    let b = cluster.other_user.clone();
    let (socket, pid) = (cluster.agent_socket(NODE), cluster.agent_pid(NODE));
    let panics = in_agent_log(&cluster, NODE, "panicked");

    let cases = hostile_frames();
    let spec: Vec<Value> = cases.iter().map(|(c, _)| c.clone()).collect();
    let started = Instant::now();
    let replies = raw_requests(&cluster, &b, &socket, Value::Array(spec));
    let mut failures = Vec::new();
    for ((_, needle), r) in cases.iter().zip(&replies) {
        match r.error() {
            Some((code, message)) if code == "bad_request" && message.contains(needle) => {
                eprintln!("{}: refused: {message}", r.name)
            }
            _ => failures.push(format!(
                "{}: expected bad_request '{needle}', got {}",
                r.name, r.value
            )),
        }
    }
    // Refusals are quick: the oversized frames are refused from their header, not read.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refusing {} frames took {:?}",
        cases.len(),
        started.elapsed()
    );

    // The largest legal frame (1 MiB: JSON padded with whitespace) is read and answered.
    let body = r#"{"version":1,"request":{"op":"status"}}"#;
    let padded = format!("{}{body}", " ".repeat(MAX_FRAME - body.len()));
    let big = raw_requests(
        &cluster,
        &b,
        &socket,
        json!([{"name": "1 MiB frame", "body": padded}]),
    );
    if big[0].result() != Some("status") {
        failures.push(format!(
            "a frame of exactly {MAX_FRAME} bytes: {}",
            big[0].value
        ));
    }

    // A burst of 200 oversized headers in a row: no slot, memory or fd is kept for them.
    let burst: Vec<Value> = (0..200)
        .map(|i| json!({"name": format!("burst {i}"), "header": u32::MAX, "body": ""}))
        .collect();
    let refused = raw_requests(&cluster, &b, &socket, Value::Array(burst))
        .iter()
        .filter(|r| r.error().is_some_and(|(c, _)| c == "bad_request"))
        .count();
    if refused != 200 {
        failures.push(format!(
            "only {refused} of 200 oversized frames in a burst were refused"
        ));
    }

    // The agent is the same process, logged no panic, and answers a plain request.
    let after = raw_requests(
        &cluster,
        &b,
        &socket,
        json!([{"name": "status", "request": {"op": "status"}}]),
    );
    if after[0].result() != Some("status") {
        failures.push(format!(
            "'status' after the hostile frames: {}",
            after[0].value
        ));
    }
    assert_agent_unhurt(&cluster, &failures, &format!("hostile frames as {b}"), pid);
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "the agent of {NODE} (pid {pid}) died:\n{}",
        cluster.log_tails()
    );
    assert_eq!(
        in_agent_log(&cluster, NODE, "panicked"),
        panics,
        "the agent of {NODE} logged a panic:\n{}",
        cluster.log_tails()
    );

    // A job on that node still stages and runs.
    let data = cluster.data_dir("sec-frames");
    std::fs::write(data.join("f.txt"), b"still serving\n").unwrap();
    let work = cluster.workdir("sec-frames");
    let job = cluster.submit(
        &work,
        &[
            "-N1",
            &format!("--nodelist={NODE}"),
            &format!("--stage-in=ds={}", data.display()),
        ],
        "#!/bin/bash\nsrun -n1 bash -c 'cat \"$SLUICE_STAGE_DIR/ds/f.txt\"'\n",
    );
    cluster.assert_completes(&job, JOB_TIMEOUT, "a staging job after the hostile frames");
    assert!(
        job.output_text().contains("still serving"),
        "{}",
        cluster.evidence(&job)
    );
    cluster.assert_nodes_return_idle(&job, Duration::from_secs(60));
}

/// Sockets the process holds open (its agent connections and listener, for the agent).
fn socket_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// F4 (docs/SECURITY.md): one local user must not starve the agent socket. User B keeps 1100
/// connections open for 10 s, reopening each one the agent closes, and sends nothing on any of them.
/// Meanwhile user A's and root's (the prolog's) requests are answered within 5 s each, the agent holds
/// no more of B's connections than its per-user cap, closes silent ones after the header timeout,
/// and B is served normally once it lets go.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_idle_connections_of_one_user_do_not_starve_others() {
    const PER_USER: usize = 64; // agent/src/server.rs: MAX_PER_USER
    let cluster = Cluster::for_sluice();
    let (socket, pid) = (cluster.agent_socket(NODE), cluster.agent_pid(NODE));
    let sockets_before = socket_fds(pid);
    let refusals_logged = || in_agent_log(&cluster, NODE, "connections to the agent");
    let logged_before = refusals_logged();
    // B: 1100 connections (raising its fd limit to hold them), each reopened as soon as the agent
    // closes it, for 10 s; then a JSON line of counts.
    let hog = format!(
        r#"
import json, resource, selectors, socket, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
sel = selectors.DefaultSelector()
st = {{"connects": 0, "connect_errors": 0, "closed_by_agent": 0, "first_errors": []}}
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    try:
        s.connect("{sock}")
    except OSError as e:
        st["connect_errors"] += 1
        if len(st["first_errors"]) < 3:
            st["first_errors"].append(str(e))
        s.close()
        return
    s.setblocking(False)
    st["connects"] += 1
    sel.register(s, selectors.EVENT_READ)
for i in range(1100):
    connect()
print("holding", len(sel.get_map()), flush=True)
end = time.time() + 10
while time.time() < end:
    for key, _ in sel.select(timeout=0.1):
        sel.unregister(key.fileobj)
        key.fileobj.close()
        st["closed_by_agent"] += 1
        connect()
    while len(sel.get_map()) < 1100 and time.time() < end:
        connect()
st["held_at_end"] = len(sel.get_map())
print(json.dumps(st), flush=True)
"#,
        sock = socket.display()
    );
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let hog_proc = std::process::Command::new("runuser")
        .args(["-u", &b, "--", "/usr/bin/python3", "-c", &hog])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    // Three rounds while B hogs: A's status (as A, through the raw client) and root's status.
    let mut failures = Vec::new();
    let mut waits = Vec::new();
    let mut max_sockets = 0;
    for round in 0..3 {
        let started = Instant::now();
        let r = raw_requests(
            &cluster,
            &a,
            &socket,
            json!([{"name": "status while B hogs", "request": {"op": "status"}, "timeout": 5}]),
        );
        let waited_a = started.elapsed();
        if r[0].result() != Some("status") {
            failures.push(format!(
                "round {round}: {a}'s status got {} after {waited_a:?}",
                r[0].value
            ));
        }
        let started = Instant::now();
        let root = sluice_proto::client::call(
            &socket,
            sluice_proto::msg::Request::Status,
            Duration::from_secs(5),
        );
        let waited_root = started.elapsed();
        if !matches!(root, Ok(sluice_proto::msg::Response::Status(_))) {
            failures.push(format!(
                "round {round}: root's status got {root:?} after {waited_root:?}"
            ));
        }
        waits.push((waited_a, waited_root));
        for _ in 0..5 {
            max_sockets = max_sockets.max(socket_fds(pid));
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let out = hog_proc.wait_with_output().unwrap();
    let hog_said = String::from_utf8_lossy(&out.stdout).to_string();
    let counts: Value = hog_said
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    eprintln!(
        "{b} hogging {NODE}: {}; waits (A, root): {waits:?}; agent sockets before {sockets_before}, \
         at most {max_sockets} during",
        hog_said.trim()
    );
    // The hog really hogged: all its connections got in (else this test would prove nothing).
    let connects = counts["connects"].as_u64().unwrap_or(0);
    assert!(
        connects >= 1100,
        "the hog did not get its connections in: {hog_said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if max_sockets > sockets_before + PER_USER + 8 {
        failures.push(format!(
            "the agent held {max_sockets} sockets while {b} hogged ({sockets_before} before): more \
             than {PER_USER} of one user's connections"
        ));
    }
    // Once B lets go, B itself is served again, and the agent is the same process.
    let after = raw_requests(
        &cluster,
        &b,
        &socket,
        json!([{"name": "status after the hog", "request": {"op": "status"}, "timeout": 5}]),
    );
    if after[0].result() != Some("status") {
        failures.push(format!("{b}'s own status afterwards: {}", after[0].value));
    }
    let what = format!("{b} holding idle connections");
    assert_agent_unhurt(&cluster, &failures, &what, pid);
    assert!(
        refusals_logged() > logged_before,
        "the agent did not log the refused connections in {}",
        cluster.agent_log(NODE).display()
    );
}
