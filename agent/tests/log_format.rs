//! `[agent] log_format = "json"`: the running agent writes one JSON object per line on stderr, as a
//! log shipper expects, from its first line on. Runs `sluiced` itself, so it needs root (the agent
//! refuses to start otherwise: its state and hot tier are root's).

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs root, like sluiced; run as root with --ignored, as tests/harness/run-e2e.sh does"]
fn the_agent_logs_json_lines_when_asked() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root, like sluiced"
    );
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = tmp.path().display();
    let cfg = tmp.path().join("sluice.toml");
    std::fs::write(
        &cfg,
        format!(
            "[agent]\nsocket = '{r}/%n.sock'\nstate_dir = '{r}/state/%n'\nsqueue = ''\n\
             log_format = 'json'\n[hot_tier]\nroot = '{r}/hot/%n'\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut agent = Command::new(env!("CARGO_BIN_EXE_sluiced"))
        .args(["--config", cfg.to_str().unwrap(), "--node", "n7"])
        .env_remove("SLUICE_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(agent.stderr.take().unwrap());
    let started = Instant::now();
    let mut ready = None;
    let mut seen = Vec::new();
    let mut stderr_lines = stderr.lines();
    for line in stderr_lines.by_ref() {
        let line = line.unwrap();
        let parsed: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        if parsed["message"] == "sluiced ready" {
            ready = Some(parsed);
            break;
        }
        seen.push(line);
        if started.elapsed() > Duration::from_secs(20) {
            break;
        }
    }
    let ready = ready.unwrap_or_else(|| panic!("no 'sluiced ready' line: {seen:#?}"));
    assert_eq!(ready["level"], "INFO", "{ready}");
    assert_eq!(ready["node"], "n7", "{ready}");
    assert!(ready["timestamp"].is_string(), "{ready}");

    // A job starts and ends: what the agent logs while answering its requests (here the job end)
    // carries the job's id and user, like its staging does.
    use sluice_proto::msg::{Request, Response};
    use sluice_proto::testing::nobody_job;
    let socket = tmp.path().join("n7.sock");
    let call = |r: Request| sluice_proto::client::call(&socket, r, Duration::from_secs(10));
    let start = nobody_job(4242, "n7", "logs", vec![("ckpt-keep".into(), "2".into())]);
    assert!(matches!(call(Request::JobStart(start)), Ok(Response::Ok)));
    assert!(matches!(
        call(Request::JobEnd { job_id: 4242 }),
        Ok(Response::Ok)
    ));
    let mut ended = None;
    let mut lines = stderr_lines;
    while started.elapsed() < Duration::from_secs(30) {
        let Some(Ok(line)) = lines.next() else { break };
        let parsed: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        if parsed["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("job ended; removed"))
        {
            ended = Some(parsed);
            break;
        }
        seen.push(line);
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let ended = ended.unwrap_or_else(|| panic!("no 'job ended' line: {seen:#?}"));
    assert_eq!(ended["span"]["job_id"], 4242, "{ended}");
    assert_eq!(ended["span"]["user"], "nobody", "{ended}");
}
