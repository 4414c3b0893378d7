//! `sluice doctor` on the test cluster's node n1, as root: every check passes on the healthy node,
//! and each thing an admin can get wrong (agent stopped, config readable by others or not readable
//! by the caller, plugstack without the plugin or with it optional) fails or warns in its own check,
//! with its fix, without hiding the other checks. What the test breaks is a copy (`--config`,
//! `--plugstack`) or the agent, which it starts again.

use crate::common::*;
use serde_json::Value;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const NODE: &str = "n1";

struct Doctor {
    ok: bool,
    checks: Vec<Value>,
    text: String,
}

impl Doctor {
    fn check(&self, name: &str) -> &Value {
        self.checks
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no check {name:?} in:\n{}", self.text))
    }

    fn status(&self, name: &str) -> &str {
        self.check(name)["status"].as_str().unwrap()
    }

    fn field(&self, name: &str, field: &str) -> String {
        self.check(name)[field]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Asserts that the check `name`'s `field` (detail, fix) says `words`.
    #[track_caller]
    fn assert_says(&self, name: &str, field: &str, words: &str) {
        assert!(self.field(name, field).contains(words), "{}", self.text);
    }

    fn assert_pass(&self, names: &[&str]) {
        for name in names {
            assert_eq!(self.status(name), "pass", "{name}:\n{}", self.text);
        }
    }
}

fn parse(out: std::process::Output) -> Doctor {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let checks: Vec<Value> = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}):\n{text}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    Doctor {
        ok: out.status.success(),
        checks,
        text,
    }
}

/// `sluice doctor --json --node n1 ARGS` as root.
fn doctor(args: &[&str]) -> Doctor {
    let out = Command::new(built_cli())
        .args(["doctor", "--json", "--node", NODE])
        .args(args)
        .output()
        .expect("run sluice doctor");
    parse(out)
}

