//! Plugin and agent of different protocol versions (issue 4: "a version mismatch between plugin and
//! agent is refused with a clear job-level error"), during a rolling upgrade where slurmd's plugin and
//! the node's agent were updated at different times.
//!
//! Stand-in: the cluster has one build of sluice, so a small relay on the node's agent socket plays the
//! plugin of the next protocol version — it forwards every request of the real plugin to the real
//! agent with the envelope's `version` raised by one, and the replies back unchanged. Both ends are the
//! real programs; only the version number differs.

use crate::common::*;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

const NODE: &str = "n2";
const JOB_TIMEOUT: Duration = Duration::from_secs(180);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Moves the agent's socket aside (the agent keeps serving the moved inode) and listens at its path,
/// relaying with the version raised. Dropping it puts the real socket back.
struct NewerPlugin {
    path: PathBuf,
    real: PathBuf,
}

impl NewerPlugin {
    fn start(socket: &Path) -> NewerPlugin {
        let real = socket.with_extension("sock.real");
        std::fs::rename(socket, &real)
            .unwrap_or_else(|e| panic!("move {} aside: {e}", socket.display()));
        let relay = NewerPlugin {
            path: socket.to_path_buf(),
            real: real.clone(),
        };
        let listener = UnixListener::bind(socket).expect("bind the relay");
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666)).unwrap();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let real = real.clone();
                std::thread::spawn(move || relay_one(client, &real));
            }
        });
        relay
    }
}

impl Drop for NewerPlugin {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        std::fs::rename(&self.real, &self.path).expect("put the agent's socket back");
    }
}

fn read_frame(s: &mut UnixStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

fn write_frame(s: &mut UnixStream, body: &[u8]) -> Option<()> {
    s.write_all(&(body.len() as u32).to_be_bytes()).ok()?;
    s.write_all(body).ok()
}

fn relay_one(mut client: UnixStream, real: &Path) -> Option<()> {
    let request = read_frame(&mut client)?;
    let mut envelope: serde_json::Value = serde_json::from_slice(&request).ok()?;
    envelope["version"] = (sluice_proto::PROTO_VERSION + 1).into();
    let mut agent = UnixStream::connect(real).ok()?;
    write_frame(&mut agent, &serde_json::to_vec(&envelope).unwrap())?;
    let reply = read_frame(&mut agent)?;
    write_frame(&mut client, &reply)
}

#[test]
#[ignore = "needs the local Slurm cluster: tests/harness/run-e2e.sh"]
fn a_plugin_of_another_protocol_version_fails_the_job_with_a_clear_message_and_the_node_stays_up() {
    let cluster = Cluster::for_sluice();
    let test = "version_skew";
    let data = cluster.dataset(test, false);
    let work = cluster.workdir(test);
    let (staged_script, ran) = marker_script(&work);
    let stage = format!("--stage-in=train={}", data.display());
    let on_node = format!("--nodelist={NODE}");

    let skewed = {
        let _relay = NewerPlugin::start(&cluster.agent_socket(NODE));
        let job = cluster.submit(&work, &["-N1", &on_node, &stage], &staged_script);
        let end = cluster.wait_end(&job, JOB_TIMEOUT);
        // A job without sluice options never talks to the agent: a skew must not touch it.
        let plain = cluster.submit(&work, &["-N1", &on_node], "#!/bin/bash\nsrun true\n");
        let plain_end = cluster.wait_end(&plain, JOB_TIMEOUT);
        cluster.assert_ended(
            &plain,
            &plain_end,
            "COMPLETED",
            "a plain job failed during the skew",
        );
        (job, end)
    };
    let (job, end) = skewed;
    let why = "a job staged through a plugin of another protocol version cannot succeed";
    cluster.assert_ended(&job, &end, "FAILED", why);
    cluster.assert_script_did_not_run(&job, &ran, "it has no dataset");
    let output = job.output_text();
    let expected = format!(
        "protocol version {} is not supported",
        sluice_proto::PROTO_VERSION + 1
    );
    assert!(
        output.contains(&expected) && output.contains("install matching sluice versions"),
        "the job output must say the versions differ and what to do; it is:\n{output}\n{}",
        cluster.evidence(&job)
    );
    cluster.assert_nodes_return_idle(&job, CLEANUP_TIMEOUT);

    // With matching versions again the same node stages the same dataset.
    std::fs::remove_file(&ran).ok();
    let again = cluster.submit(&work, &["-N1", &on_node, &stage], &staged_script);
    let again_end = cluster.wait_end(&again, JOB_TIMEOUT);
    cluster.assert_ended(
        &again,
        &again_end,
        "COMPLETED",
        "after the skew the node's agent must serve jobs again",
    );
    assert!(ran.exists(), "the job script did not run after the skew");
    cluster.assert_nodes_return_idle(&again, CLEANUP_TIMEOUT);
    cluster.assert_hot_tier_cleaned(&again, CLEANUP_TIMEOUT);
}