/// A root-only directory for the test's copies of the configuration and plugstack.conf.
fn scratch(cluster: &Cluster) -> PathBuf {
    let dir = PathBuf::from(cluster.var("SLUICE_TEST_ROOT"))
        .join("e2e")
        .join(format!("doctor-{}", unique()));
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// The agents' configuration without the store profile that only a test's own relay serves (no
/// relay runs here, so that store is rightly unreachable), root-only like the original.
fn config_copy(dir: &Path) -> PathBuf {
    let text = fs::read_to_string("/etc/sluice/sluice.toml").expect("the agents' config");
    let mut cfg: toml::Table = text.parse().expect("config is TOML");
    cfg["store"]
        .as_array_mut()
        .expect("[[store]] profiles")
        .retain(|s| s["prefix"].as_str() != Some("s3://datasets-relayed"));
    let path = dir.join("sluice.toml");
    fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// Starts the agent again when the test ends, however it ends.
struct Restart<'a>(&'a Cluster, Option<AgentProcess>);

impl Drop for Restart<'_> {
    fn drop(&mut self) {
        if let Some(agent) = self.1.take() {
            self.0.start_agent(&agent);
        }
    }
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn doctor_passes_on_a_healthy_node_and_names_each_fault_with_its_fix() {
    let cluster = Cluster::for_s3();
    // ckpt-faulty's profile goes through the tests' fault proxy: let it pass requests through.
    let _proxy = FaultProxy::start(&cluster);
    let dir = scratch(&cluster);
    let config = config_copy(&dir);
    let config_arg = config.to_str().unwrap();

    // Healthy: every check passes, and doctor says so in its exit status.
    let healthy = doctor(&["--config", config_arg]);
    healthy.assert_pass(&[
        "config",
        "agent",
        "plugstack",
        "plugin version",
        "prolog flags",
        "store s3://",
        "store s3://ckpt-faulty",
        "store az://",
        "squeue",
    ]);
    // The clocks of Garage and Azurite are this machine's: each endpoint's check passes.
    let s3 = cluster.var("SLUICE_TEST_S3_ENDPOINT");
    healthy.assert_pass(&[
        &format!("clock vs {}", s3.trim_end_matches('/')),
        "clock vs http://127.0.0.1:10000",
    ]);
    // The shared tier's stand-in is a plain directory: a warning (not Lustre), never a failure.
    assert_eq!(healthy.status("shared tier"), "warn", "{}", healthy.text);
    assert!(
        healthy.ok,
        "doctor failed on a healthy node:\n{}",
        healthy.text
    );
    healthy.assert_says("agent", "detail", "/run/sluice/n1.sock");
    healthy.assert_says("plugin version", "detail", "built for Slurm 22.05");
    // The hot tier may be above high water on a busy machine (a warning), never failing here.
    let hot = healthy.field("hot tier", "detail");
    assert_ne!(healthy.status("hot tier"), "fail", "{}", healthy.text);
    assert!(
        hot.contains(&cluster.hot_root(NODE).display().to_string())
            && hot.contains("O_DIRECT works"),
        "{}",
        healthy.text
    );
    // The human view: one line per check.
    let human = Command::new(built_cli())
        .args(["doctor", "--node", NODE, "--config", config_arg])
        .output()
        .unwrap();
    let human = String::from_utf8_lossy(&human.stdout).into_owned();
    assert!(human.contains("PASS  agent: sluiced "), "{human}");
    assert!(
        human.contains("PASS  plugstack: /etc/slurm/plugstack.conf:"),
        "{human}"
    );

    // The configuration readable by others: the config check fails with chmod, the rest still run.
    fs::set_permissions(&config, fs::Permissions::from_mode(0o644)).unwrap();
    let open = doctor(&["--config", config_arg]);
    assert!(!open.ok, "{}", open.text);
    assert_eq!(open.status("config"), "fail", "{}", open.text);
    open.assert_says("config", "detail", "mode 0644");
    assert_eq!(
        open.field("config", "fix"),
        format!("chmod 600 {config_arg}")
    );
    open.assert_pass(&["agent", "plugstack", "store s3://"]);
    fs::set_permissions(&config, fs::Permissions::from_mode(0o600)).unwrap();

    // Run by a user, who cannot read the root-only config: a warning that doctor needs root.
    let out = cluster.as_user(
        &cluster.user_home(),
        cluster.user_cli().to_str().unwrap(),
        &["doctor", "--json", "--node", NODE, "--config", config_arg],
        None,
    );
    let user = parse(out);
    assert_eq!(user.status("config"), "warn", "{}", user.text);
    user.assert_says("config", "detail", "doctor needs root");

    // A plugstack.conf without the plugin's line (commented out), then with it optional.
    let real = fs::read_to_string("/etc/slurm/plugstack.conf").unwrap();
    let plugstack = dir.join("plugstack.conf");
    let commented: String = real
        .lines()
        .map(|l| {
            if l.contains("spank_sluice.so") {
                format!("# {l}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    fs::write(&plugstack, commented).unwrap();
    let plugstack_arg = plugstack.to_str().unwrap();
    let missing = doctor(&["--config", config_arg, "--plugstack", plugstack_arg]);
    assert!(!missing.ok, "{}", missing.text);
    assert_eq!(missing.status("plugstack"), "fail", "{}", missing.text);
    missing.assert_says(
        "plugstack",
        "fix",
        "required /usr/local/lib/sluice/spank_sluice.so",
    );
    assert_eq!(missing.status("plugin version"), "warn", "{}", missing.text);
    missing.assert_pass(&["config", "agent"]);
    fs::write(&plugstack, real.replace("required ", "optional ")).unwrap();
    let optional = doctor(&["--config", config_arg, "--plugstack", plugstack_arg]);
    assert_eq!(optional.status("plugstack"), "warn", "{}", optional.text);
    optional.assert_says(
        "plugstack",
        "detail",
        "a failed stage-in does not stop the job",
    );
    assert!(
        optional.ok,
        "a warning alone does not fail doctor:\n{}",
        optional.text
    );

    // The node's agent stopped: the agent check fails with how to start it; it is started again.
    let restart = Restart(&cluster, Some(cluster.kill_agent(NODE)));
    let stopped = doctor(&["--config", config_arg]);
    assert!(!stopped.ok, "{}", stopped.text);
    assert_eq!(stopped.status("agent"), "fail", "{}", stopped.text);
    assert_eq!(
        stopped.field("agent", "fix"),
        "start sluiced (systemctl start sluiced)"
    );
    stopped.assert_pass(&["config", "plugstack", "store s3://"]);
    drop(restart);
    doctor(&["--config", config_arg]).assert_pass(&["agent"]);

    let _ = fs::remove_dir_all(&dir);
}
